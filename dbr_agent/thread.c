/*
 * thread.c — the agent's thread, hidden from glibc.
 *
 * glibc keeps fast paths for a process it believes has one thread: stdio
 * takes no lock (getc, putc, fgets ... on an unlocked FILE), malloc takes no
 * arena lock, libstdc++'s shared_ptr counts without atomics
 * (__libc_single_threaded).  pthread_create leaves them for good.  A thread
 * made by pthread_create for the agent would make every client pay for locks
 * it does not need: a getc loop ran 7x slower, malloc/free 5 %
 * (docs/decisions/0003-agent-thread-hidden-from-glibc.md).  So the agent makes its
 * thread with clone(2), outside glibc's thread list and count, with a thread
 * control block of its own so that the glibc functions it does call (syscall
 * wrappers and errno, pthread mutexes and condition variables shared with
 * program threads, dl_iterate_phdr, snprintf) work on it:
 *
 *  - static TLS and the DTV from ld.so's _dl_allocate_tls, the allocator
 *    pthread_create uses itself;
 *  - the x86-64 ABI fields of the TCB header: tcb and self point at the block,
 *    stack_guard (%fs:0x28) and pointer_guard (%fs:0x30) copied from the
 *    creating thread, multiple_threads set (glibc code run on this thread
 *    takes its locked paths);
 *  - the kernel writes the thread's id into the descriptor's tid field
 *    (CLONE_PARENT_SETTID), found through libthread_db's description of
 *    struct pthread (_thread_db_pthread_tid) and checked against the creating
 *    thread's own.  Recursive mutexes (the loader's, in dl_iterate_phdr) tell
 *    owners apart by that field.
 *
 * What the agent's code owes this (its thread runs almost all of it): no
 * malloc (glibc's heap is unlocked while glibc sees one thread: dbr_alloc
 * instead), no stdio, no function that walks glibc's thread list.  The agent
 * library is linked with -z now, so its thread never binds a symbol lazily
 * (a lookup a concurrent dlclose would not wait for).
 *
 * What glibc no longer does for the agent's thread, and who does it instead:
 *  - set*id and setgroups change every thread glibc knows of: the agent's
 *    hooks (hooks.c) have its thread apply the same credentials before the
 *    call returns (dbr_thread_sync_creds);
 *  - the last program thread ending ends the process: glibc now does this by
 *    itself again, since it never counted the agent's thread.
 *
 * Anything missing or unexpected (another libc, a glibc without those
 * symbols, a tid that does not check out, DBR_AGENT_THREAD=pthread) and the
 * agent uses pthread_create, as before.
 */
#include <dlfcn.h>
#include <errno.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <linux/capability.h>
#include <linux/futex.h>

#include "agent.h"

/* untouched pages cost nothing; glibc's alloca cutoff on a thread whose
 * descriptor has no stack size is 256 KiB */
#define HIDDEN_STACK (1024u * 1024u)

/* x86-64 glibc tcbhead_t, the part fixed by the ABI (gcc's stack protector
 * reads %fs:0x28, glibc's pointer mangling %fs:0x30) */
struct tcb_head {
    void *tcb;               /* 0x00 */
    void *dtv;               /* 0x08 */
    void *self;              /* 0x10: THREAD_SELF */
    int multiple_threads;    /* 0x18 */
    int gscope_flag;         /* 0x1c */
    uintptr_t sysinfo;       /* 0x20 */
    uintptr_t stack_guard;   /* 0x28 */
    uintptr_t pointer_guard; /* 0x30 */
};

static pthread_mutex_t g_creds_mu = PTHREAD_MUTEX_INITIALIZER;  /* program threads */

typedef void *(*allocate_tls_fn)(void *);
typedef void (*deallocate_tls_fn)(void *, int);

static allocate_tls_fn g_allocate_tls;
static deallocate_tls_fn g_deallocate_tls;
static uint32_t g_tid_off;         /* offset of tid in struct pthread; 0: unknown */
static const char *g_unusable;     /* why the hidden thread cannot be used, or NULL */

/* the current hidden thread (or the one inherited across fork: never running) */
static void *g_tcb;
static void *g_stack;
static volatile pid_t g_alive;     /* cleared by the kernel when the thread is gone (CHILD_CLEARTID) */
static int (*g_fn)(void);
static int g_started_hidden;       /* the agent's thread was started hidden */
static int g_prepared;             /* g_stack and g_tcb are ready for the next thread */

static void *thread_pointer(void)
{
    void *p;

    __asm__ volatile("mov %%fs:0x10, %0" : "=r"(p));
    return p;
}

