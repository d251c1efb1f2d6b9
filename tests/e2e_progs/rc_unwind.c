/* C: unwinding and siglongjmp through replacement code that makes real calls.
 * main -> outer (hot loop) -> middle (hot loop) -> leaf: with real_calls each loop's
 * copy calls the next function for real, so leaf runs with two copied frames above it.
 * usage: rc_unwind trace|sigjmp ROUNDS [WARM_S]
 *   trace:  leaf now and then writes "bt" (backtrace()) and "ub" (_Unwind_Backtrace)
 *           lines to stderr, each address as exe+OFFSET, lib or ?ADDR (no object).
 *   sigjmp: SIGALRM every 2 ms (setitimer), and now and then raise(SIGUSR1) from leaf;
 *           both handlers siglongjmp back to main, which redoes the interrupted round
 *           from its checkpoint: the result does not depend on where signals land;
 *           after ROUNDS, unprinted rounds until 300 alarms have been handled.
 *           stderr: how many handlers were entered with the PC in a code buffer, or
 *           in leaf called from a copy.
 * WARM_S: first run unprinted rounds until leaf is called from a copy of middle
 * called from a copy of outer, at most WARM_S seconds (stderr: "warm ..."). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <execinfo.h>
#include <setjmp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>
#include <time.h>
#include <ucontext.h>
#include <unwind.h>

extern char __executable_start[], etext[];

static void *exe_base;
static unsigned long rare_paths, warm_seen;
static int warming, trace_mode;
static char *middle_ra;
static volatile sig_atomic_t leaf_under_copy;     /* in leaf, called from a copy */
static volatile unsigned long alarms, alarm_in_copy, alarm_under_copy;
static volatile unsigned long raises, raise_under_copy;
static sigjmp_buf env;

static int foreign(const void *p) {
    const char *c = p;
    return c < __executable_start || c >= etext;
}

static int put(char *line, int k, int cap, void *a) {
    Dl_info di;
    if (!dladdr(a, &di))
        return k + snprintf(line + k, cap - k, " ?%lx", (unsigned long)a);
    if (di.dli_fbase == exe_base)
        return k + snprintf(line + k, cap - k, " exe+%lx",
                            (unsigned long)((char *)a - (char *)di.dli_fbase));
    return k + snprintf(line + k, cap - k, " lib");
}

struct ub { char *line; int k, cap, n; };

static _Unwind_Reason_Code ub_step(struct _Unwind_Context *ctx, void *arg) {
    struct ub *s = arg;
    if (s->n++ >= 32 || s->k > s->cap - 40)
        return _URC_END_OF_STACK;
    s->k = put(s->line, s->k, s->cap, (void *)_Unwind_GetIP(ctx));
    return _URC_NO_REASON;
}

__attribute__((noinline)) static void trace(void) {
    void *b[32];
    char line[1024];
    int n = backtrace(b, 32), k = snprintf(line, sizeof line, "bt");
    for (int i = 0; i < n && k < (int)sizeof line - 40; i++)
        k = put(line, k, sizeof line, b[i]);
    fprintf(stderr, "%s\n", line);
    struct ub s = {line, 0, (int)sizeof line, 0};
    s.k = snprintf(line, sizeof line, "ub");
    _Unwind_Backtrace(ub_step, &s);
    fprintf(stderr, "%s\n", line);
}

#define ROUND(k)                                                   \
    x ^= x >> 15; x *= 0x2c1b3c6du + (k); x ^= x >> 12;             \
    if (x & (1u << (k))) x += 0x297a2d39u ^ (k); else x -= 0x9e3779b9u + (k);

/* leaf and middle each call themselves once (depth 1, then 0): the region inliner
 * rejects a recursive call, and never inlines a function with a rejected hot call, so
 * each stays a real call from the copy of its caller's loop. */
__attribute__((noinline)) static unsigned leaf(unsigned x, unsigned k, int d) {
    if (d > 0) {
        char *ra = __builtin_return_address(0);
        int copy = foreign(ra) && foreign(middle_ra) && ra != middle_ra;
        if (warming && copy)
            warm_seen++;
        leaf_under_copy = copy;
        x = leaf(x ^ k, k * 5 + 1, d - 1);
        leaf_under_copy = 0;
        return (x << 5 | x >> 27) ^ k;
    }
    x += k;
    ROUND(1) ROUND(2)
    if (__builtin_expect((k & 1023) != 0, 1))
        return x;
    ROUND(5) ROUND(6) ROUND(7) ROUND(8)
    ROUND(9) ROUND(10) ROUND(11) ROUND(12) ROUND(13) ROUND(14) ROUND(15) ROUND(16)
    ++rare_paths;
    if (trace_mode && !warming && rare_paths % 128 == 0)
        trace();
    if (!trace_mode && !warming && rare_paths % 97 == 0 && raises < 60)
        raise(SIGUSR1);
    return x;
}

