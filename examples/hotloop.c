/* dbr example: a CPU-bound program whose time goes to one hot loop in mix().
 *
 *   hotloop [MILLISECONDS]   (default 1500)
 *
 * mix() is kept out of line so that its loop is the hottest code by far; main() only
 * calls it in slices until the time is up, then prints a checksum (so a wrong rewrite
 * would show in the output).
 */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

__attribute__((noinline)) unsigned long mix(unsigned long x, long n) {
    for (long i = 0; i < n; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x = x * 1103515245UL + 12345; /* imul imm32 / add imm32: 5+ byte instructions, */
        x += (unsigned long)i;         /* so the loop has a patchable instruction */
    }
    return x;
}

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

int main(int argc, char **argv) {
    double ms = argc > 1 ? atof(argv[1]) : 1500.0;
    double end = now_ms() + ms;
    unsigned long x = 88172645463325252UL;
    long slices = 0;
    while (now_ms() < end) { /* x is printed: the calls cannot be dropped */
        x = mix(x, 200000);
        slices++;
    }
    /* The checksum of a fixed amount of work, independent of timing. */
    printf("hotloop: %ld slices, state %lu, check %lu\n", slices, x, mix(12345, 1000000));
    return 0;
}
