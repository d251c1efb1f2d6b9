/* examples/mislaid.c's loop run in steps, each step timed, for bench/counting_ab.py.
 *
 *   mislaid_steps STEPS CHUNK
 *
 * Calls work() STEPS times on CHUNK iterations (a multiple of 64 keeps the branch's
 * pattern of the whole run).  Prints the result on stdout (it depends only on the
 * arguments), then on stderr one line per step: "step I WALL_NS CPU_NS", the step's
 * CLOCK_MONOTONIC and thread CPU time.  The steps after the last replacement of the
 * loop's region time the final code alone.
 */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

/* the example's own work(), not a copy: its main() renamed out of the way */
#define main mislaid_example_main
#include "../../examples/mislaid.c"
#undef main

static long long ns(clockid_t c) {
    struct timespec t;
    clock_gettime(c, &t);
    return t.tv_sec * 1000000000LL + t.tv_nsec;
}

int main(int argc, char **argv) {
    if (argc < 3)
        return 2;
    long steps = atol(argv[1]), chunk = atol(argv[2]);
    if (steps <= 0 || steps > 100000 || chunk <= 0)
        return 2;
    unsigned *a = malloc(4096 * sizeof *a);
    long long *wall = malloc(steps * sizeof *wall), *cpu = malloc(steps * sizeof *cpu);
    if (a == NULL || wall == NULL || cpu == NULL)
        return 2;
    unsigned x = 12345;
    for (int i = 0; i < 4096; i++) {
        x = x * 1103515245u + 12345u;
        a[i] = x >> 8;
    }
    unsigned long r = 0;
    for (long s = 0; s < steps; s++) {
        long long w0 = ns(CLOCK_MONOTONIC), c0 = ns(CLOCK_THREAD_CPUTIME_ID);
        r += work(a, chunk);
        cpu[s] = ns(CLOCK_THREAD_CPUTIME_ID) - c0;
        wall[s] = ns(CLOCK_MONOTONIC) - w0;
    }
    printf("mislaid_steps: %ld x %ld iterations, result %lu\n", steps, chunk, r);
    fflush(stdout);
    for (long s = 0; s < steps; s++)
        fprintf(stderr, "step %ld %lld %lld\n", s, wall[s], cpu[s]);
    free(a);
    free(wall);
    free(cpu);
    return 0;
}
