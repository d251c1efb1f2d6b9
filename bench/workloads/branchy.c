/* Branchy code with poor static layout: the common cases are marked unlikely, so
 * gcc moves them out of line and the rare cases sit on the fall-through path.  PGO
 * (and a profile-driven relayout) should undo that.  usage: branchy N  (millions) */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#define WRONGLY_UNLIKELY(x) __builtin_expect(!!(x), 0)
#define WRONGLY_LIKELY(x) __builtin_expect(!!(x), 1)

__attribute__((noinline)) static uint64_t rare(uint64_t v) { return v * 2654435761u + 17; }

__attribute__((noinline)) static uint64_t classify(uint64_t v, uint64_t acc)
{
    unsigned k = (unsigned)(v % 100);
    if (WRONGLY_LIKELY(k >= 97)) acc = rare(acc ^ v);            /* 3 % */
    else if (WRONGLY_UNLIKELY(k < 60)) acc += v >> 3;            /* 60 % */
    else if (WRONGLY_LIKELY(k == 60)) acc = rare(acc);           /* 1 % */
    else if (WRONGLY_UNLIKELY(k < 90)) acc ^= v << 1;            /* 29 % */
    else acc -= v;
    if (WRONGLY_LIKELY((acc & 0xfff) == 0)) acc = rare(acc);    /* rare */
    if (WRONGLY_UNLIKELY((v & 1) == 0)) acc += 3; else acc += 5;   /* 50/50 */
    return acc;
}

int main(int argc, char **argv)
{
    long n = argc > 1 ? atol(argv[1]) : 10;
    uint64_t acc = 0, x = 88172645463325252ull;
    for (long j = 0; j < n; j++)
        for (int i = 0; i < 1000000; i++) {
            x ^= x << 13; x ^= x >> 7; x ^= x << 17;
            acc = classify(x, acc);
        }
    printf("branchy %ld %016llx\n", n, (unsigned long long)acc);
    return 0;
}
