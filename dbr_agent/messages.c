/*
 * messages.c — what the service may send the agent: the check of every
 * received datagram (header, type, state, length) and the handlers, which run
 * on the agent thread with the datagram in g_rx and send its one reply.
 */
#include <string.h>
#include <unistd.h>

#include "session.h"

/* ---------------- validation ---------------- */

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

/* Check one received datagram; 0 if acceptable, else sends ERROR and
 * returns the error code. */
int dbr_msg_validate(size_t n, int state)
{
    const struct dbr_msg_hdr *h = (const struct dbr_msg_hdr *)g_rx;
    uint32_t fixed;

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
    fixed = h->type >= 1 && h->type <= DBR_MSG_TYPE_MAX ? fixed_size(h->type) : 0;
    if (fixed == 0) {
        dbr_send_error(DBR_E_PROTO, h->seq, "unknown or agent-only message type");
        return DBR_E_PROTO;
    }
    if (state == ST_HANDSHAKE && h->type != DBR_MSG_HELLO_ACK && h->type != DBR_MSG_BYE &&
        h->type != DBR_MSG_ERROR) {
        dbr_send_error(DBR_E_PROTO, h->seq, "message before HELLO_ACK");
        return DBR_E_PROTO;
    }
    if (state == ST_SESSION && h->type == DBR_MSG_HELLO_ACK) {
        dbr_send_error(DBR_E_PROTO, h->seq, "duplicate HELLO_ACK");
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
            dbr_send_error(DBR_E_PROTO, h->seq, xfer ? "bad TRANSFER/EVICT length" : "bad PATCH/UNPATCH length");
            return DBR_E_PROTO;
        }
        return DBR_OK;
    }
    if (h->type == DBR_MSG_PC_CENSUS_REQ) {
        /* fixed part, then n ranges */
        uint32_t count = ((const struct dbr_census_req *)g_rx)->n;

        if (n < fixed || count > DBR_MAX_CENSUS_RANGES ||
            n != fixed + (size_t)count * sizeof(struct dbr_range)) {
            dbr_send_error(DBR_E_PROTO, h->seq, "bad PC_CENSUS_REQ length");
            return DBR_E_PROTO;
        }
        return DBR_OK;
    }
    if (n != fixed) {
        dbr_send_error(DBR_E_PROTO, h->seq, "bad message length for its type");
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

int dbr_msg_handle(void)
{
    const struct dbr_msg_hdr *h = (const struct dbr_msg_hdr *)g_rx;
    int rc = DBR_OK, fd = -1;

    switch (h->type) {
    case DBR_MSG_ACK: {
        const struct dbr_ack *a = (const void *)g_rx;
        dbr_map_ack_deliver(a->req_id, a->result);
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
        rc = dbr_send_ack(r->req_id, res);
        break;
    }
    case DBR_MSG_REGION: {
        const struct dbr_region *r = (const void *)g_rx;
        int res;

        pthread_mutex_lock(&g_agent_mu);
        res = dbr_region_set(r);
        pthread_mutex_unlock(&g_agent_mu);
        rc = dbr_send_ack(r->req_id, res);
        break;
    }
    case DBR_MSG_REGION_FORGET: {
        const struct dbr_region_forget *r = (const void *)g_rx;
        int res;

        pthread_mutex_lock(&g_agent_mu);
        res = dbr_region_forget(r->region_id);
        pthread_mutex_unlock(&g_agent_mu);
        rc = dbr_send_ack(r->req_id, res);
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
        rc = dbr_send_ack(r->req_id, res);
        break;
    }
    case DBR_MSG_PATCH:
    case DBR_MSG_UNPATCH: {
        const struct dbr_patch_batch *b = (const void *)g_rx;
        struct dbr_patch_result *rep;
        size_t len = sizeof *rep + (size_t)b->n * sizeof rep->results[0];

        rep = dbr_alloc(len);
        if (!rep) {
            dbr_send_error(DBR_E_NOMEM, h->seq, "out of memory");
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
        rc = dbr_send_ack(r->req_id, dbr_sampler_stop());
        break;
    }
    case DBR_MSG_SAMPLER_THREAD: {
        const struct dbr_sampler_thread *r = (const void *)g_rx;
        rc = dbr_send_ack(r->req_id, r->on > 1 ? DBR_E_INVAL : dbr_sampler_thread(r->tid, (int)r->on));
        break;
    }
    case DBR_MSG_NOTICES: {
        const struct dbr_notices *r = (const void *)g_rx;

        if (r->flags & ~(uint32_t)DBR_NOTICE_THREADS) {
            rc = dbr_send_ack(r->req_id, DBR_E_INVAL);
            break;
        }
        __atomic_store_n(&g_notices, r->flags, __ATOMIC_SEQ_CST);
        /* threads being started unwrapped now send no THREAD_NEW: the service
         * lists /proc/PID/task after this answer, so it must find them there */
        if (r->flags)
            dbr_wait_unwrapped_starts();
        rc = dbr_send_ack(r->req_id, DBR_OK);
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
        return END_ERROR; /* dbr_msg_validate() admits nothing else */
    }
    if (rc != DBR_OK) {
        dbr_log("send failed (%d): ending session", rc);
        return END_ERROR;
    }
    return END_NONE;
}