/* Once, in the constructor (single-threaded as far as we know). */
void dbr_thread_init(void)
{
    const char *v = secure_getenv("DBR_AGENT_THREAD");
    const uint32_t *tid_desc;
    char *self = thread_pointer();

    dbr_mutex_init(&g_creds_mu);
    if (v && strcmp(v, "pthread") == 0) {
        g_unusable = "DBR_AGENT_THREAD=pthread";
        return;
    }
    /* attached: glibc's set*id reaches only threads it knows of, and no hook makes a
     * hidden thread follow a privilege drop */
    if (g_attached) {
        g_unusable = "attached by dlopen";
        return;
    }
    g_allocate_tls = (allocate_tls_fn)dlsym(RTLD_DEFAULT, "_dl_allocate_tls");
    g_deallocate_tls = (deallocate_tls_fn)dlsym(RTLD_DEFAULT, "_dl_deallocate_tls");
    tid_desc = dlsym(RTLD_DEFAULT, "_thread_db_pthread_tid");   /* { bits, count, offset } */
    if (!g_allocate_tls || !g_deallocate_tls || !tid_desc) {
        g_unusable = "no glibc TLS allocator or struct pthread description";
        return;
    }
    if (tid_desc[0] != 32 || tid_desc[1] != 1 || tid_desc[2] < sizeof(struct tcb_head) ||
        tid_desc[2] > 4096 || tid_desc[2] % 4) {
        g_unusable = "unexpected struct pthread layout";
        return;
    }
    if (!self || ((struct tcb_head *)self)->self != self ||
        *(pid_t *)(self + tid_desc[2]) != dbr_gettid()) {
        g_unusable = "struct pthread tid does not check out";
        return;
    }
    g_tid_off = tid_desc[2];
}

/* 1 while the agent's thread is a hidden one and has not ended */
int dbr_thread_hidden(void)
{
    return g_started_hidden && __atomic_load_n(&g_alive, __ATOMIC_ACQUIRE);
}

static int hidden_main(void *arg)
{
    (void)arg;
    return g_fn();
}

static void release(void)
{
    if (g_stack)
        syscall(SYS_munmap, g_stack, (size_t)HIDDEN_STACK + (size_t)dbr_page_size());
    if (g_tcb)
        g_deallocate_tls(g_tcb, 1);
    g_stack = NULL;
    g_tcb = NULL;
    g_prepared = 0;
}

#define HIDDEN_FLAGS (CLONE_VM | CLONE_FS | CLONE_FILES | CLONE_SIGHAND | CLONE_THREAD | CLONE_SYSVSEM | \
                      CLONE_SETTLS | CLONE_PARENT_SETTID | CLONE_CHILD_CLEARTID)

/* ---- born in the real-time class ----
 *
 * A new thread starts with load and utilisation estimates that the scheduler
 * takes as real and that decay with a 32 ms half-life while it sleeps.  The
 * agent's thread, made in the constructor, sleeps almost at once, yet a
 * program that starts more threads than there are CPUs at once (bench
 * `threads`) then had them placed 1:3 on two CPUs until the load balancer
 * moved them: the workers ended up to 80 ms apart and the run took 5-10 ms
 * longer.  Born at SCHED_IDLE (weight 3 of 1024) the thread's load estimate
 * is small, but not its utilisation: the kernel derives that from its run
 * queue's, and in a scheduling group of the program's own (a process that
 * leads its own session, as every service unit and `bench.compare` run does;
 * a cgroup of its own) the queue has no load history yet, so the estimate
 * comes out at half the CPU's spare capacity whatever the weight.  (The
 * earlier A/B that found SCHED_IDLE enough ran in its caller's session.)
 *
 * A thread born in the real-time class gets no fair-class estimates at all:
 * utilisation 0, and a load placeholder that the first update a whole PELT
 * period (1.024 ms) later computes from a history of nothing, 0.  So the
 * creating thread sets itself to SCHED_FIFO 1 for the clone alone and takes
 * its own policy back at once (it may always leave a real-time policy), and
 * the agent's thread sleeps RT_PARK_MS in the real-time class, on no fair run
 * queue, then takes that same policy (its nice value it already has) before
 * it does anything else: dbr_thread_settle, first thing on the thread.  Its
 * connection to a service comes RT_PARK_MS later than it would; a program
 * that ends sooner never had a session.
 * docs/decisions/0006-agent-quiet-while-the-program-starts.md: why this birth
 * was tried and is no longer the default.
 *
 * Off unless DBR_AGENT_RT_BIRTH=1.  The birth needs the creating thread to
 * change its policy and back, and any such change of a program's thread in its
 * first milliseconds (SCHED_BATCH and back, nice 1 and back, as well as
 * SCHED_FIFO) cost bench `churn` as many early stalls as the agent did; with
 * the agent's thread born at the program's policy and quiet for its first
 * 50 ms (agent.c, "quiet while the program starts") both churn and `threads`
 * did better than with this birth.
 * docs/decisions/0006-agent-quiet-while-the-program-starts.md.
 *
 * Only when the kernel allows it without a doubt: the creating thread's
 * policy is SCHED_OTHER or SCHED_BATCH (not SCHED_RESET_ON_FORK), and it
 * holds CAP_SYS_NICE in the initial user namespace or an RLIMIT_RTPRIO of at
 * least 1 (tested first: most processes have neither and do not try; a root
 * daemon that a security module denies sys_nice logs one denial per start and
 * is born as any thread).  Not in a fork child, which may carry a seccomp
 * filter that kills for sched_setscheduler (dbr_agent_start_thread).
 * Otherwise the thread is born as any thread, at the program's policy. */
