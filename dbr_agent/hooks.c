/*
 * hooks.c — interposed libc functions (the only exported symbols) and the
 * signal bookkeeping that lets the agent own SIGTRAP and its census/sampler
 * signals while the program's own handlers are recorded and chained.
 *
 * Every hook is usable before the constructor ran and before the agent
 * connected: real functions are resolved lazily with dlsym(RTLD_NEXT), and
 * the fast path (no patches, no buffers, no regions) is a few atomic loads.
 */
#include <dlfcn.h>
#include <errno.h>
#include <link.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sched.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <linux/nsfs.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "agent.h"

/* ---------------- real functions ---------------- */

typedef int (*sigaction_fn)(int, const struct sigaction *, struct sigaction *);
typedef sighandler_t (*signal_fn)(int, sighandler_t);
typedef int (*munmap_fn)(void *, size_t);
typedef int (*mprotect_fn)(void *, size_t, int);
typedef int (*dlclose_fn)(void *);
typedef int (*pthread_create_fn)(pthread_t *, const pthread_attr_t *, void *(*)(void *), void *);
typedef int (*unshare_fn)(int);
typedef int (*setns_fn)(int, int);
typedef long (*syscall_fn)(long, ...);
typedef int (*prctl_fn)(int, ...);

static sigaction_fn real_sigaction_p;
static signal_fn real_signal_p;
static munmap_fn real_munmap_p;
static mprotect_fn real_mprotect_p;
static dlclose_fn real_dlclose_p;
static pthread_create_fn real_pthread_create_p;
static unshare_fn real_unshare_p;
static setns_fn real_setns_p;
static syscall_fn real_syscall_p;
static prctl_fn real_prctl_p;

static void *resolve(void **slot, const char *name)
{
    void *p = __atomic_load_n(slot, __ATOMIC_ACQUIRE);

    if (!p) {
        p = dlsym(RTLD_NEXT, name);
        __atomic_store_n(slot, p, __ATOMIC_RELEASE);
    }
    return p;
}
#define REAL(var, name) ((__typeof__(var))resolve((void **)&(var), (name)))

int dbr_real_sigaction(int sig, const struct sigaction *act, struct sigaction *old)
{
    sigaction_fn f = REAL(real_sigaction_p, "sigaction");

    if (!f) {
        errno = ENOSYS;
        return -1;
    }
    return f(sig, act, old);
}

int dbr_real_pthread_create(pthread_t *t, const pthread_attr_t *attr, void *(*start)(void *), void *arg)
{
    pthread_create_fn f = REAL(real_pthread_create_p, "pthread_create");

    return f ? f(t, attr, start, arg) : EAGAIN;
}

/* ---------------- signals owned by the agent ---------------- */

struct managed_sig {
    int sig;                  /* 0: unused */
    int installed;
    struct sigaction prog;    /* the program's action, as it believes it is installed */
};
static struct managed_sig g_managed[3];

static struct managed_sig *managed_find(int sig)
{
    unsigned i;

    for (i = 0; i < sizeof g_managed / sizeof g_managed[0]; i++)
        if (g_managed[i].sig == sig && __atomic_load_n(&g_managed[i].installed, __ATOMIC_ACQUIRE))
            return &g_managed[i];
    return NULL;
}

int dbr_signal_install(int sig, void (*handler)(int, siginfo_t *, void *), int flags)
{
    struct managed_sig *m = NULL;
    struct sigaction sa, old;
    unsigned i;

    for (i = 0; i < sizeof g_managed / sizeof g_managed[0]; i++)
        if (g_managed[i].sig == 0 || g_managed[i].sig == sig) {
            m = &g_managed[i];
            break;
        }
    if (!m)
        return DBR_E_LIMIT;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = handler;
    sa.sa_flags = flags;
    sigemptyset(&sa.sa_mask);
    if (dbr_real_sigaction(sig, &sa, &old) < 0)
        return DBR_E_INVAL;
    if (!m->installed) {
        m->prog = old;            /* whatever the program had before us */
        m->sig = sig;
        __atomic_store_n(&m->installed, 1, __ATOMIC_RELEASE);
    }
    return DBR_OK;
}

