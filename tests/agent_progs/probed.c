/* A program for probe tests: runs its functions as told on stdin.
 *   "go N"   calls work(i, 3*i) for i in 0..N-1, then pick(i % 7, i, -i) for i < 200;
 *            prints "took NS" (the work loop's time) and "done SUM"
 *   "spin S" runs the "go" loop for S seconds (regions get hot), prints "spun SUM"
 *   "exit"   exits 0
 * Prints "ready" at start and after every command. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

volatile long sink;

__attribute__((noinline)) long work(long a, long b)
{
    sink += a ^ b;
    return a + b;
}

__attribute__((noinline)) long pick(long a, long b, long c)
{
    long r = a * 3 + b - c;
    sink += r;
    return r;
}

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

int main(void)
{
    char line[64];
    setvbuf(stdout, NULL, _IOLBF, 0);
    printf("ready\n");
    while (fgets(line, sizeof line, stdin)) {
        long n = 0, sum = 0;
        if (sscanf(line, "go %ld", &n) == 1) {
            double t0 = now();
            for (long i = 0; i < n; i++)
                sum += work(i, 3 * i);
            printf("took %ld\n", (long)((now() - t0) * 1e9));
            for (long i = 0; i < 200; i++)
                sum += pick(i % 7, i, -i);
            printf("done %ld\n", sum);
        } else if (sscanf(line, "spin %ld", &n) == 1) {
            double end = now() + n;
            while (now() < end)
                for (long i = 0; i < 100000; i++)
                    sum += work(i, 3 * i);
            printf("spun %ld\n", sum);
        } else if (strncmp(line, "exit", 4) == 0) {
            return 0;
        }
        printf("ready\n");
    }
    return 0;
}
