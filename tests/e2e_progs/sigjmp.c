/* A hot loop interrupted by timer signals whose handler siglongjmps out of it.
 * The result does not depend on where the signals land: each chunk of work is
 * restarted from its checkpoint when interrupted. */
#include <setjmp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/time.h>
static sigjmp_buf env;
static volatile sig_atomic_t interrupts;
static void on_alarm(int sig) { (void)sig; interrupts++; siglongjmp(env, 1); }
__attribute__((noinline)) static unsigned long chunk(unsigned long x, long n) {
    for (long i = 0; i < n; i++) x = (x + (unsigned long)i) * 0xc2b2ae3d27d4eb4fUL ^ (x >> 27);
    return x;
}
int main(int argc, char **argv) {
    long chunks = argc > 1 ? atol(argv[1]) : 400;
    struct sigaction sa = {0};
    sa.sa_handler = on_alarm;
    sigaction(SIGPROF, &sa, NULL);
    struct itimerval it = {{0, 7000}, {0, 7000}};
    setitimer(ITIMER_PROF, &it, NULL);
    volatile unsigned long x = 1;
    volatile long done = 0;
    while (done < chunks) {
        if (sigsetjmp(env, 1) != 0) {
            if (interrupts > 300) { struct itimerval off = {{0, 0}, {0, 0}}; setitimer(ITIMER_PROF, &off, NULL); }
            continue;  /* interrupted: redo this chunk from its checkpoint */
        }
        unsigned long r = chunk(x, 100000);
        x = r;
        done = done + 1;
    }
    struct itimerval off = {{0, 0}, {0, 0}};
    setitimer(ITIMER_PROF, &off, NULL);
    printf("sigjmp %lu\n", (unsigned long)x);
    return 0;
}
