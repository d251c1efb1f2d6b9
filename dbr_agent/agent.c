/*
 * agent.c — start-up and exit, the agent thread (its quiet start, its birth
 * when the service would look, reconnecting with backoff), stepping aside for
 * calls that need a single-threaded process, and the fork child's reset.  The
 * session with the service: session.c, with transport.c, messages.c and
 * connect.c (session.h).
 */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <sched.h>
#include <signal.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/utsname.h>
#include <time.h>
#include <unistd.h>
#include <linux/membarrier.h>

#include "session.h"

#define BACKOFF_MIN_MS   50u
#define BACKOFF_MAX_MS   2000u
#define DORMANT_TICK_MS  100u

pthread_mutex_t g_agent_mu = PTHREAD_MUTEX_INITIALIZER;
pid_t g_agent_tid;
static int g_sync_core;      /* membarrier SYNC_CORE registered (dbr_sync_core_ready) */
int g_sync_avail;
uint64_t g_agent_lo, g_agent_hi;

int g_exiting;
int g_retired;
static int g_thread_started; /* an agent thread was created (it may not have run yet) */
static int g_born_late;      /* the running agent thread was started by birth_arm's timer */
static unsigned g_quiet_ms;  /* what the agent's thread waits before it connects */
static int g_hinted;         /* g_quiet_ms is the service's hint: above 0, births are planned */
int g_forked;
int g_attached;
int g_dormant;

static void *agent_main(void *arg);

static int agent_main_hidden(void)
{
    agent_main(NULL);
    return 0;
}

/* ---- born when the service would look ----
 *
 * A sleeping second thread is what the agent costs a program that is never
 * patched: a library thread that only sleeps costs bench `churn` as much as
 * the agent (docs/decisions/0002-bench-keeps-the-worst-task-group.md,
 * docs/decisions/0005-agent-thread-born-when-the-service-would-look.md).  The service
 * does not look at a client younger than min_client_age_s, and finds nothing
 * to sample in one that does not run.  So when its hint (DBR_QUIET_FILE) says
 * how young a client it samples, the hidden thread is not made in the
 * constructor: its stack and TLS are (dbr_thread_prepare, on the program's
 * thread), and a process CPU-time timer fires the census signal once the
 * program has run BIRTH_STEP_MS, and again each BIRTH_STEP_MS it runs, until
 * it is as old as the hint says.  The handler (census.c) then makes the thread
 * with clone(2) and stores only: safe in a signal handler.  A program that ends
 * sooner, or that sleeps from then on, has no second thread.
 *
 * A CPU-time timer fires at a tick of a running thread of the process, and the
 * kernel (6.3 on) gives its signal to that thread: a program thread asleep in
 * nanosleep or epoll_wait is not cut short, as a wall-clock timer's signal
 * would cut it (tests/agent/test_agent_birth.py).  A program thread that blocks the
 * signal while the birth is pending makes the thread at once (hooks.c: one that
 * blocks it everywhere would never get one); so does one about to take a
 * seccomp filter (hooks_proc.c), which a thread made from it would inherit.
 * The thread takes the constructor's CPU affinity, policy and nice value (the
 * handler runs on any program thread).  Stepping aside (dbr_agent_retire) and
 * exit cancel a pending birth; a fork child plans its own, born parent or not.
 * Without the hint (no service, an older one, DBR_AGENT_QUIET_MS set), with a
 * hint of 0 (--aggressive), where the thread cannot be hidden (pthread_create
 * is not safe in a handler), on a kernel older than 6.3, or when the timer
 * cannot be made, the thread is made in the constructor and waits out the
 * quiet, as before. */
#define BIRTH_STEP_MS    50u
#define BIRTH_RETRY_MS   100u
#define BIRTH_RETRIES    50u

/* g_birth: BIRTH_NONE, or BIRTH_PENDING (the timer is armed), or BIRTH_BUSY (one
 * thread acts on the timer: re-arms it, makes the thread, deletes it; a timer id
 * is reused once deleted, so only the thread holding BIRTH_BUSY touches it) */
enum { BIRTH_NONE, BIRTH_PENDING, BIRTH_BUSY };
static int g_birth;
static int g_birth_timer = -1;     /* kernel timer id */
static uint64_t g_birth_due;       /* dbr_now_ms at which the thread is made */
static unsigned g_birth_tries;
static cpu_set_t g_birth_cpus;
static int g_birth_cpus_ok, g_birth_policy, g_birth_nice;
static struct sched_param g_birth_param;

