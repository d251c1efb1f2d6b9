/*
 * sampler.c — the agent-timer sampler: one POSIX CPU-time timer per program
 * thread (never the agent thread) firing the sampler signal at that thread;
 * the handler pushes the interrupted PC into a shared memfd ring
 * (struct dbr_ring_header + capacity x struct dbr_ring_entry).
 *
 * Started DBR_SAMPLER_LISTED, it arms no timer of its own: the service names
 * the threads (DBR_MSG_SAMPLER_THREAD), those its perf events leave out
 * because they give up their CPU too often (a CPU-time timer is checked at the
 * scheduler tick and costs a thread nothing per switch; a perf software clock
 * is stopped and restarted at each).
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <ucontext.h>
#include <unistd.h>

#include "agent.h"

#ifndef SIGEV_THREAD_ID
#define SIGEV_THREAD_ID 4
#endif
#define SAMPLER_COOKIE   0x0DB5A3B
#define RING_ENTRIES_MAX (1u << 22)
#define PERIOD_MIN_US    100u

struct timer_ent {
    pid_t tid;   /* 0: free */
    int kid;     /* kernel timer id */
};

static pthread_mutex_t g_sampler_mu = PTHREAD_MUTEX_INITIALIZER;
static struct timer_ent g_timers[DBR_TIMER_TABLE_MAX];
static struct dbr_ring_header *g_ring;      /* read by the handler */
static struct dbr_ring_header *g_old_ring;  /* stopped ring, unmapped at the next start */
static uint64_t g_old_ring_bytes, g_ring_bytes;
static uint32_t g_period_us;
static int g_running;
static int g_listed;        /* DBR_SAMPLER_LISTED: only threads the service names */

static void sampler_handler(int sig, siginfo_t *si, void *ucv)
{
    ucontext_t *uc = ucv;
    struct dbr_ring_header *h;
    struct dbr_ring_entry *ents;
    uint64_t head, tail;

    if (si->si_code != SI_TIMER || si->si_value.sival_int != SAMPLER_COOKIE) {
        dbr_signal_chain(sig, si, ucv);
        return;
    }
    h = __atomic_load_n(&g_ring, __ATOMIC_ACQUIRE);
    if (!h)
        return;
    /* Delivered on the way out of a system call: the tick that fired the timer
     * found the thread in the kernel, and the interrupted PC is only where the
     * call returns to.  The syscall instruction left that address in rcx and the
     * flags in r11 (rip is 2 bytes before it when the kernel restarts the call).
     * perf's exclude_kernel drops such samples; a thread that lives in system
     * calls (starting threads, waiting on futexes) would otherwise have its
     * kernel time piled on its libc call sites. */
    if (((uint64_t)uc->uc_mcontext.gregs[REG_RCX] == (uint64_t)uc->uc_mcontext.gregs[REG_RIP] ||
         (uint64_t)uc->uc_mcontext.gregs[REG_RCX] == (uint64_t)uc->uc_mcontext.gregs[REG_RIP] + 2) &&
        uc->uc_mcontext.gregs[REG_R11] == uc->uc_mcontext.gregs[REG_EFL]) {
        __atomic_add_fetch(&h->in_kernel, 1, __ATOMIC_RELAXED);
        return;
    }
    ents = (struct dbr_ring_entry *)(h + 1);
    head = __atomic_load_n(&h->head, __ATOMIC_RELAXED);
    for (;;) {
        tail = __atomic_load_n(&h->tail, __ATOMIC_ACQUIRE);
        if (head - tail >= h->capacity) {
            __atomic_add_fetch(&h->dropped, 1, __ATOMIC_RELAXED);
            return;
        }
        if (__atomic_compare_exchange_n(&h->head, &head, head + 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED))
            break;
    }
    ents[head & (h->capacity - 1)].pc = (uint64_t)uc->uc_mcontext.gregs[REG_RIP];
    ents[head & (h->capacity - 1)].tid = (uint32_t)dbr_gettid();
    __atomic_store_n(&ents[head & (h->capacity - 1)].seq, (uint32_t)(head + 1), __ATOMIC_RELEASE);
}

void dbr_sampler_init(void)
{
    dbr_mutex_init(&g_sampler_mu);
    dbr_signal_install(g_cfg.sampler_sig, sampler_handler, SA_SIGINFO | SA_RESTART | SA_ONSTACK, NULL);
}

/* g_sampler_mu held.  Free the slots of threads that have ended; how many.
 * A thread started while the sampler was off is not wrapped (hooks.c,
 * wrap_needed), so if the sampler started during its life, nothing deletes its
 * timer when it ends. */
static unsigned sweep_ended(void)
{
    unsigned i, n = 0;
    pid_t pid = getpid();

    for (i = 0; i < DBR_TIMER_TABLE_MAX; i++)
        if (g_timers[i].tid && syscall(SYS_tgkill, pid, g_timers[i].tid, 0) < 0 && errno == ESRCH) {
            syscall(SYS_timer_delete, g_timers[i].kid);
            g_timers[i].tid = 0;
            n++;
        }
    return n;
}

