/* switchwork: a loop around a switch compiled to a jump table, for the kept-code tests
 * (a region with a dispatch table in its own code).
 *   switchwork [ROUNDS]   ROUNDS calls of mix() over 2,000,000 iterations (default 10) */
#include <stdio.h>
#include <stdlib.h>
__attribute__((noinline)) unsigned long mix(unsigned long x, long n) {
    for (long i = 0; i < n; i++) {
        switch ((x >> 3) & 7) {
        case 0: x = x * 3 + 1; break;
        case 1: x ^= x << 7; break;
        case 2: x += 0x9e3779b97f4a7c15UL; break;
        case 3: x ^= x >> 11; break;
        case 4: x = x * 1103515245UL + 12345; break;
        case 5: x -= i; break;
        case 6: x = (x << 13) | (x >> 51); break;
        default: x ^= 0xabcdef; break;
        }
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
