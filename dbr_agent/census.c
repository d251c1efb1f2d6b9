/*
 * census.c — PC census: every thread reports its interrupted PC; TRANSFER:
 * threads stopped at a listed original PC continue in replacement code; and
 * EVICT, the other way: threads stopped at a listed replacement PC continue in
 * original code.
 *
 * The agent thread queues the census signal to each thread with
 * rt_tgsigqueueinfo (the tgkill of a signal with a payload): si_code SI_QUEUE,
 * si_pid our pid and a cookie in si_value mark it as the agent's, so the
 * handler can chain any other delivery of that signal to the program.  The
 * handler writes the PC into the slot keyed by its tid with atomic stores only.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <ucontext.h>
#include <unistd.h>

#include "agent.h"

#define CENSUS_COOKIE  0x0DBC3A5
/* TRANSFER signals carry (TRANSFER_MAGIC << 32) | generation in si_value */
#define TRANSFER_MAGIC 0x7AF5u
#define TRANSFER_SETTLE_MS 500u
/* bound on waiting for the threads' answers (census and transfer alike) */
#define CENSUS_WAIT_MAX_MS 1000u
#define CENSUS_WAIT_DEFAULT_MS 200u
#define WAITING 0xffu   /* state of a signalled thread whose answer is awaited */

struct slot {
    int32_t  tid;
    uint32_t done_gen;  /* == g_gen when pc is valid for this census */
    uint64_t pc;
};

static struct slot g_slots[DBR_CENSUS_SLOTS];
static unsigned g_nslots;
static uint32_t g_gen;

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

/* Agent thread: wait (bounded: 0 means the default, capped) until every slot whose
 * state is WAITING has answered generation `gen`. */