/* A loop of 2 to 5 turns (not unrolled; its call of leaf no tail call). */
__attribute__((noinline)) static unsigned middle(unsigned s, unsigned t, int d) {
    if (d > 0)
        middle_ra = __builtin_return_address(0);
    unsigned reps = 2 + (t >> 29), j;
    for (j = 0; j < reps; j++) {
        t = t * 69069u + 1;
        s += 0xfeedfaceu / ((t >> 9) | 1);
        s = leaf(s, t, 1);
    }
    if (d > 0) {
        s = middle(s, t ^ s, d - 1);
        s = (s << 3 | s >> 29) + j;
    }
    return s + j;
}

__attribute__((noinline)) static unsigned outer(unsigned s, long n, long from) {
    unsigned t = 7 + (unsigned)from;
    for (long i = 0; i < n; i++) {
        t = t * 1103515245u + 12345u;
        // an inner loop (4 to 7 turns) that makes outer's region worth keeping
        for (unsigned q = 0; q < 4 + (t & 3); q++)
            s += 0xdeadbeefu / (((t ^ s) >> q) | 1);
        s = middle(s, t, 1);
    }
    return s;
}

static double seconds_since(const struct timespec *t0) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)(t.tv_sec - t0->tv_sec) + (t.tv_nsec - t0->tv_nsec) * 1e-9;
}

static void on_alarm(int sig, siginfo_t *si, void *uc) {
    (void)sig; (void)si;
    Dl_info di;
    void *pc = (void *)((ucontext_t *)uc)->uc_mcontext.gregs[REG_RIP];
    alarms++;
    if (!dladdr(pc, &di))
        alarm_in_copy++;
    else if (leaf_under_copy)
        alarm_under_copy++;
    if (alarms >= 300) {
        struct itimerval off = {{0, 0}, {0, 0}};
        setitimer(ITIMER_REAL, &off, NULL);
    }
    siglongjmp(env, 1);
}

static void on_usr1(int sig) {
    (void)sig;
    raises++;
    raise_under_copy += leaf_under_copy;
    siglongjmp(env, 2);
}

int main(int argc, char **argv) {
    Dl_info di;
    if (dladdr((void *)&trace, &di))
        exe_base = di.dli_fbase;
    fprintf(stderr, "base %lx\n", (unsigned long)exe_base);
    trace_mode = argc > 1 && strcmp(argv[1], "trace") == 0;
    long rounds = argc > 2 ? atol(argv[2]) : 100;
    double warm_s = argc > 3 ? atof(argv[3]) : 0;
    struct timespec t0, t;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    long warm = 0;
    for (warming = warm_s > 0; warming && !warm_seen; warm++) {
        outer(5, 20000, warm);
        clock_gettime(CLOCK_MONOTONIC, &t);
        warming = (t.tv_sec - t0.tv_sec) + (t.tv_nsec - t0.tv_nsec) * 1e-9 < warm_s;
    }
    warming = 0;
    rare_paths = 0;
    fprintf(stderr, "warm %ld rounds, copies %s\n", warm, warm_seen ? "yes" : "no");

    if (!trace_mode) {
        struct sigaction sa;
        memset(&sa, 0, sizeof sa);
        sa.sa_sigaction = on_alarm;
        sa.sa_flags = SA_SIGINFO;
        sigaction(SIGALRM, &sa, NULL);
        sa.sa_flags = 0;
        sa.sa_handler = on_usr1;
        sigaction(SIGUSR1, &sa, NULL);
        struct itimerval it = {{0, 2000}, {0, 2000}};
        setitimer(ITIMER_REAL, &it, NULL);
    }
    volatile unsigned s = 1, spare = 0;
    volatile long r = 0, redone = 0;
    /* after the printed rounds, unprinted ones until 300 alarms (at most 60 s): a
     * loaded machine coalesces SIGALRMs, and the rounds alone may end sooner */
    while (r < rounds || (!trace_mode && alarms < 300 && seconds_since(&t0) < 60)) {
        if (!trace_mode && sigsetjmp(env, 1) != 0) {
            redone = redone + 1;
            continue;                  /* interrupted: this round again, from s */
        }
        unsigned v = outer(r < rounds ? s : spare, 20000, r);
        if (r < rounds) {
            s = v;
            r = r + 1;
        } else {
            spare = v;
        }
    }
    struct itimerval off = {{0, 0}, {0, 0}};
    setitimer(ITIMER_REAL, &off, NULL);
    printf("rc_unwind %s %u\n", trace_mode ? "trace" : "sigjmp", s);
    fprintf(stderr, "alarms %lu alarm-in-copy %lu alarm-under-copy %lu raises %lu "
            "raise-under-copy %lu redone %ld\n", alarms, alarm_in_copy, alarm_under_copy, raises,
            raise_under_copy, redone);
    return 0;
}
