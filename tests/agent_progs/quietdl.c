/* A steady hot loop for argv[1] seconds (a client with nothing new to optimize
 * once its loop is in replacement code) that dlopens argv[2] when it gets SIGUSR1
 * (new code: dbr samples it at the full rate again).  Prints "ready", "opened". */
#include <dlfcn.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static volatile sig_atomic_t g_open;

static void on_usr1(int sig) { (void)sig; g_open = 1; }

__attribute__((noinline)) static unsigned long step(unsigned long x, long i)
{
    return (x ^ (unsigned long)i) * 0x9E3779B97F4A7C15UL + (x >> 29);
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

int main(int argc, char **argv)
{
    double secs = argc > 1 ? atof(argv[1]) : 10.0, end = now_s() + secs;
    unsigned long x = 1;

    if (argc < 3)
        return 2;
    signal(SIGUSR1, on_usr1);
    printf("ready\n");
    fflush(stdout);
    while (now_s() < end) {
        for (long i = 0; i < 1000000; i++) {
            x = step(x, i);
            if ((x & 31) == 7) x += (unsigned long)i;
        }
        if (g_open == 1) {
            g_open = 2;
            if (!dlopen(argv[2], RTLD_NOW)) {
                printf("dlopen failed: %s\n", dlerror());
                return 3;
            }
            printf("opened\n");
            fflush(stdout);
        }
    }
    printf("done %lu\n", x);
    return 0;
}
