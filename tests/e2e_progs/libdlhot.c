/* Library loaded and unloaded while hot. */
unsigned long dl_work(unsigned long x, long n) {
    for (long i = 0; i < n; i++) x = (x ^ (unsigned long)i) * 0xff51afd7ed558ccdUL + (x >> 31);
    return x;
}
