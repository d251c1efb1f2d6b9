/* Starts threads on command, for the thread-notice tests.
 * stdin lines: "t" starts a thread, which prints "tid N" and ends; the main thread
 * joins it and prints "joined N".  EOF: exit 0.  Prints "ready" first. */
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

static void *one(void *arg)
{
    (void)arg;
    printf("tid %ld\n", (long)syscall(SYS_gettid));
    fflush(stdout);
    return NULL;
}

int main(void)
{
    char line[64];

    setvbuf(stdout, NULL, _IOLBF, 0);
    printf("ready\n");
    while (fgets(line, sizeof line, stdin)) {
        pthread_t t;

        if (strncmp(line, "t", 1) != 0)
            continue;
        if (pthread_create(&t, NULL, one, NULL) != 0)
            return 2;
        pthread_join(t, NULL);
        printf("joined\n");
    }
    return 0;
}
