/* Multi-threaded loops: T threads each run a hashing loop over a private buffer.
 * usage: threads N [T]  (N = passes, T = threads, default 4) */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#define BUF (1 << 16)

struct job { long passes; uint32_t seed; uint64_t out; };

__attribute__((noinline)) static uint64_t hash_buf(const uint8_t *b, size_t n, uint64_t h)
{
    for (size_t i = 0; i < n; i++) {
        h ^= b[i];
        h *= 0x100000001b3ull;
        if ((h & 0xff) == 0x2a)
            h += i;
    }
    return h;
}

static void *worker(void *arg)
{
    struct job *j = arg;
    uint8_t *buf = malloc(BUF);
    uint32_t s = j->seed;
    for (size_t i = 0; i < BUF; i++) { s = s * 1103515245u + 12345u; buf[i] = (uint8_t)(s >> 16); }
    uint64_t h = 0xcbf29ce484222325ull;
    for (long p = 0; p < j->passes; p++) {
        h = hash_buf(buf, BUF, h);
        buf[p % BUF] ^= (uint8_t)h;
    }
    j->out = h;
    free(buf);
    return NULL;
}

int main(int argc, char **argv)
{
    long n = argc > 1 ? atol(argv[1]) : 100;
    int t = argc > 2 ? atoi(argv[2]) : 4;
    if (t < 1 || t > 256) return 2;
    pthread_t tid[256];
    struct job jobs[256];
    for (int i = 0; i < t; i++) {
        jobs[i] = (struct job){n / t, (uint32_t)(i * 7919 + 1), 0};
        if (pthread_create(&tid[i], NULL, worker, &jobs[i])) return 3;
    }
    uint64_t acc = 0;
    for (int i = 0; i < t; i++) { pthread_join(tid[i], NULL); acc = acc * 31 + jobs[i].out; }
    printf("threads %ld %d %016llx\n", n, t, (unsigned long long)acc);
    return 0;
}
