/* tripcount.c — loops with known trip counts, for exact counting (profile=count).
 * usage: tripcount ROUNDS N1 N2
 * Each round (one call of work()) runs a loop of N1 iterations, then one of N2
 * iterations whose body takes one side when j % 3 == 0 (ceil(N2/3) times) and the
 * other side otherwise.  The trip counts come from argv so the compiler cannot
 * unroll the loops away.  Prints a checksum.
 */
#include <stdio.h>
#include <stdlib.h>

__attribute__((noinline)) static unsigned long work(unsigned long a, int n1, int n2)
{
    unsigned long b = 2;
    for (int i = 0; i < n1; i++)
        a = a * 33 + (unsigned long)i;
    for (int j = 0; j < n2; j++) {
        if (j % 3 == 0)
            b ^= a >> (j & 31);
        else
            b += (unsigned long)j * a;
    }
    return a + b;
}

int main(int argc, char **argv)
{
    if (argc < 4)
        return 2;
    long rounds = atol(argv[1]);
    int n1 = atoi(argv[2]), n2 = atoi(argv[3]);
    unsigned long sum = 1;
    for (long r = 0; r < rounds; r++)
        sum += work(sum, n1, n2);
    printf("%lu\n", sum);
    return 0;
}
