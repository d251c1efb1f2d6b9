/*
 * hooks.c — interposed libc functions (the only exported symbols) for signals
 * and map changes, and the signal bookkeeping that lets the agent own SIGTRAP
 * and its census/sampler signals while the program's own handlers are
 * recorded and chained.  Hooks of calls that change the process (threads,
 * namespaces, credentials, seccomp, fork): hooks_proc.c.
 *
 * Every hook is usable before the constructor ran and before the agent
 * connected: real functions are resolved lazily with dlsym(RTLD_NEXT), and
 * the fast path (no patches, no buffers, no regions) is a few atomic loads.
 */
#include <dlfcn.h>
#include <errno.h>
#include <link.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "hooks.h"

/* ---------------- real functions ---------------- */

typedef int (*sigaction_fn)(int, const struct sigaction *, struct sigaction *);
typedef sighandler_t (*signal_fn)(int, sighandler_t);
typedef int (*munmap_fn)(void *, size_t);
typedef int (*mprotect_fn)(void *, size_t, int);
typedef int (*dlclose_fn)(void *);
typedef int (*pthread_create_fn)(pthread_t *, const pthread_attr_t *, void *(*)(void *), void *);

static sigaction_fn real_sigaction_p;
static signal_fn real_signal_p;
static munmap_fn real_munmap_p;
static mprotect_fn real_mprotect_p;
static dlclose_fn real_dlclose_p;
static pthread_create_fn real_pthread_create_p;

void *dbr_resolve(void **slot, const char *name)
{
    void *p = __atomic_load_n(slot, __ATOMIC_ACQUIRE);

    if (!p) {
        p = dlsym(RTLD_NEXT, name);
        __atomic_store_n(slot, p, __ATOMIC_RELEASE);
    }
    return p;
}

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
    struct sigaction ours;    /* the agent's action (dbr_signals_reclaim) */
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

int dbr_signal_install(int sig, void (*handler)(int, siginfo_t *, void *), int flags,
                       const sigset_t *mask)
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
    if (mask)
        sa.sa_mask = *mask;
    else
        sigemptyset(&sa.sa_mask);
    if (dbr_real_sigaction(sig, &sa, &old) < 0)
        return DBR_E_INVAL;
    m->ours = sa;
    if (!m->installed) {
        m->prog = old;            /* whatever the program had before us */
        m->sig = sig;
        __atomic_store_n(&m->installed, 1, __ATOMIC_RELEASE);
    }
    return DBR_OK;
}

/* Attached (docs/agent.md, "Attached"): nothing interposes sigaction, so a program
 * may have replaced the agent's action for a signal it owns (SIGTRAP, whose handler
 * an int3 patch in progress needs).  Such an action becomes the program's, which
 * the agent's handler chains to, as the interposed sigaction would have made it,
 * and the agent's goes back in.  The agent's thread, before a patch batch. */
void dbr_signals_reclaim(void)
{
    struct sigaction cur;
    unsigned i;

    for (i = 0; i < sizeof g_managed / sizeof g_managed[0]; i++) {
        struct managed_sig *m = &g_managed[i];

        if (!__atomic_load_n(&m->installed, __ATOMIC_ACQUIRE) ||
            dbr_real_sigaction(m->sig, NULL, &cur) < 0 ||
            (void *)cur.sa_sigaction == (void *)m->ours.sa_sigaction)
            continue;
        if (dbr_real_sigaction(m->sig, &m->ours, NULL) == 0) {
            m->prog = cur;
            dbr_log("signal %d: the program's new action is chained, the agent's put back", m->sig);
        }
    }
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
    dbr_hooks_proc_resolve();
}
