/*
 * transport.c — the session socket: sending from any thread (one lock, a
 * bounded wait for program threads, one fd passed with SCM_RIGHTS), receiving
 * one datagram on the agent thread (descriptors sent to it are closed and
 * refused), and the identity checks that keep the agent off fd numbers the
 * program closed and reused.
 */
#include <errno.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "session.h"

#define CLIENT_LOCK_WAIT_MS 50u

pthread_mutex_t g_send_mu = PTHREAD_MUTEX_INITIALIZER;
int g_sock = -1;
int g_sock_lost;
struct fd_id g_sock_id;
int g_ready;
uint32_t g_seq;
int g_bye_sent;
uint8_t g_rx[DBR_MSG_MAX];

void dbr_fd_id_take(int fd, struct fd_id *id)
{
    struct stat st;

    id->dev = 0;
    id->ino = 0;
    if (fd >= 0 && fstat(fd, &st) == 0) {
        id->dev = st.st_dev;
        id->ino = st.st_ino;
    }
}

int dbr_fd_is(int fd, const struct fd_id *id)
{
    struct stat st;

    return fd >= 0 && fstat(fd, &st) == 0 && st.st_dev == id->dev && st.st_ino == id->ino;
}

int dbr_connected(void)
{
    return __atomic_load_n(&g_ready, __ATOMIC_ACQUIRE);
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
    if (!dbr_fd_is(g_sock, &g_sock_id)) {
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

int dbr_send_ack(uint32_t req_id, int result)
{
    struct dbr_ack a;

    memset(&a, 0, sizeof a);
    a.req_id = req_id;
    a.result = result;
    return dbr_send(&a, DBR_MSG_ACK, sizeof a, -1, 0);
}

void dbr_send_error(int code, uint32_t ref_seq, const char *text)
{
    struct dbr_error e;

    memset(&e, 0, sizeof e);
    e.code = code;
    e.ref_seq = ref_seq;
    strncpy(e.msg, text, sizeof e.msg - 1);
    dbr_log("protocol error %d (seq %u): %s", code, ref_seq, text);
    dbr_send(&e, DBR_MSG_ERROR, sizeof e, -1, 0);
}

/* ---------------- receiving ---------------- */

/* seq of the datagram in g_rx after an oversized receive (header intact) */
uint32_t dbr_rx_seq(void)
{
    const struct dbr_msg_hdr *h = (const struct dbr_msg_hdr *)g_rx;

    return h->magic == DBR_PROTO_MAGIC ? h->seq : 0;
}

/* Receive one datagram.  Returns its length (> 0), 0 on EOF, or a negative
 * dbr_result (DBR_E_PROTO with *why set) for an unacceptable datagram. */
ssize_t dbr_recv_one(int fd, const char **why)
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

    if (!dbr_fd_is(fd, &g_sock_id)) {
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