#define RT_PARK_MS 4

static int g_born_rt;              /* the current hidden thread was born SCHED_FIFO */
static int g_birth_policy;         /* the policy it takes (its creator's) */
static const struct sched_param g_no_priority;   /* 0: SCHED_OTHER, SCHED_BATCH */
static const struct sched_param g_rt_priority = { .sched_priority = 1 };

/* CAP_SYS_NICE in the effective set, in the initial user namespace (the
 * kernel's capable(); that namespace's id is fixed, PROC_USER_INIT_INO) */
static int sys_nice_held(void)
{
    struct __user_cap_header_struct h = { _LINUX_CAPABILITY_VERSION_3, 0 };
    struct __user_cap_data_struct d[2];
    char ns[64];
    ssize_t n;

    if (syscall(SYS_capget, &h, d) != 0 || !(d[CAP_SYS_NICE / 32].effective & (1u << (CAP_SYS_NICE % 32))))
        return 0;
    n = readlink("/proc/self/ns/user", ns, sizeof ns - 1);
    if (n <= 0)
        return 0;
    ns[n] = 0;
    return strcmp(ns, "user:[4026531837]") == 0;
}

/* 1 if the calling thread may go to SCHED_FIFO and back; g_birth_policy set */
static int rt_birth_allowed(void)
{
    const char *v = secure_getenv("DBR_AGENT_RT_BIRTH");
    struct rlimit rl;
    int p;

    if (!v || strcmp(v, "1") != 0)
        return 0;
    p = sched_getscheduler(0);
    if (p != SCHED_OTHER && p != SCHED_BATCH)   /* also: SCHED_RESET_ON_FORK set */
        return 0;
    g_birth_policy = p;
    if (getrlimit(RLIMIT_RTPRIO, &rl) == 0 && rl.rlim_cur >= 1)
        return 1;
    return sys_nice_held();
}

/* The stack and TLS of the next hidden thread, made on a program thread
 * (glibc's TLS allocator uses malloc), so that dbr_thread_launch needs no call
 * a signal handler may not make.  0, or -1 (use pthread_create). */
int dbr_thread_prepare(void)
{
    size_t guard = (size_t)dbr_page_size();
    long stk;
    void *t;

    if (g_unusable || !g_tid_off)
        return -1;
    if (g_prepared)
        return 0;
    if (g_tcb && __atomic_load_n(&g_alive, __ATOMIC_ACQUIRE))
        return -1;   /* one hidden thread at a time */
    release();
    stk = syscall(SYS_mmap, NULL, HIDDEN_STACK + guard, PROT_READ | PROT_WRITE,
                  MAP_PRIVATE | MAP_ANONYMOUS | MAP_STACK | MAP_NORESERVE, -1, 0);
    if (stk == -1)
        return -1;
    syscall(SYS_mprotect, (void *)stk, guard, PROT_NONE);
    /* glibc's own allocator: static TLS blocks initialised, DTV set, the
     * descriptor zeroed */
    t = g_allocate_tls(NULL);
    if (!t) {
        syscall(SYS_munmap, (void *)stk, HIDDEN_STACK + guard);
        return -1;
    }
    g_tcb = t;
    g_stack = (void *)stk;
    g_prepared = 1;
    return 0;
}

/* Start fn on the prepared hidden thread; the caller has blocked every signal
 * (the new thread inherits that mask).  Only system calls and stores unless
 * rt_birth_ok: safe in a signal handler (agent.c, "born when the service would
 * look").  0, or -1 (the preparation is kept for another try). */
