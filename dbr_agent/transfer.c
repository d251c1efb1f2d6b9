/*
 * transfer.c — TRANSFER: threads stopped at a listed original PC continue in
 * replacement code; and EVICT, the other way: threads stopped at a listed
 * replacement PC continue in original code.  Each running thread is sent the
 * census signal with a generation in its value; the handler (census.c) passes it
 * here, and a thread at a point has the PC in its signal frame rewritten.
 */
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include "census.h"

#define TRANSFER_SETTLE_MS 500u

/* a TRANSFER's or an EVICT's answer slot (the census has its own, struct cslot) */
struct slot {
    int32_t  tid;
    uint32_t done_gen;  /* == the generation pc answers */
    uint64_t pc;
};

/* Signal handler: the calling thread's answer `value` for generation `gen`. */
static void slot_answer(struct slot *slots, unsigned n, uint32_t gen, uint64_t value)
{
    pid_t tid = dbr_gettid();
    unsigned i;

    for (i = 0; i < n; i++) {
        if (slots[i].tid != tid)
            continue;
        __atomic_store_n(&slots[i].pc, value, __ATOMIC_RELAXED);
        __atomic_store_n(&slots[i].done_gen, gen, __ATOMIC_RELEASE);
        break;
    }
}

/* Agent thread: one slot per listed thread, none answered. */
static void slots_reset(struct slot *slots, const pid_t *tids, int n)
{
    int i;

    for (i = 0; i < n; i++) {
        slots[i].tid = tids[i];
        slots[i].pc = 0;
        __atomic_store_n(&slots[i].done_gen, 0, __ATOMIC_RELAXED);
    }
}

static void wait_answers(const struct slot *slots, const uint8_t *state, int n, uint32_t gen,
                         uint32_t timeout_ms)
{
    dbr_wait_answers_at(slots, sizeof *slots, offsetof(struct slot, done_gen), state, n, gen,
                        timeout_ms);
}

/* ---- TRANSFER and EVICT state ----
 * The table is written by the agent thread only while no handler can read it:
 * g_tp_gen is 0 (no transfer open) and g_tp_active is 0 (no handler between its
 * generation check and its last read).  A handler counts itself active, then
 * compares the generation its signal carries with g_tp_gen; a late delivery of
 * an earlier transfer sees a different generation and touches nothing.  The
 * table is kept as (from, to) pairs sorted by from: (orig, repl) for a TRANSFER,
 * (repl, orig) for an EVICT. */
struct move {
    uint64_t from, to;
};
static struct move g_tp[DBR_MAX_TRANSFER];
static uint32_t g_tp_n;
static uint64_t g_tp_lo, g_tp_hi;  /* EVICT: the region's code; else empty */
static uint32_t g_tp_gen;       /* generation of the open transfer, 0: none */
static uint32_t g_tp_counter;   /* last generation used */
static int g_tp_active;         /* handlers inside the critical part */
static struct slot g_tslots[DBR_CENSUS_SLOTS];   /* pc: a MOVE_* answer */
static unsigned g_tn;

#define MOVE_NONE 0u   /* not at a point, not in the evicted region */
#define MOVE_DONE 1u   /* moved */
#define MOVE_LEFT 2u   /* inside the evicted region's code, at no point */

void dbr_transfer_handler(ucontext_t *uc, uint32_t gen)
{
    unsigned lo, hi;
    uint64_t pc, answer = MOVE_NONE;

    __atomic_add_fetch(&g_tp_active, 1, __ATOMIC_SEQ_CST);
    if (gen != 0 && gen == __atomic_load_n(&g_tp_gen, __ATOMIC_SEQ_CST)) {
        pc = (uint64_t)uc->uc_mcontext.gregs[REG_RIP];
        lo = 0;
        hi = g_tp_n;
        while (lo < hi) {           /* binary search: g_tp is sorted by from */
            unsigned mid = lo + (hi - lo) / 2;
            if (g_tp[mid].from < pc)
                lo = mid + 1;
            else
                hi = mid;
        }
        if (lo < g_tp_n && g_tp[lo].from == pc) {
            uc->uc_mcontext.gregs[REG_RIP] = (greg_t)g_tp[lo].to;
            answer = MOVE_DONE;
        } else if (pc >= g_tp_lo && pc < g_tp_hi) {
            answer = MOVE_LEFT;
        }
        slot_answer(g_tslots, g_tn, gen, answer);
    }
    __atomic_sub_fetch(&g_tp_active, 1, __ATOMIC_SEQ_CST);
}

void dbr_transfer_fork_child(void)
{
    /* A handler counted in g_tp_active belonged to a thread the child does not have:
     * left as it was, every transfer in the child would wait for it and say BUSY. */
    __atomic_store_n(&g_tp_gen, 0, __ATOMIC_SEQ_CST);
    __atomic_store_n(&g_tp_active, 0, __ATOMIC_SEQ_CST);
    g_tn = 0;
    /* the same for a census the parent's agent thread had open */
    dbr_census_fork_child();
}

static int wait_handlers_idle(unsigned ms)
{
    return dbr_wait_idle(&g_tp_active, ms);
}

/* The checks of a TRANSFER or an EVICT (see dbr_protocol.h); g_agent_mu held.
 * The region's code range in *lo, *hi. */
