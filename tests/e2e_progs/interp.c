/* A bytecode interpreter whose dispatch is a switch compiled to a jump table. */
#include <stdio.h>
#include <stdlib.h>
enum { OP_LOAD, OP_MUL, OP_ADD, OP_XOR, OP_SHR, OP_ROT, OP_DEC, OP_JNZ, OP_AND, OP_SUB, OP_NOP,
       OP_HALT };
/* Not const: the compiler must not specialise run() for this program. */
static unsigned char code[] = {OP_MUL, OP_XOR, 31, OP_SHR, 3, OP_ADD, OP_NOP, OP_ROT, OP_AND,
                               OP_SUB, OP_LOAD, 5, OP_DEC, OP_JNZ, 0, OP_HALT};
__attribute__((noinline)) static long run(const unsigned char *c, long n) {
    long x = 1, acc = 7, cnt = n;
    int pc = 0;
    for (;;) {
        switch (c[pc++]) {
        case OP_MUL: x = x * 6364136223846793005L + 1; break;
        case OP_ADD: x += acc; break;
        case OP_XOR: x ^= c[pc++]; break;
        case OP_SHR: x += x >> c[pc++]; break;
        case OP_ROT: acc = (acc << 5) ^ (acc >> 3) ^ x; break;
        case OP_AND: acc &= 0xffffffffffffL; break;
        case OP_SUB: x -= acc & 0xff; break;
        case OP_DEC: cnt--; break;
        case OP_JNZ: pc = cnt > 0 ? c[pc] : pc + 1; break;
        case OP_NOP: break;
        case OP_LOAD: acc += c[pc++]; break;
        case OP_HALT: return acc ^ x;
        default: abort();
        }
    }
}
int main(int argc, char **argv) {
    long n = (argc > 1 ? atol(argv[1]) : 15) * 1000000L;
    printf("interp %ld\n", run(code, n));
    return 0;
}