int dbr_thread_launch(int (*fn)(void), int rt_birth_ok)
{
    struct tcb_head *t = g_tcb, *cur = thread_pointer();
    size_t guard = (size_t)dbr_page_size();
    int tid;

    if (!g_prepared)
        return -1;
    t->tcb = t;
    t->self = t;
    t->multiple_threads = 1;
    t->stack_guard = cur->stack_guard;
    t->pointer_guard = cur->pointer_guard;
    g_fn = fn;
    g_started_hidden = 1;    /* before the thread runs: it says so in HELLO */
    __atomic_store_n(&g_alive, 1, __ATOMIC_RELEASE);
    g_born_rt = rt_birth_ok && rt_birth_allowed();
    if (g_born_rt)
        g_born_rt = sched_setscheduler(0, SCHED_FIFO, &g_rt_priority) == 0;
    tid = clone(hidden_main, (char *)g_stack + HIDDEN_STACK + guard, HIDDEN_FLAGS,
                NULL, (pid_t *)((char *)t + g_tid_off), (void *)t, (pid_t *)&g_alive);
    if (g_born_rt) {
        /* leaving a real-time policy needs no privilege; a refusal here would be
         * a security module's, for a call it has just allowed */
        if (sched_setscheduler(0, g_birth_policy, &g_no_priority) != 0)
            dbr_log("thread %d cannot leave SCHED_FIFO (errno %d)", (int)dbr_gettid(), errno);
        dbr_log("agent thread born at SCHED_FIFO");
    }
    if (tid < 0) {
        __atomic_store_n(&g_alive, 0, __ATOMIC_RELEASE);
        g_started_hidden = 0;
        g_born_rt = 0;
        return -1;
    }
    g_prepared = 0;          /* the stack and TLS are the running thread's */
    return 0;
}

/* Start fn on a hidden thread now; the caller has blocked every signal.  0, or
 * -1 (use pthread_create). */
int dbr_thread_start_hidden(int (*fn)(void), int rt_birth_ok)
{
    if (dbr_thread_prepare() < 0)
        return -1;
    if (dbr_thread_launch(fn, rt_birth_ok) < 0) {
        release();
        return -1;
    }
    return 0;
}

/* On the agent's thread, first thing: a thread born in the real-time class
 * sleeps there RT_PARK_MS, then takes the policy of the program's thread that
 * started it.  0 (nothing to do, or done), -1 (refused: the agent must not
 * work at a real-time priority, above every thread of the program). */
int dbr_thread_settle(void)
{
    struct timespec park = { 0, RT_PARK_MS * 1000000L };
    int p;

    if (!g_born_rt)
        return 0;
    p = sched_getscheduler(0);
    if (p < 0 || (p != SCHED_FIFO && p != SCHED_RR))
        return 0;
    while (syscall(SYS_clock_nanosleep, CLOCK_MONOTONIC, 0, &park, &park) != 0 && errno == EINTR)
        ;
    if (sched_setscheduler(0, g_birth_policy, &g_no_priority) != 0) {
        dbr_log("the agent's thread cannot leave SCHED_FIFO (errno %d)", errno);
        return -1;
    }
    dbr_log("agent thread left SCHED_FIFO after %d ms", RT_PARK_MS);
    return 0;
}

/* Program thread, after the hidden thread has returned (or in a fork child,
 * where it never existed): wait, bounded, for the kernel to be done with its
 * stack, then give back its stack and TLS.  1 if released. */
int dbr_thread_reap(unsigned timeout_ms)
{
    uint64_t deadline = dbr_now_ms() + timeout_ms;

    if (!g_tcb)
        return 1;
    while (__atomic_load_n(&g_alive, __ATOMIC_ACQUIRE)) {
        struct timespec ts = { 0, 1000000 };

        if (dbr_now_ms() >= deadline)
            return 0;
        syscall(SYS_futex, &g_alive, FUTEX_WAIT, 1, &ts, NULL, 0);
    }
    release();
    return 1;
}

const char *dbr_thread_mode(void)
{
    return g_unusable ? g_unusable : "hidden";
}

/* ---- credentials ----
 *
 * Linux keeps credentials per thread; glibc's set*id and setgroups make every
 * thread it knows of follow the caller (SIGSETXID).  It does not know the
 * hidden thread, so a program that drops privileges would leave the agent's
 * thread with the old ones.  The hooks call dbr_thread_sync_creds after a
 * successful call: the program thread posts its new credentials and wakes the
 * agent's thread, which applies them with raw syscalls at its next wake-up
 * (dbr_thread_apply_creds) and acknowledges.  The caller waits for that,
 * bounded by CREDS_WAIT_MS (the agent's thread may be inside a request); the
 * agent's thread applies a pending change before it handles anything else. */