/* a one-shot expiry after ms more of the process's CPU time */
static int birth_timer_set(unsigned ms)
{
    struct itimerspec its;

    memset(&its, 0, sizeof its);
    its.it_value.tv_sec = ms / 1000;
    its.it_value.tv_nsec = (long)(ms % 1000) * 1000000L + (ms ? 0 : 1000000L);
    return (int)syscall(SYS_timer_settime, g_birth_timer, 0, &its, NULL);
}

static void birth_timer_delete(void)
{
    if (g_birth_timer >= 0)
        syscall(SYS_timer_delete, g_birth_timer);
    g_birth_timer = -1;
}

static unsigned birth_step(void)
{
    uint64_t now = dbr_now_ms();

    if (now >= g_birth_due)
        return 1;
    return g_birth_due - now < BIRTH_STEP_MS ? (unsigned)(g_birth_due - now) : BIRTH_STEP_MS;
}

/* 1 if the kernel gives a process-directed timer signal to the thread that was
 * running when the timer fired (Linux 6.3, "posix-timers: Prefer delivery of
 * signals to the current thread").  Before, it went to the main thread if that
 * did not block it, which could be asleep in nanosleep beside running workers. */
static int signal_goes_to_running_thread(void)
{
    struct utsname u;
    unsigned v[2] = { 0, 0 }, i = 0;
    const char *c;

    if (uname(&u) != 0)
        return 0;
    for (c = u.release; i < 2; c++) {   /* "MAJOR.MINOR..." */
        if (*c >= '0' && *c <= '9')
            v[i] = v[i] * 10 + (unsigned)(*c - '0');
        else if (*c == '.' && c > u.release)
            i++;
        else
            break;
    }
    return i >= 1 && (v[0] > 6 || (v[0] == 6 && v[1] >= 3));
}

/* On a program thread, single-threaded as far as the agent is concerned (the
 * constructor, a fork child's handler).  0 planned, -1 (make the thread now). */
static int birth_arm(unsigned ms)
{
    struct sigevent sev;
    int kid = -1;

    if (!signal_goes_to_running_thread()) {
        dbr_log("kernel older than 6.3: the agent's thread is made now");
        return -1;
    }
    if (dbr_thread_prepare() < 0)
        return -1;
    memset(&sev, 0, sizeof sev);
    sev.sigev_notify = SIGEV_SIGNAL;
    sev.sigev_signo = g_cfg.census_sig;
    sev.sigev_value.sival_ptr = (void *)(uintptr_t)DBR_BIRTH_COOKIE;
    if (syscall(SYS_timer_create, CLOCK_PROCESS_CPUTIME_ID, &sev, &kid) < 0)
        return -1;
    g_birth_timer = kid;
    g_birth_tries = 0;
    g_birth_due = dbr_now_ms() + ms;
    g_birth_cpus_ok = sched_getaffinity(0, sizeof g_birth_cpus, &g_birth_cpus) == 0;
    g_birth_policy = sched_getscheduler(0);
    if (g_birth_policy < 0 || sched_getparam(0, &g_birth_param) < 0)
        g_birth_policy = -1;
    errno = 0;
    g_birth_nice = getpriority(PRIO_PROCESS, 0);   /* this thread's */
    if (errno)
        g_birth_nice = INT_MIN;
    __atomic_store_n(&g_birth, BIRTH_BUSY, __ATOMIC_SEQ_CST);
    if (birth_timer_set(birth_step()) < 0) {
        birth_timer_delete();
        __atomic_store_n(&g_birth, BIRTH_NONE, __ATOMIC_SEQ_CST);
        return -1;
    }
    __atomic_store_n(&g_birth, BIRTH_PENDING, __ATOMIC_SEQ_CST);
    return 0;
}

/* BIRTH_PENDING -> BIRTH_BUSY.  wait: a program thread, which waits (bounded)
 * while another thread acts on the timer; a signal handler does not. */
static int birth_take(int wait)
{
    unsigned spins = 0;
    int st;

    for (;;) {
        st = BIRTH_PENDING;
        if (__atomic_compare_exchange_n(&g_birth, &st, BIRTH_BUSY, 0, __ATOMIC_SEQ_CST,
                                        __ATOMIC_SEQ_CST))
            return 1;
        if (st != BIRTH_BUSY || !wait || ++spins > 100000)
            return 0;
        sched_yield();
    }
}

