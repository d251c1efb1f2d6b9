/*
 * messages.c — what the service may send the agent: one table of message specs
 * (size, entries after the fixed part, when allowed, handler), the check of
 * every received datagram against it, and the handlers.
 *
 * A handler runs on the agent thread with a validated datagram in g_rx; it
 * sends the one reply its request gets and returns END_NONE, or how the
 * session ends (a failed send ends it too).
 */
#include <stddef.h>
#include <string.h>
#include <unistd.h>

#include "session.h"

/* when a message type is accepted */
#define IN_HANDSHAKE 1u   /* before HELLO_ACK */
#define IN_SESSION   2u   /* after it */

struct msg_spec {
    uint32_t fixed;      /* bytes of the fixed part; 0: not a type the service sends */
    uint32_t count_off;  /* entries: offset of their uint32_t count in the fixed part */
    uint32_t elem;       /* bytes of one entry after the fixed part; 0: none */
    uint32_t max;        /* entries at most */
    uint32_t when;       /* IN_HANDSHAKE, IN_SESSION */
    const char *bad_len; /* ERROR text for a bad length; NULL: BAD_LENGTH */
    int (*handle)(const struct dbr_msg_hdr *h);  /* NULL: only the handshake reads it */
};

#define BAD_LENGTH "bad message length for its type"

/* ---------------- handlers ---------------- */

/* the handler's reply went out (END_NONE), or the session ends */
static int sent(int rc)
{
    if (rc != DBR_OK) {
        dbr_log("send failed (%d): ending session", rc);
        return END_ERROR;
    }
    return END_NONE;
}

static int on_ack(const struct dbr_msg_hdr *h)
{
    const struct dbr_ack *a = (const void *)h;

    dbr_map_ack_deliver(a->req_id, a->result);
    return END_NONE;
}

static int on_code_buffer_req(const struct dbr_msg_hdr *h)
{
    const struct dbr_code_buffer_req *r = (const void *)h;
    struct dbr_code_buffer rep;
    int rc, fd = -1;

    memset(&rep, 0, sizeof rep);
    rep.req_id = r->req_id;
    pthread_mutex_lock(&g_agent_mu);
    rep.result = dbr_buffer_alloc(r->near, r->size, r->flags, &rep.buffer_id, &rep.base,
                                  &rep.size, &fd);
    pthread_mutex_unlock(&g_agent_mu);
    rc = dbr_send(&rep, DBR_MSG_CODE_BUFFER, sizeof rep, rep.result == DBR_OK ? fd : -1, 0);
    if (fd >= 0)
        close(fd);
    /* after the answer: the service writes the code meanwhile */
    if (rep.result == DBR_OK && !(r->flags & DBR_BUFFER_F_DATA))
        dbr_sync_core_ready();
    return sent(rc);
}

static int on_code_buffer_free(const struct dbr_msg_hdr *h)
{
    const struct dbr_code_buffer_free *r = (const void *)h;
    int res;

    pthread_mutex_lock(&g_agent_mu);
    res = dbr_buffer_free(r->buffer_id);
    pthread_mutex_unlock(&g_agent_mu);
    return sent(dbr_send_ack(r->req_id, res));
}

static int on_region(const struct dbr_msg_hdr *h)
{
    const struct dbr_region *r = (const void *)h;
    int res;

    pthread_mutex_lock(&g_agent_mu);
    res = dbr_region_set(r);
    pthread_mutex_unlock(&g_agent_mu);
    return sent(dbr_send_ack(r->req_id, res));
}

static int on_region_forget(const struct dbr_msg_hdr *h)
{
    const struct dbr_region_forget *r = (const void *)h;
    int res;

    pthread_mutex_lock(&g_agent_mu);
    res = dbr_region_forget(r->region_id);
    pthread_mutex_unlock(&g_agent_mu);
    return sent(dbr_send_ack(r->req_id, res));
}

