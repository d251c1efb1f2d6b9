/* A CPU-bound program (steady-state cost probe): ARGV[1] million iterations of an LCG. */
#include <stdio.h>
#include <stdlib.h>
int main(int argc, char **argv) {
    long n = (argc > 1 ? atol(argv[1]) : 200) * 1000000L;
    unsigned long x = 88172645463325252UL;
    for (long i = 0; i < n; i++) x = x * 6364136223846793005UL + 1442695040888963407UL;
    printf("%lu\n", x);
    return 0;
}
