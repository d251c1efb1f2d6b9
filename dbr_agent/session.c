/*
 * session.c — one session with the service on the agent thread: connect,
 * HELLO and a bounded wait for HELLO_ACK, then receive, validate and handle
 * until either side ends it, and the disconnect policy; the agent thread's
 * waits and wake-ups (and its exit once no program thread is left); the
 * bounded waits of program threads for the ACK to a MAP_CHANGED.
 */
#include <errno.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "session.h"

#define HELLO_ACK_WAIT_MS 2000u
#define MAP_WAIT_MAX_MS  10000u
#define DLOPEN_TICK_MS   250

int g_wake[2] = { -1, -1 };
struct fd_id g_wake_id[2];
uint32_t g_notices;
static int g_on_disconnect = DBR_DISCONNECT_KEEP;
static uint32_t g_map_wait_ms;

pthread_mutex_t g_wait_mu = PTHREAD_MUTEX_INITIALIZER;
pthread_cond_t g_wait_cv;
struct map_wait g_waits[MAP_WAIT_SLOTS];
static uint32_t g_next_req;
static uint32_t g_session_gen;

/* Whether a starting or ending thread should tell the service (DBR_HELLO_QUIET_THREADS:
 * only while it asks, i.e. while it samples with one event per thread).  A plain load,
 * no lock and no system call: a program that starts threads by the thousand pays for
 * none of it while the service does not listen. */
int dbr_thread_notices(void)
{
    return __atomic_load_n(&g_ready, __ATOMIC_ACQUIRE) &&
           (__atomic_load_n(&g_notices, __ATOMIC_RELAXED) & DBR_NOTICE_THREADS);
}

/* ---------------- map-change waits ---------------- */

int dbr_map_changed_wait(uint32_t kind, uint64_t lo, uint64_t hi, uint32_t prot)
{
    struct dbr_map_changed m;
    struct map_wait *w = NULL;
    struct timespec ts;
    uint32_t gen, wait_ms;
    unsigned i;
    int rc;

    if (!dbr_connected())
        return DBR_E_PROTO;
    pthread_mutex_lock(&g_wait_mu);
    for (i = 0; i < MAP_WAIT_SLOTS; i++)
        if (g_waits[i].req_id == 0) {
            w = &g_waits[i];
            break;
        }
    if (w) {
        if (++g_next_req == 0)
            g_next_req = 1;
        w->req_id = g_next_req;
        w->acked = 0;
        w->result = 0;
    }
    gen = g_session_gen;
    wait_ms = g_map_wait_ms;
    pthread_mutex_unlock(&g_wait_mu);
    if (!w)
        return DBR_E_LIMIT;

    memset(&m, 0, sizeof m);
    m.req_id = w->req_id;
    m.kind = kind;
    m.lo = lo;
    m.hi = hi;
    m.prot = prot;
    rc = dbr_send(&m, DBR_MSG_MAP_CHANGED, sizeof m, -1, 1);

    clock_gettime(CLOCK_MONOTONIC, &ts);
    ts.tv_sec += wait_ms / 1000u;
    ts.tv_nsec += (long)(wait_ms % 1000u) * 1000000L;
    if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000L;
    }
    pthread_mutex_lock(&g_wait_mu);
    while (rc == DBR_OK && !w->acked && g_session_gen == gen)
        if (pthread_cond_timedwait(&g_wait_cv, &g_wait_mu, &ts) == ETIMEDOUT)
            break;
    if (rc == DBR_OK)
        rc = w->acked ? w->result : (g_session_gen != gen ? DBR_E_PROTO : DBR_E_TIMEOUT);
    w->req_id = 0;
    pthread_mutex_unlock(&g_wait_mu);
    return rc;
}

void dbr_map_ack_deliver(uint32_t req_id, int result)
{
    unsigned i;

    pthread_mutex_lock(&g_wait_mu);
    for (i = 0; i < MAP_WAIT_SLOTS; i++)
        if (req_id && g_waits[i].req_id == req_id) {
            g_waits[i].acked = 1;
            g_waits[i].result = result;
        }
    pthread_cond_broadcast(&g_wait_cv);
    pthread_mutex_unlock(&g_wait_mu);
}

