/* stayloop.c — one loop that never leaves itself: it hashes a buffer and writes it
 * with a raw `syscall` (no call into libc) every 1024 iterations, so a thread that
 * enters its replacement code stays there to the end.  Its I/O grows with its
 * progress, so a speed check can measure it, and a check's phases with the
 * original code in place only run the original if the thread is moved out
 * (EVICT; tests/test_speedcheck_live.py).  usage: stayloop ITERATIONS OUT */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>

static unsigned char buf[4096];

int main(int argc, char **argv)
{
    long n, i;
    unsigned h = 1;
    int out;

    if (argc != 3) {
        fprintf(stderr, "usage: stayloop ITERATIONS OUT\n");
        return 2;
    }
    n = atol(argv[1]);
    out = open(argv[2], O_WRONLY);
    if (out < 0) {
        perror(argv[2]);
        return 1;
    }
    for (i = 0; i < n; i++) {
        h = h * 2654435761u + buf[i & 4095];
        buf[(i * 7) & 4095] ^= (unsigned char)(h >> 9);
        if ((i & 1023) == 1023) {
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
