/* dbr example: several threads, some started late, each spinning in its own function.
 *
 *   threads [NTHREADS] [MILLISECONDS]   (default 4 threads, 1500 ms)
 *
 * Thread k starts k * MILLISECONDS / (2 * NTHREADS) ms after the first, so samplers
 * must pick up threads created after the process attached.  Each thread prints its
 * tid on stdout and a checksum at the end.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>
#include <sys/syscall.h>

static double ms_total = 1500.0;

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

__attribute__((noinline)) static unsigned long spin(unsigned long x, long n) {
    for (long i = 0; i < n; i++) x = x * 6364136223846793005UL + 1442695040888963407UL;
    return x;
}

static void *worker(void *arg) {
    long k = (long)arg;
    printf("thread %ld tid %ld\n", k, (long)syscall(SYS_gettid));
    fflush(stdout);
    double end = now_ms() + ms_total / 2;
    unsigned long x = (unsigned long)k;
    while (now_ms() < end) x = spin(x, 100000);
    return (void *)(x & 1);
}

int main(int argc, char **argv) {
    int n = argc > 1 ? atoi(argv[1]) : 4;
    if (argc > 2) ms_total = atof(argv[2]);
    if (n < 1 || n > 64) n = 4;
    pthread_t t[64];
    for (long k = 0; k < n; k++) {
        pthread_create(&t[k], NULL, worker, (void *)k);
        usleep((useconds_t)(ms_total * 1000 / (2 * n)));
    }
    for (int k = 0; k < n; k++) pthread_join(t[k], NULL);
    printf("threads: done, check %lu\n", spin(1, 1000000));
    return 0;
}
