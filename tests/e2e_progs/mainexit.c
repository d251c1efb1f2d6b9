/* Hot loops in threads that outlive main(): main ends with pthread_exit, the
 * last worker to finish prints every result, and the process ends (glibc's
 * exit(0) after its last thread) with the atexit handler's line.  The agent's
 * own thread must neither keep the process alive nor stop dbr from reading
 * the client's memory once its main thread is gone. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
static long iters;
static int nthreads, left;
static unsigned long results[8];
__attribute__((noinline)) static unsigned long step(unsigned long x, long i) {
    return (x ^ (unsigned long)i) * 0xC2B2AE3D27D4EB4FUL + (x >> 31);
}
static void *work(void *arg) {
    long t = (long)arg;
    unsigned long x = (unsigned long)t + 7;
    for (long i = 0; i < iters; i++) {
        x = step(x, i);
        if ((x & 15) == 5) x -= (unsigned long)t;
    }
    results[t] = x;
    if (__atomic_sub_fetch(&left, 1, __ATOMIC_ACQ_REL) == 0)
        for (int k = 0; k < nthreads; k++) printf("thread %d %lu\n", k, results[k]);
    return NULL;
}
static void bye(void) { printf("exit handler ran\n"); }
int main(int argc, char **argv) {
    iters = (argc > 1 ? atol(argv[1]) : 30) * 1000000L;
    nthreads = argc > 2 ? atoi(argv[2]) : 2;
    if (nthreads < 1 || nthreads > 8) return 2;
    left = nthreads;
    atexit(bye);
    for (long t = 0; t < nthreads; t++) {
        pthread_t th;
        if (pthread_create(&th, NULL, work, (void *)t) != 0) return 3;
        pthread_detach(th);
    }
    pthread_exit(NULL);
}