static void map_waits_abort(void)
{
    pthread_mutex_lock(&g_wait_mu);
    g_session_gen++;
    pthread_cond_broadcast(&g_wait_cv);
    pthread_mutex_unlock(&g_wait_mu);
}

void dbr_map_changed_advise(uint32_t kind, uint64_t lo, uint64_t hi)
{
    struct dbr_map_changed m;

    if (!dbr_connected())
        return;
    memset(&m, 0, sizeof m);
    m.kind = kind;
    m.lo = lo;
    m.hi = hi;
    dbr_send(&m, DBR_MSG_MAP_CHANGED, sizeof m, -1, 0);
}

/* the agent thread must end its session and return */
int dbr_stopping(void)
{
    return __atomic_load_n(&g_exiting, __ATOMIC_ACQUIRE) || __atomic_load_n(&g_retired, __ATOMIC_ACQUIRE);
}

/* ---- the process outliving its program threads ----
 *
 * glibc ends a process with exit(0) when its last thread ends, main thread
 * included (pthread_exit from main), and it counts the agent's thread among
 * them: without help, a program whose threads have all ended would live on as
 * the agent's thread alone, deaf to SIGTERM (the agent blocks every
 * asynchronous signal).  So the agent does what glibc would: once no program
 * thread is left, it calls exit(0) itself.  Threads that end through
 * pthread_exit or by returning poke it (the thread-exit key's destructor), and
 * it then looks every LONELY_POLL_MS for LONELY_WATCH_MS; it also looks at
 * every idle wake-up.  A hidden agent thread (thread.c) is not counted, so
 * glibc ends the process itself: only the idle look remains, for threads that
 * end without glibc (a raw exit). */
#define LONELY_POLL_MS   5
#define LONELY_WATCH_MS  2000u

static uint64_t g_watch_until;  /* agent thread only */
sigset_t g_prog_sigmask;  /* mask of the thread that started the agent's */

/* 1 if every thread but the agent's has ended.  Only the thread-group leader
 * can linger (a zombie, state Z) after it ended; other threads leave
 * /proc/self/task when they end.  The agent's own tid must be listed, else
 * /proc is not what it seems and the answer is no.  The listing misses no
 * thread alive through it (dbr_list_threads checks it against the kernel's
 * thread count). */
static int program_threads_gone(void)
{
    pid_t tids[3];
    pid_t self = __atomic_load_n(&g_agent_tid, __ATOMIC_ACQUIRE), leader = getpid();
    int n = dbr_list_threads(tids, 3), i, seen_self = 0;

    if (n < 1 || n > 2 || self <= 0)
        return 0;
    for (i = 0; i < n; i++) {
        char st;

        if (tids[i] == self) {
            seen_self = 1;
            continue;
        }
        if (tids[i] != leader)
            return 0;
        st = dbr_thread_state(tids[i]);
        if (st != 'Z' && st != 'X')
            return 0;
    }
    return seen_self;
}

static void exit_if_alone(void)
{
    if (__atomic_load_n(&g_exiting, __ATOMIC_ACQUIRE) || !program_threads_gone())
        return;
    dbr_log("every program thread has ended: exit(0), as glibc would");
    /* the last thread: signals the program raises in its exit handlers are its own */
    pthread_sigmask(SIG_SETMASK, &g_prog_sigmask, NULL);
    exit(0);
}

/* any thread: wake the agent thread (a program thread is ending) */
void dbr_agent_poke(void)
{
    int fd = g_wake[1], e = errno;

    if (fd >= 0 && dbr_fd_is(fd, &g_wake_id[1]) && write(fd, "x", 1) < 0) {
        /* full pipe: the agent is awake anyway */
    }
    errno = e;
}

/* Wait for readability of fd (-1: none) or the wake pipe.  1 readable, 0
 * timeout or woken.  The only place the agent thread sleeps between
 * requests, so it is also where it notices that the program has ended. */
