/* stayloop.c — one loop that never leaves itself: it hashes a buffer and writes it
 * with a raw `syscall` (no call into libc) every 16384 iterations, so a thread that
 * enters its replacement code stays there to the end (and rarely enough that the
 * time in the kernel, sampled at the instruction after the syscall, does not make
 * the syscall's block look as hot as the loop body).  Its I/O grows with its
 * progress, so a speed check can measure it, and a check's phases with the
 * original code in place only run the original if the thread is moved out
 * (EVICT; tests/live/test_speedcheck_live.py).  usage: stayloop ITERATIONS OUT [short]
 * With "short" the loop is shortloop below, whose instructions are all shorter
 * than 5 bytes: it has no patch point, and its region is entered by TRANSFER only.
 */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static unsigned char buf[4096];

/* unsigned shortloop(long iterations, long fd): the same kind of loop, every
 * instruction of it shorter than 5 bytes (a write of 128 bytes of sbuf every
 * 2048 iterations); returns the hash, or 0 if a write failed. */
unsigned shortloop(long n, long fd);
unsigned char sbuf[128];
__asm__(".text\n.globl shortloop\n.type shortloop,@function\n"
        "shortloop:\n"
        "    push %rbx\n"
        "    mov %rdi, %rbx\n"
        "    mov %rsi, %rdi\n"
        "    lea sbuf(%rip), %rsi\n"
        "    xor %r8d, %r8d\n"
        "    inc %r8d\n"
        "    xor %r9d, %r9d\n"
        "    mov $0x8, %r9b\n"
        "    shl $8, %r9d\n"                  /* a write every 2048 iterations */
        "1:  imul $33, %r8d, %r8d\n"         /* 4 bytes */
        "    mov %ebx, %ecx\n"
        "    and $0x7f, %ecx\n"
        "    movzbl (%rsi,%rcx), %ecx\n"      /* 4 bytes */
        "    add %ecx, %r8d\n"
        "    mov %r8d, %ecx\n"
        "    shr $9, %ecx\n"
        "    xor %cl, (%rsi)\n"
        "    dec %r9d\n"
        "    jne 2f\n"
        "    mov $0x8, %r9b\n"
        "    shl $8, %r9d\n"
        "    xor %eax, %eax\n"
        "    inc %eax\n"                      /* write */
        "    xor %edx, %edx\n"
        "    mov $0x80, %dl\n"
        "    syscall\n"
        "    test %rax, %rax\n"
        "    jle 3f\n"
        "2:  dec %rbx\n"
        "    jne 1b\n"
        "    mov %r8d, %eax\n"
        "    pop %rbx\n"
        "    ret\n"
        "3:  xor %eax, %eax\n"
        "    pop %rbx\n"
        "    ret\n"
        ".size shortloop, .-shortloop\n");

int main(int argc, char **argv)
{
    long n, i;
    unsigned h = 1;
    int out;

    if (argc != 3 && !(argc == 4 && strcmp(argv[3], "short") == 0)) {
        fprintf(stderr, "usage: stayloop ITERATIONS OUT [short]\n");
        return 2;
    }
    n = atol(argv[1]);
    out = open(argv[2], O_WRONLY);
    if (out < 0) {
        perror(argv[2]);
        return 1;
    }
    if (argc == 4) {
        h = shortloop(n > 0 ? n : 1, out);
        if (h == 0)
            return 1;
        printf("%ld iterations, hash %08x\n", n, h);
        return 0;
    }
    for (i = 0; i < n; i++) {
        h = h * 2654435761u + buf[i & 4095];
        buf[(i * 7) & 4095] ^= (unsigned char)(h >> 9);
        if ((i & 16383) == 16383) {
            long r;

            __asm__ volatile("syscall" : "=a"(r) : "0"(1L), "D"((long)out), "S"(buf),
                             "d"(sizeof buf) : "rcx", "r11", "memory");
            if (r != (long)sizeof buf)
                return 1;
        }
    }
    printf("%ld iterations, hash %08x\n", n, h);
    return 0;
}
