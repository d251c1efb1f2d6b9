/* dlopen a library, run its hot loop, dlclose it while it was hot, repeat. */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
int main(int argc, char **argv) {
    if (argc < 2) return 2;
    long n = (argc > 2 ? atol(argv[2]) : 40) * 1000000L;
    unsigned long x = 11;
    for (int round = 0; round < 4; round++) {
        void *h = dlopen(argv[1], RTLD_NOW);
        if (!h) { fprintf(stderr, "%s\n", dlerror()); return 2; }
        unsigned long (*f)(unsigned long, long) = (unsigned long (*)(unsigned long, long))dlsym(h, "dl_work");
        x = f(x, n / 4);
        printf("round %d %lu\n", round, x);
        if (dlclose(h) != 0) return 3;
    }
    return 0;
}