/* FRAMES_ADD and FRAMES_DEL */
static int on_frames(const struct dbr_msg_hdr *h)
{
    const struct dbr_frames *r = (const void *)h;
    int res;

    pthread_mutex_lock(&g_agent_mu);
    res = h->type == DBR_MSG_FRAMES_ADD ? dbr_frames_add(r->region_id, r->addr, r->len)
                                        : dbr_frames_del(r->region_id, r->addr);
    pthread_mutex_unlock(&g_agent_mu);
    return sent(dbr_send_ack(r->req_id, res));
}

/* PATCH and UNPATCH */
static int on_patch(const struct dbr_msg_hdr *h)
{
    const struct dbr_patch_batch *b = (const void *)h;
    struct dbr_patch_result *rep;
    size_t len = sizeof *rep + (size_t)b->n * sizeof rep->results[0];
    int rc;

    rep = dbr_alloc(len);
    if (!rep) {
        dbr_send_error(DBR_E_NOMEM, h->seq, "out of memory");
        return END_ERROR;
    }
    rep->batch_id = b->batch_id;
    rep->n = b->n;
    pthread_mutex_lock(&g_agent_mu);
    if (g_attached)
        dbr_signals_reclaim();
    dbr_patch_batch(b->sites, b->n, h->type == DBR_MSG_UNPATCH, rep->results);
    pthread_mutex_unlock(&g_agent_mu);
    rc = dbr_send(rep, DBR_MSG_PATCH_RESULT, (uint32_t)len, -1, 0);
    dbr_free(rep);
    return sent(rc);
}

static int on_census_req(const struct dbr_msg_hdr *h)
{
    const struct dbr_census_req *r = (const void *)h;

    return sent(dbr_census_run(r->req_id, r->timeout_ms, r->ranges, r->n));
}

/* TRANSFER and EVICT */
static int on_transfer(const struct dbr_msg_hdr *h)
{
    const struct dbr_transfer *t = (const void *)h;
    struct dbr_transfer_result rep;

    memset(&rep, 0, sizeof rep);
    rep.req_id = t->req_id;
    pthread_mutex_lock(&g_agent_mu);
    rep.result = dbr_transfer_run(t->region_id, t->points, t->n, t->timeout_ms,
                                  h->type == DBR_MSG_EVICT, &rep);
    pthread_mutex_unlock(&g_agent_mu);
    return sent(dbr_send(&rep, DBR_MSG_TRANSFER_RESULT, sizeof rep, -1, 0));
}

static int on_sampler_start(const struct dbr_msg_hdr *h)
{
    const struct dbr_sampler_start *r = (const void *)h;
    struct dbr_sampler_ring rep;
    int rc, fd = -1;

    memset(&rep, 0, sizeof rep);
    rep.req_id = r->req_id;
    rep.result = dbr_sampler_start(r->period_us, r->ring_entries, r->flags, &fd, &rep.ring_bytes);
    rc = dbr_send(&rep, DBR_MSG_SAMPLER_RING, sizeof rep, rep.result == DBR_OK ? fd : -1, 0);
    if (fd >= 0)
        close(fd);
    return sent(rc);
}

static int on_sampler_stop(const struct dbr_msg_hdr *h)
{
    const struct dbr_ack *r = (const void *)h;

    return sent(dbr_send_ack(r->req_id, dbr_sampler_stop()));
}

static int on_sampler_thread(const struct dbr_msg_hdr *h)
{
    const struct dbr_sampler_thread *r = (const void *)h;

    return sent(dbr_send_ack(r->req_id, r->on > 1 ? DBR_E_INVAL : dbr_sampler_thread(r->tid, (int)r->on)));
}

static int on_notices(const struct dbr_msg_hdr *h)
{
    const struct dbr_notices *r = (const void *)h;

    if (r->flags & ~(uint32_t)DBR_NOTICE_THREADS)
        return sent(dbr_send_ack(r->req_id, DBR_E_INVAL));
    __atomic_store_n(&g_notices, r->flags, __ATOMIC_SEQ_CST);
    /* threads being started unwrapped now send no THREAD_NEW: the service
     * lists /proc/PID/task after this answer, so it must find them there */
    if (r->flags)
        dbr_wait_unwrapped_starts();
    return sent(dbr_send_ack(r->req_id, DBR_OK));
}