/* BIRTH_BUSY held: make the agent's thread.  0 made, -1 not on this thread or not
 * now (another try later), -2 never (the agent is stopping).  Only system calls
 * and stores: also in a signal handler. */
static int birth(void)
{
    sigset_t all, old;
    int rc;

    if (dbr_stopping())
        return -2;
    /* a thread made here inherits this thread's seccomp filter */
    if (syscall(SYS_prctl, PR_GET_SECCOMP, 0, 0, 0, 0) != 0)
        return -1;
    sigfillset(&all);
    syscall(SYS_rt_sigprocmask, SIG_SETMASK, &all, &old, sizeof(uint64_t));
    /* set before dbr_stopping() is read again: dbr_agent_retire sets g_retired before it
     * reads g_thread_started, so one of the two sees the other */
    __atomic_store_n(&g_thread_started, 1, __ATOMIC_SEQ_CST);
    g_born_late = 1;
    rc = dbr_stopping() ? -2 : dbr_thread_launch(agent_main_hidden, 0);
    if (rc != 0) {
        g_born_late = 0;
        __atomic_store_n(&g_thread_started, 0, __ATOMIC_SEQ_CST);
    }
    syscall(SYS_rt_sigprocmask, SIG_SETMASK, &old, NULL, sizeof(uint64_t));
    return rc;
}

/* BIRTH_BUSY held, after birth() gave rc: release it */
static void birth_settle(int rc)
{
    if (rc == -1 && ++g_birth_tries <= BIRTH_RETRIES && birth_timer_set(BIRTH_RETRY_MS) == 0) {
        /* a filtered thread, or no memory for a thread now: another try after the
         * program has run a little more, perhaps on another thread */
        __atomic_store_n(&g_birth, BIRTH_PENDING, __ATOMIC_SEQ_CST);
        return;
    }
    birth_timer_delete();
    __atomic_store_n(&g_birth, BIRTH_NONE, __ATOMIC_SEQ_CST);
}

/* census.c: the birth timer's signal, on the program thread that was running */
void dbr_agent_birth_signal(void)
{
    int e = errno;

    if (!birth_take(0))
        goto out;
    if (dbr_now_ms() < g_birth_due && birth_timer_set(birth_step()) == 0) {
        __atomic_store_n(&g_birth, BIRTH_PENDING, __ATOMIC_SEQ_CST);   /* younger than the hint */
        goto out;
    }
    birth_settle(birth());
out:
    errno = e;
}

int dbr_agent_birth_pending(void)
{
    return __atomic_load_n(&g_birth, __ATOMIC_ACQUIRE) != BIRTH_NONE;
}

/* hooks.c, hooks_proc.c: a program thread about to make a later birth
 * impossible or wrong: make the agent's thread now. */
void dbr_agent_birth_now(const char *why)
{
    int rc;

    if (!birth_take(1))
        return;
    rc = birth();
    birth_settle(rc);
    if (rc == 0)
        dbr_log("%s: the agent's thread made now", why);
    else if (rc == -1)
        dbr_log("%s: the agent's thread cannot be made on this thread", why);
}

/* no birth from now on (stepping aside, exit); 1 if one was pending */
static int birth_cancel(void)
{
    if (!birth_take(1))
        return 0;
    birth_timer_delete();
    __atomic_store_n(&g_birth, BIRTH_NONE, __ATOMIC_SEQ_CST);
    return 1;
}

/* On a thread born late, first: the constructor's CPUs, policy and nice value
 * (best effort: the program may have changed what it may ask for since). */
static void take_birth_attributes(void)
{
    cpu_set_t now;
    struct sched_param p;
    int e;

    if (g_birth_cpus_ok && sched_getaffinity(0, sizeof now, &now) == 0 &&
        !CPU_EQUAL(&now, &g_birth_cpus) &&
        sched_setaffinity(0, sizeof g_birth_cpus, &g_birth_cpus) < 0)
        dbr_log("the agent's thread cannot take the program's CPUs (errno %d)", errno);
    if (g_birth_policy >= 0 &&
        (sched_getscheduler(0) != g_birth_policy ||
         (sched_getparam(0, &p) == 0 && p.sched_priority != g_birth_param.sched_priority)) &&
        sched_setscheduler(0, g_birth_policy, &g_birth_param) < 0)
        dbr_log("the agent's thread cannot take the program's policy (errno %d)", errno);
    errno = 0;
    e = getpriority(PRIO_PROCESS, 0);
    if (g_birth_nice != INT_MIN && !errno && e != g_birth_nice &&
        setpriority(PRIO_PROCESS, 0, g_birth_nice) < 0)
        dbr_log("the agent's thread cannot take the program's nice value (errno %d)", errno);
}