static int transfer_check(uint32_t region_id, const struct dbr_transfer_point *p, uint32_t n,
                          int evict, uint64_t *lo, uint64_t *hi)
{
    struct dbr_maps maps;
    uint32_t i;
    int rc = DBR_OK;

    if (dbr_region_code(region_id, lo, hi) != DBR_OK)
        return DBR_E_UNKNOWN;
    if (n == 0 || n > DBR_MAX_TRANSFER)
        return DBR_E_INVAL;
    for (i = 1; i < n; i++)
        if (evict ? p[i].repl <= p[i - 1].repl : p[i].orig <= p[i - 1].orig)
            return DBR_E_INVAL;
    for (i = 0; i < n; i++)
        if (p[i].repl < *lo || p[i].repl >= *hi || !dbr_buffer_containing(p[i].repl, 1))
            return DBR_E_TARGET;
    if (dbr_maps_read(&maps) != DBR_OK)
        return DBR_E_NOMEM;
    for (i = 0; i < n && rc == DBR_OK; i++) {
        const struct dbr_map_ent *m = dbr_maps_find(&maps, p[i].orig);

        if (!m || !(m->prot & PROT_EXEC))
            rc = DBR_E_NOT_EXEC;
        else if (m->special || (p[i].orig >= g_agent_lo && p[i].orig < g_agent_hi) ||
                 dbr_buffers_intersect(p[i].orig, p[i].orig + 1) ||
                 (evict && dbr_inside_installed_site(p[i].orig)))
            rc = DBR_E_FORBIDDEN;
    }
    dbr_maps_free(&maps);
    return rc;
}

int dbr_transfer_run(uint32_t region_id, const struct dbr_transfer_point *p, uint32_t n,
                     uint32_t timeout_ms, int evict, struct dbr_transfer_result *res)
{
    pid_t *tids = NULL;
    uint8_t *waiting = NULL;
    int nt, i, rc;
    uint32_t gen, k;
    uint64_t lo, hi;

    rc = transfer_check(region_id, p, n, evict, &lo, &hi);
    if (rc != DBR_OK)
        return rc;
    /* a handler of an earlier transfer that passed its check may still read g_tp */
    if (wait_handlers_idle(TRANSFER_SETTLE_MS) != DBR_OK)
        return DBR_E_BUSY;
    tids = dbr_alloc(DBR_CENSUS_SLOTS * sizeof *tids);
    waiting = dbr_alloc(DBR_CENSUS_SLOTS);
    if (!tids || !waiting) {
        dbr_free(tids);
        dbr_free(waiting);
        return DBR_E_NOMEM;
    }
    for (k = 0; k < n; k++) {
        g_tp[k].from = evict ? p[k].repl : p[k].orig;
        g_tp[k].to = evict ? p[k].orig : p[k].repl;
    }
    g_tp_n = n;
    g_tp_lo = evict ? lo : 0;
    g_tp_hi = evict ? hi : 0;
    nt = dbr_list_threads(tids, DBR_CENSUS_SLOTS);
    if (nt < 0) {               /* threads unknown: no transfer rather than one that misses some */
        g_tp_n = 0;
        dbr_free(tids);
        dbr_free(waiting);
        return DBR_E_BUSY;
    }
    if (nt > (int)DBR_CENSUS_SLOTS)
        nt = DBR_CENSUS_SLOTS;
    slots_reset(g_tslots, tids, nt);
    g_tn = (unsigned)nt;
    gen = ++g_tp_counter;
    if (gen == 0)
        gen = ++g_tp_counter;
    __atomic_store_n(&g_tp_gen, gen, __ATOMIC_SEQ_CST);    /* open: handlers may read */

    for (i = 0; i < nt; i++) {
        if (tids[i] == g_agent_tid || tids[i] == dbr_gettid())
            continue;
        /* Only running threads can be in the middle of a loop; a sleeping one sits
         * in a system call, and the signal would cut short an unrestartable sleep
         * (nanosleep, epoll_wait) for nothing. */
        if (dbr_thread_state(tids[i]) != 'R')
            continue;
        if (dbr_queue_signal_value(tids[i], ((uint64_t)TRANSFER_MAGIC << 32) | gen) == 0) {
            waiting[i] = WAITING;
            res->threads++;
        }
    }
    wait_answers(g_tslots, waiting, nt, gen, timeout_ms);
    __atomic_store_n(&g_tp_gen, 0, __ATOMIC_SEQ_CST);      /* closed: late signals do nothing */
    /* handlers that passed the check finish before the table is reused (next call) */
    (void)wait_handlers_idle(TRANSFER_SETTLE_MS);
    for (i = 0; i < nt; i++) {
        if (waiting[i] != WAITING)
            continue;
        if (__atomic_load_n(&g_tslots[i].done_gen, __ATOMIC_ACQUIRE) == gen) {
            uint64_t a = __atomic_load_n(&g_tslots[i].pc, __ATOMIC_RELAXED);

            res->moved += a == MOVE_DONE;
            res->left += a == MOVE_LEFT;
        } else
            res->no_reply++;
    }
    dbr_free(tids);
    dbr_free(waiting);
    return DBR_OK;
}
