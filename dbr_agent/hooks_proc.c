/*
 * hooks_proc.c — interposed calls that change the process: thread starts and
 * ends (the start wrapper, thread notices, the poke at the last program
 * thread's end), namespaces and seccomp filters (the agent steps aside, or its
 * thread is made first), credentials the hidden thread must follow, and fork.
 * Real functions are resolved as in hooks.c (hooks.h).
 */
#include <errno.h>
#include <sched.h>
#include <stdarg.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <linux/nsfs.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "hooks.h"

typedef int (*unshare_fn)(int);
typedef int (*setns_fn)(int, int);
typedef long (*syscall_fn)(long, ...);
typedef int (*prctl_fn)(int, ...);

static unshare_fn real_unshare_p;
static setns_fn real_setns_p;
static syscall_fn real_syscall_p;
static prctl_fn real_prctl_p;

void dbr_hooks_proc_resolve(void)
{
    REAL(real_unshare_p, "unshare");
    REAL(real_setns_p, "setns");
    REAL(real_syscall_p, "syscall");
    REAL(real_prctl_p, "prctl");
}

/* ---------------- threads ---------------- */

static pthread_key_t g_thread_key;
static int g_thread_key_ok;
static pthread_t g_main_thread;   /* the thread that loaded the agent */
static int g_main_ended;          /* it has called pthread_exit */

struct start_wrap {
    void *(*start)(void *);
    void *arg;
    int in_use;                 /* a slot of g_wraps taken (atomic) */
};

/* The wrapper's two words for a thread being started.  A slot of this table,
 * not dbr_alloc: that is an mmap in pthread_create and an munmap in the new
 * thread, and an munmap in a process whose other threads run on other CPUs
 * interrupts them all to flush their TLBs (and takes the mmap lock their page
 * faults need), once per thread the program starts.  More threads starting at
 * once than slots fall back to dbr_alloc. */
#define START_WRAP_SLOTS 64
static struct start_wrap g_wraps[START_WRAP_SLOTS];

static struct start_wrap *wrap_take(void)
{
    unsigned i;

    for (i = 0; i < START_WRAP_SLOTS; i++)   /* a plain look first: no write to busy slots */
        if (!__atomic_load_n(&g_wraps[i].in_use, __ATOMIC_RELAXED) &&
            !__atomic_exchange_n(&g_wraps[i].in_use, 1, __ATOMIC_ACQUIRE))
            return &g_wraps[i];
    return dbr_alloc(sizeof(struct start_wrap));
}

static void wrap_put(struct start_wrap *w)
{
    if (w >= g_wraps && w < g_wraps + START_WRAP_SLOTS)
        __atomic_store_n(&w->in_use, 0, __ATOMIC_RELEASE);
    else
        dbr_free(w);
}

static void thread_exit_notice(void *v)
{
    struct dbr_thread m;

    (void)v;
    dbr_sampler_thread_exit();
    if (dbr_thread_notices()) {
        memset(&m, 0, sizeof m);
        m.tid = (uint32_t)dbr_gettid();
        dbr_send(&m, DBR_MSG_THREAD_EXIT, sizeof m, -1, 1);
    }
    /* If it was the last program thread, the agent's thread must end the process,
     * as glibc would, when glibc counts it (DBR_AGENT_THREAD=pthread).  A hidden
     * agent thread is not counted: glibc ends the process itself, and a wake-up
     * per ending thread (a look at /proc/self/task each) would be for nothing.
     * Nor is one needed while the main thread lives: the process ends when it
     * returns from main or calls exit, and if it calls pthread_exit instead, its
     * own end is the first that pokes.  (A wake-up per thread end cost a program
     * that starts threads by the thousand 15 us a thread when pinned to one CPU.) */
    if (dbr_thread_hidden())
        return;
    if (pthread_equal(pthread_self(), g_main_thread))
        __atomic_store_n(&g_main_ended, 1, __ATOMIC_RELEASE);
    if (__atomic_load_n(&g_main_ended, __ATOMIC_ACQUIRE))
        dbr_agent_poke();
}