static int wait_readable(int fd, int timeout_ms)
{
    struct pollfd p[2] = { { fd, POLLIN, 0 }, { g_wake[0], POLLIN, 0 } };
    uint64_t now = dbr_now_ms(), end = now + (uint64_t)(timeout_ms < 0 ? 0 : timeout_ms);
    int r, woken = 0;

    for (;;) {
        int slice = (int)(end - now);

        if (g_watch_until > now && slice > LONELY_POLL_MS)
            slice = LONELY_POLL_MS;
        p[1].fd = g_wake[0];
        do
            r = poll(p, g_wake[0] >= 0 ? 2 : 1, slice);
        while (r < 0 && errno == EINTR);
        if (r > 0 && g_wake[0] >= 0 && p[1].revents) {
            char buf[16];
            if ((p[1].revents & POLLNVAL) || !dbr_fd_is(g_wake[0], &g_wake_id[0]))
                g_wake[0] = -1;      /* closed by the program: never touch that number again */
            else
                while (read(g_wake[0], buf, sizeof buf) > 0)
                    ;
            woken = 1;
        }
        if (dbr_thread_apply_creds() < 0) {
            /* the program's new credentials could not be taken: the agent must
             * not go on with others; it steps aside (its own thread: no wait) */
            dbr_agent_retire("the program's new credentials cannot be taken");
            return 0;
        }
        now = dbr_now_ms();
        if (woken && !dbr_thread_hidden())   /* glibc ends the process itself then */
            g_watch_until = now + LONELY_WATCH_MS;
        if (r > 0 && fd >= 0 && (p[0].revents & (POLLIN | POLLHUP | POLLERR)))
            return 1;
        exit_if_alone();
        if (woken || r < 0 || now >= end)
            return 0;
    }
}

static void end_session(int fd, int how)
{
    int policy = g_cfg.on_disconnect_env >= 0 ? g_cfg.on_disconnect_env : g_on_disconnect;
    int was_ready = g_ready;

    if (how == END_BYE && dbr_stopping()) {
        /* the program thread that stopped the agent could not send BYE (the socket
         * was busy: it only waits CLIENT_LOCK_WAIT_MS): the service must still hear it */
        struct dbr_bye b;

        memset(&b, 0, sizeof b);
        dbr_send(&b, DBR_MSG_BYE, sizeof b, -1, 0);
    }
    pthread_mutex_lock(&g_send_mu);
    __atomic_store_n(&g_ready, 0, __ATOMIC_RELEASE);
    __atomic_store_n(&g_notices, 0, __ATOMIC_RELAXED);   /* each session asks anew */
    g_sock = -1;
    if (!g_sock_lost) {
        /* A Unix socket closed with unread messages resets its peer, whose next
         * read fails (ECONNRESET) even with our BYE still queued for it: read what
         * the service sent and we will not handle (a HELLO_ACK not yet read) */
        char sink[256];

        while (recv(fd, sink, sizeof sink, MSG_DONTWAIT) > 0)
            ;
        close(fd);
    }
    pthread_mutex_unlock(&g_send_mu);
    map_waits_abort();
    dbr_log("session ended (%s)", how == END_BYE ? "bye" : how == END_EOF ? "eof" : "error");
    if (was_ready && how != END_BYE && policy == DBR_DISCONNECT_REVERT && !__atomic_load_n(&g_exiting, __ATOMIC_ACQUIRE)) {
        int k = dbr_unpatch_all();
        dbr_log("disconnect policy revert: %d sites restored", k);
    }
}

/* One session; returns 1 if a session was established (HELLO_ACK seen) and
 * did not end with the service's BYE (then the backoff keeps growing). */