static void stay_quiet(void)
{
    if (g_born_late)
        dbr_log("agent thread made by its planned birth");
    else if (g_quiet_ms)
        dbr_wait_until(dbr_now_ms() + g_quiet_ms);
}

static void *agent_main(void *arg)
{
    unsigned backoff = BACKOFF_MIN_MS;
    sigset_t sync_sigs;

    (void)arg;
    /* synchronous signals must never be blocked (a trap at a site being patched) */
    sigemptyset(&sync_sigs);
    sigaddset(&sync_sigs, SIGTRAP);
    sigaddset(&sync_sigs, SIGSEGV);
    sigaddset(&sync_sigs, SIGBUS);
    sigaddset(&sync_sigs, SIGILL);
    sigaddset(&sync_sigs, SIGFPE);
    pthread_sigmask(SIG_UNBLOCK, &sync_sigs, NULL);
    __atomic_store_n(&g_agent_tid, dbr_gettid(), __ATOMIC_RELEASE);
    dbr_log("agent thread %d started (socket %s)", (int)g_agent_tid, g_cfg.sock_path);
    if (dbr_thread_settle() < 0) {   /* first of all: never work at a real-time priority */
        dbr_agent_retire("the agent's thread cannot leave SCHED_FIFO");
        return NULL;
    }
    if (g_born_late)
        take_birth_attributes();
    stay_quiet();
    while (!dbr_stopping()) {
        if (__atomic_load_n(&g_dormant, __ATOMIC_ACQUIRE)) {
            /* attached, or detached: no connection until dbr_agent_activate */
            dbr_wait_until(dbr_now_ms() + DORMANT_TICK_MS);
            backoff = BACKOFF_MIN_MS;
            continue;
        }
        if (dbr_session_run())
            backoff = BACKOFF_MIN_MS;
        if (dbr_stopping())
            break;
        /* the whole backoff: a poke (a program thread ending) is not a reason to reconnect */
        dbr_wait_until(dbr_now_ms() + backoff);
        backoff = backoff * 2 > BACKOFF_MAX_MS ? BACKOFF_MAX_MS : backoff * 2;
    }
    dbr_log("agent thread %d ends", (int)dbr_gettid());
    return NULL;
}

/* ---- stepping aside for calls that need a single-threaded process ----
 *
 * The kernel refuses unshare(CLONE_NEWUSER) to a process with more than one
 * thread, and setns into a user, mount or time namespace to a thread that
 * shares its address space or filesystem attributes (EINVAL, EUSERS): rootless
 * containers, bwrap and `unshare -U` failed under the agent.  Before such a
 * call (hooks_proc.c) the agent steps aside for good: the session ends with
 * BYE, the sampler's timers are deleted, the agent's thread returns, and the
 * caller waits, bounded, until the kernel no longer counts that thread.
 * Installed patches stay, as on a disconnect with `keep`: the map-change hooks
 * still restore sites before their code goes away.  Fork children of such a
 * process start no agent thread either; an exec loads a new agent.  The same
 * happens before a seccomp filter with TSYNC (hooks_proc.c), and when the
 * agent's thread cannot take the program's new credentials (called on that
 * thread: nothing to wait for). */
#define RETIRE_WAIT_MS 3000u

