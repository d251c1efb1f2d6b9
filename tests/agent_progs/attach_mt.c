/* attach_mt: a multi-threaded program that `dbr attach` loads the agent into while
 * it runs (tests/live/test_attach.py).
 *
 *   attach_mt [HOT_THREADS]      (default 2)
 *
 * Hot threads compute the same checksum round after round (a loop with branches,
 * long enough to be sampled and patched) and count the rounds whose result differs
 * from their first, computed before any attach.  A reader thread blocks in read()
 * on a pipe, a sleeper in nanosleep.  Commands on stdin, one a line:
 *   ping    main writes to the pipe; the reader prints "reader got N"
 *   report  "hot K rounds R bad B value V" per hot thread, "sleeper ticks T", "end"
 *   spawn   one more thread, spinning in late_sum() (started after an attach: the
 *           agent has no pthread_create hook to hear of it); "spawned"
 *   trap    installs a SIGTRAP handler of its own (with libc's sigaction, which an
 *           attached agent does not interpose); "trap set"
 *   raise   raises SIGTRAP; "traps N handler mine|other": the handler's count, and
 *           whether the action in force now is the one it installed
 *   stop    every thread ends; "done" */
#define _GNU_SOURCE
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define MAX_HOT 16

static volatile int g_stop;
static int g_pipe[2];
static struct { unsigned long rounds, bad, value; } g_hot[MAX_HOT];
static unsigned long g_ticks;
static volatile unsigned long g_seed = 12345;
static volatile sig_atomic_t g_traps;

static void on_trap(int sig)
{
    (void)sig;
    g_traps++;
}

__attribute__((noipa)) unsigned long checksum(unsigned long seed, long n)
{
    unsigned long x = seed, acc = 0;

    for (long i = 0; i < n; i++) {
        x = x * 6364136223846793005UL + 1442695040888963407UL;
        if ((x >> 33) & 1)
            acc += x >> 40;
        else
            acc ^= x << 3;
        if (i % 7 == 3)
            acc = (acc << 1) | (acc >> 63);
    }
    return acc;
}

static void *hot(void *arg)
{
    long k = (long)arg;
    unsigned long first = checksum(g_seed, 2000000);

    __atomic_store_n(&g_hot[k].value, first, __ATOMIC_RELEASE);
    while (!g_stop) {
        unsigned long v = checksum(g_seed, 2000000);

        if (v != first)
            __atomic_add_fetch(&g_hot[k].bad, 1, __ATOMIC_RELAXED);
        __atomic_add_fetch(&g_hot[k].rounds, 1, __ATOMIC_RELAXED);
    }
    return NULL;
}

__attribute__((noipa)) unsigned long late_sum(unsigned long x, long n)
{
    for (long i = 0; i < n; i++)
        x = (x ^ (x >> 7)) * 0x9E3779B97F4A7C15UL + (unsigned long)i;
    return x;
}

static void *late(void *arg)
{
    unsigned long x = 1;

    (void)arg;
    while (!g_stop)
        x = late_sum(x, 1000000);
    return (void *)(x & 1);
}

static void *reader(void *arg)
{
    char c;
    unsigned long n = 0;

    (void)arg;
    while (read(g_pipe[0], &c, 1) == 1 && c == 'p')
        printf("reader got %lu\n", ++n), fflush(stdout);
    return NULL;
}

static void *sleeper(void *arg)
{
    struct timespec ts = { 0, 10 * 1000 * 1000 };

    (void)arg;
    while (!g_stop) {
        nanosleep(&ts, NULL);
        __atomic_add_fetch(&g_ticks, 1, __ATOMIC_RELAXED);
    }
    return NULL;
}

int main(int argc, char **argv)
{
    int n = argc > 1 ? atoi(argv[1]) : 2;
    pthread_t t[MAX_HOT + 2], spawned;
    int nspawned = 0;
    char line[64];

    if (n < 1 || n > MAX_HOT)
        n = 2;
    if (pipe(g_pipe) < 0)
        return 1;
    for (long k = 0; k < n; k++)
        pthread_create(&t[k], NULL, hot, (void *)k);
    pthread_create(&t[n], NULL, reader, NULL);
    pthread_create(&t[n + 1], NULL, sleeper, NULL);
    printf("ready %d\n", n);
    fflush(stdout);
    while (fgets(line, sizeof line, stdin)) {
        if (strncmp(line, "ping", 4) == 0) {
            if (write(g_pipe[1], "p", 1) != 1)
                return 1;
        } else if (strncmp(line, "report", 6) == 0) {
            for (int k = 0; k < n; k++)
                printf("hot %d rounds %lu bad %lu value %lu\n", k,
                       __atomic_load_n(&g_hot[k].rounds, __ATOMIC_RELAXED),
                       __atomic_load_n(&g_hot[k].bad, __ATOMIC_RELAXED),
                       __atomic_load_n(&g_hot[k].value, __ATOMIC_ACQUIRE));
            printf("sleeper ticks %lu\nend\n", __atomic_load_n(&g_ticks, __ATOMIC_RELAXED));
            fflush(stdout);
        } else if (strncmp(line, "spawn", 5) == 0 && !nspawned) {
            nspawned = pthread_create(&spawned, NULL, late, NULL) == 0;
            printf("spawned\n");
            fflush(stdout);
        } else if (strncmp(line, "trap", 4) == 0) {
            struct sigaction sa;

            memset(&sa, 0, sizeof sa);
            sa.sa_handler = on_trap;
            sigaction(SIGTRAP, &sa, NULL);
            printf("trap set\n");
            fflush(stdout);
        } else if (strncmp(line, "raise", 5) == 0) {
            struct sigaction now;

            raise(SIGTRAP);
            sigaction(SIGTRAP, NULL, &now);
            printf("traps %d handler %s\n", (int)g_traps,
                   now.sa_handler == on_trap ? "mine" : "other");
            fflush(stdout);
        } else if (strncmp(line, "stop", 4) == 0) {
            break;
        }
    }
    g_stop = 1;
    if (write(g_pipe[1], "q", 1) != 1)
        return 1;
    for (int k = 0; k < n + 2; k++)
        pthread_join(t[k], NULL);
    if (nspawned)
        pthread_join(spawned, NULL);
    printf("done\n");
    return 0;
}
