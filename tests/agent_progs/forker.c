/* A patched process forks.  stdin "fork": the child runs 4 checking threads
 * through site0 for CHILD_MS milliseconds, prints "child ok N" and exits 0; the
 * parent prints "child pid P" then, after waiting, "child exit S".  EOF exits 0.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include "sites.h"

#define CHILD_MS 1500
static atomic_int stop;
static atomic_long calls;

static void *worker(void *arg) {
    long n = 0;
    for (unsigned i = (unsigned)(long)arg; !atomic_load_explicit(&stop, memory_order_relaxed); i++) {
        int x = (int)(i & 0xFFFFF);
        if (site0(x) != expected(x)) { fprintf(stderr, "WRONG %d\n", getpid()); _exit(3); }
        n++;
    }
    atomic_fetch_add(&calls, n);
    return NULL;
}

static void run_threads(int ms) {
    pthread_t th[4];
    atomic_store(&stop, 0);
    for (long t = 0; t < 4; t++) pthread_create(&th[t], NULL, worker, (void *)t);
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
    atomic_store(&stop, 1);
    for (int t = 0; t < 4; t++) pthread_join(th[t], NULL);
}

int main(void) {
    printf("sites %p\nready\n", (void *)site0);
    fflush(stdout);
    char line[64];
    while (fgets(line, sizeof line, stdin)) {
        if (strncmp(line, "fork", 4) == 0) {
            pid_t pid = fork();
            if (pid == 0) {
                run_threads(CHILD_MS);
                printf("child ok %ld\n", atomic_load(&calls));
                fflush(stdout);
                _exit(0);
            }
            printf("child pid %d\n", pid);
            fflush(stdout);
            run_threads(CHILD_MS / 3);
            int st = 0;
            waitpid(pid, &st, 0);
            printf("child exit %d\n", WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st));
            fflush(stdout);
        }
    }
    printf("ok\n");
    return 0;
}
