/* Varied frames for the CFI parser tests (tests/unit/test_codegen_cfi.py): a VLA (frame
 * pointer CFA), many callee-saved registers, a large frame, a cleanup handler under
 * -fexceptions (an LSDA read by __gcc_personality_v0), a leaf and a tail call. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

__attribute__((noinline)) int leaf(int x) { return x * 3 + 1; }

__attribute__((noinline)) int vla(int n) {
    int a[n];
    for (int i = 0; i < n; i++) a[i] = leaf(i);
    int s = 0;
    for (int i = 0; i < n; i++) s += a[i];
    return s;
}

__attribute__((noinline)) long many(long a, long b, long c, long d, long e, long f) {
    long x = leaf(a), y = leaf(b), z = leaf(c), u = leaf(d), v = leaf(e), w = leaf(f);
    return x * y + z * u + v * w + leaf(x + y + z + u + v + w);
}

__attribute__((noinline)) int big(int k) {
    char buf[100000];
    memset(buf, k, sizeof buf);
    return buf[k] + leaf(buf[k + 1]);
}

static void release(char **p) { free(*p); }

__attribute__((noinline)) int cleaned(int n) {
    __attribute__((cleanup(release))) char *p = malloc(n + 1);
    snprintf(p, n + 1, "%d", n);
    return leaf((int)strlen(p));
}

__attribute__((noinline)) int tail(int n) { return leaf(n + 2); }

int main(int argc, char **argv) {
    (void)argv;
    printf("%d %ld %d %d %d\n", vla(argc + 5), many(argc, 2, 3, 4, 5, 6), big(argc),
           cleaned(argc * 1000), tail(argc));
    return 0;
}
