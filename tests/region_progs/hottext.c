#include <stdio.h>
#include <stdlib.h>

__attribute__((noinline)) unsigned mixa(unsigned h, unsigned c) {
    h ^= c; h *= 16777619u;
    if (h & 1) h += c * 3; else h -= c >> 2;
    if (h & 4) h ^= h >> 7;
    return h;
}

__attribute__((noinline)) unsigned mixb(unsigned h, unsigned c) {
    h += c; h *= 2654435761u;
    if (h & 2) h ^= c << 3; else h += c >> 1;
    if (h & 8) h -= h >> 5;
    return h;
}

unsigned into(unsigned h);
unsigned jumper(unsigned h);
unsigned into8(unsigned h);
unsigned jumper8(unsigned h);
/* into's bytes 1..4 are the target of a jump in jumper (rel32) and of a short
   jump in jumper8 into into8 (rel8): no entry site may be placed there */
__asm__(".text\n"
        ".globl into\n.type into,@function\ninto:\n.cfi_startproc\n"
        "  nop\n  mov %edi,%eax\n  add $1,%eax\n  ret\n.cfi_endproc\n.size into,.-into\n"
        ".fill 200,1,0xcc\n.globl jumper\n.type jumper,@function\njumper:\n.cfi_startproc\n"
        "  jmp into+1\n.cfi_endproc\n.size jumper,.-jumper\n"
        ".globl jumper8\n.type jumper8,@function\njumper8:\n.cfi_startproc\n"
        "  jmp into8+1\n.cfi_endproc\n.size jumper8,.-jumper8\n"
        ".globl into8\n.type into8,@function\ninto8:\n.cfi_startproc\n"
        "  nop\n  mov %edi,%eax\n  add $1,%eax\n  ret\n.cfi_endproc\n.size into8,.-into8\n");

unsigned (*volatile table[2])(unsigned, unsigned) = {mixa, mixb};

/* calls through the table (a callee it cannot know), then works on: its copy is left
   at the call, and the code after it is entered again by the return */
__attribute__((noinline)) unsigned drive(unsigned h, unsigned c) {
    if (c % 3 == 0) h = h * 31 + c;
    h = table[c & 1](h, c);
    h ^= h >> 3; h *= 0x9e3779b1u;
    if (h & 16) h += c; else h ^= c << 1;
    return h;
}

int main(int argc, char **argv) {
    unsigned h = 1;
    long n = argc > 1 ? atol(argv[1]) : 1000;
    for (long i = 0; i < n; i++)
        h = drive(h, (unsigned)i);
    h += into(h) + jumper(h) + jumper8(h);
    printf("%u\n", h);
    return 0;
}
