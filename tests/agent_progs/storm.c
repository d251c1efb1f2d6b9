/* Threads run through eight patch sites and check every result.
 * usage: storm [THREADS] [print]
 *   default mode: each result must equal x*1000+7, else exit 3 (a wrong result).
 *   print mode: the main thread prints "v <site0(3)>" every 5 ms (results unchecked).
 * Prints "sites A0 .. A7" and "ready"; runs until stdin reaches EOF; then prints
 * "ok calls=N" and exits 0.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <poll.h>
#include "sites.h"

static atomic_int stop;
static atomic_long calls;
static int print_mode;

static void *worker(void *arg) {
    long n = 0;
    unsigned i = (unsigned)(long)arg * 7919u;
    while (!atomic_load_explicit(&stop, memory_order_relaxed)) {
        int x = (int)(i++ & 0xFFFFF);
        for (int k = 0; k < 8; k++) {
            int r = sites[k](x);
            if (!print_mode && r != expected(x)) {
                fprintf(stderr, "WRONG site%d(%d) = %d, expected %d\n", k, x, r, expected(x));
                _exit(3);
            }
        }
        n += 8;
    }
    atomic_fetch_add(&calls, n);
    return NULL;
}

int main(int argc, char **argv) {
    int nthreads = argc > 1 ? atoi(argv[1]) : 8;
    print_mode = argc > 2 && strcmp(argv[2], "print") == 0;
    pthread_t th[64];
    if (nthreads < 1 || nthreads > 64) return 2;
    printf("sites");
    for (int k = 0; k < 8; k++) printf(" %p", (void *)sites[k]);
    printf("\n");
    for (long t = 0; t < nthreads; t++) pthread_create(&th[t], NULL, worker, (void *)t);
    printf("ready\n");
    fflush(stdout);
    char buf[256];
    for (;;) {
        if (print_mode) {
            printf("v %d\n", site0(3));
            fflush(stdout);
            struct pollfd p = {.fd = 0, .events = POLLIN};
            if (poll(&p, 1, 5) == 1 && read(0, buf, sizeof buf) <= 0) break;
        } else if (read(0, buf, sizeof buf) <= 0) {
            break;
        }
    }
    atomic_store(&stop, 1);
    for (int t = 0; t < nthreads; t++) pthread_join(th[t], NULL);
    printf("ok calls=%ld\n", atomic_load(&calls));
    return 0;
}
