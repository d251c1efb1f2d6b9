/* Two known call paths for the stack-unwinding tests: main -> path_a -> leaf_work and
 * main -> path_b -> vla_frame -> leaf_work, forever (the test kills it).  Built once
 * with -fomit-frame-pointer (CFA from rsp; vla_frame's from rbp) and once with frame
 * pointers.  Prints "ready" once running. */
#include <stdio.h>
#include <string.h>

volatile unsigned long sink;

__attribute__((noinline)) unsigned long leaf_work(unsigned long n, unsigned long seed)
{
    unsigned long a = seed, b = seed * 3, c = seed ^ 0x55, d = seed + 7, e = 1, f = 2;
    for (unsigned long i = 0; i < n; i++) {
        a = a * 6364136223846793005UL + b;
        b ^= a >> 13;
        c += b * d;
        d = (d << 3) ^ c;
        e += a & f;
        f = (f * 31) ^ e;
    }
    return a ^ b ^ c ^ d ^ e ^ f;
}

__attribute__((noinline)) unsigned long path_a(unsigned long n)
{
    char pad[256];
    memset(pad, (int)n, sizeof pad);
    unsigned long r = leaf_work(n, (unsigned long)pad[n % 256]);
    sink = pad[7];
    return r + 1;
}

__attribute__((noinline)) unsigned long vla_frame(unsigned long n)
{
    char buf[n % 512 + 64];          /* variable size: CFA from rbp */
    memset(buf, (int)n, sizeof buf);
    unsigned long r = leaf_work(n, (unsigned long)buf[n % 64]);
    sink = buf[3];
    return r + 2;
}

__attribute__((noinline)) unsigned long path_b(unsigned long n)
{
    char pad[512];
    memset(pad, (int)(n >> 1), sizeof pad);
    unsigned long r = vla_frame(n + (unsigned long)pad[n % 512]);
    sink = pad[9];
    return r + 3;
}

int main(void)
{
    printf("ready\n");
    fflush(stdout);
    for (unsigned long k = 0;; k++) {
        sink += path_a(20000 + (k & 7));
        sink += path_b(20000 + (k & 7));
    }
    return 0;
}
