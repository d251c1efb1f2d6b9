/*
 * agent.c — start-up, the agent thread, and the session with the service:
 * connect (dormant retry with backoff), HELLO/HELLO_ACK, validation of every
 * datagram, dispatch, replies, disconnect policy, fork and exit.
 */
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/utsname.h>
#include <time.h>
#include <unistd.h>
#include <linux/membarrier.h>

#include "agent.h"

#define BACKOFF_MIN_MS   50u
#define BACKOFF_MAX_MS   2000u
#define HELLO_ACK_WAIT_MS 2000u
#define SEND_TIMEOUT_MS  2000u
#define CLIENT_LOCK_WAIT_MS 50u
#define MAP_WAIT_MAX_MS  10000u
#define MAP_WAIT_SLOTS   64u
#define DLOPEN_TICK_MS   250

pthread_mutex_t g_agent_mu = PTHREAD_MUTEX_INITIALIZER;
pid_t g_agent_tid;
static int g_sync_core;      /* membarrier SYNC_CORE registered (dbr_sync_core_ready) */
static int g_sync_avail;   /* the kernel offers membarrier SYNC_CORE */
uint64_t g_agent_lo, g_agent_hi;

static pthread_mutex_t g_send_mu = PTHREAD_MUTEX_INITIALIZER;
static int g_sock = -1;
static int g_sock_lost;      /* the program closed our socket fd (number may be reused) */
static int g_ready;          /* HELLO_ACK received: anything may be sent */
static uint32_t g_seq;
static int g_wake[2] = { -1, -1 };
static int g_exiting;
static int g_retired;        /* the agent stopped for good here (dbr_agent_retire) */
static int g_thread_started; /* an agent thread was created (it may not have run yet) */
static int g_born_late;      /* the running agent thread was started by birth_arm's timer */
static unsigned g_quiet_ms;  /* what the agent's thread waits before it connects */
static int g_hinted;         /* g_quiet_ms is the service's hint: above 0, births are planned */
static int g_bye_sent;       /* this session's BYE went out (g_send_mu) */
static int g_forked;
static int g_on_disconnect = DBR_DISCONNECT_KEEP;
static uint32_t g_map_wait_ms;
static uint32_t g_notices;   /* DBR_NOTICE_* the service asked for in this session */

/* bounded waits of map-changing hooks for the service's ACK */
struct map_wait {
    uint32_t req_id;   /* 0: free */
    int acked;
    int result;
};
static pthread_mutex_t g_wait_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_wait_cv;
static struct map_wait g_waits[MAP_WAIT_SLOTS];
static uint32_t g_next_req;
static uint32_t g_session_gen;

/* Identity of the agent's own fds: a program may close fds it does not know
 * about (daemons close everything) and reuse the numbers; the agent then must
 * never read, write or close them. */
struct fd_id {
    dev_t dev;
    ino_t ino;
};
static struct fd_id g_sock_id, g_wake_id[2];

static void fd_id_take(int fd, struct fd_id *id)
{
    struct stat st;

    id->dev = 0;
    id->ino = 0;
    if (fd >= 0 && fstat(fd, &st) == 0) {
        id->dev = st.st_dev;
        id->ino = st.st_ino;
    }
}

static int fd_is(int fd, const struct fd_id *id)
{
    struct stat st;

    return fd >= 0 && fstat(fd, &st) == 0 && st.st_dev == id->dev && st.st_ino == id->ino;
}

int dbr_connected(void)
{
    return __atomic_load_n(&g_ready, __ATOMIC_ACQUIRE);
}

/* Whether a starting or ending thread should tell the service (DBR_HELLO_QUIET_THREADS:
 * only while it asks, i.e. while it samples with one event per thread).  A plain load,
 * no lock and no system call: a program that starts threads by the thousand pays for
 * none of it while the service does not listen. */
int dbr_thread_notices(void)
{
    return __atomic_load_n(&g_ready, __ATOMIC_ACQUIRE) &&
           (__atomic_load_n(&g_notices, __ATOMIC_RELAXED) & DBR_NOTICE_THREADS);
}

/* ---------------- sending ---------------- */

static int lock_for_send(int from_client)
{
    struct timespec ts;

    if (!from_client)
        return pthread_mutex_lock(&g_send_mu);
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_nsec += (long)CLIENT_LOCK_WAIT_MS * 1000000L;
    if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000L;
    }
    return pthread_mutex_timedlock(&g_send_mu, &ts);
}

