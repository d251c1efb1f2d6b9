/* A shared library with one patchable function (see sites.h). */
__asm__(".text\n.p2align 4\n.globl hot\n.type hot,@function\nhot:\n"
        "imul $1000, %edi, %eax\nadd $7, %eax\nret\n");
