/* Hot loop (a division a turn) calling a static function the inliner will not take:
   its rare path makes it too large for the budget.  The callee counts the calls whose
   return address lies outside the executable's text, i.e. calls made from replacement
   code (real_calls); the count goes to stderr, so stdout is the same under dbr. */
#include <stdio.h>
#include <stdlib.h>

extern char __executable_start[], etext[];
static long foreign;

#define ROUND(k)                                                   \
    x ^= x >> 15; x *= 0x2c1b3c6du + (k); x ^= x >> 12;             \
    if (x & (1u << (k))) x += 0x297a2d39u ^ (k); else x -= 0x9e3779b9u + (k);

__attribute__((noinline)) static unsigned step(unsigned x, unsigned k) {
    char *ra = __builtin_return_address(0);
    if (ra < __executable_start || ra >= etext)
        foreign++;
    if (__builtin_expect((k & 1023) != 0, 1))
        return x * 2654435761u + k;
    ROUND(1) ROUND(2) ROUND(3) ROUND(4) ROUND(5) ROUND(6) ROUND(7) ROUND(8)
    ROUND(9) ROUND(10) ROUND(11) ROUND(12) ROUND(13) ROUND(14) ROUND(15) ROUND(16)
    return x;
}

int main(int argc, char **argv) {
    long n = (argc > 1 ? atol(argv[1]) : 40) * 1000000L;
    unsigned s = 1, t = 7;
    for (long i = 0; i < n; i++) {
        t = t * 1103515245u + 12345u;
        s += 0xdeadbeefu / ((t >> 7) | 1);
        s = step(s, t);
    }
    printf("realcall %u\n", s);
    fprintf(stderr, "foreign-returns %ld\n", foreign);
    return 0;
}