void dbr_signal_chain(int sig, siginfo_t *si, void *uc)
{
    struct managed_sig *m = managed_find(sig);
    struct sigaction pa, dfl, ours;
    sigset_t mask, oldmask;
    void *h;
    int saved_errno = errno;

    if (!m)
        goto out;
    pa = m->prog;
    h = (void *)pa.sa_handler;
    if (h == (void *)SIG_IGN)
        goto out;
    if (h == (void *)SIG_DFL) {
        /* default action (terminate / core): re-raise with the default installed */
        memset(&dfl, 0, sizeof dfl);
        dfl.sa_handler = SIG_DFL;
        sigemptyset(&dfl.sa_mask);
        dbr_real_sigaction(sig, &dfl, &ours);
        sigemptyset(&mask);
        sigaddset(&mask, sig);
        pthread_sigmask(SIG_UNBLOCK, &mask, &oldmask);
        syscall(SYS_tgkill, getpid(), dbr_gettid(), sig);
        pthread_sigmask(SIG_SETMASK, &oldmask, NULL);
        dbr_real_sigaction(sig, &ours, NULL);   /* still alive: the default ignored it */
        goto out;
    }
    mask = pa.sa_mask;
    if (!(pa.sa_flags & SA_NODEFER))
        sigaddset(&mask, sig);
    sigdelset(&mask, SIGTRAP);       /* never blocked: see strip_trap() */
    pthread_sigmask(SIG_BLOCK, &mask, &oldmask);
    if (pa.sa_flags & SA_RESETHAND) {
        m->prog.sa_handler = SIG_DFL;
        m->prog.sa_flags &= ~(SA_SIGINFO | SA_RESETHAND);
    }
    if (pa.sa_flags & SA_SIGINFO)
        pa.sa_sigaction(sig, si, uc);
    else
        pa.sa_handler(sig);
    pthread_sigmask(SIG_SETMASK, &oldmask, NULL);
out:
    errno = saved_errno;
}

/*
 * SIGTRAP must never be blocked in a program thread: a thread that hits the
 * CC of an int3 patch in progress with SIGTRAP blocked would be killed by
 * the kernel (a forced synchronous signal resets a blocked handler to
 * SIG_DFL).  So SIGTRAP is taken out of every mask the program installs:
 * handler masks (sigaction) and thread masks (sigprocmask/pthread_sigmask).
 * A mask set by a raw system call, or inherited from such a thread, is found
 * by the look at every thread's mask before a batch writes a CC (patch_write.c,
 * guard_int3), not by an unblock in each new thread: that was a system call
 * per thread start, and it left the blocking thread itself exposed.
 */
static const sigset_t *strip_trap(int how, const sigset_t *set, sigset_t *copy)
{
    /* the agent's thread is still to be made by a timer firing this signal: a
     * program that blocks it in every thread would never get one (agent.c, "born
     * when the service would look") */
    if (set && how != SIG_UNBLOCK && dbr_agent_birth_pending() &&
        sigismember(set, g_cfg.census_sig))
        dbr_agent_birth_now("a program thread blocks the agent's signal");
    if (!set || how == SIG_UNBLOCK || !managed_find(SIGTRAP) ||
        !sigismember(set, SIGTRAP))
        return set;
    *copy = *set;
    sigdelset(copy, SIGTRAP);
    return copy;
}

typedef int (*sigmask_fn)(int, const sigset_t *, sigset_t *);
static sigmask_fn real_sigprocmask_p, real_pthread_sigmask_p;

DBR_EXPORT int sigprocmask(int how, const sigset_t *set, sigset_t *old)
{
    sigmask_fn f = REAL(real_sigprocmask_p, "sigprocmask");
    sigset_t copy;

    if (!f) {
        errno = ENOSYS;
        return -1;
    }
    return f(how, strip_trap(how, set, &copy), old);
}

DBR_EXPORT int pthread_sigmask(int how, const sigset_t *set, sigset_t *old)
{
    sigmask_fn f = REAL(real_pthread_sigmask_p, "pthread_sigmask");
    sigset_t copy;

    if (!f)
        return ENOSYS;
    return f(how, strip_trap(how, set, &copy), old);
}