static int on_bye(const struct dbr_msg_hdr *h)
{
    const struct dbr_bye *b = (const void *)h;

    if (b->flags & (DBR_BYE_REVERT | DBR_BYE_DORMANT)) {
        int k = dbr_unpatch_all();
        dbr_log("BYE with revert: %d sites restored", k);
    }
    if (b->flags & DBR_BYE_DORMANT) {
        /* `dbr detach`: no samples, no thread work, no connection until activated */
        dbr_sampler_stop();
        __atomic_store_n(&g_dormant, 1, __ATOMIC_RELEASE);
        dbr_log("BYE dormant: the agent waits for dbr attach");
    }
    return END_BYE;
}

static int on_error(const struct dbr_msg_hdr *h)
{
    const struct dbr_error *e = (const void *)h;
    char text[DBR_ERRMSG_MAX + 1];

    memcpy(text, e->msg, DBR_ERRMSG_MAX);
    text[DBR_ERRMSG_MAX] = 0;
    dbr_log("service reported error %d (seq %u): %s", e->code, e->ref_seq, text);
    return END_ERROR;
}

/* ---------------- the table ---------------- */

/* a message of one size */
#define FIXED(st, when_, fn) \
    { .fixed = sizeof(struct st), .when = (when_), .handle = (fn) }
/* a fixed part with a count `n`, then that many entries */
#define ARRAY(st, ent, max_, text, fn)                                               \
    { .fixed = sizeof(struct st), .count_off = offsetof(struct st, n),              \
      .elem = sizeof(struct ent), .max = (max_), .when = IN_SESSION, .bad_len = (text), \
      .handle = (fn) }

/* indexed by type; types the agent sends, or none, have fixed 0 */
static const struct msg_spec g_specs[DBR_MSG_TYPE_MAX + 1] = {
    [DBR_MSG_HELLO_ACK]        = FIXED(dbr_hello_ack, IN_HANDSHAKE, NULL),
    [DBR_MSG_ACK]              = FIXED(dbr_ack, IN_SESSION, on_ack),
    [DBR_MSG_CODE_BUFFER_REQ]  = FIXED(dbr_code_buffer_req, IN_SESSION, on_code_buffer_req),
    [DBR_MSG_CODE_BUFFER_FREE] = FIXED(dbr_code_buffer_free, IN_SESSION, on_code_buffer_free),
    [DBR_MSG_REGION]           = FIXED(dbr_region, IN_SESSION, on_region),
    [DBR_MSG_REGION_FORGET]    = FIXED(dbr_region_forget, IN_SESSION, on_region_forget),
    [DBR_MSG_PATCH]            = ARRAY(dbr_patch_batch, dbr_patch_site, DBR_MAX_SITES,
                                       "bad PATCH/UNPATCH length", on_patch),
    [DBR_MSG_UNPATCH]          = ARRAY(dbr_patch_batch, dbr_patch_site, DBR_MAX_SITES,
                                       "bad PATCH/UNPATCH length", on_patch),
    [DBR_MSG_PC_CENSUS_REQ]    = ARRAY(dbr_census_req, dbr_range, DBR_MAX_CENSUS_RANGES,
                                       "bad PC_CENSUS_REQ length", on_census_req),
    [DBR_MSG_TRANSFER]         = ARRAY(dbr_transfer, dbr_transfer_point, DBR_MAX_TRANSFER,
                                       "bad TRANSFER/EVICT length", on_transfer),
    [DBR_MSG_EVICT]            = ARRAY(dbr_transfer, dbr_transfer_point, DBR_MAX_TRANSFER,
                                       "bad TRANSFER/EVICT length", on_transfer),
    [DBR_MSG_SAMPLER_START]    = FIXED(dbr_sampler_start, IN_SESSION, on_sampler_start),
    [DBR_MSG_SAMPLER_STOP]     = FIXED(dbr_ack, IN_SESSION, on_sampler_stop),
    [DBR_MSG_SAMPLER_THREAD]   = FIXED(dbr_sampler_thread, IN_SESSION, on_sampler_thread),
    [DBR_MSG_BYE]              = FIXED(dbr_bye, IN_HANDSHAKE | IN_SESSION, on_bye),
    [DBR_MSG_ERROR]            = FIXED(dbr_error, IN_HANDSHAKE | IN_SESSION, on_error),
    [DBR_MSG_NOTICES]          = FIXED(dbr_notices, IN_SESSION, on_notices),
    [DBR_MSG_FRAMES_ADD]       = FIXED(dbr_frames, IN_SESSION, on_frames),
    [DBR_MSG_FRAMES_DEL]       = FIXED(dbr_frames, IN_SESSION, on_frames),
};