int dbr_agent_retire(const char *why)
{
    struct dbr_bye b;
    uint64_t deadline = dbr_now_ms() + RETIRE_WAIT_MS;
    pid_t tid;

    if (g_cfg.disabled)
        return 1;
    if (!__atomic_exchange_n(&g_retired, 1, __ATOMIC_ACQ_REL)) {
        dbr_log("%s: the agent steps aside", why);
        /* also mid-handshake (HELLO sent, HELLO_ACK not yet read by the agent's
         * thread): the service has the session by then and must hear it end */
        memset(&b, 0, sizeof b);
        dbr_send(&b, DBR_MSG_BYE, sizeof b, -1, 1);
        dbr_sampler_stop();
    }
    if (birth_cancel())
        dbr_log("%s: the agent's thread will not be made", why);
    if (!__atomic_load_n(&g_thread_started, __ATOMIC_SEQ_CST))
        return 1;
    /* the thread may not have run yet: it then returns as soon as it starts (or a
     * birth that saw g_retired makes none and clears g_thread_started) */
    while ((tid = __atomic_load_n(&g_agent_tid, __ATOMIC_ACQUIRE)) == 0 &&
           __atomic_load_n(&g_thread_started, __ATOMIC_SEQ_CST) && dbr_now_ms() < deadline)
        dbr_sleep_ms(1);
    if (tid == 0 && !__atomic_load_n(&g_thread_started, __ATOMIC_SEQ_CST))
        return 1;
    if (tid == 0 || tid == dbr_gettid())
        return 0;
    dbr_agent_poke();
    while (syscall(SYS_tgkill, getpid(), tid, 0) == 0) {
        if (dbr_now_ms() >= deadline) {
            dbr_log("%s: the agent thread %d did not end within %u ms", why, (int)tid, RETIRE_WAIT_MS);
            return 0;
        }
        dbr_sleep_ms(1);
    }
    dbr_thread_reap(RETIRE_WAIT_MS);   /* a hidden thread: its stack and TLS */
    __atomic_store_n(&g_agent_tid, 0, __ATOMIC_RELEASE);
    __atomic_store_n(&g_thread_started, 0, __ATOMIC_RELEASE);
    return 1;
}

/* Make the agent's thread now, or under the service's hint plan its birth (a
 * fork child too, counted from the fork, whether or not the parent had its
 * thread: inherited patches need none, the map-change hooks restore sites
 * themselves, and the service hears of the child once it is old enough and
 * running). */
void dbr_agent_start_thread(int forked)
{
    pthread_attr_t attr;
    pthread_t t;
    sigset_t all, old;

    g_forked = forked;
    if (g_hinted && g_quiet_ms && birth_arm(g_quiet_ms) == 0)
        return;
    sigfillset(&all);
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&attr, 256 * 1024);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    g_prog_sigmask = old;
    __atomic_store_n(&g_thread_started, 1, __ATOMIC_RELEASE);
    /* not in a fork child: it may carry a seccomp filter of the thread that forked
     * (one without TSYNC does not make the agent step aside), and the calls a
     * real-time birth makes (capget, sched_setscheduler ...) are ones such a
     * filter may kill the process for; the constructor never gets here under one */
    if (dbr_thread_start_hidden(agent_main_hidden, !forked) == 0) {
        dbr_log("agent thread hidden from glibc");
    } else if (dbr_real_pthread_create(&t, &attr, agent_main, NULL) == 0) {
        dbr_log("agent thread made by pthread_create (%s)", dbr_thread_mode());
    } else {
        __atomic_store_n(&g_thread_started, 0, __ATOMIC_RELEASE);
        dbr_log("cannot start the agent thread");
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    pthread_attr_destroy(&attr);
}

static void query_sync_core(void)
{
    long q = syscall(SYS_membarrier, MEMBARRIER_CMD_QUERY, 0, 0);

    g_sync_avail = q > 0 && (q & MEMBARRIER_CMD_PRIVATE_EXPEDITED_SYNC_CORE);
}

/* Register membarrier SYNC_CORE for the process, once, when code is about to be
 * written (the first code buffer, and before any patch), not when the agent is
 * loaded.  A registered process serialises the core whenever one of its threads
 * comes back to a CPU from the idle task, and most clients are never patched: a
 * program that starts and joins threads by the thousand paid 0.2-0.3 % of its time
 * for the registration alone (docs/decisions/0008-threads-start-unwrapped.md).  With
 * more than one thread, the kernel waits for an RCU grace period here (10-20 ms on this VM).  Whether it is registered. */
int dbr_sync_core_ready(void)
{
    if (!__atomic_load_n(&g_sync_core, __ATOMIC_ACQUIRE) && g_sync_avail &&
        syscall(SYS_membarrier, MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED_SYNC_CORE, 0, 0) == 0) {
        __atomic_store_n(&g_sync_core, 1, __ATOMIC_RELEASE);
        dbr_log("membarrier SYNC_CORE registered");
    }
    return __atomic_load_n(&g_sync_core, __ATOMIC_ACQUIRE);
}

static void make_wake_pipe(void)
{
    if (pipe2(g_wake, O_CLOEXEC | O_NONBLOCK) < 0)
        g_wake[0] = g_wake[1] = -1;
    dbr_fd_id_take(g_wake[0], &g_wake_id[0]);
    dbr_fd_id_take(g_wake[1], &g_wake_id[1]);
}