static void wait_answers(const struct slot *slots, const uint8_t *state, int n, uint32_t gen,
                         uint32_t timeout_ms)
{
    uint64_t deadline;
    int i, pending;

    if (timeout_ms == 0)
        timeout_ms = CENSUS_WAIT_DEFAULT_MS;
    if (timeout_ms > CENSUS_WAIT_MAX_MS)
        timeout_ms = CENSUS_WAIT_MAX_MS;
    deadline = dbr_now_ms() + timeout_ms;
    for (;;) {
        pending = 0;
        for (i = 0; i < n; i++)
            if (state[i] == WAITING && __atomic_load_n(&slots[i].done_gen, __ATOMIC_ACQUIRE) != gen)
                pending++;
        if (pending == 0 || dbr_now_ms() >= deadline)
            return;
        dbr_sleep_ms(1);
    }
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

static void transfer_handler(ucontext_t *uc, uint32_t gen)
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

static void census_handler(int sig, siginfo_t *si, void *ucv)
{
    ucontext_t *uc = ucv;
    uint64_t cookie = (uint64_t)(uintptr_t)si->si_value.sival_ptr;

    if (si->si_code == SI_TIMER && cookie == DBR_BIRTH_COOKIE) {   /* agent.c, birth_arm */
        dbr_agent_birth_signal();
        return;
    }
    if (si->si_code != SI_QUEUE || si->si_pid != getpid() ||
        (cookie != CENSUS_COOKIE && (cookie >> 32) != TRANSFER_MAGIC)) {
        dbr_signal_chain(sig, si, ucv);
        return;
    }
    if ((cookie >> 32) == TRANSFER_MAGIC) {
        transfer_handler(uc, (uint32_t)cookie);
        return;
    }
    slot_answer(g_slots, __atomic_load_n(&g_nslots, __ATOMIC_ACQUIRE),
                __atomic_load_n(&g_gen, __ATOMIC_ACQUIRE), (uint64_t)uc->uc_mcontext.gregs[REG_RIP]);
}

void dbr_census_init(void)
{
    dbr_signal_install(g_cfg.census_sig, census_handler, SA_SIGINFO | SA_RESTART | SA_ONSTACK);
}

static int queue_signal_value(pid_t tid, uint64_t value)
{
    siginfo_t si;

    memset(&si, 0, sizeof si);
    si.si_signo = g_cfg.census_sig;
    si.si_code = SI_QUEUE;
    si.si_pid = getpid();
    si.si_uid = getuid();
    si.si_value.sival_ptr = (void *)(uintptr_t)value;
    return (int)syscall(SYS_rt_tgsigqueueinfo, getpid(), tid, g_cfg.census_sig, &si);
}

static int queue_signal(pid_t tid)
{
    return queue_signal_value(tid, CENSUS_COOKIE);
}

int dbr_census_run(uint32_t req_id, uint32_t timeout_ms)
{
    pid_t *tids = NULL;
    uint8_t *state = NULL;
    struct dbr_census *msg = NULL;
    int n, i, rc = DBR_OK;
    unsigned nslots;
    uint32_t gen, k, sent;

    tids = dbr_alloc(DBR_CENSUS_SLOTS * sizeof *tids);
    state = dbr_alloc(DBR_CENSUS_SLOTS);
    msg = dbr_alloc(sizeof *msg + DBR_MAX_CENSUS * sizeof msg->entries[0]);
    if (!tids || !state || !msg) {
        rc = DBR_E_NOMEM;
        goto out;
    }
    n = dbr_list_threads(tids, DBR_CENSUS_SLOTS);
    if (n > (int)DBR_CENSUS_SLOTS)
        n = DBR_CENSUS_SLOTS;   /* the rest cannot be reported */
    nslots = (unsigned)n;
    __atomic_store_n(&g_nslots, 0, __ATOMIC_RELEASE);
    slots_reset(g_slots, tids, n);
    gen = __atomic_add_fetch(&g_gen, 1, __ATOMIC_RELEASE);
    if (gen == 0)
        gen = __atomic_add_fetch(&g_gen, 1, __ATOMIC_RELEASE);
    __atomic_store_n(&g_nslots, nslots, __ATOMIC_RELEASE);

    for (i = 0; i < n; i++) {
        if (tids[i] == g_agent_tid || tids[i] == dbr_gettid())
            state[i] = DBR_CENSUS_AGENT;
        else if (queue_signal(tids[i]) < 0)
            state[i] = errno == ESRCH ? DBR_CENSUS_GONE : DBR_CENSUS_NO_REPLY;
        else
            state[i] = WAITING;
    }
    wait_answers(g_slots, state, n, gen, timeout_ms);

    /* reply: ceil(n / DBR_MAX_CENSUS) messages (one with n = 0 if no thread) */
    sent = 0;
    do {
        uint32_t m = (uint32_t)n - sent > DBR_MAX_CENSUS ? DBR_MAX_CENSUS : (uint32_t)n - sent;

        msg->req_id = req_id;
        msg->n = m;
        msg->n_total = (uint32_t)n;
        msg->flags = sent + m < (uint32_t)n ? DBR_CENSUS_MORE : 0;
        for (k = 0; k < m; k++) {
            struct dbr_census_entry *e = &msg->entries[k];
            unsigned s = sent + k;

            e->tid = (uint32_t)tids[s];
            e->pc = 0;
            if (state[s] != WAITING) {
                e->state = state[s];
            } else if (__atomic_load_n(&g_slots[s].done_gen, __ATOMIC_ACQUIRE) == gen) {
                e->state = DBR_CENSUS_OK;
                e->pc = __atomic_load_n(&g_slots[s].pc, __ATOMIC_RELAXED);
            } else if (syscall(SYS_tgkill, getpid(), tids[s], 0) < 0 && errno == ESRCH) {
                e->state = DBR_CENSUS_GONE;     /* exited before answering */
            } else {
                e->state = DBR_CENSUS_NO_REPLY;
            }
        }
        rc = dbr_send(msg, DBR_MSG_PC_CENSUS, (uint32_t)(sizeof *msg + m * sizeof msg->entries[0]), -1, 0);
        sent += m;
    } while (rc == DBR_OK && sent < (uint32_t)n);
out:
    dbr_free(tids);
    dbr_free(state);
    dbr_free(msg);
    return rc;
}

void dbr_transfer_fork_child(void)
{
    /* A handler counted in g_tp_active belonged to a thread the child does not have:
     * left as it was, every transfer in the child would wait for it and say BUSY. */
    __atomic_store_n(&g_tp_gen, 0, __ATOMIC_SEQ_CST);
    __atomic_store_n(&g_tp_active, 0, __ATOMIC_SEQ_CST);
    g_tn = 0;
}

static int wait_handlers_idle(unsigned ms)
{
    uint64_t deadline = dbr_now_ms() + ms;

    while (__atomic_load_n(&g_tp_active, __ATOMIC_SEQ_CST) != 0) {
        if (dbr_now_ms() >= deadline)
            return DBR_E_BUSY;
        dbr_sleep_ms(1);
    }
    return DBR_OK;
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
        if (queue_signal_value(tids[i], ((uint64_t)TRANSFER_MAGIC << 32) | gen) == 0) {
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
