/* dbr example: a hot loop whose compiled layout is wrong for the data it runs on.
 *
 *   mislaid [ITERATIONS]   (default 2000000000: about 1.5 s of CPU)
 *
 * The branch hint says the loop's common case is rare (as a stale profile or a wrong
 * annotation would), so gcc -O2 moves the common path out of line: each iteration
 * jumps out to it and back, three taken branches where one would do.  dbr's copy of
 * the loop, laid out from the sampled counts, falls through the common path.  The
 * result depends only on ITERATIONS, so runs under dbr must print what native runs
 * print.
 */
#include <stdio.h>
#include <stdlib.h>

__attribute__((noinline)) unsigned long work(const unsigned *a, long n) {
    unsigned long s1 = 0, s2 = 0, s3 = 0;
    for (long i = 0; i < n; i++) {
        unsigned v = a[i & 4095];
        if (__builtin_expect((i & 63) != 0, 0)) {   /* true 63 times in 64 */
            s1 += v;
            s2 ^= v;
        } else {
            s3 += v * 7;
        }
    }
    return s1 * 3 + s2 * 5 + s3;
}

int main(int argc, char **argv) {
    long n = argc > 1 ? atol(argv[1]) : 2000000000L;
    unsigned *a = malloc(4096 * sizeof *a);
    if (a == NULL || n < 0)
        return 2;
    unsigned x = 12345;
    for (int i = 0; i < 4096; i++) {
        x = x * 1103515245u + 12345u;
        a[i] = x >> 8;
    }
    printf("mislaid: %ld iterations, result %lu\n", n, work(a, n));
    free(a);
    return 0;
}