int dbr_send(void *msg, uint32_t type, uint32_t len, int fd, int from_client)
{
    struct dbr_msg_hdr *h = msg;
    struct msghdr mh;
    struct iovec iov;
    union {
        char buf[CMSG_SPACE(sizeof(int))];
        struct cmsghdr align;
    } ctl;
    ssize_t n;
    int rc = DBR_OK;

    h->magic = DBR_PROTO_MAGIC;
    h->version = DBR_PROTO_VERSION;
    h->type = (uint16_t)type;
    h->length = len;
    if (lock_for_send(from_client) != 0)
        return DBR_E_TIMEOUT;
    /* before HELLO_ACK: only HELLO, ERROR, and BYE once HELLO went out (g_seq > 0) */
    if (g_sock < 0 || (!g_ready && type != DBR_MSG_HELLO && type != DBR_MSG_ERROR &&
                       !(type == DBR_MSG_BYE && g_seq > 0))) {
        rc = DBR_E_PROTO;
        goto out;
    }
    if (!fd_is(g_sock, &g_sock_id)) {
        g_sock_lost = 1;
        rc = DBR_E_PROTO;
        goto out;
    }
    if (type == DBR_MSG_BYE && g_bye_sent)
        goto out;      /* one BYE a session, whichever thread sends it */
    h->seq = ++g_seq;
    memset(&mh, 0, sizeof mh);
    iov.iov_base = msg;
    iov.iov_len = len;
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    if (fd >= 0) {
        struct cmsghdr *c;

        memset(&ctl, 0, sizeof ctl);
        mh.msg_control = ctl.buf;
        mh.msg_controllen = sizeof ctl.buf;
        c = CMSG_FIRSTHDR(&mh);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(c), &fd, sizeof fd);
    }
    do
        n = sendmsg(g_sock, &mh, MSG_NOSIGNAL | (from_client ? MSG_DONTWAIT : 0));
    while (n < 0 && errno == EINTR);
    if (n != (ssize_t)len)
        rc = n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK) ? DBR_E_TIMEOUT : DBR_E_PROTO;
    else if (type == DBR_MSG_BYE)
        g_bye_sent = 1;
out:
    pthread_mutex_unlock(&g_send_mu);
    return rc;
}

static int send_ack(uint32_t req_id, int result)
{
    struct dbr_ack a;

    memset(&a, 0, sizeof a);
    a.req_id = req_id;
    a.result = result;
    return dbr_send(&a, DBR_MSG_ACK, sizeof a, -1, 0);
}

static void send_error(int code, uint32_t ref_seq, const char *text)
{
    struct dbr_error e;

    memset(&e, 0, sizeof e);
    e.code = code;
    e.ref_seq = ref_seq;
    strncpy(e.msg, text, sizeof e.msg - 1);
    dbr_log("protocol error %d (seq %u): %s", code, ref_seq, text);
    dbr_send(&e, DBR_MSG_ERROR, sizeof e, -1, 0);
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

static void map_ack_deliver(uint32_t req_id, int result)
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

/* ---------------- receiving and validation ---------------- */

static uint8_t g_rx[DBR_MSG_MAX];

enum { ST_HANDSHAKE, ST_SESSION };
enum { END_NONE = 0, END_EOF, END_ERROR, END_BYE };

static uint32_t fixed_size(uint32_t type)
{
    switch (type) {
    case DBR_MSG_HELLO_ACK:        return sizeof(struct dbr_hello_ack);
    case DBR_MSG_ACK:              return sizeof(struct dbr_ack);
    case DBR_MSG_CODE_BUFFER_REQ:  return sizeof(struct dbr_code_buffer_req);
    case DBR_MSG_CODE_BUFFER_FREE: return sizeof(struct dbr_code_buffer_free);
    case DBR_MSG_REGION:           return sizeof(struct dbr_region);
    case DBR_MSG_REGION_FORGET:    return sizeof(struct dbr_region_forget);
    case DBR_MSG_PATCH:
    case DBR_MSG_UNPATCH:          return sizeof(struct dbr_patch_batch);
    case DBR_MSG_PC_CENSUS_REQ:    return sizeof(struct dbr_census_req);
    case DBR_MSG_TRANSFER:
    case DBR_MSG_EVICT:            return sizeof(struct dbr_transfer);
    case DBR_MSG_SAMPLER_START:    return sizeof(struct dbr_sampler_start);
    case DBR_MSG_SAMPLER_STOP:     return sizeof(struct dbr_ack);
    case DBR_MSG_SAMPLER_THREAD:   return sizeof(struct dbr_sampler_thread);
    case DBR_MSG_BYE:              return sizeof(struct dbr_bye);
    case DBR_MSG_ERROR:            return sizeof(struct dbr_error);
    case DBR_MSG_NOTICES:          return sizeof(struct dbr_notices);
    case DBR_MSG_FRAMES_ADD:
    case DBR_MSG_FRAMES_DEL:       return sizeof(struct dbr_frames);
    default:                       return 0; /* not a service->agent type */
    }
}

/* seq of the datagram in g_rx after an oversized receive (header intact) */
static uint32_t rx_seq(void)
{
    const struct dbr_msg_hdr *h = (const struct dbr_msg_hdr *)g_rx;

    return h->magic == DBR_PROTO_MAGIC ? h->seq : 0;
}

/* Receive one datagram.  Returns its length (> 0), 0 on EOF, or a negative
 * dbr_result (DBR_E_PROTO with *why set) for an unacceptable datagram. */
static ssize_t recv_one(int fd, const char **why)
{
    struct msghdr mh;
    struct iovec iov = { g_rx, sizeof g_rx };
    union {
        char buf[CMSG_SPACE(16 * sizeof(int))];
        struct cmsghdr align;
    } ctl;
    struct cmsghdr *c;
    ssize_t n;
    int got_fds = 0;

    if (!fd_is(fd, &g_sock_id)) {
        g_sock_lost = 1;
        *why = "socket fd closed by the program";
        return 0;
    }
    memset(&mh, 0, sizeof mh);
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    mh.msg_control = ctl.buf;
    mh.msg_controllen = sizeof ctl.buf;
    do
        n = recvmsg(fd, &mh, MSG_TRUNC | MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
    while (n < 0 && errno == EINTR);
    if (n < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK)
            return DBR_E_TIMEOUT;
        *why = "receive failed";
        return 0;
    }
    for (c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c)) {
        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
            int k, nfd = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
            for (k = 0; k < nfd; k++) {
                int x;
                memcpy(&x, CMSG_DATA(c) + k * sizeof(int), sizeof x);
                close(x);
            }
            got_fds = 1;
        }
    }
    if ((mh.msg_flags & MSG_TRUNC) || n > (ssize_t)sizeof g_rx) {
        *why = "oversized datagram";
        return DBR_E_PROTO;
    }
    if (got_fds || (mh.msg_flags & MSG_CTRUNC)) {
        *why = "unexpected file descriptors";
        return DBR_E_PROTO;
    }
    return n;
}

