/* Cross-library calls: the hot loop calls small functions of libxlibwork.so through
 * the PLT.  usage: xlib N  (N = iterations, millions) */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

uint64_t xl_hash(uint64_t x);
uint64_t xl_combine(uint64_t a, uint64_t b);
int xl_pick(uint64_t x);

int main(int argc, char **argv)
{
    long n = argc > 1 ? atol(argv[1]) : 10;
    uint64_t acc = 7;
    for (long j = 0; j < n; j++)
        for (uint64_t i = 0; i < 1000000; i++) {
            uint64_t h = xl_hash(acc + i);
            switch (xl_pick(h)) {
            case 0: acc = xl_combine(acc, h); break;
            case 1: acc = xl_combine(h, acc); break;
            default: acc ^= h; break;
            }
        }
    printf("xlib %ld %016llx\n", n, (unsigned long long)acc);
    return 0;
}
