/* Thread churn: the main thread starts and joins N short threads, one at a time,
 * while one busy thread hashes until the last has been joined (a server handing
 * short tasks to new threads).  Prints a checksum of the short threads' results.
 * usage: churn N [late]
 * late (tests/live/test_service_sampling.py): halfway, also start a long-lived thread
 * that prints "late tid T" and hashes until the end. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

static atomic_int stop;

__attribute__((noinline)) static uint64_t step(uint64_t h)
{
    for (int i = 0; i < 1000; i++)
        h = h * 6364136223846793005ull + 1442695040888963407ull;
    return h;
}

static void *busy(void *arg)
{
    uint64_t h = (uint64_t)(uintptr_t)arg;
    while (!atomic_load_explicit(&stop, memory_order_relaxed))
        h = step(h);
    return (void *)(uintptr_t)(h & 1);
}

static void *late(void *arg)
{
    printf("late tid %ld\n", (long)syscall(SYS_gettid));
    fflush(stdout);
    return busy(arg);
}

static void *task(void *arg)
{
    uint64_t x = (uint64_t)(uintptr_t)arg;
    for (int i = 0; i < 200; i++)
        x = x * 31 + (uint64_t)i;
    return (void *)(uintptr_t)x;
}

int main(int argc, char **argv)
{
    long n = argc > 1 ? atol(argv[1]) : 20000;
    int with_late = argc > 2 && strcmp(argv[2], "late") == 0;
    pthread_t b, t, l;
    uint64_t sum = 0;

    if (pthread_create(&b, NULL, busy, (void *)1))
        return 2;
    for (long i = 0; i < n; i++) {
        void *r;
        if (pthread_create(&t, NULL, task, (void *)(uintptr_t)i))
            return 2;
        pthread_join(t, &r);
        sum += (uint64_t)(uintptr_t)r;
        if (with_late && i == n / 2 && pthread_create(&l, NULL, late, (void *)2))
            return 2;
    }
    atomic_store(&stop, 1);
    pthread_join(b, NULL);
    if (with_late)
        pthread_join(l, NULL);
    printf("churn: %ld threads, checksum %016llx\n", n, (unsigned long long)sum);
    return 0;
}
