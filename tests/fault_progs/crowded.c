/* A hot loop in a process that has first filled every free byte of address space
 * within 2.2 GiB of its own code with PROT_NONE reservations: no code buffer can be
 * placed within rel32 reach of it. */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>

#define SPAN (2200UL << 20)
#define MAXR 4096

static unsigned long reserved;

static void reserve(uintptr_t lo, uintptr_t hi)
{
    if (hi <= lo)
        return;
    void *p = mmap((void *)lo, hi - lo, PROT_NONE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED_NOREPLACE, -1, 0);
    if (p != MAP_FAILED)
        reserved += hi - lo;
}

static void fill_around(uintptr_t at)
{
    static uintptr_t s[MAXR], e[MAXR];
    int n = 0;
    uintptr_t lo = (at > SPAN + 0x10000 ? at - SPAN : 0x10000) & ~0xfffUL;
    uintptr_t hi = (at + SPAN + 0xfff) & ~0xfffUL, cur;
    FILE *f = fopen("/proc/self/maps", "r");
    char line[512];

    if (!f)
        exit(3);
    while (n < MAXR && fgets(line, sizeof line, f))
        if (sscanf(line, "%lx-%lx", &s[n], &e[n]) == 2)
            n++;
    fclose(f);
    cur = lo;
    for (int i = 0; i < n && cur < hi; i++) {       /* maps are in address order */
        if (e[i] <= cur)
            continue;
        reserve(cur, s[i] < hi ? s[i] : hi);
        if (e[i] > cur)
            cur = e[i];
    }
    reserve(cur, hi);
}

static volatile unsigned long bump = 7;  /* a RIP-relative load: a 5+-byte patch site */

__attribute__((noinline)) static unsigned long work(unsigned long x, long n)
{
    for (long i = 0; i < n; i++) {
        x = x * 6364136223846793005UL + (unsigned long)i + bump;
        if (x & 0x40)
            x ^= x >> 17;
    }
    return x;
}

int main(int argc, char **argv)
{
    long n = (argc > 1 ? atol(argv[1]) : 100) * 1000000L;

    fill_around((uintptr_t)&work);
    if (reserved < (4000UL << 20))
        return 4;                                   /* the neighbourhood was not filled */
    printf("crowded %lu\n", work(3, n));
    return 0;
}