static void *start_wrapper(void *p)
{
    struct start_wrap w = *(struct start_wrap *)p;
    struct dbr_thread m;
    int oldstate;

    wrap_put(p);
    if (g_thread_key_ok)
        pthread_setspecific(g_thread_key, (void *)1);
    dbr_sampler_thread_start();
    if (dbr_thread_notices()) {   /* sendmsg is a cancellation point */
        pthread_setcancelstate(PTHREAD_CANCEL_DISABLE, &oldstate);
        memset(&m, 0, sizeof m);
        m.tid = (uint32_t)dbr_gettid();
        dbr_send(&m, DBR_MSG_THREAD_NEW, sizeof m, -1, 1);
        pthread_setcancelstate(oldstate, NULL);
    }
    return w.start(w.arg);
}

/* pthread_create calls that chose to start their thread unwrapped and have not
 * returned yet (dbr_wait_unwrapped_starts). */
static int g_unwrapped_starts;

/* Whether a thread started now needs the wrapper.  Only for what it does at the
 * thread's start and end: tell the service (thread notices, asked for while a perf
 * window is open), arm and delete the thread's sampler timer (agent-timer sampling
 * of every thread; a listed sampler arms only the threads the service names),
 * and, when glibc counts the agent's thread, poke it at the last thread's end.  A
 * dormant agent needs none of them, and the wrapper (a slot, a thread-specific key
 * and its destructor at the thread's end) cost a program ~0.18 us of user time a
 * thread, about 1 % of a thread start and join
 * (docs/decisions/0008-threads-start-unwrapped.md).  Called between the caller's
 * count in g_unwrapped_starts and its start, so that turning either on waits for
 * unwrapped starts under way. */
static int wrap_needed(void)
{
    return dbr_thread_notices() || dbr_sampler_arms_new();
}

/* The agent's thread, after it turned thread notices or the sampler on and before
 * it answers or lists the threads: wait until every pthread_create that chose to
 * start its thread unwrapped has returned, so that its thread is in
 * /proc/self/task (seen by the service's listing, or by the sampler's).  A
 * creating thread that cannot go on (stopped by a debugger) is not waited for past
 * ~200 ms: its thread is then sampled from the next window.  Whether none was left. */
int dbr_wait_unwrapped_starts(void)
{
    unsigned i;

    __atomic_thread_fence(__ATOMIC_SEQ_CST);   /* the flag's store before this load */
    for (i = 0; i < 2000; i++) {
        if (!__atomic_load_n(&g_unwrapped_starts, __ATOMIC_ACQUIRE))
            return 1;
        if (i < 100)
            sched_yield();
        else {
            struct timespec ts = { 0, 100000 };
            nanosleep(&ts, NULL);
        }
    }
    dbr_log("thread starts still under way after 200 ms: going on");
    return 0;
}

DBR_EXPORT int pthread_create(pthread_t *t, const pthread_attr_t *attr, void *(*start)(void *), void *arg)
{
    struct start_wrap *w;
    int rc;

    if (g_cfg.disabled)
        return dbr_real_pthread_create(t, attr, start, arg);
    /* The wrapper's poke at a thread's end is for an agent thread glibc counts.  A
     * hidden one is not counted, and a pending birth makes only a hidden one
     * (birth() in agent.c): read first, as its end (BIRTH_NONE, a release) comes
     * after a thread it made is marked hidden and alive.  Until then, unwrapped
     * starts are counted as beside a hidden thread, since the birth may come while
     * one is under way.  Wrapped, the program's thread starts in the first second
     * of every program under a service (the quiet before its birth), and in every
     * run of a program born late, cost ~0.16 us more each: 0.6 % of bench churn. */
    if (dbr_agent_birth_pending() || dbr_thread_hidden()) {
        __atomic_add_fetch(&g_unwrapped_starts, 1, __ATOMIC_SEQ_CST);
        __atomic_thread_fence(__ATOMIC_SEQ_CST);   /* the count before the flags' loads */
        if (!wrap_needed()) {
            if (g_cfg.start_delay_us) {
                struct timespec ts = { 0, (long)g_cfg.start_delay_us * 1000L };
                nanosleep(&ts, NULL);
            }
            rc = dbr_real_pthread_create(t, attr, start, arg);
            __atomic_sub_fetch(&g_unwrapped_starts, 1, __ATOMIC_RELEASE);
            return rc;
        }
        __atomic_sub_fetch(&g_unwrapped_starts, 1, __ATOMIC_RELEASE);
    }
    w = wrap_take();
    if (!w)
        return dbr_real_pthread_create(t, attr, start, arg);
    w->start = start;
    w->arg = arg;
    rc = dbr_real_pthread_create(t, attr, start_wrapper, w);
    if (rc != 0)
        wrap_put(w);
    return rc;
}

