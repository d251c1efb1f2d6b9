/*
 * thread.c — the agent's thread, hidden from glibc.
 *
 * glibc keeps fast paths for a process it believes has one thread: stdio
 * takes no lock (getc, putc, fgets ... on an unlocked FILE), malloc takes no
 * arena lock, libstdc++'s shared_ptr counts without atomics
 * (__libc_single_threaded).  pthread_create leaves them for good.  A thread
 * made by pthread_create for the agent would make every client pay for locks
 * it does not need: a getc loop ran 7x slower, malloc/free 5 % (design-notes,
 * "The agent's thread, seen from the program").  So the agent makes its
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
#include <fcntl.h>
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

static void *thread_pointer(void)
{
    void *p;

    __asm__ volatile("mov %%fs:0x10, %0" : "=r"(p));
    return p;
}

/* Once, in the constructor (single-threaded as far as we know). */
void dbr_thread_init(void)
{
    const char *v = getenv("DBR_AGENT_THREAD");
    const uint32_t *tid_desc;
    char *self = thread_pointer();

    dbr_mutex_init(&g_creds_mu);
    if (v && strcmp(v, "pthread") == 0) {
        g_unusable = "DBR_AGENT_THREAD=pthread";
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
}

#define HIDDEN_FLAGS (CLONE_VM | CLONE_FS | CLONE_FILES | CLONE_SIGHAND | CLONE_THREAD | CLONE_SYSVSEM | \
                      CLONE_SETTLS | CLONE_PARENT_SETTID | CLONE_CHILD_CLEARTID)

/* ---- born at SCHED_IDLE ----
 *
 * A new thread starts with load estimates that the scheduler takes as real
 * and that decay with a 32 ms half-life while it sleeps; the load one is its
 * weight.  The agent's thread, made in the constructor, sleeps almost at
 * once, yet a program that starts more threads than there are CPUs at once
 * (bench `threads`) had them placed 3:1 on two CPUs until the load balancer
 * moved them, 5-10 ms of wall time per run.  Born at SCHED_IDLE (weight 3 of
 * 1024) a dormant agent cost nothing measurable there, one in session about
 * half as much; set to SCHED_IDLE after its birth it cost as much as before
 * (design-notes, "The agent's thread is born at SCHED_IDLE": figures, and
 * what did not work).  So it is born there:
 * the creating thread sets itself to SCHED_IDLE for the clone alone (a new
 * thread inherits its creator's policy) and takes its own back at once.  The
 * agent's thread takes the same policy back before it does any work
 * (dbr_thread_leave_idle): once it has connected to a service, or when it
 * must take the program's new credentials.  A dormant agent (no service)
 * stays at SCHED_IDLE, where it only sleeps and tries to connect.
 *
 * Leaving SCHED_IDLE needs privilege: CAP_SYS_NICE, or an RLIMIT_NICE that
 * allows the thread's nice value.  A program thread left at SCHED_IDLE would
 * be harmed, so the birth is done only when that is certain: the policy is
 * SCHED_OTHER or SCHED_BATCH, and the rlimit allows it, or the thread just
 * lowered its nice value by one and raised it back (the kernel checks the same
 * privilege for both, the capability through the security modules too, which
 * may refuse a capability the thread holds).  And only while a CPU is free:
 * at SCHED_IDLE the creating thread yields to any other runnable thread on its
 * CPU (a_cpu_is_free).  Otherwise (most unprivileged processes, a busy
 * machine, a fork child) the agent's thread is born as before.  DBR_AGENT_IDLE_BIRTH=0
 * turns this off; =1 skips the free-CPU check (tests). */

static int g_born_idle;            /* the current hidden thread was born at SCHED_IDLE */
static int g_left_idle;            /* ... and has left it */
static int g_birth_policy;         /* the policy it takes back */
static const struct sched_param g_no_priority;   /* 0: SCHED_OTHER, BATCH, IDLE */

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

/* Fewer runnable threads on the machine than CPUs this thread may use (the
 * count in /proc/loadavg includes the caller).  Else a thread at SCHED_IDLE
 * gives its CPU away to the first other one there and waits behind it: on two
 * CPUs kept busy by four others, a trivial program's start took 3.2 ms at the
 * median instead of 0.8. */
static int a_cpu_is_free(void)
{
    char buf[128], *slash;
    cpu_set_t set;
    ssize_t n;
    long running;
    int fd;

    if (sched_getaffinity(0, sizeof set, &set) != 0)
        return 0;
    fd = open("/proc/loadavg", O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 0;
    n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0)
        return 0;
    buf[n] = 0;
    /* "0.20 0.18 0.12 1/80 11206": the fourth field is running/total */
    slash = strchr(buf, '/');
    if (!slash)
        return 0;
    while (slash > buf && slash[-1] >= '0' && slash[-1] <= '9')
        slash--;
    running = strtol(slash, NULL, 10);
    return running >= 1 && running <= CPU_COUNT(&set);
}

