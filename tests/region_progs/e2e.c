/* Small loops for end-to-end region selection with exact expected patch points:
   globals make rip-relative instructions of >= 5 bytes on the way into each loop. */
#define NI __attribute__((noinline))
#define N 64

int a[N], b[N];
long total;

NI long single(int n) {
    long s = 0;
    total += n;
    for (int i = 0; i < n; i++) s += a[i & 63] * 3 + b[(i * 7) & 63];
    return s;
}

NI long nest2(int n) {
    long s = 0;
    total += n;
    for (int i = 0; i < n; i++) {
        total += i;
        for (int j = 0; j < n; j++) s += a[j & 63] ^ b[i & 63];
    }
    return s;
}

int main(int argc, char **argv) {
    (void)argv;
    return (int)(single(argc * 1000) + nest2(argc * 50)) & 1;
}
