/* CPU-bound, no I/O but a line per block: a hashing loop in a function called once
 * per round.  usage: cpuwork ROUNDS [N [STOPFILE [BLOCKS]]]
 *   N: the loop's length (256).  Without STOPFILE: one block of ROUNDS rounds.  With
 *   it: blocks of ROUNDS rounds until STOPFILE exists or BLOCKS blocks (1000000) are
 *   done.  Prints the running hash after each block. */
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

static unsigned data[4096];

__attribute__((noinline)) unsigned long work(const unsigned *a, long n, unsigned long seed)
{
    unsigned long h = seed ^ 0x9E3779B97F4A7C15ul;

    for (long i = 0; i < n; i++) {
        h ^= a[i];
        h *= 0x100000001B3ul;
        h = (h << 7) | (h >> 57);
    }
    return h;
}

int main(int argc, char **argv)
{
    long rounds = argc > 1 ? atol(argv[1]) : 1000, n = argc > 2 ? atol(argv[2]) : 256;
    const char *stop = argc > 3 ? argv[3] : NULL;
    long blocks = stop ? (argc > 4 ? atol(argv[4]) : 1000000) : 1;
    unsigned long h = 1;

    if (n < 0 || n > 4096)
        return 2;
    for (int i = 0; i < 4096; i++)
        data[i] = (unsigned)i * 2654435761u;
    for (long b = 0; b < blocks && !(stop && access(stop, F_OK) == 0); b++) {
        for (long r = 0; r < rounds; r++)
            h = work(data, n, h);
        printf("%lx\n", h);
        fflush(stdout);
    }
    return 0;
}
