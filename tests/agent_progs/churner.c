/* Starts detached threads one after another, each living LIFE_MS, until stdin
 * reaches EOF (tests/agent/test_agent_notices.py: threads started while the service
 * turns thread notices on), GAP_US apart.  usage: churner LIFE_MS GAP_US.  Prints "ready" once the
 * first thread has started, "done N" (threads started) at the end. */
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

static long life_ms, gap_us;

static void *one(void *arg)
{
    struct timespec ts = { life_ms / 1000, (life_ms % 1000) * 1000000L };

    (void)arg;
    nanosleep(&ts, NULL);
    return NULL;
}

int main(int argc, char **argv)
{
    pthread_attr_t a;
    long n = 0;
    char buf[64];

    life_ms = argc > 1 ? atol(argv[1]) : 30;
    gap_us = argc > 2 ? atol(argv[2]) : 500;
    setvbuf(stdout, NULL, _IOLBF, 0);
    pthread_attr_init(&a);
    pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&a, 64 * 1024);
    for (;;) {
        struct pollfd p = { 0, POLLIN, 0 };
        pthread_t t;

        if (pthread_create(&t, &a, one, NULL) != 0)
            return 2;
        if (n++ == 0)
            printf("ready\n");
        if (poll(&p, 1, 0) > 0 && read(0, buf, sizeof buf) <= 0)
            break;
        if (gap_us)
            usleep((useconds_t)gap_us);
    }
    printf("done %ld\n", n);
    return 0;
}
