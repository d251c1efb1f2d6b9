/* A program that forks workers; each runs a hot loop; results printed in order. */
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>
__attribute__((noinline)) static unsigned long crunch(unsigned long x, long n) {
    for (long i = 0; i < n; i++) x = x * 2862933555777941757UL + 3037000493UL + (x >> 33);
    return x;
}
int main(int argc, char **argv) {
    long n = (argc > 1 ? atol(argv[1]) : 60) * 1000000L;
    int fds[3][2];
    pid_t pids[3];
    unsigned long warm = crunch(1, n / 4);  /* the parent gets hot (and patched) first */
    for (int w = 0; w < 3; w++) {
        if (pipe(fds[w]) != 0) return 1;
        pids[w] = fork();
        if (pids[w] == 0) {
            unsigned long r = crunch((unsigned long)w + warm, n / 3);
            if (write(fds[w][1], &r, sizeof r) != sizeof r) _exit(1);
            _exit(0);
        }
        close(fds[w][1]);
    }
    for (int w = 0; w < 3; w++) {
        unsigned long r = 0;
        int st = 0;
        if (read(fds[w][0], &r, sizeof r) != sizeof r) return 1;
        waitpid(pids[w], &st, 0);
        printf("worker %d %lu exit %d\n", w, r, WIFEXITED(st) ? WEXITSTATUS(st) : -1);
    }
    printf("parent %lu\n", crunch(warm, n / 4));
    return 0;
}
