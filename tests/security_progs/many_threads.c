/* N threads blocked on a condition variable while the main thread computes for S
 * seconds: a client whose sampling needs more than 1024 descriptors in the service
 * (one perf event per thread).  Prints "ready N" once every thread runs, then a
 * checksum of the work and "done". */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
static int started, quit;

static void *idle(void *arg)
{
    (void)arg;
    pthread_mutex_lock(&mu);
    started++;
    pthread_cond_broadcast(&cv);
    while (!quit)
        pthread_cond_wait(&cv, &mu);
    pthread_mutex_unlock(&mu);
    return NULL;
}

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

int main(int argc, char **argv)
{
    int n = argc > 1 ? atoi(argv[1]) : 1500;
    double secs = argc > 2 ? atof(argv[2]) : 3.0, end;
    pthread_t *t = calloc((size_t)n, sizeof *t);
    pthread_attr_t attr;
    unsigned long x = 1;

    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, 64 * 1024);
    for (int i = 0; i < n; i++)
        if (pthread_create(&t[i], &attr, idle, NULL) != 0) {
            fprintf(stderr, "pthread_create %d failed\n", i);
            return 2;
        }
    pthread_mutex_lock(&mu);
    while (started < n)
        pthread_cond_wait(&cv, &mu);
    pthread_mutex_unlock(&mu);
    printf("ready %d\n", n);
    fflush(stdout);
    end = now() + secs;
    while (now() < end)
        for (int i = 0; i < 100000; i++)
            x = x * 6364136223846793005ul + 1442695040888963407ul;
    pthread_mutex_lock(&mu);
    quit = 1;
    pthread_cond_broadcast(&cv);
    pthread_mutex_unlock(&mu);
    for (int i = 0; i < n; i++)
        pthread_join(t[i], NULL);
    printf("%lu\ndone\n", x & 1);
    return 0;
}
