/* syscaller: one thread that lives in system calls (getppid in a loop: nearly all
 * of its CPU time is in the kernel) and one that spins in user code.  Prints
 * "sys TID" and "user TID" (flushed); exits at EOF on stdin. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <sys/syscall.h>
#include <unistd.h>

volatile unsigned long sink;

static void *sys_loop(void *arg)
{
    (void)arg;
    printf("sys %ld\n", (long)syscall(SYS_gettid));
    fflush(stdout);
    for (;;)
        sink += (unsigned long)syscall(SYS_getppid);
    return NULL;
}

static void *user_loop(void *arg)
{
    unsigned long a = 1;

    (void)arg;
    printf("user %ld\n", (long)syscall(SYS_gettid));
    fflush(stdout);
    for (;;) {
        for (int i = 0; i < 100000; i++)
            a = a * 6364136223846793005ul + (unsigned long)i;
        sink = a;
    }
    return NULL;
}

int main(void)
{
    pthread_t t;
    char line[16];

    alarm(60);
    if (pthread_create(&t, NULL, sys_loop, NULL) || pthread_create(&t, NULL, user_loop, NULL))
        return 2;
    while (fgets(line, sizeof line, stdin))
        ;
    return 0;
}
