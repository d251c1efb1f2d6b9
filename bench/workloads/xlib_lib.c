/* The shared library of the cross-library workload (built as libxlibwork.so). */
#include <stdint.h>

uint64_t xl_hash(uint64_t x) { x ^= x >> 33; x *= 0xff51afd7ed558ccdull; return x ^ (x >> 33); }
uint64_t xl_combine(uint64_t a, uint64_t b) { return (a * 31) ^ b; }
int xl_pick(uint64_t x) { return (int)((x >> 11) % 3); }
