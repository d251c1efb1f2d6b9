/* Library side of the PLT test. */
unsigned lib_step(unsigned x, unsigned i) { return (x * 1664525u + 1013904223u) ^ (i >> 3); }
