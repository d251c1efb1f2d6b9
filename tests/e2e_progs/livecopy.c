/* An outer loop calling, for real, a hot function with a loop of its own, so that both
 * get regions and the outer one's copy can call the inner one's copy directly.
 * usage: livecopy ITERS THREADS; commands on stdin, one a line:
 *   park     each worker, the next time inner() is called from a copy (its return
 *            address is outside the executable), blocks in read() of a pipe inside
 *            note() ("parked TID"); then "all-parked"
 *   release  the parked workers return (into the copies that called them); "released"
 *   quit/EOF the workers stop once they have done ITERS iterations each
 *   reached? "reached 1" if every worker has done ITERS iterations, else "reached 0"
 * Prints "ready N" once every worker runs, and at the end "sum HEX" (of the first ITERS results of each worker, the
 * same in every run) and "ok calls=N foreign=F wrong=W"; exit 3 if W > 0.  Every
 * result is checked against expect().  The outer loop never leaves (it tests `stop`
 * in every iteration): a thread in a copy of it stays there until moved out.
 *
 * inner(x, d) is written in assembly so that its first instruction is one 6-byte
 * imul (an ordinary patch site at the function entry) and it has an FDE; with d > 0
 * it calls note() and itself (recursion: never inlined into the outer loop). */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define HIDDEN __attribute__((visibility("hidden")))

HIDDEN unsigned livecopy_inner(unsigned x, int d);
HIDDEN void livecopy_note(const void *ret);

__asm__(".text\n"
        ".intel_syntax noprefix\n"
        ".p2align 4\n"
        ".globl livecopy_inner\n"
        ".hidden livecopy_inner\n"
        ".type livecopy_inner, @function\n"
        "livecopy_inner:\n"
        "  .cfi_startproc\n"
        "  imul eax, edi, 0x9e3779b1\n"
        "  test esi, esi\n"
        "  jg 2f\n"
        "  mov ecx, 16\n"
        "1:\n"
        "  mov edx, eax\n"
        "  shr edx, 7\n"
        "  xor eax, edx\n"
        "  imul eax, eax, 0x85ebca6b\n"
        "  add eax, ecx\n"
        "  dec ecx\n"
        "  jne 1b\n"
        "  ret\n"
        "2:\n"
        "  push rbx\n"
        "  .cfi_def_cfa_offset 16\n"
        "  .cfi_offset rbx, -16\n"
        "  mov ebx, edi\n"
        "  mov rdi, [rsp + 8]\n"
        "  call livecopy_note\n"
        "  mov edi, ebx\n"
        "  xor edi, 0x5bd1e995\n"
        "  xor esi, esi\n"
        "  call livecopy_inner\n"
        "  rol eax, 7\n"
        "  xor eax, 0x1234567\n"
        "  pop rbx\n"
        "  .cfi_def_cfa_offset 8\n"
        "  ret\n"
        "  .cfi_endproc\n"
        ".size livecopy_inner, .-livecopy_inner\n"
        ".att_syntax prefix\n");

extern char __executable_start[], etext[];

static atomic_int park_gen, parked, started, reached, stop;
static atomic_long calls, wrong, foreign_calls;
static _Thread_local int my_gen;
static int pipefd[2];
static long iters;
static unsigned sums[64];
static pthread_mutex_t out = PTHREAD_MUTEX_INITIALIZER;

static void say(const char *what, long v) {
    pthread_mutex_lock(&out);
    printf("%s %ld\n", what, v);
    fflush(stdout);
    pthread_mutex_unlock(&out);
}

HIDDEN void livecopy_note(const void *ret) {
    const char *c = ret;
    if (c >= __executable_start && c < etext)
        return;
    atomic_fetch_add_explicit(&foreign_calls, 1, memory_order_relaxed);
    int g = atomic_load_explicit(&park_gen, memory_order_relaxed);
    if (g == my_gen)
        return;
    my_gen = g;
    atomic_fetch_add(&parked, 1);
    say("parked", (long)syscall(SYS_gettid));
    char b;
    while (read(pipefd[0], &b, 1) != 1) {}
    atomic_fetch_sub(&parked, 1);
}

static inline unsigned rotl7(unsigned r) { return r << 7 | r >> 25; }

/* inner(x, 1), in C */
static inline unsigned expect(unsigned x) {
    unsigned h = (x ^ 0x5bd1e995u) * 0x9e3779b1u;
    for (unsigned c = 16; c; c--) {
        h ^= h >> 7;
        h = h * 0x85ebca6bu + c;
    }
    return rotl7(h) ^ 0x1234567u;
}

static void *worker(void *arg) {
    long t = (long)arg;
    unsigned seed = (unsigned)(t + 1) * 0x9e3779b9u, s = seed, sum = 0;
    long bad = 0, i;
    atomic_fetch_add(&started, 1);
    for (i = 0; i < iters || !atomic_load_explicit(&stop, memory_order_relaxed); i++) {
        unsigned x = seed + (unsigned)i;
        s += 0xdeadbeefu / ((x >> 3 ^ s) | 1);
        unsigned r = livecopy_inner(x ^ (s & 1), 1);
        if (r != expect(x ^ (s & 1)))
            bad++;
        if (i < iters)
            sum = sum * 31 + r;
        else if (i == iters)
            atomic_fetch_add(&reached, 1);
    }
    sums[t] = sum;
    atomic_fetch_add(&wrong, bad);
    atomic_fetch_add(&calls, i);
    return NULL;
}

static int wait_for(atomic_int *v, int want) {
    for (int i = 0; i < 30000; i++) {            /* at most 30 s */
        if (atomic_load(v) == want)
            return 1;
        usleep(1000);
    }
    return 0;
}

int main(int argc, char **argv) {
    iters = argc > 1 ? atol(argv[1]) : 1000000;
    int n = argc > 2 ? atoi(argv[2]) : 1;
    pthread_t th[64];
    if (n < 1 || n > 64 || iters < 1 || pipe(pipefd) != 0)
        return 2;
    for (long t = 0; t < n; t++)
        pthread_create(&th[t], NULL, worker, (void *)t);
    if (!wait_for(&started, n))
        return 2;
    say("ready", n);
    char line[64];
    while (fgets(line, sizeof line, stdin)) {
        if (strncmp(line, "park", 4) == 0) {
            atomic_fetch_add(&park_gen, 1);
            say(wait_for(&parked, n) ? "all-parked" : "park-timeout", n);
        } else if (strncmp(line, "release", 7) == 0) {
            int k = atomic_load(&parked);
            for (int i = 0; i < k; i++)
                if (write(pipefd[1], "x", 1) != 1)
                    return 2;
            say(wait_for(&parked, 0) ? "released" : "release-timeout", k);
        } else if (strncmp(line, "reached?", 8) == 0) {
            say("reached", atomic_load(&reached) == n);
        } else if (strncmp(line, "quit", 4) == 0) {
            break;
        }
    }
    atomic_store(&stop, 1);
    unsigned total = 0;
    for (int t = 0; t < n; t++) {
        pthread_join(th[t], NULL);
        total = total * 131 + sums[t];
    }
    printf("sum %08x\n", total);
    printf("ok calls=%ld foreign=%ld wrong=%ld\n", atomic_load(&calls),
           atomic_load(&foreign_calls), atomic_load(&wrong));
    return atomic_load(&wrong) ? 3 : 0;
}
