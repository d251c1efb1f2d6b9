/* stackscan: threads that stay inside a function called from replacement code, for
 * the census's stack scan (tests/agent/test_agent_stackscan.py).
 *
 * The test patches site K (sites.h) with code that makes a real `call` to park()
 * (or to outer(), which calls park()), a function of this program that blocks
 * until released: a thread that called site K then waits with its PC in park's
 * read() and the return address into the code buffer a word of its stack.
 *
 * Prints "sites 0x.. (8)", "park 0x..", "outer 0x..", "ready"; then reads commands:
 *   go N K        N threads each call site K once
 *   alt N K       the same, each thread with a sigaltstack of its own
 *   sig           SIGUSR1 to every alt thread: its handler runs on the alternate
 *                 stack (interrupting park's read) and waits there until "unhold"
 *   unhold        the waiting handlers return (park's read resumes: SA_RESTART)
 *   release N     N threads waiting in park() return from it
 *   deep N KIB    N threads fill KIB KiB of their stack, then wait in park() (not
 *                 through replacement code)
 *   ctx N         N threads switch to a stack in a MAP_SHARED mapping
 *                 (makecontext) and wait in park() there
 * Each thread says "parked TID" once in park(), "inhandler TID" in its SIGUSR1
 * handler, and "done TID V" when its call of site K returned V.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <ucontext.h>
#include <unistd.h>

#include "sites.h"

#define ALT_SIZE (64 * 1024)
#define CTX_SIZE (256 * 1024)
#define MAX_ALT 64

static int g_release[2], g_hold[2];
static pthread_mutex_t g_out = PTHREAD_MUTEX_INITIALIZER;
static pthread_t g_alt[MAX_ALT];
static int g_nalt;
static pthread_mutex_t g_alt_mu = PTHREAD_MUTEX_INITIALIZER;

static void say(const char *what, long a, long b, int nb)
{
    pthread_mutex_lock(&g_out);
    if (nb)
        printf("%s %ld %ld\n", what, a, b);
    else
        printf("%s %ld\n", what, a);
    fflush(stdout);
    pthread_mutex_unlock(&g_out);
}

static long tid(void)
{
    return (long)syscall(SYS_gettid);
}

static void wait_byte(int fd)
{
    char c;

    while (read(fd, &c, 1) < 0 && errno == EINTR)
        ;
}

__attribute__((noinline)) int park(void)
{
    say("parked", tid(), 0, 0);
    wait_byte(g_release[0]);
    return 1;
}

/* park() one frame deeper: not a tail call (the sum needs park's result) */
__attribute__((noinline)) int outer(void)
{
    volatile int k = 1;

    return park() + k;
}

static void on_usr1(int sig)
{
    (void)sig;
    say("inhandler", tid(), 0, 0);
    wait_byte(g_hold[0]);
}

struct job {
    int mode;      /* 'g' go, 'a' alt, 'd' deep, 'c' ctx */
    int site;
    long kib;
    int index;
};

/* kib KiB of this thread's stack in use (written: no zero pages), then park() */
__attribute__((noinline)) static int deep(long kib)
{
    size_t n = (size_t)kib * 1024;
    volatile char *p = __builtin_alloca(n);
    size_t i;

    for (i = 0; i < n; i++)
        p[i] = (char)(i * 131 + 7);
    return park() + p[0];
}

static void ctx_fn(void)
{
    park();
}

static void *worker(void *arg)
{
    struct job j = *(struct job *)arg;
    int v;

    free(arg);
    if (j.mode == 'd') {
        say("done", tid(), deep(j.kib), 1);
        return NULL;
    }
    if (j.mode == 'c') {
        ucontext_t here, there;
        void *stack = mmap(NULL, CTX_SIZE, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);

        if (stack == MAP_FAILED) {
            perror("mmap");
            exit(2);
        }
        getcontext(&there);
        there.uc_stack.ss_sp = stack;
        there.uc_stack.ss_size = CTX_SIZE;
        there.uc_link = &here;
        makecontext(&there, ctx_fn, 0);
        swapcontext(&here, &there);
        munmap(stack, CTX_SIZE);
        say("done", tid(), 0, 1);
        return NULL;
    }
    if (j.mode == 'a') {
        stack_t ss;

        ss.ss_sp = malloc(ALT_SIZE);
        ss.ss_size = ALT_SIZE;
        ss.ss_flags = 0;
        if (!ss.ss_sp || sigaltstack(&ss, NULL) != 0) {
            perror("sigaltstack");
            exit(2);
        }
        pthread_mutex_lock(&g_alt_mu);
        if (g_nalt < MAX_ALT)
            g_alt[g_nalt++] = pthread_self();
        pthread_mutex_unlock(&g_alt_mu);
    }
    v = sites[j.site](j.index);
    say("done", tid(), v, 1);
    return NULL;
}

static void start(int mode, int n, int site, long kib)
{
    int i;

    for (i = 0; i < n; i++) {
        struct job *j = malloc(sizeof *j);
        pthread_t t;
        pthread_attr_t a;

        j->mode = mode;
        j->site = site & 7;
        j->kib = kib;
        j->index = i;
        pthread_attr_init(&a);
        pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
        if (mode == 'd')
            pthread_attr_setstacksize(&a, (size_t)(kib + 256) * 1024);
        if (pthread_create(&t, &a, worker, j) != 0) {
            perror("pthread_create");
            exit(2);
        }
        pthread_attr_destroy(&a);
    }
}

static void put(int fd, int n)
{
    while (n-- > 0)
        if (write(fd, "x", 1) != 1)
            exit(3);
}

int main(void)
{
    struct sigaction sa;
    char line[128];
    int k;

    if (pipe(g_release) || pipe(g_hold))
        return 2;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_usr1;
    sa.sa_flags = SA_ONSTACK | SA_RESTART;
    sigaction(SIGUSR1, &sa, NULL);
    printf("sites");
    for (k = 0; k < 8; k++)
        printf(" %p", (void *)sites[k]);
    printf("\npark %p\nouter %p\nready\n", (void *)park, (void *)outer);
    fflush(stdout);
    while (fgets(line, sizeof line, stdin)) {
        int n = 0, site = 0;
        long kib = 0;

        if (sscanf(line, "go %d %d", &n, &site) == 2)
            start('g', n, site, 0);
        else if (sscanf(line, "alt %d %d", &n, &site) == 2)
            start('a', n, site, 0);
        else if (sscanf(line, "deep %d %ld", &n, &kib) == 2)
            start('d', n, 0, kib);
        else if (sscanf(line, "ctx %d", &n) == 1)
            start('c', n, 0, 0);
        else if (sscanf(line, "release %d", &n) == 1)
            put(g_release[1], n);
        else if (strncmp(line, "unhold", 6) == 0) {
            pthread_mutex_lock(&g_alt_mu);
            put(g_hold[1], g_nalt);
            pthread_mutex_unlock(&g_alt_mu);
        } else if (strncmp(line, "sig", 3) == 0) {
            pthread_mutex_lock(&g_alt_mu);
            for (k = 0; k < g_nalt; k++)
                pthread_kill(g_alt[k], SIGUSR1);
            pthread_mutex_unlock(&g_alt_mu);
        }
    }
    return 0;
}
