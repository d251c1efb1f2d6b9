/* Hot loop calling small functions (inlinable) and a large one (not). */
#include <stdio.h>
#include <stdlib.h>
__attribute__((noinline)) static unsigned mix(unsigned x) { return x * 2654435761u ^ (x >> 13); }
__attribute__((noinline)) static unsigned add3(unsigned a, unsigned b, unsigned c) { return a + b + c; }
__attribute__((noinline)) static unsigned big(unsigned x) {
    unsigned acc = 0;
    for (int i = 0; i < 24; i++) {
        switch ((x >> (i & 7)) & 3) {
        case 0: acc += x * 17 + i; break;
        case 1: acc ^= (x << 3) | i; break;
        case 2: acc -= x / (i + 1); break;
        default: acc = (acc << 1) | (acc >> 31); break;
        }
        x = x * 1103515245u + 12345u;
    }
    return acc;
}
int main(int argc, char **argv) {
    long n = (argc > 1 ? atol(argv[1]) : 40) * 1000000L;
    unsigned s = 1;
    for (long i = 0; i < n; i++) {
        s = add3(mix(s), (unsigned)i, s >> 7);
        if ((i & 1023) == 0) s ^= big(s);
    }
    printf("calls %u\n", s);
    return 0;
}
