/* Functions whose entries start with short instructions (entry sites:
 * docs/architecture.md, "Invariants" 3), and threads that call them or sit inside them.
 * usage: entry_sites MODE [THREADS]
 *   stress: THREADS workers call entry_a and entry_b (x*1000+7, first instructions
 *     push %rbp (1), mov %rsp,%rbp (3): inner boundaries at +1 and +4) in a tight
 *     loop and check every result (a wrong one: exit 3).
 *   park: one thread calls park_pc, whose `jmp .` at +1 keeps its PC at an inner
 *     boundary until something moves it (the agent's TRANSFER); then prints "left V"
 *     with V what park_pc returned.
 *   sigpark: one thread spins at park_sig+1; SIGUSR1 then interrupts it there and its
 *     handler waits for "release" on stdin (the PC park_sig+1 is in the signal frame
 *     on its stack meanwhile), sends the thread on to park_sig_out (returns 3) and
 *     returns; the thread prints "left 3".
 * Prints "fns entry_a entry_b park_pc park_sig counter" and "ready"; runs until stdin
 * reaches EOF (stress), then prints "ok calls=N repl=R" and exits 0.  `counter` is a
 * word replacement code may count its runs in.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <ucontext.h>
#include <unistd.h>

#define ENTRY_FN(name, skip) \
    ".p2align 4\n" ".skip " #skip ", 0x90\n" ".globl " #name "\n" ".type " #name ",@function\n" \
    #name ":\n" "push %rbp\n" "mov %rsp, %rbp\n" "imul $1000, %edi, %eax\n" "add $7, %eax\n" \
    "pop %rbp\n" "ret\n"
/* park_pc/park_sig: nop (1), jmp . (2), nop, nop: inner boundaries +1, +3, +4 */
#define PARK_FN(name) \
    ".p2align 4\n" ".globl " #name "\n" ".type " #name ",@function\n" #name ":\n" "nop\n" \
    "1: jmp 1b\n" "nop\n" "nop\n" "xor %eax, %eax\n" "ret\n"
__asm__(".text\n" ENTRY_FN(entry_a, 8) ENTRY_FN(entry_b, 7) PARK_FN(park_pc) PARK_FN(park_sig)
        ".p2align 4\n" ".globl park_sig_out\n" "park_sig_out:\n" "mov $3, %eax\n" "ret\n");
int entry_a(int), entry_b(int), park_pc(void), park_sig(void);
void park_sig_out(void);

volatile unsigned long counter;
static atomic_int stop, started;
static atomic_long calls;
static int release_pipe[2];

static void *worker(void *arg) {
    unsigned i = (unsigned)(long)arg * 7919u;
    long n = 0;
    atomic_fetch_add(&started, 1);
    while (!atomic_load_explicit(&stop, memory_order_relaxed)) {
        int x = (int)(i++ & 0xFFFFF);
        int a = entry_a(x), b = entry_b(x);
        if (a != x * 1000 + 7 || b != x * 1000 + 7) {
            fprintf(stderr, "WRONG entry(%d) = %d, %d\n", x, a, b);
            _exit(3);
        }
        n += 2;
    }
    atomic_fetch_add(&calls, n);
    return NULL;
}

static void *parker(void *arg) {
    int v = arg ? park_sig() : park_pc();
    printf("left %d\n", v);
    fflush(stdout);
    return NULL;
}

static atomic_int sig_state;   /* 0: not yet, 1: interrupted at park_sig+1, 2: elsewhere */

static void on_usr1(int sig, siginfo_t *si, void *ucv) {
    ucontext_t *uc = ucv;
    char c;
    (void)sig;
    (void)si;
    if ((unsigned long)uc->uc_mcontext.gregs[REG_RIP] != (unsigned long)park_sig + 1) {
        atomic_store(&sig_state, 2);
        return;
    }
    atomic_store(&sig_state, 1);
    while (read(release_pipe[0], &c, 1) < 0)
        ;
    uc->uc_mcontext.gregs[REG_RIP] = (greg_t)(unsigned long)park_sig_out;
}

int main(int argc, char **argv) {
    const char *mode = argc > 1 ? argv[1] : "stress";
    int nthreads = argc > 2 ? atoi(argv[2]) : 4;
    pthread_t th[64], p;
    char line[64];
    if (nthreads < 1 || nthreads > 64 || pipe(release_pipe) < 0) return 2;
    printf("fns %p %p %p %p %p\n", (void *)entry_a, (void *)entry_b, (void *)park_pc,
           (void *)park_sig, (void *)&counter);
    fflush(stdout);
    if (strcmp(mode, "stress") == 0) {
        for (long t = 0; t < nthreads; t++) pthread_create(&th[t], NULL, worker, (void *)t);
        for (int w = 0; w < 10000 && atomic_load(&started) < nthreads; w++) usleep(1000);
    } else if (strcmp(mode, "park") == 0) {
        pthread_create(&p, NULL, parker, NULL);
    } else if (strcmp(mode, "sigpark") == 0) {
        struct sigaction sa;
        memset(&sa, 0, sizeof sa);
        sa.sa_sigaction = on_usr1;
        sa.sa_flags = SA_SIGINFO | SA_RESTART;
        sigaction(SIGUSR1, &sa, NULL);
        pthread_create(&p, NULL, parker, (void *)1);
        for (int tries = 0; atomic_load(&sig_state) != 1; tries++) {
            if (tries == 100) return 6;
            atomic_store(&sig_state, 0);
            usleep(10000);
            pthread_kill(p, SIGUSR1);
            for (int w = 0; w < 1000 && atomic_load(&sig_state) == 0; w++) usleep(1000);
        }
        printf("inhandler\n");
    } else {
        return 2;
    }
    printf("ready\n");
    fflush(stdout);
    while (fgets(line, sizeof line, stdin)) {
        if (strncmp(line, "release", 7) == 0 && write(release_pipe[1], "x", 1) != 1) return 4;
    }
    atomic_store(&stop, 1);
    if (strcmp(mode, "stress") == 0)
        for (int t = 0; t < nthreads; t++) pthread_join(th[t], NULL);
    printf("ok calls=%ld repl=%lu\n", atomic_load(&calls), counter);
    fflush(stdout);
    return 0;
}