/* g_sampler_mu held.  new_thread: the calling thread has just started, so a slot
 * with its tid is an ended thread's whose timer nothing deleted (sweep_ended). */
static int arm_timer(pid_t tid, int new_thread)
{
    struct sigevent sev;
    struct itimerspec its;
    clockid_t clk = (clockid_t)((~(unsigned)tid << 3) | 6u); /* MAKE_THREAD_CPUCLOCK(tid, SCHED) */
    int kid = -1, slot = -1;
    unsigned i;

    for (i = 0; i < DBR_TIMER_TABLE_MAX; i++) {
        if (g_timers[i].tid == tid) {
            if (!new_thread)
                return DBR_OK;
            syscall(SYS_timer_delete, g_timers[i].kid);
            g_timers[i].tid = 0;
        }
        if (slot < 0 && g_timers[i].tid == 0)
            slot = (int)i;
    }
    if (slot < 0 && sweep_ended())
        for (i = 0; i < DBR_TIMER_TABLE_MAX && slot < 0; i++)
            if (g_timers[i].tid == 0)
                slot = (int)i;
    if (slot < 0)
        return DBR_E_LIMIT;
    memset(&sev, 0, sizeof sev);
    sev.sigev_notify = SIGEV_THREAD_ID;
    sev.sigev_signo = g_cfg.sampler_sig;
    sev.sigev_value.sival_int = SAMPLER_COOKIE;
    sev._sigev_un._tid = tid;
    if (syscall(SYS_timer_create, clk, &sev, &kid) < 0)
        return errno == ESRCH || errno == EINVAL ? DBR_E_UNKNOWN : DBR_E_NOMEM;
    memset(&its, 0, sizeof its);
    its.it_interval.tv_sec = g_period_us / 1000000u;
    its.it_interval.tv_nsec = (long)(g_period_us % 1000000u) * 1000L;
    its.it_value = its.it_interval;
    if (syscall(SYS_timer_settime, kid, 0, &its, NULL) < 0) {
        syscall(SYS_timer_delete, kid);
        return DBR_E_INVAL;
    }
    g_timers[slot].tid = tid;
    g_timers[slot].kid = kid;
    return DBR_OK;
}

/* g_sampler_mu held.  Delete the timer of thread tid, if it has one. */
static void delete_timers_of(pid_t tid)
{
    unsigned i;

    for (i = 0; i < DBR_TIMER_TABLE_MAX; i++)
        if (g_timers[i].tid == tid) {
            syscall(SYS_timer_delete, g_timers[i].kid);
            g_timers[i].tid = 0;
        }
}

static void delete_all_timers(void)
{
    unsigned i;

    for (i = 0; i < DBR_TIMER_TABLE_MAX; i++)
        if (g_timers[i].tid) {
            syscall(SYS_timer_delete, g_timers[i].kid);
            g_timers[i].tid = 0;
        }
}

