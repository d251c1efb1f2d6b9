/* Several threads in hot loops (patching happens while they run). */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
static long iters;
static unsigned long results[8];
__attribute__((noinline)) static unsigned long step(unsigned long x, long i) {
    return (x ^ (unsigned long)i) * 0x9E3779B97F4A7C15UL + (x >> 29);
}
static void *work(void *arg) {
    long t = (long)arg;
    unsigned long x = (unsigned long)t + 1;
    for (long i = 0; i < iters; i++) {
        x = step(x, i);
        if ((x & 7) == 3) x += (unsigned long)t;
    }
    results[t] = x;
    return NULL;
}
int main(int argc, char **argv) {
    iters = (argc > 1 ? atol(argv[1]) : 30) * 1000000L;
    int n = argc > 2 ? atoi(argv[2]) : 4;
    pthread_t th[8];
    for (long t = 0; t < n; t++) pthread_create(&th[t], NULL, work, (void *)t);
    for (int t = 0; t < n; t++) pthread_join(th[t], NULL);
    for (int t = 0; t < n; t++) printf("thread %d %lu\n", t, results[t]);
    return 0;
}