#define CREDS_WAIT_MS 5000u

static struct {
    uint32_t posted, applied;   /* sequence numbers; futex word: applied */
    int result;                 /* 0, or -errno of the first failed syscall */
    uid_t uid[3];
    gid_t gid[3];
    int ngroups;                /* -1: leave the groups alone */
    /* never freed: after a timed-out wait the agent's thread may still read it
     * (it then applies the next posting too); untouched pages cost nothing */
    gid_t groups[65536];        /* NGROUPS_MAX */
} g_creds;

/* groups, gids, uids in that order, or the uids first too */
static long set_creds(int uid_first)
{
    long r = 0;

    if (uid_first)
        r = syscall(SYS_setresuid, g_creds.uid[0], g_creds.uid[1], g_creds.uid[2]);
    if (r == 0 && g_creds.ngroups >= 0)
        r = syscall(SYS_setgroups, (size_t)g_creds.ngroups, g_creds.groups);
    if (r == 0)
        r = syscall(SYS_setresgid, g_creds.gid[0], g_creds.gid[1], g_creds.gid[2]);
    if (r == 0)
        r = syscall(SYS_setresuid, g_creds.uid[0], g_creds.uid[1], g_creds.uid[2]);
    return r;
}

int dbr_thread_apply_creds(void)
{
    uint32_t seq = __atomic_load_n(&g_creds.posted, __ATOMIC_ACQUIRE);
    long r;

    if (seq == __atomic_load_n(&g_creds.applied, __ATOMIC_RELAXED))
        return 0;
    /* A drop: groups and gids while the thread still holds the privilege to set
     * them, uids last.  A drop undone (seteuid(0) back through the saved uid):
     * the thread has no capabilities until its uids are back, so the groups
     * fail with EPERM before anything changed; then the uids go first. */
    r = set_creds(0);
    if (r != 0 && errno == EPERM)
        r = set_creds(1);
    g_creds.result = r == 0 ? 0 : -errno;
    __atomic_store_n(&g_creds.applied, seq, __ATOMIC_RELEASE);
    syscall(SYS_futex, &g_creds.applied, FUTEX_WAKE, 1 << 30, NULL, NULL, 0);
    return r == 0 ? 1 : -1;
}

int dbr_thread_sync_creds(const char *what)
{
    uint64_t deadline;
    uint32_t seq;
    int n, rc = 0, e = errno;

    if (!dbr_thread_hidden() || dbr_gettid() == __atomic_load_n(&g_agent_tid, __ATOMIC_ACQUIRE))
        return 0;
    pthread_mutex_lock(&g_creds_mu);
    n = (int)syscall(SYS_getgroups, (int)(sizeof g_creds.groups / sizeof g_creds.groups[0]),
                     g_creds.groups);
    g_creds.ngroups = n >= 0 ? n : -1;
    syscall(SYS_getresuid, &g_creds.uid[0], &g_creds.uid[1], &g_creds.uid[2]);
    syscall(SYS_getresgid, &g_creds.gid[0], &g_creds.gid[1], &g_creds.gid[2]);
    seq = __atomic_add_fetch(&g_creds.posted, 1, __ATOMIC_ACQ_REL);
    dbr_agent_poke();
    deadline = dbr_now_ms() + CREDS_WAIT_MS;
    for (;;) {
        uint32_t got = __atomic_load_n(&g_creds.applied, __ATOMIC_ACQUIRE);
        struct timespec ts = { 0, 50 * 1000000 };

        if (got == seq) {
            rc = g_creds.result;
            break;
        }
        if (!dbr_thread_hidden()) {    /* it ended: nothing left to change */
            rc = 0;
            break;
        }
        if (dbr_now_ms() >= deadline) {
            rc = -ETIMEDOUT;
            break;
        }
        syscall(SYS_futex, &g_creds.applied, FUTEX_WAIT, got, &ts, NULL, 0);
    }
    pthread_mutex_unlock(&g_creds_mu);
    if (rc)
        dbr_log("%s: the agent's thread did not take the new credentials (%d)%s", what, rc,
                rc == -ETIMEDOUT ? "; it will at its next wake-up" : "");
    errno = e;
    return rc;
}

/* fork child: the hidden thread was not copied; its stack and TLS were */
void dbr_thread_fork_child(void)
{
    dbr_mutex_init(&g_creds_mu);   /* another thread may have held it at fork */
    g_creds.applied = g_creds.posted;   /* the child's thread starts with the forker's */
    g_creds.result = 0;
    __atomic_store_n(&g_alive, 0, __ATOMIC_RELEASE);
    g_started_hidden = 0;
    g_born_rt = 0;
    release();
}
