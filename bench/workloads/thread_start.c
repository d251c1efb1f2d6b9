/* Thread start cost: start and join N threads that do nothing, one at a time, and
 * print the mean nanoseconds per start+join, timed inside the program (process
 * start-up and exit are not in the figure).  bench/agent_overhead.py runs it pinned
 * to one CPU, where the figure is steadiest (no cross-CPU wake-ups).
 * usage: thread_start [N] */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static void *nothing(void *arg) { return arg; }

int main(int argc, char **argv)
{
    long n = argc > 1 ? atol(argv[1]) : 20000;
    struct timespec t0, t1;

    if (n <= 0)
        return 2;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (long i = 0; i < n; i++) {
        pthread_t t;

        if (pthread_create(&t, NULL, nothing, NULL) != 0 || pthread_join(t, NULL) != 0)
            return 1;
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    printf("%.1f\n", ((t1.tv_sec - t0.tv_sec) * 1e9 + (t1.tv_nsec - t0.tv_nsec)) / n);
    return 0;
}
