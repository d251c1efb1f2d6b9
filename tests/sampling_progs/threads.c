/* threads: 4 busy threads at once, 2 more when a line arrives on stdin; each
 * further line starts a brief thread that lives 0.2 s, joined before "ended N".
 * Prints "tid N" for every thread it starts (main thread included) and flushes. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <sys/syscall.h>
#include <unistd.h>

volatile unsigned long sink;

static void *spin(void *arg)
{
    (void)arg;
    printf("tid %ld\n", (long)syscall(SYS_gettid));
    fflush(stdout);
    unsigned long a = 1;
    for (;;) {
        for (int i = 0; i < 100000; i++)
            a = a * 6364136223846793005ul + i;
        sink = a;
    }
    return NULL;
}

static void *brief(void *arg)
{
    (void)arg;
    printf("tid %ld\n", (long)syscall(SYS_gettid));
    fflush(stdout);
    usleep(200000);
    return NULL;
}

int main(void)
{
    pthread_t t[6];
    char line[16];
    alarm(30);
    printf("tid %ld\n", (long)syscall(SYS_gettid));
    fflush(stdout);
    for (int i = 0; i < 4; i++)
        pthread_create(&t[i], NULL, spin, NULL);
    if (fgets(line, sizeof line, stdin)) {
        for (int i = 4; i < 6; i++)
            pthread_create(&t[i], NULL, spin, NULL);
    }
    while (fgets(line, sizeof line, stdin)) {
        pthread_t b;
        if (pthread_create(&b, NULL, brief, NULL) == 0) {
            pthread_join(b, NULL);
            printf("ended\n");
            fflush(stdout);
        }
    }
    pause();
    return 0;
}
