/* Threads spin in a three-instruction loop until a flag is set, then return 1.
 * usage: spin [THREADS]
 * Prints "spin ADDR" (the loop) and "ready"; on a line from stdin sets the flag,
 * joins, prints "results R..." (each thread's return value) and exits 0.
 * A TRANSFER test moves the spinning threads into a copy of the loop that
 * returns 2 instead: the results say which threads ran the copy. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

long spin(volatile long *flag);
__asm__(".text\n.globl spin\n.type spin,@function\n"
        "spin:\n"
        "    mov (%rdi), %rax\n"      /* +0, 3 bytes */
        "    test %rax, %rax\n"       /* +3, 3 bytes */
        "    je spin\n"               /* +6, 2 bytes */
        "    mov $1, %eax\n"          /* +8 */
        "    ret\n"
        ".size spin, .-spin\n");

static volatile long flag;
static long results[64];

static void *worker(void *arg) {
    results[(long)arg] = spin(&flag);
    return NULL;
}

int main(int argc, char **argv) {
    int n = argc > 1 ? atoi(argv[1]) : 2;
    pthread_t th[64];
    char buf[64];
    if (n < 1 || n > 64) return 2;
    printf("spin %p\n", (void *)spin);
    for (long t = 0; t < n; t++) pthread_create(&th[t], NULL, worker, (void *)t);
    printf("ready\n");
    fflush(stdout);
    if (read(0, buf, sizeof buf) < 0) return 3;
    flag = 1;
    for (int t = 0; t < n; t++) pthread_join(th[t], NULL);
    printf("results");
    for (int t = 0; t < n; t++) printf(" %ld", results[t]);
    printf("\n");
    return 0;
}