/* Check one received datagram; 0 if acceptable, else sends ERROR and
 * returns the error code. */
static int validate(size_t n, int state)
{
    const struct dbr_msg_hdr *h = (const struct dbr_msg_hdr *)g_rx;
    uint32_t fixed;

    if (n < sizeof *h) {
        send_error(DBR_E_PROTO, 0, "datagram shorter than the header");
        return DBR_E_PROTO;
    }
    if (h->magic != DBR_PROTO_MAGIC) {
        send_error(DBR_E_PROTO, h->seq, "bad magic");
        return DBR_E_PROTO;
    }
    if (h->version != DBR_PROTO_VERSION) {
        send_error(DBR_E_VERSION, h->seq, "protocol version mismatch");
        return DBR_E_VERSION;
    }
    if (h->length != n) {
        send_error(DBR_E_PROTO, h->seq, "length field differs from datagram size");
        return DBR_E_PROTO;
    }
    fixed = h->type >= 1 && h->type <= DBR_MSG_TYPE_MAX ? fixed_size(h->type) : 0;
    if (fixed == 0) {
        send_error(DBR_E_PROTO, h->seq, "unknown or agent-only message type");
        return DBR_E_PROTO;
    }
    if (state == ST_HANDSHAKE && h->type != DBR_MSG_HELLO_ACK && h->type != DBR_MSG_BYE &&
        h->type != DBR_MSG_ERROR) {
        send_error(DBR_E_PROTO, h->seq, "message before HELLO_ACK");
        return DBR_E_PROTO;
    }
    if (state == ST_SESSION && h->type == DBR_MSG_HELLO_ACK) {
        send_error(DBR_E_PROTO, h->seq, "duplicate HELLO_ACK");
        return DBR_E_PROTO;
    }
    if (h->type == DBR_MSG_PATCH || h->type == DBR_MSG_UNPATCH || h->type == DBR_MSG_TRANSFER ||
        h->type == DBR_MSG_EVICT) {
        /* fixed part, then `count` entries (PATCH/UNPATCH: sites; TRANSFER, EVICT: points) */
        int xfer = h->type == DBR_MSG_TRANSFER || h->type == DBR_MSG_EVICT;
        uint32_t count = xfer ? ((const struct dbr_transfer *)g_rx)->n
                              : ((const struct dbr_patch_batch *)g_rx)->n;
        size_t elem = xfer ? sizeof(struct dbr_transfer_point) : sizeof(struct dbr_patch_site);

        if (n < fixed || count > (xfer ? DBR_MAX_TRANSFER : DBR_MAX_SITES) ||
            n != fixed + (size_t)count * elem) {
            send_error(DBR_E_PROTO, h->seq, xfer ? "bad TRANSFER/EVICT length" : "bad PATCH/UNPATCH length");
            return DBR_E_PROTO;
        }
        return DBR_OK;
    }
    if (h->type == DBR_MSG_PC_CENSUS_REQ) {
        /* fixed part, then n ranges */
        uint32_t count = ((const struct dbr_census_req *)g_rx)->n;

        if (n < fixed || count > DBR_MAX_CENSUS_RANGES ||
            n != fixed + (size_t)count * sizeof(struct dbr_range)) {
            send_error(DBR_E_PROTO, h->seq, "bad PC_CENSUS_REQ length");
            return DBR_E_PROTO;
        }
        return DBR_OK;
    }
    if (n != fixed) {
        send_error(DBR_E_PROTO, h->seq, "bad message length for its type");
        return DBR_E_PROTO;
    }
    return DBR_OK;
}

/* ---------------- handlers ---------------- */

static int end_by_bye(const struct dbr_bye *b)
{
    if (b->flags & DBR_BYE_REVERT) {
        int k = dbr_unpatch_all();
        dbr_log("BYE with revert: %d sites restored", k);
    }
    return END_BYE;
}