DBR_EXPORT int sigaction(int sig, const struct sigaction *act, struct sigaction *old)
{
    struct managed_sig *m = managed_find(sig);
    struct sigaction prev, copy;

    if (!m) {
        if (act && sigismember(&act->sa_mask, SIGTRAP) && managed_find(SIGTRAP)) {
            copy = *act;
            sigdelset(&copy.sa_mask, SIGTRAP);
            act = &copy;
        }
        return dbr_real_sigaction(sig, act, old);
    }
    prev = m->prog;
    if (act)
        m->prog = *act;
    if (old)
        *old = prev;
    return 0;
}

DBR_EXPORT sighandler_t signal(int sig, sighandler_t handler)
{
    struct managed_sig *m = managed_find(sig);
    struct sigaction prev;
    signal_fn f;

    if (!m) {
        f = REAL(real_signal_p, "signal");
        if (!f) {
            errno = ENOSYS;
            return SIG_ERR;
        }
        return f(sig, handler);
    }
    if (handler == SIG_ERR) {
        errno = EINVAL;
        return SIG_ERR;
    }
    prev = m->prog;
    memset(&m->prog, 0, sizeof m->prog);
    sigemptyset(&m->prog.sa_mask);
    m->prog.sa_flags = SA_RESTART;      /* glibc signal(): BSD semantics */
    m->prog.sa_handler = handler;
    return (prev.sa_flags & SA_SIGINFO) ? (sighandler_t)(void *)prev.sa_sigaction : prev.sa_handler;
}

/* ---------------- map changes ---------------- */

static int map_interesting(void)
{
    return dbr_any_installed() || __atomic_load_n(&g_n_buffers, __ATOMIC_ACQUIRE) ||
           __atomic_load_n(&g_n_regions, __ATOMIC_ACQUIRE);
}

/* Before a call that unmaps or changes [lo, hi): tell the service and wait
 * (bounded); sites in the range are always restored before the call
 * proceeds; if the service did not answer, also sites whose region exits
 * into the range. */
static void map_check(uint32_t kind, uint64_t lo, uint64_t hi, uint32_t prot)
{
    int hit, rc, saved_errno = errno;

    if (hi <= lo || !map_interesting())
        goto out;
    if (g_agent_tid && dbr_gettid() == g_agent_tid)
        goto out;               /* the agent's own thread: never wait on itself */
    pthread_mutex_lock(&g_agent_mu);
    hit = dbr_site_overlaps_installed(lo, hi) || dbr_region_exits_intersect(lo, hi) ||
          dbr_buffers_intersect(lo, hi);
    pthread_mutex_unlock(&g_agent_mu);
    if (!hit)
        goto out;
    rc = dbr_map_changed_wait(kind, lo, hi, prot);
    dbr_log("map change kind %u [%#lx,%#lx): service %s", kind, (unsigned long)lo, (unsigned long)hi,
            rc == DBR_OK ? "acked" : "did not answer");
    dbr_unpatch_affected(lo, hi, rc != DBR_OK);
out:
    errno = saved_errno;
}

static uint64_t page_down(uint64_t a)
{
    return a & ~((uint64_t)dbr_page_size() - 1);
}

static uint64_t page_up(uint64_t a)
{
    uint64_t pg = (uint64_t)dbr_page_size();

    return a > UINT64_MAX - pg ? UINT64_MAX & ~(pg - 1) : (a + pg - 1) & ~(pg - 1);
}

DBR_EXPORT int munmap(void *addr, size_t len)
{
    uint64_t lo = page_down((uint64_t)addr), hi = page_up((uint64_t)addr + len);
    munmap_fn f;
    int rc, saved_errno;

    map_check(DBR_MAP_MUNMAP, lo, hi, 0);
    f = REAL(real_munmap_p, "munmap");
    rc = f ? f(addr, len) : dbr_sys_munmap(addr, len);
    if (rc == 0 && __atomic_load_n(&g_n_buffers, __ATOMIC_ACQUIRE) && hi > lo) {
        /* the program unmapped (part of) a code buffer: never target it again */
        saved_errno = errno;
        pthread_mutex_lock(&g_agent_mu);
        dbr_buffers_forget(lo, hi);
        pthread_mutex_unlock(&g_agent_mu);
        errno = saved_errno;
    }
    return rc;
}

