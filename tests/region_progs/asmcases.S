/* Hand-written cases C cannot produce: overlapping instructions, data after a call
   that never returns, a tiny block samples miss, a partly executed block.
   Each function takes n in %edi and returns in %eax; no stack frame needed. */
        .text

/* ovl: odd iterations jump into the immediate of a 5-byte mov. */
        .globl ovl
        .type ovl, @function
ovl:
        xor %eax, %eax
        mov %edi, %ecx
.Lovl_head:
        test $1, %ecx
        jnz ovl_mid
        .globl ovl_l0
ovl_l0:
        .byte 0xba              /* mov $0x9090c801, %edx ...            */
        .globl ovl_mid
ovl_mid:
        .byte 0x01, 0xc8        /* ... or, entered here: add %ecx, %eax */
        .byte 0x90, 0x90        /*                       nop; nop       */
        .globl ovl_join
ovl_join:
        dec %ecx
        jnz .Lovl_head
        ret
        .size ovl, .-ovl

/* junk: the error path calls a local function that never returns, and the
   bytes after that call are data (ff ff is not an instruction). */
        .globl junk
        .type junk, @function
junk:
        xor %eax, %eax
.Lj_head:
        add %edi, %eax
        cmp $-1, %edi
        je .Lj_err
        dec %edi
        jnz .Lj_head
        ret
.Lj_err:
        call fatal_local
        .globl junk_data
junk_data:
        .byte 0xff, 0xff, 0x0b, 0x0b
        .size junk, .-junk

        .type fatal_local, @function
fatal_local:
        mov $60, %eax
        syscall
        ud2
        .size fatal_local, .-fatal_local

/* tiny: the then-block is a single 2-byte instruction. */
        .globl tiny
        .type tiny, @function
tiny:
        xor %eax, %eax
        xor %edx, %edx
.Lt_head:
        test $3, %edi
        jnz tiny_skip
        .globl tiny_inc
tiny_inc:
        inc %edx
        .globl tiny_skip
tiny_skip:
        add %edi, %eax
        dec %edi
        jnz .Lt_head
        add %edx, %eax
        ret
        .size tiny, .-tiny

/* part: the code after a call is reached only through the call's return. */
        .globl part
        .type part, @function
part:
        push %rbx
        mov %edi, %ebx
        xor %edx, %edx
        .globl part_call
part_call:
        call leaf
        .globl part_after
part_after:
        mov %eax, %ecx
        .globl part_add
part_add:
        add %ecx, %edx
        dec %ebx
        jnz part_call
        mov %edx, %eax
        pop %rbx
        ret
        .size part, .-part

        .type leaf, @function
leaf:
        lea 1(%rdx), %eax
        ret
        .size leaf, .-leaf

        .section .note.GNU-stack,"",@progbits