static int handle(size_t n)
{
    const struct dbr_msg_hdr *h = (const struct dbr_msg_hdr *)g_rx;
    int rc = DBR_OK, fd = -1;

    switch (h->type) {
    case DBR_MSG_ACK: {
        const struct dbr_ack *a = (const void *)g_rx;
        map_ack_deliver(a->req_id, a->result);
        break;
    }
    case DBR_MSG_CODE_BUFFER_REQ: {
        const struct dbr_code_buffer_req *r = (const void *)g_rx;
        struct dbr_code_buffer rep;

        memset(&rep, 0, sizeof rep);
        rep.req_id = r->req_id;
        pthread_mutex_lock(&g_agent_mu);
        rep.result = dbr_buffer_alloc(r->near, r->size, &rep.buffer_id, &rep.base, &rep.size, &fd);
        pthread_mutex_unlock(&g_agent_mu);
        rc = dbr_send(&rep, DBR_MSG_CODE_BUFFER, sizeof rep, rep.result == DBR_OK ? fd : -1, 0);
        if (fd >= 0)
            close(fd);
        /* after the answer: the service writes the code meanwhile */
        if (rep.result == DBR_OK)
            dbr_sync_core_ready();
        break;
    }
    case DBR_MSG_CODE_BUFFER_FREE: {
        const struct dbr_code_buffer_free *r = (const void *)g_rx;
        int res;

        pthread_mutex_lock(&g_agent_mu);
        res = dbr_buffer_free(r->buffer_id);
        pthread_mutex_unlock(&g_agent_mu);
        rc = send_ack(r->req_id, res);
        break;
    }
    case DBR_MSG_REGION: {
        const struct dbr_region *r = (const void *)g_rx;
        int res;

        pthread_mutex_lock(&g_agent_mu);
        res = dbr_region_set(r);
        pthread_mutex_unlock(&g_agent_mu);
        rc = send_ack(r->req_id, res);
        break;
    }
    case DBR_MSG_REGION_FORGET: {
        const struct dbr_region_forget *r = (const void *)g_rx;
        int res;

        pthread_mutex_lock(&g_agent_mu);
        res = dbr_region_forget(r->region_id);
        pthread_mutex_unlock(&g_agent_mu);
        rc = send_ack(r->req_id, res);
        break;
    }
    case DBR_MSG_FRAMES_ADD:
    case DBR_MSG_FRAMES_DEL: {
        const struct dbr_frames *r = (const void *)g_rx;
        int res;

        pthread_mutex_lock(&g_agent_mu);
        res = h->type == DBR_MSG_FRAMES_ADD ? dbr_frames_add(r->region_id, r->addr, r->len)
                                            : dbr_frames_del(r->region_id, r->addr);
        pthread_mutex_unlock(&g_agent_mu);
        rc = send_ack(r->req_id, res);
        break;
    }
    case DBR_MSG_PATCH:
    case DBR_MSG_UNPATCH: {
        const struct dbr_patch_batch *b = (const void *)g_rx;
        struct dbr_patch_result *rep;
        size_t len = sizeof *rep + (size_t)b->n * sizeof rep->results[0];

        rep = dbr_alloc(len);
        if (!rep) {
            send_error(DBR_E_NOMEM, h->seq, "out of memory");
            return END_ERROR;
        }
        rep->batch_id = b->batch_id;
        rep->n = b->n;
        pthread_mutex_lock(&g_agent_mu);
        dbr_patch_batch(b->sites, b->n, h->type == DBR_MSG_UNPATCH, rep->results);
        pthread_mutex_unlock(&g_agent_mu);
        rc = dbr_send(rep, DBR_MSG_PATCH_RESULT, (uint32_t)len, -1, 0);
        dbr_free(rep);
        break;
    }
    case DBR_MSG_PC_CENSUS_REQ: {
        const struct dbr_census_req *r = (const void *)g_rx;
        rc = dbr_census_run(r->req_id, r->timeout_ms, r->ranges, r->n);
        break;
    }
    case DBR_MSG_TRANSFER:
    case DBR_MSG_EVICT: {
        const struct dbr_transfer *t = (const void *)g_rx;
        struct dbr_transfer_result rep;

        memset(&rep, 0, sizeof rep);
        rep.req_id = t->req_id;
        pthread_mutex_lock(&g_agent_mu);
        rep.result = dbr_transfer_run(t->region_id, t->points, t->n, t->timeout_ms,
                                      h->type == DBR_MSG_EVICT, &rep);
        pthread_mutex_unlock(&g_agent_mu);
        rc = dbr_send(&rep, DBR_MSG_TRANSFER_RESULT, sizeof rep, -1, 0);
        break;
    }
    case DBR_MSG_SAMPLER_START: {
        const struct dbr_sampler_start *r = (const void *)g_rx;
        struct dbr_sampler_ring rep;

        memset(&rep, 0, sizeof rep);
        rep.req_id = r->req_id;
        rep.result = dbr_sampler_start(r->period_us, r->ring_entries, r->flags, &fd, &rep.ring_bytes);
        rc = dbr_send(&rep, DBR_MSG_SAMPLER_RING, sizeof rep, rep.result == DBR_OK ? fd : -1, 0);
        if (fd >= 0)
            close(fd);
        break;
    }
    case DBR_MSG_SAMPLER_STOP: {
        const struct dbr_ack *r = (const void *)g_rx;
        rc = send_ack(r->req_id, dbr_sampler_stop());
        break;
    }
    case DBR_MSG_SAMPLER_THREAD: {
        const struct dbr_sampler_thread *r = (const void *)g_rx;
        rc = send_ack(r->req_id, r->on > 1 ? DBR_E_INVAL : dbr_sampler_thread(r->tid, (int)r->on));
        break;
    }
    case DBR_MSG_NOTICES: {
        const struct dbr_notices *r = (const void *)g_rx;

        if (r->flags & ~(uint32_t)DBR_NOTICE_THREADS) {
            rc = send_ack(r->req_id, DBR_E_INVAL);
            break;
        }
        __atomic_store_n(&g_notices, r->flags, __ATOMIC_SEQ_CST);
        /* threads being started unwrapped now send no THREAD_NEW: the service
         * lists /proc/PID/task after this answer, so it must find them there */
        if (r->flags)
            dbr_wait_unwrapped_starts();
        rc = send_ack(r->req_id, DBR_OK);
        break;
    }
    case DBR_MSG_BYE:
        return end_by_bye((const void *)g_rx);
    case DBR_MSG_ERROR: {
        const struct dbr_error *e = (const void *)g_rx;
        char text[DBR_ERRMSG_MAX + 1];
        memcpy(text, e->msg, DBR_ERRMSG_MAX);
        text[DBR_ERRMSG_MAX] = 0;
        dbr_log("service reported error %d (seq %u): %s", e->code, e->ref_seq, text);
        return END_ERROR;
    }
    default:
        return END_ERROR; /* validate() admits nothing else */
    }
    (void)n;
    if (rc != DBR_OK) {
        dbr_log("send failed (%d): ending session", rc);
        return END_ERROR;
    }
    return END_NONE;
}

