// C++ exceptions and backtraces through replacement code that makes real calls.
// usage: rc_throw nested|inner ROUNDS [WARM_S]
//   nested: main (catch) -> outer (hot loop) -> middle (hot loop) -> leaf (throws now
//           and then).  With real_calls both loops' copies call for real: a throw
//           from leaf unwinds through two copied frames to main's catch.
//   inner:  main (catch Big) -> inner (hot loop with a try around its call of leaf):
//           Rare is caught inside the loop's (copied) frame, Big passes through it.
// leaf now and then writes two backtraces to stderr: "bt" from backtrace(), "ub" from
// _Unwind_Backtrace; each address as exe+OFFSET (the executable), lib (another object)
// or ?ADDR (no object: a code buffer), for the test to name.  stdout is the same under
// dbr; the counts of throws that left a call made from a code buffer go to stderr.
// WARM_S: first run rounds whose result is not printed until leaf was called from a
// copy (nested: from a copy of middle called from a copy of outer), at most WARM_S
// seconds; the printed rounds then run with the copies live (stderr: "warm ...").
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <dlfcn.h>
#include <execinfo.h>
#include <time.h>
#include <unwind.h>

extern "C" char __executable_start[], etext[];

struct Rare { unsigned v; };
struct Big { unsigned v; };

static void *exe_base;
static unsigned long rare_paths, thrown, thrown_from_copy, thrown_two_copies;
static unsigned long caught_inner, caught_inner_from_copy;
static bool last_throw_from_copy;
static char *middle_ra;      // middle's return address at its latest entry
static bool nested, warming;
static unsigned long warm_seen;

static bool foreign(const void *p) {
    const char *c = (const char *)p;
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

struct UbState { char *line; int k; int cap; int n; };

static _Unwind_Reason_Code ub_step(struct _Unwind_Context *ctx, void *arg) {
    UbState *s = (UbState *)arg;
    if (s->n++ >= 32 || s->k > s->cap - 40)
        return _URC_END_OF_STACK;
    s->k = put(s->line, s->k, s->cap, (void *)_Unwind_GetIP(ctx));
    return _URC_NO_REASON;
}

__attribute__((noinline)) static void trace() {
    void *b[32];
    int n = backtrace(b, 32);
    char line[1024];
    int k = snprintf(line, sizeof line, "bt");
    for (int i = 0; i < n && k < (int)sizeof line - 40; i++)
        k = put(line, k, sizeof line, b[i]);
    fprintf(stderr, "%s\n", line);
    UbState s = {line, 0, (int)sizeof line, 0};
    s.k = snprintf(line, sizeof line, "ub");
    _Unwind_Backtrace(ub_step, &s);
    fprintf(stderr, "%s\n", line);
}

#define ROUND(k)                                                   \
    x ^= x >> 15; x *= 0x2c1b3c6du + (k); x ^= x >> 12;             \
    if (x & (1u << (k))) x += 0x297a2d39u ^ (k); else x -= 0x9e3779b9u + (k);

// leaf and middle each call themselves once (depth 1, then 0): the region inliner
// rejects a recursive call, and never inlines a function with a rejected hot call, so
// each stays a real call from the copy of its caller's loop.
__attribute__((noinline)) static unsigned leaf(unsigned x, unsigned k, int d) {
    static bool copy, two;       // of the depth-1 call
    if (d > 0) {
        char *ra = (char *)__builtin_return_address(0);
        // called from a copy; nested: from a copy of middle, itself called from a copy
        copy = foreign(ra);
        two = copy && foreign(middle_ra) && ra != middle_ra;
        if (warming && (nested ? two : copy))
            warm_seen++;
        x = leaf(x ^ k, k * 5 + 1, d - 1);
        return (x << 5 | x >> 27) ^ k;
    }
    x += k;
    ROUND(1) ROUND(2)
    if (__builtin_expect((k & 1023) != 0, 1))
        return x;
    ROUND(5) ROUND(6) ROUND(7) ROUND(8)
    ROUND(9) ROUND(10) ROUND(11) ROUND(12) ROUND(13) ROUND(14) ROUND(15) ROUND(16)
    if (++rare_paths % 512 == 0 && !warming)
        trace();
    if ((x & 0x3ff) <= 1) {
        thrown++;
        thrown_from_copy += copy;
        thrown_two_copies += two;
        last_throw_from_copy = copy;
        if (x & 1)
            throw Big{x};
        throw Rare{x};
    }
    return x;
}

// A loop of 2 to 5 turns (not unrolled; its call of leaf no tail call).
__attribute__((noinline)) static unsigned middle(unsigned s, unsigned t, int d) {
    if (d > 0)
        middle_ra = (char *)__builtin_return_address(0);
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

__attribute__((noinline)) static unsigned inner(unsigned s, long n, long from) {
    unsigned t = 7 + (unsigned)from;
    for (long i = 0; i < n; i++) {
        t = t * 1103515245u + 12345u;
        s += 0xdeadbeefu / ((t >> 7) | 1);
        try {
            s = leaf(s, t, 1);
        } catch (const Rare &e) {
            caught_inner++;
            caught_inner_from_copy += last_throw_from_copy;
            s += e.v | 1;
        }
    }
    return s;
}

int main(int argc, char **argv) {
    Dl_info di;
    if (dladdr((void *)&trace, &di))
        exe_base = di.dli_fbase;
    fprintf(stderr, "base %lx\n", (unsigned long)exe_base);
    nested = argc > 1 && strcmp(argv[1], "nested") == 0;
    long rounds = argc > 2 ? atol(argv[2]) : 100;
    double warm_s = argc > 3 ? atof(argv[3]) : 0;
    struct timespec t0, t;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    long warm = 0;
    for (warming = warm_s > 0; warming && !warm_seen; warm++) {
        try {
            nested ? outer(5, 20000, warm) : inner(5, 60000, warm);
        } catch (const Rare &) {
        } catch (const Big &) {
        }
        clock_gettime(CLOCK_MONOTONIC, &t);
        warming = (t.tv_sec - t0.tv_sec) + (t.tv_nsec - t0.tv_nsec) * 1e-9 < warm_s;
    }
    warming = false;
    rare_paths = thrown = thrown_from_copy = thrown_two_copies = 0;   // the printed rounds'
    caught_inner = caught_inner_from_copy = 0;
    fprintf(stderr, "warm %ld rounds, copies %s\n", warm, warm_seen ? "yes" : "no");
    unsigned s = 1;
    unsigned long caught = 0;
    for (long r = 0; r < rounds; r++) {
        try {
            s = nested ? outer(s, 100000, r) : inner(s, 600000, r);
        } catch (const Rare &e) {
            caught++;
            s += e.v | 1;
        } catch (const Big &e) {
            caught += 1000;
            s ^= e.v;
        }
    }
    printf("rc_throw %s %u caught %lu inner %lu\n", nested ? "nested" : "inner", s, caught,
           caught_inner);
    fprintf(stderr, "thrown %lu from-copy %lu two-copies %lu caught-inner-from-copy %lu\n",
            thrown, thrown_from_copy, thrown_two_copies, caught_inner_from_copy);
    return 0;
}
