/* A bytecode interpreter whose dispatch is a dense switch (a jump table).
 * usage: interp N  (N = times the bytecode program runs, thousands) */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

enum { PUSH, LOAD, STORE, ADD, SUB, MUL, XOR, SHR, DUP, SWAP, JNZ, JMP, DEC, AND, INC, POP, HALT, NOPS };

static const int64_t prog[] = {
    /* r0 = acc, r1 = counter */
    PUSH, 5000, STORE, 1,
    /* loop: */
    LOAD, 0, PUSH, 31, MUL, LOAD, 1, XOR, DUP, PUSH, 7, SHR, ADD,
    PUSH, 0xffffff, AND, STORE, 0,
    LOAD, 1, DEC, DUP, STORE, 1, JNZ, 4,
    HALT,
};

__attribute__((noinline)) static int64_t run(int64_t seed)
{
    int64_t stack[64], reg[4] = {seed, 0, 0, 0};
    int sp = 0;
    long pc = 0;
    for (;;) {
        int64_t op = prog[pc++];
        switch (op) {
        case PUSH: stack[sp++] = prog[pc++]; break;
        case LOAD: stack[sp++] = reg[prog[pc++]]; break;
        case STORE: reg[prog[pc++]] = stack[--sp]; break;
        case ADD: sp--; stack[sp - 1] += stack[sp]; break;
        case SUB: sp--; stack[sp - 1] -= stack[sp]; break;
        case MUL: sp--; stack[sp - 1] *= stack[sp]; break;
        case XOR: sp--; stack[sp - 1] ^= stack[sp]; break;
        case SHR: sp--; stack[sp - 1] >>= stack[sp]; break;
        case AND: sp--; stack[sp - 1] &= stack[sp]; break;
        case DUP: stack[sp] = stack[sp - 1]; sp++; break;
        case SWAP: { int64_t t = stack[sp - 1]; stack[sp - 1] = stack[sp - 2]; stack[sp - 2] = t; break; }
        case JNZ: { int64_t t = prog[pc++]; if (stack[--sp]) pc = t; break; }
        case JMP: pc = prog[pc]; break;
        case DEC: stack[sp - 1]--; break;
        case INC: stack[sp - 1]++; break;
        case POP: sp--; break;
        case HALT: return reg[0];
        default: abort();
        }
    }
}

int main(int argc, char **argv)
{
    long n = argc > 1 ? atol(argv[1]) : 10;
    int64_t acc = 0;
    for (long i = 0; i < n * 1000 / 50; i++)
        acc = run(acc + i);
    printf("interp %ld %lld\n", n, (long long)acc);
    return 0;
}
