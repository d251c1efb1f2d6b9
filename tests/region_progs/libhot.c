/* A shared library with a hot function, called through the PLT. */
__attribute__((noinline)) long lib_work(int n) {
    long s = 0;
    for (int i = 0; i < n; i++) s += (long)i * i ^ (s >> 3);
    return s;
}
