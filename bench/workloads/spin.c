/* Scaling-run client: the call-heavy loop of calls.c, for a fixed wall time, so that
 * N clients on a small machine all stay alive for the same period.
 * usage: spin SECONDS */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define NOINLINE __attribute__((noinline))

NOINLINE static uint64_t mix(uint64_t x) { x ^= x >> 31; x *= 0x9e3779b97f4a7c15ull; return x ^ (x >> 29); }
NOINLINE static uint64_t add3(uint64_t a, uint64_t b, uint64_t c) { return a + (b ^ c); }
NOINLINE static uint64_t step(uint64_t acc, uint64_t i) { return add3(acc, i, mix(i)) * 3 + (acc >> 7); }

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

int main(int argc, char **argv)
{
    double secs = argc > 1 ? atof(argv[1]) : 5.0, end = now() + secs;
    uint64_t acc = 1, rounds = 0;
    while (now() < end) {
        for (uint64_t i = 0; i < 100000; i++)
            acc = step(acc, i);
        rounds++;
    }
    printf("spin %llu %016llx\n", (unsigned long long)rounds, (unsigned long long)acc);
    return 0;
}