DBR_EXPORT int mprotect(void *addr, size_t len, int prot)
{
    mprotect_fn f;

    if (!(prot & PROT_EXEC) || (prot & PROT_WRITE))
        map_check(DBR_MAP_MPROTECT, page_down((uint64_t)addr), page_up((uint64_t)addr + len),
                  (uint32_t)prot);
    f = REAL(real_mprotect_p, "mprotect");
    return f ? f(addr, len, prot) : dbr_sys_mprotect(addr, len, prot);
}

struct lib_range {
    uint64_t base;
    const char *name;
    uint64_t lo, hi;
};

static int phdr_cb(struct dl_phdr_info *info, size_t size, void *data)
{
    struct lib_range *r = data;

    (void)size;
    if (info->dlpi_addr != r->base || !info->dlpi_name || strcmp(info->dlpi_name, r->name) != 0)
        return 0;
    dbr_obj_range(info, &r->lo, &r->hi);
    return 1;
}

/* mapped range of a dlopen handle ([0,0) if unknown) */
static void handle_range(void *handle, uint64_t *lo, uint64_t *hi)
{
    struct link_map *lm = NULL;
    struct lib_range r = { 0 };

    *lo = *hi = 0;
    if (!handle || dlinfo(handle, RTLD_DI_LINKMAP, &lm) != 0 || !lm)
        return;
    r.base = lm->l_addr;
    r.name = lm->l_name ? lm->l_name : "";
    dl_iterate_phdr(phdr_cb, &r);
    *lo = r.lo;
    *hi = r.hi;
}

DBR_EXPORT int dlclose(void *handle)
{
    dlclose_fn f;
    uint64_t lo, hi;

    if (map_interesting()) {
        handle_range(handle, &lo, &hi);
        if (hi > lo)
            map_check(DBR_MAP_DLCLOSE, lo, hi, 0);
    }
    f = REAL(real_dlclose_p, "dlclose");
    if (!f) {
        errno = ENOSYS;
        return -1;
    }
    return f(handle);
}

/* ---------------- threads ---------------- */

static pthread_key_t g_thread_key;
static int g_thread_key_ok;
static pthread_t g_main_thread;   /* the thread that loaded the agent */
static int g_main_ended;          /* it has called pthread_exit */

/* the calling thread: SIGTRAP unblocked (see strip_trap) */
void dbr_unblock_trap(void)
{
    sigset_t t;
    sigmask_fn f = REAL(real_pthread_sigmask_p, "pthread_sigmask");

    sigemptyset(&t);
    sigaddset(&t, SIGTRAP);
    if (f)
        f(SIG_UNBLOCK, &t, NULL);
}

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
 * thread, about 1 % of a thread start and join (docs/design-notes.md, "Threads
 * start unwrapped while nothing needs the wrapper").  Called between the caller's
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

/* Resolve every real function now, also for an inert agent: dlsym is not
 * async-signal-safe, and the signal handlers' chaining path calls
 * pthread_sigmask and sigaction (the program's handlers may call syscall). */
void dbr_hooks_resolve(void)
{
    REAL(real_sigaction_p, "sigaction");
    REAL(real_signal_p, "signal");
    REAL(real_sigprocmask_p, "sigprocmask");
    REAL(real_pthread_sigmask_p, "pthread_sigmask");
    REAL(real_munmap_p, "munmap");
    REAL(real_mprotect_p, "mprotect");
    REAL(real_dlclose_p, "dlclose");
    REAL(real_pthread_create_p, "pthread_create");
    REAL(real_unshare_p, "unshare");
    REAL(real_setns_p, "setns");
    REAL(real_syscall_p, "syscall");
    REAL(real_prctl_p, "prctl");
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
