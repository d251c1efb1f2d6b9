/* Call-heavy loops: small non-inlined functions and calls through a table of
 * function pointers, in a hot loop.  usage: calls N  (N = outer iterations, millions) */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#define NOINLINE __attribute__((noinline))

NOINLINE static uint64_t mix(uint64_t x) { x ^= x >> 31; x *= 0x9e3779b97f4a7c15ull; return x ^ (x >> 29); }
NOINLINE static uint64_t add3(uint64_t a, uint64_t b, uint64_t c) { return a + (b ^ c); }
NOINLINE static uint64_t rot(uint64_t x, unsigned r) { return (x << (r & 63)) | (x >> ((64 - r) & 63)); }
NOINLINE static uint64_t f0(uint64_t x) { return mix(x) + 1; }
NOINLINE static uint64_t f1(uint64_t x) { return rot(x, 13) ^ 0x5555; }
NOINLINE static uint64_t f2(uint64_t x) { return add3(x, x >> 7, 12345); }
NOINLINE static uint64_t f3(uint64_t x) { return x * 3 + (x >> 3); }

static uint64_t (*const table[4])(uint64_t) = {f0, f1, f2, f3};

NOINLINE static uint64_t step(uint64_t acc, uint64_t i)
{
    acc = add3(acc, i, mix(i));
    acc = table[(acc >> 17) & 3](acc);
    return rot(acc, (unsigned)i);
}

int main(int argc, char **argv)
{
    long n = argc > 1 ? atol(argv[1]) : 10;
    uint64_t acc = 1;
    for (long j = 0; j < n; j++)
        for (uint64_t i = 0; i < 1000000; i++)
            acc = step(acc, i + (uint64_t)j);
    printf("calls %ld %016llx\n", n, (unsigned long long)acc);
    return 0;
}