void dbr_hooks_init(void)
{
    g_main_thread = pthread_self();
    g_thread_key_ok = pthread_key_create(&g_thread_key, thread_exit_notice) == 0;
    /* the thread that loads the agent (main) too: pthread_exit from main must poke */
    if (g_thread_key_ok)
        pthread_setspecific(g_thread_key, (void *)1);
}

/* ---------------- namespaces: calls that need a single-threaded process ----------------
 *
 * The kernel refuses unshare(CLONE_NEWUSER) (and CLONE_THREAD, CLONE_SIGHAND,
 * CLONE_VM) to a process with another thread, and setns into a user, mount or
 * time namespace to a thread sharing its address space or filesystem
 * attributes.  The agent's thread would make those calls fail where they work
 * natively, so the agent steps aside first (dbr_agent_retire). */

#ifndef CLONE_NEWTIME
#define CLONE_NEWTIME 0x00000080
#endif
#define NEEDS_ALONE_UNSHARE (CLONE_NEWUSER | CLONE_THREAD | CLONE_SIGHAND | CLONE_VM)
#define NEEDS_ALONE_SETNS   (CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWTIME)

DBR_EXPORT int unshare(int flags)
{
    unshare_fn f = REAL(real_unshare_p, "unshare");

    if (!f) {
        errno = ENOSYS;
        return -1;
    }
    if (!g_cfg.disabled && (flags & NEEDS_ALONE_UNSHARE))
        dbr_agent_retire("unshare needs a single-threaded process");
    return f(flags);
}

DBR_EXPORT int setns(int fd, int nstype)
{
    setns_fn f = REAL(real_setns_p, "setns");
    int type = nstype, e = errno;

    if (!f) {
        errno = ENOSYS;
        return -1;
    }
    if (!g_cfg.disabled) {
        if (type == 0) {   /* "any type": ask the namespace fd; unknown means step aside */
            type = ioctl(fd, NS_GET_NSTYPE);
            if (type <= 0)
                type = NEEDS_ALONE_SETNS;
            errno = e;
        }
        if (type & NEEDS_ALONE_SETNS)
            dbr_agent_retire("setns needs a single-threaded process");
    }
    return f(fd, nstype);
}

/* ---------------- credentials ----------------
 *
 * glibc's set*id and setgroups change the credentials of every thread it
 * knows of; the agent's hidden thread is not among them (thread.c), so after
 * a successful call it is made to follow (dbr_thread_sync_creds). */

