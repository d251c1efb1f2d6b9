/* warmwork: a fixed amount of work (its checksum shows a wrong rewrite), hot in one
 * loop, for the warm-start tests.
 *   warmwork [ROUNDS]   ROUNDS calls of mix() over 2,000,000 iterations (default 10) */
#include <stdio.h>
#include <stdlib.h>
__attribute__((noinline)) unsigned long mix(unsigned long x, long n) {
    for (long i = 0; i < n; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x = x * 1103515245UL + 12345;
        x += (unsigned long)i;
    }
    return x;
}
int main(int argc, char **argv) {
    long rounds = argc > 1 ? atol(argv[1]) : 10;
    unsigned long x = 1;
    for (long r = 0; r < rounds; r++)
        x = mix(x, 2000000);
    printf("%lu\n", x);
    return 0;
}
