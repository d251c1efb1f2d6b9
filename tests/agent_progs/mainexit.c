/* mainexit: the main thread ends with pthread_exit while workers run on.
 * glibc ends the process with exit(0) when its last thread ends; the agent's
 * own thread must not keep it alive.
 *   mainexit N MS   N workers, each busy for MS ms, then returning
 *   mainexit 0 0    main's pthread_exit is the last thread's end
 * An atexit handler prints, so the test sees that exit() ran. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

static long g_ms;

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static void *worker(void *arg)
{
    long i = (long)arg;
    double end = now() + g_ms / 1000.0;
    volatile unsigned long x = 0;

    while (now() < end)
        x += i;
    printf("worker %ld done\n", i);
    fflush(stdout);
    return NULL;
}

static void at_exit(void)
{
    printf("atexit ran\n");
    fflush(stdout);
}

int main(int argc, char **argv)
{
    long n = argc > 1 ? atol(argv[1]) : 2, i;

    g_ms = argc > 2 ? atol(argv[2]) : 200;
    atexit(at_exit);
    printf("ready\n");
    fflush(stdout);
    for (i = 0; i < n; i++) {
        pthread_t t;
        if (pthread_create(&t, NULL, worker, (void *)i) != 0)
            return 2;
        pthread_detach(t);
    }
    pthread_exit(NULL);
}