/* ---------------- what the agent trusts ----------------
 *
 * The service sends code that the agent runs in its process, as whoever the
 * process is: the agent talks only to a listener it trusts.  The runtime dir
 * must be a directory (not a symbolic link), owned by root or by our effective
 * uid, and writable by no one else: nobody else can then put a socket or a
 * hint file there, nor move ours aside.  It is opened once and everything in
 * it is reached through that descriptor, so no path is looked up again after
 * the check.  The listener must run as root or as our effective uid
 * (SO_PEERCRED: the credentials it had at listen()).  Anything else: no HELLO,
 * no hint read; the agent stays dormant and tries again later.  Each reason is
 * logged once (DBR_AGENT_DEBUG). */
enum {
    DISTRUST_DIR = 1u,      /* cannot be opened as a directory without following a link */
    DISTRUST_OWNER = 2u,
    DISTRUST_MODE = 4u,
    DISTRUST_SOCK = 8u,     /* agent.sock is not a socket */
    DISTRUST_PROC = 16u,    /* no connection through /proc/thread-self/fd */
    DISTRUST_PEER = 32u,
};
static unsigned g_distrust_said;

static int say_once(unsigned reason)
{
    return !(__atomic_fetch_or(&g_distrust_said, reason, __ATOMIC_RELAXED) & reason);
}

/* Root, the agent's own euid, or the service uid the process's owner named */
static int trusted_uid(uid_t uid)
{
    return uid == 0 || uid == geteuid() ||
           (g_cfg.service_uid >= 0 && (long)uid == g_cfg.service_uid);
}

/* The runtime dir (agent.sock's), opened if it can be trusted, else -1.  Its
 * path goes to dir (cap bytes), the socket's name in it to *name, its fstat to
 * *st.  Trailing slashes are dropped: "link/" would follow the link despite
 * O_NOFOLLOW. */
static int open_runtime_dir(char *dir, size_t cap, const char **name, struct stat *st)
{
    const char *slash = strrchr(g_cfg.sock_path, '/');
    size_t len;
    uid_t me;
    int fd;

    if (!slash || !slash[1])
        return -1;
    *name = slash + 1;
    len = (size_t)(slash - g_cfg.sock_path);
    while (len > 1 && g_cfg.sock_path[len - 1] == '/')
        len--;
    if (len == 0)
        len = 1;   /* "/agent.sock": the root dir */
    if (len >= cap)
        return -1;
    memcpy(dir, g_cfg.sock_path, len);
    dir[len] = 0;
    fd = open(dir, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) {
        if (errno != ENOENT && say_once(DISTRUST_DIR))
            dbr_log("not connecting: %s %s (errno %d)", dir,
                    errno == ELOOP || errno == ENOTDIR ? "is a symbolic link or not a directory"
                                                       : "cannot be opened", errno);
        return -1;
    }
    if (fstat(fd, st) < 0 || !S_ISDIR(st->st_mode)) {
        close(fd);
        return -1;
    }
    if (!trusted_uid(st->st_uid)) {
        me = geteuid();
        if (say_once(DISTRUST_OWNER))
            dbr_log("not connecting: %s is owned by uid %u, neither root nor %u", dir,
                    (unsigned)st->st_uid, (unsigned)me);
        close(fd);
        return -1;
    }
    if (st->st_mode & 022) {
        if (say_once(DISTRUST_MODE))
            dbr_log("not connecting: %s is writable by group or others (mode %04o)", dir,
                    (unsigned)(st->st_mode & 07777));
        close(fd);
        return -1;
    }
    return fd;
}

/* Close one of the agent's fds only if it is still the file it opened (the
 * program may have closed the number and reused it meanwhile) */
static void close_own(int fd, const struct stat *was)
{
    struct fd_id id = { was->st_dev, was->st_ino };

    if (fd_is(fd, &id))
        close(fd);
}

/* ---------------- the session ---------------- */

/* A connection to the service in a trusted runtime dir, from a trusted
 * listener (above), or -1.  The socket file is opened with O_PATH (no
 * link followed), checked, and connected to through /proc/thread-self/fd:
 * the connection reaches that very file.  thread-self, not self: once main
 * has ended (pthread_exit) /proc/self/fd is gone. */