int dbr_session_run(void)
{
    const struct dbr_hello_ack *ack = (const void *)g_rx;
    const char *why = NULL;
    uint64_t deadline, last_poll;
    int fd, how = END_NONE, established = 0;
    ssize_t n;

    fd = dbr_connect_service();
    if (fd < 0)
        return 0;
    pthread_mutex_lock(&g_send_mu);
    g_sock = fd;
    g_sock_lost = 0;
    dbr_fd_id_take(fd, &g_sock_id);
    g_seq = 0;
    g_bye_sent = 0;
    pthread_mutex_unlock(&g_send_mu);
    if (dbr_send_hello() != DBR_OK) {
        end_session(fd, END_ERROR);
        return 0;
    }
    /* handshake: bounded wait for HELLO_ACK */
    deadline = dbr_now_ms() + HELLO_ACK_WAIT_MS;
    for (;;) {
        uint64_t now = dbr_now_ms();

        if (dbr_stopping()) {
            end_session(fd, END_BYE);   /* the service has the session: it hears BYE */
            return 0;
        }
        if (now >= deadline) {
            dbr_log("no HELLO_ACK");
            end_session(fd, END_ERROR);
            return 0;
        }
        if (!wait_readable(fd, (int)(deadline - now)))
            continue;
        n = dbr_recv_one(fd, &why);
        if (n == DBR_E_TIMEOUT)
            continue;
        if (n == 0) {
            end_session(fd, END_EOF);
            return 0;
        }
        if (n < 0) {
            dbr_send_error((int)n, dbr_rx_seq(), why);
            end_session(fd, END_ERROR);
            return 0;
        }
        if (dbr_msg_validate((size_t)n, ST_HANDSHAKE) != DBR_OK) {
            end_session(fd, END_ERROR);
            return 0;
        }
        if (ack->hdr.type != DBR_MSG_HELLO_ACK) {   /* BYE or ERROR */
            end_session(fd, END_BYE);
            return 0;
        }
        break;
    }
    g_on_disconnect = ack->on_disconnect == DBR_DISCONNECT_REVERT ? DBR_DISCONNECT_REVERT : DBR_DISCONNECT_KEEP;
    pthread_mutex_lock(&g_wait_mu);
    g_map_wait_ms = ack->map_wait_ms > MAP_WAIT_MAX_MS ? MAP_WAIT_MAX_MS : ack->map_wait_ms;
    pthread_mutex_unlock(&g_wait_mu);
    if (ack->service_pid)
        prctl(PR_SET_PTRACER, (unsigned long)ack->service_pid, 0, 0, 0);
    dbr_log("session %llu established with service pid %u (on_disconnect %s, map_wait %u ms)",
            (unsigned long long)ack->session_id, ack->service_pid,
            g_on_disconnect == DBR_DISCONNECT_REVERT ? "revert" : "keep", g_map_wait_ms);
    dbr_objects_snapshot();
    __atomic_store_n(&g_ready, 1, __ATOMIC_RELEASE);
    established = 1;
    last_poll = dbr_now_ms();

    while (how == END_NONE) {
        if (dbr_stopping()) {
            how = END_BYE;
            break;
        }
        if (!wait_readable(fd, DLOPEN_TICK_MS)) {
            if (!dbr_fd_is(fd, &g_sock_id)) {
                g_sock_lost = 1;
                how = END_EOF;
                break;
            }
            if (dbr_now_ms() - last_poll >= DLOPEN_TICK_MS) {   /* not at every poke */
                dbr_objects_poll();
                last_poll = dbr_now_ms();
            }
            continue;
        }
        n = dbr_recv_one(fd, &why);
        if (n == DBR_E_TIMEOUT)
            continue;
        if (n == 0) {
            how = END_EOF;
            break;
        }
        if (n < 0) {
            dbr_send_error((int)n, dbr_rx_seq(), why);
            how = END_ERROR;
            break;
        }
        if (dbr_msg_validate((size_t)n, ST_SESSION) != DBR_OK) {
            how = END_ERROR;
            break;
        }
        how = dbr_msg_handle();
    }
    end_session(fd, how);
    return established && how != END_BYE;
}

/* Wait until `until` (dbr_now_ms), or until the agent stops.  Pokes wake the
 * wait without ending it; the program's new credentials are taken meanwhile
 * (wait_readable), so a privilege drop never waits for the end of it. */
void dbr_wait_until(uint64_t until)
{
    uint64_t now;

    while (!dbr_stopping() && (now = dbr_now_ms()) < until)
        wait_readable(-1, (int)(until - now));
}