int dbr_sampler_start(uint32_t period_us, uint32_t ring_entries, uint32_t flags, int *fd_out,
                      uint64_t *bytes_out)
{
    uint64_t pg = (uint64_t)dbr_page_size(), bytes;
    struct dbr_ring_header *h = MAP_FAILED;
    pid_t *tids = NULL;
    int fd = -1, rc = DBR_OK, n, i, armed = 0;

    *fd_out = -1;
    *bytes_out = 0;
    if (period_us == 0 || ring_entries == 0 || ring_entries > RING_ENTRIES_MAX ||
        (ring_entries & (ring_entries - 1)) != 0 || (flags & ~(uint32_t)DBR_SAMPLER_LISTED))
        return DBR_E_INVAL;
    if (period_us < PERIOD_MIN_US)
        period_us = PERIOD_MIN_US;
    pthread_mutex_lock(&g_sampler_mu);
    if (g_running) {      /* restart: the old ring stops being fed and is leaked */
        __atomic_store_n(&g_ring, NULL, __ATOMIC_RELEASE);
        delete_all_timers();
        g_running = 0;
    }
    if (g_old_ring) {     /* stopped one round trip ago: no handler can still use it */
        dbr_sys_munmap(g_old_ring, g_old_ring_bytes);
        g_old_ring = NULL;
    }
    bytes = sizeof(struct dbr_ring_header) + (uint64_t)ring_entries * sizeof(struct dbr_ring_entry);
    bytes = (bytes + pg - 1) & ~(pg - 1);
    fd = (int)syscall(SYS_memfd_create, "dbr-ring", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0 || dbr_memfd_size_sealed(fd, bytes) < 0) {
        rc = DBR_E_NOMEM;
        goto out;
    }
    h = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (h == MAP_FAILED) {
        rc = DBR_E_NOMEM;
        goto out;
    }
    h->magic = DBR_RING_MAGIC;
    h->version = DBR_PROTO_VERSION;
    h->capacity = ring_entries;
    h->entry_size = sizeof(struct dbr_ring_entry);
    g_ring_bytes = bytes;
    g_period_us = period_us;
    g_listed = (flags & DBR_SAMPLER_LISTED) != 0;
    __atomic_store_n(&g_ring, h, __ATOMIC_RELEASE);
    __atomic_store_n(&g_running, 1, __ATOMIC_SEQ_CST);
    if (g_listed) {
        dbr_log("sampler started: period %u us, %u entries, listed threads only", period_us,
                ring_entries);
        goto handed;
    }
    dbr_wait_unwrapped_starts();   /* their threads arm no timer: listed below */

    tids = dbr_alloc(DBR_TIMER_TABLE_MAX * sizeof *tids);
    if (!tids) {
        rc = DBR_E_NOMEM;
        goto out;
    }
    n = dbr_list_threads(tids, DBR_TIMER_TABLE_MAX);
    if (n < 0)
        n = 0;                  /* threads unknown: they get timers as they are seen */
    if (n > (int)DBR_TIMER_TABLE_MAX)
        n = DBR_TIMER_TABLE_MAX;
    for (i = 0; i < n; i++)
        if (tids[i] != g_agent_tid && tids[i] != dbr_gettid() && arm_timer(tids[i], 0) == DBR_OK)
            armed++;
    dbr_log("sampler started: period %u us, %u entries, %d timers", period_us, ring_entries, armed);
handed:
    *fd_out = fd;
    *bytes_out = bytes;
    fd = -1;
out:
    if (rc != DBR_OK && h != MAP_FAILED) {
        __atomic_store_n(&g_ring, NULL, __ATOMIC_RELEASE);
        delete_all_timers();
        g_running = 0;
        dbr_sys_munmap(h, bytes);
    }
    pthread_mutex_unlock(&g_sampler_mu);
    if (fd >= 0)
        close(fd);
    dbr_free(tids);
    return rc;
}

int dbr_sampler_stop(void)
{
    pthread_mutex_lock(&g_sampler_mu);
    if (g_running) {
        g_old_ring = g_ring;
        g_old_ring_bytes = g_ring_bytes;
        __atomic_store_n(&g_ring, NULL, __ATOMIC_RELEASE);
        delete_all_timers();
        g_running = 0;
    }
    pthread_mutex_unlock(&g_sampler_mu);
    return DBR_OK;
}

/* Agent thread (DBR_MSG_SAMPLER_THREAD): arm (again) or delete the timer of one
 * thread of a listed sampler.  Arming always creates a new timer: a slot with the
 * same tid may be an ended thread's whose tid was reused. */
int dbr_sampler_thread(pid_t tid, int on)
{
    int rc = DBR_OK;

    if (tid <= 0 || tid == g_agent_tid || tid == dbr_gettid())
        return DBR_E_INVAL;
    /* a thread of this process (tgkill checks the thread group), before its tid
     * goes into a clock id */
    if (on && syscall(SYS_tgkill, getpid(), tid, 0) < 0)
        return DBR_E_UNKNOWN;
    pthread_mutex_lock(&g_sampler_mu);
    if (!g_running || !g_listed)
        rc = DBR_E_INVAL;
    else if (on)
        rc = arm_timer(tid, 1);
    else
        delete_timers_of(tid);
    pthread_mutex_unlock(&g_sampler_mu);
    return rc;
}

int dbr_sampler_arms_new(void)
{
    return __atomic_load_n(&g_running, __ATOMIC_ACQUIRE) && !__atomic_load_n(&g_listed, __ATOMIC_RELAXED);
}

void dbr_sampler_thread_start(void)
{
    if (!dbr_sampler_arms_new())
        return;
    pthread_mutex_lock(&g_sampler_mu);
    if (g_running && !g_listed)
        arm_timer(dbr_gettid(), 1);
    pthread_mutex_unlock(&g_sampler_mu);
}

void dbr_sampler_thread_exit(void)
{
    pid_t tid;

    if (!__atomic_load_n(&g_running, __ATOMIC_ACQUIRE))
        return;       /* before gettid: a thread's end costs no system call here */
    tid = dbr_gettid();
    pthread_mutex_lock(&g_sampler_mu);
    delete_timers_of(tid);
    pthread_mutex_unlock(&g_sampler_mu);
}

/* fork child: POSIX timers are not inherited; the ring belongs to the parent */
void dbr_sampler_fork_child(void)
{
    dbr_mutex_init(&g_sampler_mu);
    memset(g_timers, 0, sizeof g_timers);
    __atomic_store_n(&g_ring, NULL, __ATOMIC_RELEASE);
    g_running = 0;
    g_listed = 0;
    g_old_ring = NULL;
}
