/* A const table of function pointers: in a PIE it lands in .data.rel.ro, which the
 * file holds unrelocated (R_X86_64_RELATIVE) and the loader makes read-only. */
#include <stdio.h>

#define NI __attribute__((noinline))
typedef long (*op_t)(long);

NI static long f0(long x) { return x + 1; }
NI static long f1(long x) { return x * 3; }
NI static long f2(long x) { return x ^ 5; }
NI static long f3(long x) { return x - 7; }

static op_t const table[4] = {f0, f1, f2, f3};

NI static long step(long acc)
{
    return table[(acc >> 17) & 3](acc);
}

NI long table_loop(long n)
{
    long s = 1;
    for (long i = 0; i < n; i++)
        s = step(s + i);
    return s;
}

int main(int argc, char **argv)
{
    (void)argv;
    printf("%ld\n", table_loop(argc * 100000L));
    return 0;
}