static const struct msg_spec *spec_of(uint32_t type)
{
    return type >= 1 && type <= DBR_MSG_TYPE_MAX && g_specs[type].fixed ? &g_specs[type] : NULL;
}

/* ---------------- validation and dispatch ---------------- */

/* Check the datagram of n bytes in g_rx; DBR_OK if acceptable, else sends ERROR
 * and returns the error code.  First failure wins: header, type, state, length. */
int dbr_msg_validate(size_t n, int state)
{
    const struct dbr_msg_hdr *h = (const struct dbr_msg_hdr *)g_rx;
    const struct msg_spec *s;

    if (n < sizeof *h) {
        dbr_send_error(DBR_E_PROTO, 0, "datagram shorter than the header");
        return DBR_E_PROTO;
    }
    if (h->magic != DBR_PROTO_MAGIC) {
        dbr_send_error(DBR_E_PROTO, h->seq, "bad magic");
        return DBR_E_PROTO;
    }
    if (h->version != DBR_PROTO_VERSION) {
        dbr_send_error(DBR_E_VERSION, h->seq, "protocol version mismatch");
        return DBR_E_VERSION;
    }
    if (h->length != n) {
        dbr_send_error(DBR_E_PROTO, h->seq, "length field differs from datagram size");
        return DBR_E_PROTO;
    }
    s = spec_of(h->type);
    if (!s) {
        dbr_send_error(DBR_E_PROTO, h->seq, "unknown or agent-only message type");
        return DBR_E_PROTO;
    }
    if (state == ST_HANDSHAKE && !(s->when & IN_HANDSHAKE)) {
        dbr_send_error(DBR_E_PROTO, h->seq, "message before HELLO_ACK");
        return DBR_E_PROTO;
    }
    if (state == ST_SESSION && !(s->when & IN_SESSION)) {   /* HELLO_ACK only */
        dbr_send_error(DBR_E_PROTO, h->seq, "duplicate HELLO_ACK");
        return DBR_E_PROTO;
    }
    if (s->elem) {
        uint32_t count;

        memcpy(&count, g_rx + s->count_off, sizeof count);
        if (n < s->fixed || count > s->max || n != s->fixed + (size_t)count * s->elem) {
            dbr_send_error(DBR_E_PROTO, h->seq, s->bad_len ? s->bad_len : BAD_LENGTH);
            return DBR_E_PROTO;
        }
        return DBR_OK;
    }
    if (n != s->fixed) {
        dbr_send_error(DBR_E_PROTO, h->seq, s->bad_len ? s->bad_len : BAD_LENGTH);
        return DBR_E_PROTO;
    }
    return DBR_OK;
}

/* Handle the validated datagram in g_rx: END_NONE, or how the session ends. */
int dbr_msg_handle(void)
{
    const struct dbr_msg_hdr *h = (const struct dbr_msg_hdr *)g_rx;
    const struct msg_spec *s = spec_of(h->type);

    return s && s->handle ? s->handle(h) : END_ERROR;   /* validation admits nothing else */
}
