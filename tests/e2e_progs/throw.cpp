// C++: exceptions thrown from and through hot code.
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
__attribute__((noinline)) static unsigned long inner(unsigned long x, long i) {
    x = x * 6364136223846793005UL + (unsigned long)i;
    if ((x >> 40) % 4099 == 0) throw std::runtime_error("rare");
    return x;
}
__attribute__((noinline)) static unsigned long middle(unsigned long x, long n) {
    for (long i = 0; i < n; i++) x = inner(x, i) ^ (x >> 17);
    return x;
}
int main(int argc, char **argv) {
    long rounds = argc > 1 ? atol(argv[1]) : 3000;
    unsigned long x = 3, caught = 0;
    for (long r = 0; r < rounds; r++) {
        try {
            x = middle(x, 10000);
        } catch (const std::runtime_error &) {
            caught++;
            x += 0x9e37;
        }
    }
    std::printf("throw %lu caught %lu\n", x, caught);
    return 0;
}
