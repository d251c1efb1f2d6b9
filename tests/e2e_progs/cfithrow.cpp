// C++: a hot loop calls a function too large to inline (same module), which throws now
// and then; the loop's caller catches.  With real_calls the call is made from
// replacement code, so the throw unwinds through a copy of the loop's function: the
// copy's unwind information must be there (FRAMES_ADD).  The callee also writes, now
// and then, a backtrace() to stderr: each return address as exe+OFFSET (the executable),
// lib (another object) or ? (no object: a code buffer), for the test to name.
#include <cstdio>
#include <cstdlib>
#include <dlfcn.h>
#include <execinfo.h>

struct Rare {
    unsigned v;
};

static void *exe_base;
static unsigned long rare_paths;

static void trace() {
    void *b[32];
    int n = backtrace(b, 32);
    char line[1024];
    int k = snprintf(line, sizeof line, "bt");
    for (int i = 0; i < n && k < (int)sizeof line - 40; i++) {
        Dl_info di;
        if (!dladdr(b[i], &di))
            k += snprintf(line + k, sizeof line - k, " ?");
        else if (di.dli_fbase == exe_base)
            k += snprintf(line + k, sizeof line - k, " exe+%lx",
                          (unsigned long)((char *)b[i] - (char *)di.dli_fbase));
        else
            k += snprintf(line + k, sizeof line - k, " lib");
    }
    fprintf(stderr, "%s\n", line);
}

#define ROUND(k)                                                   \
    x ^= x >> 15; x *= 0x2c1b3c6du + (k); x ^= x >> 12;             \
    if (x & (1u << (k))) x += 0x297a2d39u ^ (k); else x -= 0x9e3779b9u + (k);

__attribute__((noinline)) static unsigned work(unsigned x, unsigned k) {
    if (__builtin_expect((k & 1023) != 0, 1))
        return x * 2654435761u + k;
    ROUND(1) ROUND(2) ROUND(3) ROUND(4) ROUND(5) ROUND(6) ROUND(7) ROUND(8)
    ROUND(9) ROUND(10) ROUND(11) ROUND(12) ROUND(13) ROUND(14) ROUND(15) ROUND(16)
    if (++rare_paths % 8192 == 0)
        trace();
    if ((x & 0xfff) == 0)
        throw Rare{x};
    return x;
}

__attribute__((noinline)) static unsigned hot(unsigned s, long n, long from) {
    unsigned t = 7 + (unsigned)from;
    for (long i = 0; i < n; i++) {
        t = t * 1103515245u + 12345u;
        s += 0xdeadbeefu / ((t >> 7) | 1);
        s = work(s, t);
    }
    return s;
}

int main(int argc, char **argv) {
    Dl_info di;
    if (dladdr((void *)&trace, &di))
        exe_base = di.dli_fbase;
    long rounds = argc > 1 ? atol(argv[1]) : 100;
    unsigned s = 1;
    unsigned long caught = 0;
    for (long r = 0; r < rounds; r++) {
        try {
            s = hot(s, 1000000, r);
        } catch (const Rare &e) {
            caught++;
            s += e.v | 1;
        }
    }
    printf("cfithrow %u caught %lu\n", s, caught);
    return 0;
}
