/* switchy: a thread that spins and a thread that sleeps 1 us at a time (tens of
 * thousands of CPU switches a second), or with "alone" only the main thread, sleeping
 * so.  Prints "spin TID" and "switchy TID" (flushed); a line on stdin or SIGUSR1
 * makes the switchy thread spin too ("calm": it then leaves its CPU only when
 * preempted).  SWITCHY_WORK=K: K units of work between two sleeps (default 1). */
#define _GNU_SOURCE
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static atomic_int calm;

static void on_usr1(int sig)
{
    (void)sig;
    atomic_store(&calm, 1);
}
volatile unsigned long sink;

static void work(void)
{
    unsigned long a = sink;
    for (int i = 0; i < 1000; i++)
        a = a * 6364136223846793005ul + (unsigned long)i;
    sink = a;
}

static void *spin(void *arg)
{
    (void)arg;
    printf("spin %ld\n", (long)syscall(SYS_gettid));
    fflush(stdout);
    for (;;)
        work();
    return NULL;
}

static void *switchy(void *arg)
{
    struct timespec ts = {0, 1000};
    const char *k = getenv("SWITCHY_WORK");
    int units = k ? atoi(k) : 1;

    (void)arg;
    printf("switchy %ld\n", (long)syscall(SYS_gettid));
    fflush(stdout);
    for (;;) {
        for (int i = 0; i < units; i++)
            work();
        if (!atomic_load(&calm))
            nanosleep(&ts, NULL);
    }
    return NULL;
}

int main(int argc, char **argv)
{
    pthread_t t;
    char line[16];

    alarm(60);
    signal(SIGUSR1, on_usr1);
    if (argc > 1 && strcmp(argv[1], "alone") == 0)
        switchy(NULL);
    if (pthread_create(&t, NULL, spin, NULL) || pthread_create(&t, NULL, switchy, NULL))
        return 2;
    if (fgets(line, sizeof line, stdin))
        atomic_store(&calm, 1);
    for (;;)
        pause();
    return 0;
}
