/* threadlist: the agent's thread listing (dbr_list_threads, linked from
 * dbr_agent/util.c) under threads ending in crowds.
 *   threadlist SECONDS NDIE
 * Rounds: NDIE threads sleep to a common deadline and end together, while one
 * more thread, created after them (last in the kernel's thread list), lives on
 * a little longer.  The main thread lists the threads over and over while that
 * one lives; a listing without it is a miss.  Prints
 *   looks N missed M unknown U   (U: listings answered -1) */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

int dbr_list_threads(pid_t *tids, int max);

#define MAX_TIDS 4096

static volatile pid_t g_last_tid;
static volatile int g_last_alive, g_last_started;
static double g_deadline;

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static void sleep_until(double t)
{
    struct timespec ts;
    ts.tv_sec = (time_t)t;
    ts.tv_nsec = (long)((t - (double)ts.tv_sec) * 1e9);
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) != 0)
        ;
}

static void *ending(void *arg)
{
    (void)arg;
    sleep_until(g_deadline);
    return NULL;
}

static void *last(void *arg)
{
    (void)arg;
    g_last_tid = (pid_t)syscall(SYS_gettid);
    g_last_alive = 1;
    __atomic_store_n(&g_last_started, 1, __ATOMIC_RELEASE);
    sleep_until(g_deadline + 0.005);
    g_last_alive = 0;
    return NULL;
}

int main(int argc, char **argv)
{
    double end = now() + (argc > 1 ? atof(argv[1]) : 2.0);
    int ndie = argc > 2 ? atoi(argv[2]) : 200, i;
    long looks = 0, missed = 0, unknown = 0;
    static pid_t tids[MAX_TIDS];
    pthread_t *t = calloc((size_t)ndie, sizeof *t), l;

    if (!t || ndie < 1 || ndie > MAX_TIDS - 8)
        return 2;
    while (now() < end) {
        g_deadline = now() + 0.010;
        for (i = 0; i < ndie; i++)
            if (pthread_create(&t[i], NULL, ending, NULL) != 0)
                return 2;
        if (pthread_create(&l, NULL, last, NULL) != 0)
            return 2;
        while (!__atomic_load_n(&g_last_started, __ATOMIC_ACQUIRE))
            ;
        g_last_started = 0;
        while (g_last_alive) {
            pid_t want = g_last_tid;
            int n = dbr_list_threads(tids, MAX_TIDS), found = 0;

            for (i = 0; i < n && i < MAX_TIDS; i++)
                found |= tids[i] == want;
            if (!g_last_alive)
                break;          /* it may have ended during the listing */
            looks++;
            if (n < 0)
                unknown++;
            else if (!found)
                missed++;
        }
        for (i = 0; i < ndie; i++)
            pthread_join(t[i], NULL);
        pthread_join(l, NULL);
    }
    printf("looks %ld missed %ld unknown %ld\n", looks, missed, unknown);
    return 0;
}
