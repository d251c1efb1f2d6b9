/* Starts and joins short threads, one at a time, for MS milliseconds, beside one busy
 * thread; with "late", also starts a long-lived spinning thread halfway through.
 * usage: churn MS [late]
 * Prints "late tid N" when that thread starts, and "churn: T threads" at the end. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static atomic_int stop;

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

__attribute__((noinline)) static uint64_t spin(uint64_t h)
{
    for (int i = 0; i < 1000; i++)
        h = h * 6364136223846793005ull + 1442695040888963407ull;
    return h;
}

static void *busy(void *a)
{
    uint64_t h = (uint64_t)(uintptr_t)a;
    while (!atomic_load_explicit(&stop, memory_order_relaxed))
        h = spin(h);
    return (void *)(uintptr_t)(h & 1);
}

static void *late(void *a)
{
    printf("late tid %ld\n", (long)syscall(SYS_gettid));
    fflush(stdout);
    return busy(a);
}

static void *tiny(void *a)
{
    uint64_t x = (uint64_t)(uintptr_t)a;
    for (int i = 0; i < 200; i++)
        x = x * 31 + (uint64_t)i;
    return (void *)(uintptr_t)x;
}

int main(int argc, char **argv)
{
    double ms = argc > 1 ? atof(argv[1]) : 1000, t0 = now_ms();
    int with_late = argc > 2 && strcmp(argv[2], "late") == 0, late_started = 0;
    pthread_t b, l, t;
    long n = 0;

    if (pthread_create(&b, NULL, busy, (void *)1))
        return 2;
    while (now_ms() - t0 < ms) {
        void *r;
        for (int k = 0; k < 64; k++, n++) {
            if (pthread_create(&t, NULL, tiny, (void *)(uintptr_t)n))
                return 2;
            pthread_join(t, &r);
        }
        if (with_late && !late_started && now_ms() - t0 >= ms / 2) {
            if (pthread_create(&l, NULL, late, (void *)2))
                return 2;
            late_started = 1;
        }
    }
    atomic_store(&stop, 1);
    pthread_join(b, NULL);
    if (late_started)
        pthread_join(l, NULL);
    printf("churn: %ld threads\n", n);
    return 0;
}
