/* A program for latency probe tests: runs its functions as told on stdin.
 *   "nap N US"        calls nap(US) N times (nanosleep of US microseconds)
 *   "timed N US"      the same, N at most 100, and prints "times T1 T2 ..." first: each
 *                     call's time in ns, measured around the call (CLOCK_MONOTONIC)
 *   "rec D US"        calls rec(D, US): D nested calls, each sleeping US first
 *   "leap N"          N times: setjmp, then leap(i): odd i longjmp out of leap
 *   "threads T N US"  T threads each call nap(US) N times; joined
 *   "exiters T N"     T threads each call leave(i) for i < N, and the last call ends
 *                     the thread inside leave (pthread_exit); joined
 *   "bg T N US"       the same, not joined yet ("started" once every thread is in)
 *   "join"            joins the "bg" threads
 *   "exit"            exits 0
 * Every command prints "done SUM" (its results, checked by the test), then "ready". */
#include <pthread.h>
#include <setjmp.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#define MAX_THREADS 16
#define MAX_TIMED 100

static jmp_buf env;
volatile long sink;
static pthread_t bg[MAX_THREADS];
static int nbg;
static volatile int entered;

__attribute__((noinline)) long nap(long us)
{
    struct timespec ts = {us / 1000000, (us % 1000000) * 1000};
    __atomic_add_fetch(&entered, 1, __ATOMIC_SEQ_CST);
    while (nanosleep(&ts, &ts) != 0)
        ;
    return us;
}

__attribute__((noinline)) long rec(long depth, long us)
{
    long r = nap(us);
    if (depth > 1)
        r += rec(depth - 1, us);
    sink += r;
    return r;
}

__attribute__((noinline)) long leap(long i)
{
    sink += i;
    if (i & 1)
        longjmp(env, 1);
    return i;
}

__attribute__((noinline)) long leave(long i, long last)
{
    sink += i;
    if (i == last)
        pthread_exit(NULL);
    return i;
}

struct job { long n, us, sum; };
static struct job jobs[MAX_THREADS];

static void *worker(void *arg)
{
    struct job *j = arg;
    for (long i = 0; i < j->n; i++)
        j->sum += nap(j->us);
    return NULL;
}

static void *exiter(void *arg)
{
    struct job *j = arg;
    for (long i = 0; i < j->n; i++)
        j->sum += leave(i, j->n - 1);   /* the thread ends inside the last call */
    return NULL;
}

static long start_fn(long t, long n, long us, void *(*fn)(void *))
{
    if (t > MAX_THREADS)
        t = MAX_THREADS;
    for (long i = 0; i < t; i++) {
        jobs[i] = (struct job){n, us, 0};
        pthread_create(&bg[i], NULL, fn, &jobs[i]);
    }
    return t;
}

static long start(long t, long n, long us)
{
    return start_fn(t, n, us, worker);
}

static long join(long t)
{
    long sum = 0;
    for (long i = 0; i < t; i++) {
        pthread_join(bg[i], NULL);
        sum += jobs[i].sum;
    }
    return sum;
}

int main(void)
{
    char line[64];
    setvbuf(stdout, NULL, _IOLBF, 0);
    printf("ready\n");
    while (fgets(line, sizeof line, stdin)) {
        long a = 0, b = 0, c = 0, sum = 0;
        if (sscanf(line, "timed %ld %ld", &a, &b) == 2) {
            long t[MAX_TIMED];
            struct timespec t0, t1;
            if (a > MAX_TIMED)
                a = MAX_TIMED;
            for (long i = 0; i < a; i++) {
                clock_gettime(CLOCK_MONOTONIC, &t0);
                sum += nap(b);
                clock_gettime(CLOCK_MONOTONIC, &t1);
                t[i] = (t1.tv_sec - t0.tv_sec) * 1000000000L + (t1.tv_nsec - t0.tv_nsec);
            }
            printf("times");
            for (long i = 0; i < a; i++)
                printf(" %ld", t[i]);
            printf("\n");
        } else if (sscanf(line, "nap %ld %ld", &a, &b) == 2) {
            for (long i = 0; i < a; i++)
                sum += nap(b);
        } else if (sscanf(line, "rec %ld %ld", &a, &b) == 2) {
            sum = rec(a, b);
        } else if (sscanf(line, "leap %ld", &a) == 1) {
            for (volatile long i = 0; i < a; i++)
                if (setjmp(env) == 0)
                    sum += leap(i);
                else
                    sum += 1000;
        } else if (sscanf(line, "threads %ld %ld %ld", &a, &b, &c) == 3) {
            sum = join(start(a, b, c));
        } else if (sscanf(line, "exiters %ld %ld", &a, &b) == 2) {
            sum = join(start_fn(a, b, 0, exiter));
        } else if (sscanf(line, "bg %ld %ld %ld", &a, &b, &c) == 3) {
            entered = 0;
            nbg = (int)start(a, b, c);
            for (int k = 0; k < 5000 && __atomic_load_n(&entered, __ATOMIC_SEQ_CST) < nbg; k++)
                nanosleep(&(struct timespec){0, 1000000}, NULL);
            printf("started\n");
            sum = nbg;
        } else if (strncmp(line, "join", 4) == 0) {
            sum = join(nbg);
            nbg = 0;
        } else if (strncmp(line, "exit", 4) == 0) {
            return 0;
        }
        printf("done %ld\n", sum);
        printf("ready\n");
    }
    return 0;
}
