/* Worker threads call, from a hot loop, a function the region inliner does not take
 * (recursive), so the loop's region calls it for real; every result is checked.
 * usage: rc_block THREADS [nice]; commands on stdin, one a line:
 *   park     each worker, the next time it is called from a copy (its return address
 *            is outside the executable), blocks in read() of a pipe inside the callee
 *            ("parked TID"); then "all-parked"
 *   release  the parked workers return (into the copy that called them); "released"
 *   slow     from now on one call in 4096 spins in the callee for a millisecond, so a
 *            census often finds workers there, with only a return address in the copy
 *   quit/EOF the workers stop; "ok calls=N foreign=F wrong=W"; exit 3 if W > 0
 * Prints "ready" once every worker runs.  A worker's loop runs in batches of 20000
 * calls, so it leaves the loop (and a copy of it) every millisecond or so (-DBATCH=N:
 * other sizes; a huge one keeps the workers in the loop for good).  "nice":
 * the workers run at nice 10, below the agent's thread (its replies to a storm of
 * requests then do not wait for a time slice behind eight busy workers). */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

extern char __executable_start[], etext[];

#ifndef BATCH
#define BATCH 20000
#endif
static atomic_int park_gen, parked, started, stop;
static atomic_long calls, wrong, foreign_calls;
static _Thread_local int my_gen;
static int pipefd[2], nice_workers;
static atomic_int slow_calls;
static pthread_mutex_t out = PTHREAD_MUTEX_INITIALIZER;
static volatile unsigned sink;

static int foreign(const void *p) {
    const char *c = p;
    return c < __executable_start || c >= etext;
}

static void say(const char *what, long v) {
    pthread_mutex_lock(&out);
    printf("%s %ld\n", what, v);
    fflush(stdout);
    pthread_mutex_unlock(&out);
}

__attribute__((noinline)) static void park(void) {
    atomic_fetch_add(&parked, 1);
    say("parked", (long)syscall(SYS_gettid));
    char c;
    while (read(pipefd[0], &c, 1) != 1) {}
    atomic_fetch_sub(&parked, 1);
}

static inline unsigned rotl7(unsigned r) { return r << 7 | r >> 25; }

/* depth 1 calls depth 0: recursive, so never inlined into the loop's region */
__attribute__((noinline)) static unsigned step(unsigned x, int d) {
    if (d > 0) {
        if (foreign(__builtin_return_address(0))) {
            atomic_fetch_add_explicit(&foreign_calls, 1, memory_order_relaxed);
            int g = atomic_load_explicit(&park_gen, memory_order_relaxed);
            if (g != my_gen) {
                my_gen = g;
                park();
            }
        }
        return rotl7(step(x ^ 0x5bd1e995u, d - 1)) ^ 0x1234567u;
    }
    if ((x & 4095) == 0 && atomic_load_explicit(&slow_calls, memory_order_relaxed)) {
        struct timespec t0, t;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        do
            clock_gettime(CLOCK_MONOTONIC, &t);
        while ((t.tv_sec - t0.tv_sec) * 1000000000L + t.tv_nsec - t0.tv_nsec < 1000000);
    }
    return x * 2654435761u + 7;
}

static inline unsigned expect(unsigned x) {
    return rotl7((x ^ 0x5bd1e995u) * 2654435761u + 7) ^ 0x1234567u;
}

__attribute__((noinline)) static long batch(unsigned seed) {
    long bad = 0;
    unsigned s = seed;
    for (long i = 0; i < BATCH; i++) {
        unsigned x = seed + (unsigned)i;
        s += 0xdeadbeefu / ((x >> 3 ^ s) | 1);
        if (step(x, 1) != expect(x))
            bad++;
    }
    sink = s;
    return bad;
}

static void *worker(void *arg) {
    unsigned seed = (unsigned)(long)arg * 0x9e3779b9u;
    my_gen = 0;
    if (nice_workers && setpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid), 10) != 0)
        _exit(2);
    atomic_fetch_add(&started, 1);
    while (!atomic_load_explicit(&stop, memory_order_relaxed)) {
        long bad = batch(seed);
        if (bad) {
            fprintf(stderr, "WRONG: %ld results of batch %u\n", bad, seed);
            atomic_fetch_add(&wrong, bad);
        }
        atomic_fetch_add_explicit(&calls, BATCH, memory_order_relaxed);
        seed += BATCH;
    }
    return NULL;
}

static int wait_for(atomic_int *v, int want) {
    for (int i = 0; i < 30000; i++) {            /* at most 30 s */
        if (atomic_load(v) == want)
            return 1;
        usleep(1000);
    }
    return 0;
}

int main(int argc, char **argv) {
    int n = argc > 1 ? atoi(argv[1]) : 4;
    pthread_t th[64];
    nice_workers = argc > 2 && strcmp(argv[2], "nice") == 0;
    if (n < 1 || n > 64 || pipe(pipefd) != 0)
        return 2;
    for (long t = 0; t < n; t++)
        pthread_create(&th[t], NULL, worker, (void *)(t + 1));
    if (!wait_for(&started, n))
        return 2;
    say("ready", n);
    char line[64];
    while (fgets(line, sizeof line, stdin)) {
        if (strncmp(line, "park", 4) == 0) {
            atomic_fetch_add(&park_gen, 1);
            say(wait_for(&parked, n) ? "all-parked" : "park-timeout", n);
        } else if (strncmp(line, "release", 7) == 0) {
            int k = atomic_load(&parked);
            for (int i = 0; i < k; i++)
                if (write(pipefd[1], "x", 1) != 1)
                    return 2;
            say(wait_for(&parked, 0) ? "released" : "release-timeout", k);
        } else if (strncmp(line, "slow", 4) == 0) {
            atomic_store(&slow_calls, 1);
            say("slow", n);
        } else if (strncmp(line, "quit", 4) == 0) {
            break;
        }
    }
    atomic_store(&stop, 1);
    for (int t = 0; t < n; t++)
        pthread_join(th[t], NULL);
    printf("ok calls=%ld foreign=%ld wrong=%ld\n", atomic_load(&calls),
           atomic_load(&foreign_calls), atomic_load(&wrong));
    return atomic_load(&wrong) ? 3 : 0;
}
