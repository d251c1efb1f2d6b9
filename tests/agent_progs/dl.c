/* dlopen/dlclose a library whose function is patched while threads use it.
 * stdin commands (one per line): "close" stops the threads and dlcloses the
 * library, "open" dlopens it again and prints "hot(5)=N"; EOF exits 0.
 * Prints "hot ADDR" and "ready" after the first dlopen.
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static atomic_int stop;
static int (*hot)(int);

static void *worker(void *arg) {
    (void)arg;
    for (unsigned i = 0; !atomic_load(&stop); i++) {
        int x = (int)(i & 0xFFFF);
        if (hot(x) != (int)((unsigned)x * 1000u + 7u)) {
            fprintf(stderr, "WRONG hot(%d)\n", x);
            exit(3);
        }
    }
    return NULL;
}

int main(int argc, char **argv) {
    if (argc < 2) return 2;
    void *h = dlopen(argv[1], RTLD_NOW);
    if (!h) { fprintf(stderr, "%s\n", dlerror()); return 2; }
    hot = (int (*)(int))dlsym(h, "hot");
    pthread_t th[4];
    for (int t = 0; t < 4; t++) pthread_create(&th[t], NULL, worker, NULL);
    printf("hot %p\nready\n", (void *)hot);
    fflush(stdout);
    char line[64];
    while (fgets(line, sizeof line, stdin)) {
        if (strncmp(line, "close", 5) == 0) {
            atomic_store(&stop, 1);
            for (int t = 0; t < 4; t++) pthread_join(th[t], NULL);
            int rc = dlclose(h);
            printf("closed %d\n", rc);
        } else if (strncmp(line, "open", 4) == 0) {
            h = dlopen(argv[1], RTLD_NOW);
            hot = (int (*)(int))dlsym(h, "hot");
            printf("hot(5)=%d\n", hot(5));
        }
        fflush(stdout);
    }
    printf("ok\n");
    return 0;
}
