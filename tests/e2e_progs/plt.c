/* A hot loop calling into a shared library through the PLT. */
#include <stdio.h>
#include <stdlib.h>
unsigned lib_step(unsigned x, unsigned i);
int main(int argc, char **argv) {
    long n = (argc > 1 ? atol(argv[1]) : 60) * 1000000L;
    unsigned x = 5;
    for (long i = 0; i < n; i++) {
        x = lib_step(x, (unsigned)i);
        if (x & 0x100) x += 3;
    }
    printf("plt %u\n", x);
    return 0;
}