/* 1 if the calling thread can go to SCHED_IDLE and come back; g_birth_policy set */
static int idle_birth_allowed(void)
{
    const char *v = getenv("DBR_AGENT_IDLE_BIRTH");
    pid_t self = dbr_gettid();
    int always = v && strcmp(v, "1") == 0;   /* even with no CPU free (tests) */
    struct rlimit rl;
    int p, nice, by_rlimit;

    if (v && strcmp(v, "0") == 0)
        return 0;
    p = sched_getscheduler(0);
    if (p != SCHED_OTHER && p != SCHED_BATCH)   /* also: SCHED_RESET_ON_FORK set */
        return 0;
    g_birth_policy = p;
    errno = 0;
    nice = getpriority(PRIO_PROCESS, (id_t)self);
    if (nice == -1 && errno)
        return 0;
    by_rlimit = getrlimit(RLIMIT_NICE, &rl) == 0 &&
                (rl.rlim_cur == RLIM_INFINITY || (rlim_t)(20 - nice) <= rl.rlim_cur);
    /* the cheap privilege tests before /proc/loadavg: most processes fail them */
    if (!by_rlimit && (nice <= -20 || !sys_nice_held()))
        return 0;
    if (!always && !a_cpu_is_free())
        return 0;
    if (by_rlimit)
        return 1;
    if (setpriority(PRIO_PROCESS, (id_t)self, nice - 1) != 0)
        return 0;
    if (setpriority(PRIO_PROCESS, (id_t)self, nice) != 0) {   /* raising it: always allowed */
        dbr_log("cannot restore nice %d of thread %d (errno %d)", nice, (int)self, errno);
        return 0;
    }
    return 1;
}

/* Start fn on a hidden thread; the caller has blocked every signal (the new
 * thread inherits that mask).  0, or -1 (use pthread_create). */
int dbr_thread_start_hidden(int (*fn)(void), int idle_birth_ok)
{
    struct tcb_head *t, *cur = thread_pointer();
    size_t guard = (size_t)dbr_page_size();
    long stk;
    int tid;

    if (g_unusable || !g_tid_off)
        return -1;
    if (g_tcb && __atomic_load_n(&g_alive, __ATOMIC_ACQUIRE))
        return -1;   /* one hidden thread at a time */
    release();
    stk = syscall(SYS_mmap, NULL, HIDDEN_STACK + guard, PROT_READ | PROT_WRITE,
                  MAP_PRIVATE | MAP_ANONYMOUS | MAP_STACK | MAP_NORESERVE, -1, 0);
    if (stk == -1)
        return -1;
    syscall(SYS_mprotect, (void *)stk, guard, PROT_NONE);
    /* glibc's own allocator: static TLS blocks initialised, DTV set, the
     * descriptor zeroed.  It uses malloc: we are on a program thread. */
    t = g_allocate_tls(NULL);
    if (!t) {
        syscall(SYS_munmap, (void *)stk, HIDDEN_STACK + guard);
        return -1;
    }
    t->tcb = t;
    t->self = t;
    t->multiple_threads = 1;
    t->stack_guard = cur->stack_guard;
    t->pointer_guard = cur->pointer_guard;
    g_tcb = t;
    g_stack = (void *)stk;
    g_fn = fn;
    g_started_hidden = 1;    /* before the thread runs: it says so in HELLO */
    __atomic_store_n(&g_alive, 1, __ATOMIC_RELEASE);
    g_born_idle = idle_birth_ok && idle_birth_allowed();
    g_left_idle = 0;
    if (g_born_idle)
        g_born_idle = sched_setscheduler(0, SCHED_IDLE, &g_no_priority) == 0;
    tid = clone(hidden_main, (char *)stk + HIDDEN_STACK + guard, HIDDEN_FLAGS,
                NULL, (pid_t *)((char *)t + g_tid_off), (void *)t, (pid_t *)&g_alive);
    if (g_born_idle) {
        if (sched_setscheduler(0, g_birth_policy, &g_no_priority) != 0)
            dbr_log("thread %d cannot leave SCHED_IDLE (errno %d)", (int)dbr_gettid(), errno);
        dbr_log("agent thread born at SCHED_IDLE");
    }
    if (tid < 0) {
        __atomic_store_n(&g_alive, 0, __ATOMIC_RELEASE);
        g_started_hidden = 0;
        g_born_idle = 0;
        release();
        return -1;
    }
    return 0;
}

/* On the agent's thread, before anything but sleeping and connecting: a
 * thread born at SCHED_IDLE takes the policy the program's thread that
 * started it had (its nice value it already has).  0 (nothing to do, or
 * done), -1 (the kernel refused: the agent must not work at SCHED_IDLE, where
 * a lock it held could keep program threads waiting). */
int dbr_thread_leave_idle(void)
{
    int p;

    if (!g_born_idle || g_left_idle)
        return 0;
    p = sched_getscheduler(0);
    if (p < 0 || (p & ~SCHED_RESET_ON_FORK) != SCHED_IDLE) {
        g_left_idle = 1;
        return 0;
    }
    if (sched_setscheduler(0, g_birth_policy, &g_no_priority) != 0) {
        dbr_log("the agent's thread cannot leave SCHED_IDLE (errno %d)", errno);
        return -1;
    }
    g_left_idle = 1;
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
    /* with the old credentials, which may be what allows it; a thread that
     * cannot leave SCHED_IDLE ends, as one that cannot take the new ones */
    if (dbr_thread_leave_idle() < 0)
        return -1;
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
    g_born_idle = 0;
    release();
}