static int connect_service(void)
{
    struct sockaddr_un sa;
    struct timeval tv = { SEND_TIMEOUT_MS / 1000u, (SEND_TIMEOUT_MS % 1000u) * 1000 };
    struct ucred peer;
    socklen_t peer_len = sizeof peer;
    char dir[sizeof g_cfg.sock_path];
    const char *name;
    struct stat st;
    int fd, dfd, sfd, fl, rc, e;
    uid_t me;

    if (!g_cfg.sock_path[0])
        return -1;
    dfd = open_runtime_dir(dir, sizeof dir, &name, &st);
    if (dfd < 0)
        return -1;
    sfd = openat(dfd, name, O_PATH | O_NOFOLLOW | O_CLOEXEC);
    close_own(dfd, &st);
    if (sfd < 0)
        return -1;
    if (fstat(sfd, &st) < 0 || !S_ISSOCK(st.st_mode)) {
        if (say_once(DISTRUST_SOCK))
            dbr_log("not connecting: %s/%s is not a socket", dir, name);
        close(sfd);
        return -1;
    }
    fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) {
        close_own(sfd, &st);
        return -1;
    }
    memset(&sa, 0, sizeof sa);
    sa.sun_family = AF_UNIX;
    snprintf(sa.sun_path, sizeof sa.sun_path, "/proc/thread-self/fd/%d", sfd);
    rc = connect(fd, (struct sockaddr *)&sa, sizeof sa);
    e = errno;
    close_own(sfd, &st);
    if (rc < 0) {
        /* ENOENT, ENOTDIR: no /proc here (refused, stale: ECONNREFUSED, EACCES) */
        if ((e == ENOENT || e == ENOTDIR) && say_once(DISTRUST_PROC))
            dbr_log("not connecting: no connection through /proc/thread-self/fd (errno %d)", e);
        close(fd);
        return -1;
    }
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &peer, &peer_len) < 0 || peer_len < sizeof peer)
        peer.uid = (uid_t)-1;
    me = geteuid();
    if (!trusted_uid(peer.uid)) {
        if (say_once(DISTRUST_PEER))
            dbr_log("not connecting: listener uid %d is neither root nor %u", (int)peer.uid,
                    (unsigned)me);
        close(fd);
        return -1;
    }
    fl = fcntl(fd, F_GETFL);
    fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    return fd;
}

static int send_hello(void)
{
    struct dbr_hello m;
    ssize_t k;

    memset(&m, 0, sizeof m);
    m.pid = (uint32_t)getpid();
    m.ppid = (uint32_t)getppid();
    m.uid = (uint32_t)getuid();
    m.flags = (g_sync_avail ? DBR_HELLO_SYNC_CORE : 0) | (g_forked ? DBR_HELLO_FORKED : 0) |
              (g_forked && dbr_any_installed() ? DBR_HELLO_INHERITED : 0) |
              (dbr_thread_hidden() ? DBR_HELLO_HIDDEN_THREAD : 0) | DBR_HELLO_QUIET_THREADS |
              DBR_HELLO_SAMPLER_LISTED | DBR_HELLO_EVICT |
              DBR_HELLO_FRAMES | DBR_HELLO_ENTRY_SITES;
    m.agent_version = DBR_AGENT_VERSION;
    m.n_threads = (uint32_t)dbr_count_threads();
    m.page_size = (uint32_t)dbr_page_size();
    m.census_signal = (uint32_t)g_cfg.census_sig;
    m.sampler_signal = (uint32_t)g_cfg.sampler_sig;
    m.build_id_len = g_build_id_len;
    memcpy(m.build_id, g_build_id, g_build_id_len);
    /* thread-self: once main has ended (pthread_exit) /proc/self/exe is unreadable */
    k = readlink("/proc/thread-self/exe", m.exe, sizeof m.exe - 1);
    if (k < 0)
        k = readlink("/proc/self/exe", m.exe, sizeof m.exe - 1);
    if (k < 0)
        m.exe[0] = 0;
    return dbr_send(&m, DBR_MSG_HELLO, sizeof m, -1, 0);
}

/* the agent thread must end its session and return */
static int stopping(void)
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
static sigset_t g_prog_sigmask;  /* mask of the thread that started the agent's */

