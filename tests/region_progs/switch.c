/* A switch dense enough for gcc to emit a jump table, in a hot loop; and noreturn
   calls (exit, abort, __stack_chk_fail via -fstack-protector-all). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define NI __attribute__((noinline))

NI long dispatch(int op, long a) {
    switch (op) {
    case 0: return a + 7;
    case 1: return a * 3;
    case 2: return a - 11;
    case 3: return a ^ 0x55;
    case 4: return a << 2;
    case 5: return a >> 1;
    case 6: return a | 0x100;
    case 7: return ~a;
    default: return 0;
    }
}

NI long switch_loop(int n) {
    long s = 1;
    for (int i = 0; i < n; i++) s += dispatch(i % 9, s);
    return s;
}

NI void die(const char *msg) { fputs(msg, stderr); exit(3); }

NI int checked(int x) {
    if (x < 0) die("negative");
    if (x > 1000000) abort();
    return x + 1;
}

NI long checked_loop(int n) {
    long s = 0;
    for (int i = 0; i < n; i++) s += checked(i);
    return s;
}

NI int protected_copy(const char *src, int n) {
    char buf[32];
    strncpy(buf, src, sizeof buf - 1);
    buf[31] = 0;
    return (int)strlen(buf) + n;
}

int main(int argc, char **argv) {
    int n = argc > 1 ? atoi(argv[1]) : 1000;
    long r = switch_loop(n) + checked_loop(n) + protected_copy(argv[0], n);
    printf("%ld\n", r);
    return 0;
}
