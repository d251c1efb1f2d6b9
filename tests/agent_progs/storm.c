/* Threads run through eight patch sites and check every result.
 * usage: storm [THREADS] [print|blocktrap]
 *   default mode: each result must equal x*1000+7, else exit 3 (a wrong result).
 *   print mode: the main thread prints "v <site0(3)>" every 5 ms (results unchecked).
 *   blocktrap mode: as the default, but every worker first blocks SIGTRAP with a raw
 *   rt_sigprocmask (no libc call the agent could see), and prints "blocked TID".
 * Prints "sites A0 .. A7", and "ready" once every worker runs; runs until stdin
 * reaches EOF; then prints "ok calls=N" and exits 0.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <poll.h>
#include <signal.h>
#include <sys/syscall.h>
#include "sites.h"

static atomic_int stop;
static atomic_long calls;
static int print_mode, blocktrap_mode;

/* rt_sigprocmask(SIG_BLOCK, {SIGTRAP}, NULL) by the syscall instruction itself */
static long raw_block_trap(void) {
    unsigned long set = 1ul << (SIGTRAP - 1);
    long rc;
    register long r10 __asm__("r10") = 8;
    __asm__ volatile("syscall" : "=a"(rc)
                     : "0"((long)SYS_rt_sigprocmask), "D"((long)SIG_BLOCK), "S"(&set), "d"(0L),
                       "r"(r10)
                     : "rcx", "r11", "memory");
    return rc;
}

static atomic_int started;

static void *worker(void *arg) {
    long n = 0;
    unsigned i = (unsigned)(long)arg * 7919u;
    atomic_fetch_add(&started, 1);   /* running, its signal mask its own */
    if (blocktrap_mode) {
        if (raw_block_trap() != 0) _exit(4);
        printf("blocked %ld\n", (long)syscall(SYS_gettid));
        fflush(stdout);
    }
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
    blocktrap_mode = argc > 2 && strcmp(argv[2], "blocktrap") == 0;
    pthread_t th[64];
    if (nthreads < 1 || nthreads > 64) return 2;
    printf("sites");
    for (int k = 0; k < 8; k++) printf(" %p", (void *)sites[k]);
    printf("\n");
    for (long t = 0; t < nthreads; t++) pthread_create(&th[t], NULL, worker, (void *)t);
    /* "ready" once every worker runs: a thread glibc has made but the scheduler has
     * not run yet still has every signal blocked (pthread_create's window), and an
     * int3 batch then rightly waits or refuses (bounded: 10 s) */
    for (int w = 0; w < 10000 && atomic_load(&started) < nthreads; w++) usleep(1000);
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