static void init_wait_cv(void)
{
    pthread_condattr_t ca;

    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_condattr_setpshared(&ca, PTHREAD_PROCESS_SHARED);   /* util.c: dbr_mutex_init */
    pthread_cond_init(&g_wait_cv, &ca);
    pthread_condattr_destroy(&ca);
}

/* atfork child handler (the child has one thread; g_agent_mu was released) */
void dbr_fork_child_reset(void)
{
    if (g_cfg.disabled)
        return;
    dbr_mutex_init(&g_send_mu);
    dbr_mutex_init(&g_wait_mu);
    init_wait_cv();
    memset(g_waits, 0, sizeof g_waits);
    if (g_sock >= 0 && dbr_fd_is(g_sock, &g_sock_id))
        close(g_sock);     /* the parent's session: never used by the child */
    g_sock = -1;
    g_ready = 0;
    g_notices = 0;
    g_agent_tid = 0;
    g_thread_started = 0;
    g_born_late = 0;
    /* POSIX timers are not inherited: the parent's pending birth is not the child's */
    __atomic_store_n(&g_birth, BIRTH_NONE, __ATOMIC_SEQ_CST);
    g_birth_timer = -1;
    dbr_thread_fork_child();
    if (g_wake[0] >= 0 && dbr_fd_is(g_wake[0], &g_wake_id[0]))
        close(g_wake[0]);
    if (g_wake[1] >= 0 && dbr_fd_is(g_wake[1], &g_wake_id[1]))
        close(g_wake[1]);
    make_wake_pipe();
    dbr_buffers_privatise();
    dbr_sampler_fork_child();
    dbr_transfer_fork_child();
    /* a new address space, not registered; the parent's patches came with it, so
     * register now if the parent had (one thread here: no grace period to wait) */
    if (__atomic_exchange_n(&g_sync_core, 0, __ATOMIC_ACQ_REL))
        dbr_sync_core_ready();
    if (__atomic_load_n(&g_retired, __ATOMIC_ACQUIRE))
        return;     /* the parent stepped aside (dbr_agent_retire): so does the child */
    dbr_agent_start_thread(1);
}

/* attach.c: whether an agent thread was made (it may not have run yet) */
int dbr_agent_thread_started(void)
{
    return __atomic_load_n(&g_thread_started, __ATOMIC_ACQUIRE);
}

__attribute__((constructor)) static void dbr_agent_init(void)
{
    dbr_config_load();
    dbr_hooks_resolve();
    if (g_cfg.disabled)
        return;
    /* attached: no quiet and no planned birth (the program's start is long past); a
     * pthread agent thread that waits, dormant, for dbr_agent_activate */
    g_attached = dbr_loaded_by_dlopen();
    g_dormant = g_attached;
    dbr_mutex_init(&g_agent_mu);
    dbr_mutex_init(&g_send_mu);
    dbr_mutex_init(&g_wait_mu);
    dbr_hooks_init();
    dbr_thread_init();
    init_wait_cv();
    dbr_self_scan();
    query_sync_core();
    dbr_patch_init();
    dbr_unblock_trap();
    dbr_census_init();
    dbr_sampler_init();
    dbr_atfork_register();
    make_wake_pipe();
    dbr_log("loaded: sync_core %d, census signal %d, sampler signal %d, agent [%#lx,%#lx)", g_sync_avail,
            g_cfg.census_sig, g_cfg.sampler_sig, (unsigned long)g_agent_lo, (unsigned long)g_agent_hi);
    if (!g_attached)
        g_quiet_ms = dbr_quiet_ms(&g_hinted);
    dbr_jitdump_open();
    dbr_agent_start_thread(0);
}

__attribute__((destructor)) static void dbr_agent_fini(void)
{
    struct dbr_bye b;

    if (g_cfg.disabled)
        return;
    __atomic_store_n(&g_exiting, 1, __ATOMIC_SEQ_CST);
    birth_cancel();
    memset(&b, 0, sizeof b);
    dbr_send(&b, DBR_MSG_BYE, sizeof b, -1, 1);   /* refused unless HELLO went out */
    if (dbr_fd_is(g_wake[1], &g_wake_id[1]) && write(g_wake[1], "x", 1) < 0) {
        /* the agent thread notices g_exiting at its next wake-up anyway */
    }
}