#define CREDS_HOOK(name, params, args)                                  \
    typedef int (*name##_fn) params;                                    \
    static name##_fn real_##name##_p;                                   \
    DBR_EXPORT int name params                                          \
    {                                                                   \
        name##_fn f = REAL(real_##name##_p, #name);                     \
        int rc_;                                                        \
                                                                        \
        if (!f) {                                                       \
            errno = ENOSYS;                                             \
            return -1;                                                  \
        }                                                               \
        rc_ = f args;                                                   \
        if (rc_ == 0 && !g_cfg.disabled)                                \
            dbr_thread_sync_creds(#name);                               \
        return rc_;                                                     \
    }

CREDS_HOOK(setuid, (uid_t u), (u))
CREDS_HOOK(setgid, (gid_t g), (g))
CREDS_HOOK(seteuid, (uid_t u), (u))
CREDS_HOOK(setegid, (gid_t g), (g))
CREDS_HOOK(setreuid, (uid_t r, uid_t e), (r, e))
CREDS_HOOK(setregid, (gid_t r, gid_t e), (r, e))
CREDS_HOOK(setresuid, (uid_t r, uid_t e, uid_t s), (r, e, s))
CREDS_HOOK(setresgid, (gid_t r, gid_t e, gid_t s), (r, e, s))
CREDS_HOOK(setgroups, (size_t n, const gid_t *list), (n, list))

/* ---------------- seccomp ----------------
 *
 * A seccomp filter binds the thread that installs it, and with
 * SECCOMP_FILTER_FLAG_TSYNC every thread of the process: the agent's too,
 * which then dies by the filter's action at its next forbidden call (or the
 * synchronisation fails, naming the agent's thread, because it lacks
 * no_new_privs).  glibc has no seccomp() wrapper: programs (libseccomp) call
 * syscall(SYS_seccomp, ...), interposed here; the agent steps aside first, as
 * for unshare.  A filter installed with a raw syscall instruction is not seen. */

#ifndef SECCOMP_SET_MODE_FILTER
#define SECCOMP_SET_MODE_FILTER 1
#endif
#ifndef SECCOMP_FILTER_FLAG_TSYNC
#define SECCOMP_FILTER_FLAG_TSYNC 1
#endif

DBR_EXPORT long syscall(long n, ...)
{
    syscall_fn f = REAL(real_syscall_p, "syscall");
    long a[6];
    va_list ap;
    int i;

    va_start(ap, n);
    for (i = 0; i < 6; i++)   /* as glibc's syscall: six argument registers, used or not */
        a[i] = va_arg(ap, long);
    va_end(ap);
    if (!f) {
        errno = ENOSYS;
        return -1;
    }
    if (n == SYS_seccomp && a[0] == SECCOMP_SET_MODE_FILTER && (a[1] & SECCOMP_FILTER_FLAG_TSYNC) &&
        !g_cfg.disabled)
        dbr_agent_retire("seccomp with TSYNC");
    else if (n == SYS_seccomp && (unsigned long)a[0] <= SECCOMP_SET_MODE_FILTER && !g_cfg.disabled)
        dbr_agent_birth_now("seccomp");   /* a thread made later from here would inherit it */
    return f(n, a[0], a[1], a[2], a[3], a[4], a[5]);
}

/* prctl(PR_SET_SECCOMP) binds the calling thread, and the agent's thread, if it
 * is still to be made (agent.c, "born when the service would look") and made from
 * that thread, would inherit the filter: it is made first. */
DBR_EXPORT int prctl(int option, ...)
{
    prctl_fn f = REAL(real_prctl_p, "prctl");
    unsigned long a[4];
    va_list ap;
    int i;

    va_start(ap, option);
    for (i = 0; i < 4; i++)   /* as glibc's prctl: four argument registers, used or not */
        a[i] = va_arg(ap, unsigned long);
    va_end(ap);
    if (!f) {
        errno = ENOSYS;
        return -1;
    }
    if (option == PR_SET_SECCOMP && !g_cfg.disabled)
        dbr_agent_birth_now("prctl(PR_SET_SECCOMP)");
    return f(option, a[0], a[1], a[2], a[3]);
}

/* ---------------- fork ---------------- */

static void atfork_prepare(void)
{
    pthread_mutex_lock(&g_agent_mu);
}

static void atfork_parent(void)
{
    pthread_mutex_unlock(&g_agent_mu);
}

static void atfork_child(void)
{
    pthread_mutex_unlock(&g_agent_mu);
    /* threads the parent was starting do not exist here: their slots are free */
    memset(g_wraps, 0, sizeof g_wraps);
    g_unwrapped_starts = 0;
    /* the forking thread is the child's main thread, whichever it was here */
    g_main_thread = pthread_self();
    g_main_ended = 0;
    dbr_fork_child_reset();
}

void dbr_atfork_register(void)
{
    pthread_atfork(atfork_prepare, atfork_parent, atfork_child);
}
