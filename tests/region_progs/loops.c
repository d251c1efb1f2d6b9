/* Nested loops, a hot loop calling a small and a large function, recursion,
   function pointers, tail calls.  Each hot function is `noinline` so that its
   symbol (in the unstripped build) delimits its code for ground truth. */
#include <stdio.h>
#include <stdlib.h>

#define NI __attribute__((noinline))

volatile int sink;

NI int small(int x) { return x * 3 + 1; }

NI int large(int x) {
    int acc = 0;
    for (int i = 0; i < 8; i++) {
        if (x & (1 << i)) acc += i * x;
        else acc -= x >> 1;
        acc ^= acc << 3;
        if (acc > 100000) acc %= 977;
    }
    return acc;
}

NI long nested(int n) {
    long s = 0;
    for (int i = 0; i < n; i++)
        for (int j = 0; j < n; j++)
            s += (i * j) ^ (i + j);
    return s;
}

NI long calls_in_loop(int n) {
    long s = 0;
    for (int i = 0; i < n; i++) {
        s += small(i);
        if ((i & 7) == 0) s += large(i);
    }
    return s;
}

NI long fib(int n) { return n < 2 ? n : fib(n - 1) + fib(n - 2); }

typedef int (*op_t)(int);
NI int inc(int x) { return x + 1; }
NI int dbl(int x) { return x * 2; }
op_t ops[2] = {inc, dbl};

NI long fptr_loop(int n) {
    long s = 0;
    for (int i = 0; i < n; i++) s += ops[i & 1](i);
    return s;
}

/* A function pointer in writable memory, loaded by a literal address. */
int (*volatile hook)(int) = inc;

NI long hook_loop(int n) {
    long s = 0;
    for (int i = 0; i < n; i++) s += hook(i);
    return s;
}

NI int tail_target(int x) { sink = x; return x - 1; }
NI int tail_caller(int x) { if (x > 5) return tail_target(x * 2); return x; }

NI long tail_loop(int n) {
    long s = 0;
    for (int i = 0; i < n; i++) s += tail_caller(i);
    return s;
}

int main(int argc, char **argv) {
    int n = argc > 1 ? atoi(argv[1]) : 300;
    long r = nested(n) + calls_in_loop(n * 10) + fib(20) + fptr_loop(n * 10) + tail_loop(n) + hook_loop(n);
    printf("%ld\n", r);
    return 0;
}