/* 1 if every thread but the agent's has ended.  Only the thread-group leader
 * can linger (a zombie, state Z) after it ended; other threads leave
 * /proc/self/task when they end.  The agent's own tid must be listed, else
 * /proc is not what it seems and the answer is no. */
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

    if (fd >= 0 && fd_is(fd, &g_wake_id[1]) && write(fd, "x", 1) < 0) {
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
            if ((p[1].revents & POLLNVAL) || !fd_is(g_wake[0], &g_wake_id[0]))
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

    if (how == END_BYE && stopping()) {
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
static int session_run(void)
{
    const struct dbr_hello_ack *ack = (const void *)g_rx;
    const char *why = NULL;
    uint64_t deadline, last_poll;
    int fd, how = END_NONE, established = 0;
    ssize_t n;

    fd = connect_service();
    if (fd < 0)
        return 0;
    pthread_mutex_lock(&g_send_mu);
    g_sock = fd;
    g_sock_lost = 0;
    fd_id_take(fd, &g_sock_id);
    g_seq = 0;
    g_bye_sent = 0;
    pthread_mutex_unlock(&g_send_mu);
    if (send_hello() != DBR_OK) {
        end_session(fd, END_ERROR);
        return 0;
    }
    /* handshake: bounded wait for HELLO_ACK */
    deadline = dbr_now_ms() + HELLO_ACK_WAIT_MS;
    for (;;) {
        uint64_t now = dbr_now_ms();

        if (stopping()) {
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
        n = recv_one(fd, &why);
        if (n == DBR_E_TIMEOUT)
            continue;
        if (n == 0) {
            end_session(fd, END_EOF);
            return 0;
        }
        if (n < 0) {
            send_error((int)n, rx_seq(), why);
            end_session(fd, END_ERROR);
            return 0;
        }
        if (validate((size_t)n, ST_HANDSHAKE) != DBR_OK) {
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
        if (stopping()) {
            how = END_BYE;
            break;
        }
        if (!wait_readable(fd, DLOPEN_TICK_MS)) {
            if (!fd_is(fd, &g_sock_id)) {
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
        n = recv_one(fd, &why);
        if (n == DBR_E_TIMEOUT)
            continue;
        if (n == 0) {
            how = END_EOF;
            break;
        }
        if (n < 0) {
            send_error((int)n, rx_seq(), why);
            how = END_ERROR;
            break;
        }
        if (validate((size_t)n, ST_SESSION) != DBR_OK) {
            how = END_ERROR;
            break;
        }
        how = handle((size_t)n);
    }
    end_session(fd, how);
    return established && how != END_BYE;
}

static void *agent_main(void *arg);

static int agent_main_hidden(void)
{
    agent_main(NULL);
    return 0;
}

/* Wait until `until` (dbr_now_ms), or until the agent stops.  Pokes wake the
 * wait without ending it; the program's new credentials are taken meanwhile
 * (wait_readable), so a privilege drop never waits for the end of it. */
static void wait_until(uint64_t until)
{
    uint64_t now;

    while (!stopping() && (now = dbr_now_ms()) < until)
        wait_readable(-1, (int)(until - now));
}

/* ---- quiet while the program starts ----
 *
 * For its first DBR_AGENT_QUIET_MS (default DBR_QUIET_DEFAULT_MS) the agent's
 * thread only waits: no connection, no HELLO, no /proc reads.  A program's
 * first tens of milliseconds are when the scheduler knows least about its
 * threads (their load and utilisation averages are young), and any extra
 * activity then, on the program's CPUs or the service's threads woken by it,
 * tips where the program's first threads are placed: a thread put beside a busy
 * one waits for the next tick.  Measured with a copy of bench `churn` that
 * times each start and join
 * (docs/decisions/0006-agent-quiet-while-the-program-starts.md):
 * stalls of over 1 ms in the loop's first 40 ms, per run, were 2.7 natively,
 * 6.9 with the agent's thread born at the program's policy and connecting at
 * once, 4.0-4.7 with it quiet for 30, 60 or 120 ms.  A thread that only exists
 * and sleeps for good gave 3.8-4.1: the birth itself is the rest.  A service
 * run with --aggressive has it 0 (below): it wants code patched from the
 * program's first moments.  A program that ends within the quiet never had a
 * session (the service does not sample such young clients anyway). */

/* A small file in the runtime dir (dfd), NUL-terminated in buf: the bytes
 * read (0 when the read fails), or -1 if it cannot be opened.  O_NONBLOCK: a
 * FIFO put there must not hold the program; O_NOFOLLOW: nor a link. */
static ssize_t read_small_at(int dfd, const char *name, char *buf, size_t cap)
{
    return dbr_read_small_at(dfd, name, O_NOFOLLOW | O_NONBLOCK, buf, cap);
}

/* A later birth for this program (DBR_QUIET_PROGRAM beside DBR_QUIET_FILE): a
 * service that saw the program's last runs each end within its short_run_s, with
 * nothing installed, writes that age for it (dbr_service/shortruns.py), and its
 * later runs that end as soon make no thread at all.  The key names the executable
 * by device, inode and mtime (a rebuilt program is another one).  Two more system
 * calls, only under a hint above 0; it can only make the birth later.  Read from
 * the runtime dir dfd (path dir); `from` is made to name the file that set *ms,
 * for the log. */
static void program_hint(int dfd, const char *dir, char *from, size_t from_len, unsigned *ms)
{
    char name[sizeof DBR_QUIET_FILE + 64], buf[16];
    struct stat st;
    unsigned later;

    if (stat("/proc/self/exe", &st) < 0)
        return;
    snprintf(name, sizeof name, DBR_QUIET_PROGRAM, (unsigned long)st.st_dev,
             (unsigned long)st.st_ino, (unsigned long long)st.st_mtim.tv_sec);
    if (read_small_at(dfd, name, buf, sizeof buf) < 0)
        return;
    if (dbr_parse_ms(buf, DBR_QUIET_MAX_MS, &later) < 0) {
        dbr_log("%s/%s does not hold a number of ms: ignored", dir, name);
        return;
    }
    if (later > *ms) {
        *ms = later;
        snprintf(from, from_len, "%s/%s", dir, name);
    }
}

/* Unless DBR_AGENT_QUIET_MS set it, the service says how young a client it
 * samples in DBR_QUIET_FILE beside agent.sock (service.py, write_quiet_hint:
 * min_client_age_s in ms, 0 under --aggressive): the agent's thread is not
 * needed sooner, and a host service cannot set its clients' environment.  Read
 * in the constructor (six system calls, two more for program_hint: the birth
 * is planned there), only from a runtime dir the agent trusts (open_runtime_dir):
 * another user's hint could keep its thread from ever being born.  A missing
 * or unreadable file, one that does not hold a number (logged), or a dir not
 * trusted, leaves the default. */
static int quiet_hint(char *from, size_t from_len, unsigned *ms)
{
    char dir[sizeof g_cfg.sock_path], buf[16];
    const char *name;
    struct stat st;
    int dfd, got = 0;

    if (g_cfg.quiet_from_env || !g_cfg.sock_path[0])
        return 0;
    dfd = open_runtime_dir(dir, sizeof dir, &name, &st);
    if (dfd < 0)
        return 0;
    snprintf(from, from_len, "%s/%s", dir, DBR_QUIET_FILE);
    if (read_small_at(dfd, DBR_QUIET_FILE, buf, sizeof buf) < 0)
        goto out;
    if (dbr_parse_ms(buf, DBR_QUIET_MAX_MS, ms) < 0) {
        dbr_log("%s does not hold a number of ms: ignored", from);
        goto out;
    }
    if (*ms)
        program_hint(dfd, dir, from, from_len, ms);
    got = 1;
out:
    close(dfd);
    return got;
}

/* The quiet, and whether the service's hint set it (*hinted) */
static unsigned quiet_ms(int *hinted)
{
    char from[sizeof g_cfg.sock_path + sizeof DBR_QUIET_FILE + 64];
    unsigned ms = g_cfg.quiet_ms;

    *hinted = quiet_hint(from, sizeof from, &ms);
    if (*hinted)
        dbr_log("agent thread quiet for %u ms (the service's hint, %s)", ms, from);
    else if (ms)
        dbr_log("agent thread quiet for %u ms", ms);
    return ms;
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
 * would cut it (tests/test_agent_birth.py).  A program thread that blocks the
 * signal while the birth is pending makes the thread at once (hooks.c: one
 * that blocks it everywhere would never get one); so does one about to take a
 * seccomp filter, which a thread made from it would inherit.  The thread takes
 * the constructor's CPU affinity, policy and nice value (the handler runs on
 * any program thread).  Stepping aside (dbr_agent_retire) and exit cancel a
 * pending birth; a fork child plans its own, born parent or not.  Without the
 * hint (no service, an older one, DBR_AGENT_QUIET_MS set), with a hint of 0
 * (--aggressive), where the thread cannot be hidden (pthread_create is not
 * safe in a handler), on a kernel older than 6.3, or when the timer cannot be
 * made, the thread is made in the constructor and waits out the quiet, as
 * before. */
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

static int agent_main_hidden(void);

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

    if (stopping())
        return -2;
    /* a thread made here inherits this thread's seccomp filter */
    if (syscall(SYS_prctl, PR_GET_SECCOMP, 0, 0, 0, 0) != 0)
        return -1;
    sigfillset(&all);
    syscall(SYS_rt_sigprocmask, SIG_SETMASK, &all, &old, sizeof(uint64_t));
    /* set before stopping() is read again: dbr_agent_retire sets g_retired before it
     * reads g_thread_started, so one of the two sees the other */
    __atomic_store_n(&g_thread_started, 1, __ATOMIC_SEQ_CST);
    g_born_late = 1;
    rc = stopping() ? -2 : dbr_thread_launch(agent_main_hidden, 0);
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

/* hooks.c, a program thread about to make a later birth impossible or wrong:
 * make the agent's thread now. */
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
        wait_until(dbr_now_ms() + g_quiet_ms);
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
    while (!stopping()) {
        if (session_run())
            backoff = BACKOFF_MIN_MS;
        if (stopping())
            break;
        /* the whole backoff: a poke (a program thread ending) is not a reason to reconnect */
        wait_until(dbr_now_ms() + backoff);
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
 * call (hooks.c) the agent steps aside for good: the session ends with BYE,
 * the sampler's timers are deleted, the agent's thread returns, and the
 * caller waits, bounded, until the kernel no longer counts that thread.
 * Installed patches stay, as on a disconnect with `keep`: the map-change
 * hooks still restore sites before their code goes away.  Fork children of
 * such a process start no agent thread either; an exec loads a new agent.
 * The same happens before a seccomp filter with TSYNC (hooks.c), and when the
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
 * more than one thread, the kernel waits for an RCU grace period here (10-20 ms on
 * this VM).  Whether it is registered. */
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
    fd_id_take(g_wake[0], &g_wake_id[0]);
    fd_id_take(g_wake[1], &g_wake_id[1]);
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
    if (g_sock >= 0 && fd_is(g_sock, &g_sock_id))
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
    if (g_wake[0] >= 0 && fd_is(g_wake[0], &g_wake_id[0]))
        close(g_wake[0]);
    if (g_wake[1] >= 0 && fd_is(g_wake[1], &g_wake_id[1]))
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

__attribute__((constructor)) static void dbr_agent_init(void)
{
    dbr_config_load();
    dbr_hooks_resolve();
    if (g_cfg.disabled)
        return;
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
    g_quiet_ms = quiet_ms(&g_hinted);
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
    if (fd_is(g_wake[1], &g_wake_id[1]) && write(g_wake[1], "x", 1) < 0) {
        /* the agent thread notices g_exiting at its next wake-up anyway */
    }
}
