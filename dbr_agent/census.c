/*
 * census.c — PC census: every thread reports its interrupted PC and the words of
 * its registers and stack that lie in ranges the service names; and the census
 * signal's handler, which also serves TRANSFER and EVICT (transfer.c).
 *
 * The agent thread queues the census signal to each thread with
 * rt_tgsigqueueinfo (the tgkill of a signal with a payload): si_code SI_QUEUE,
 * si_pid our pid and a cookie in si_value mark it as the agent's, so the
 * handler can chain any other delivery of that signal to the program.  The
 * handler writes its answer into the slot keyed by its tid with atomic stores
 * only; it never allocates, locks or makes a system call beyond getpid/gettid.
 *
 * Stack scan (a census with ranges).  Replacement code may make real calls, so a
 * return address into code space the service wants to reuse can sit in any frame
 * of any thread.  Before signalling, the agent thread reads /proc/self/maps into
 * a table of candidate stacks: the private writable anonymous mappings (thread
 * stacks, [stack], the heap), adjacent ones joined.  Each handler finds the span
 * holding its interrupted stack pointer (binary search) and reads every aligned
 * word from there to the span's end; a glibc thread's stack ends below its
 * thread control block, which glibc puts at the top of the thread's stack block,
 * so the scan stops at the thread pointer when that lies above the stack pointer
 * in the same span (its first word points to itself, as the x86-64 ABI says).
 * The thread's own stack cannot be unmapped while the thread runs the handler;
 * what lies past it in a span (a stack that is not a glibc thread's: a coroutine
 * in the heap) is memory the snapshot showed mapped: the risk that it is unmapped
 * meanwhile is accepted.  An interrupted context on the thread's sigaltstack
 * (bounds from the signal frame) has that stack scanned and is UNKNOWN: its
 * normal stack cannot be found.  A stack pointer in no span gets a second round
 * with maps read again, then UNKNOWN.  A scan stops at SCAN_CAP (UNKNOWN).
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <ucontext.h>
#include <unistd.h>

#include "census.h"

#define CENSUS_COOKIE  0x0DBC3A5
/* bound on waiting for the threads' answers (census and transfer alike) */
#define CENSUS_WAIT_MAX_MS 1000u
#define CENSUS_WAIT_DEFAULT_MS 200u
/* after a census closes: bound on waiting for handlers still scanning, before its
 * stack table is freed (else it is left allocated: a late handler may read it) */
#define CENSUS_SETTLE_MS 200u
#define SCAN_CAP ((uint64_t)8 << 20)   /* bytes of one stack scanned at most */
/* ranges one census looks for: a request's (DBR_MAX_CENSUS_RANGES), or the entry
 * sites of one PATCH batch (DBR_MAX_SITES, dbr_census_inside) */
#define CS_RANGES_MAX (DBR_MAX_SITES > DBR_MAX_CENSUS_RANGES ? DBR_MAX_SITES : DBR_MAX_CENSUS_RANGES)

/* Agent thread: wait (bounded: 0 means the default, capped) until every slot whose
 * state is WAITING has answered generation `gen`.  `stride`: bytes between slots,
 * `gen_off`: offset of done_gen in a slot (the census and transfers have their own). */
void dbr_wait_answers_at(const void *slots, size_t stride, size_t gen_off, const uint8_t *state,
                         int n, uint32_t gen, uint32_t timeout_ms)
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
        for (i = 0; i < n; i++) {
            const uint32_t *g = (const uint32_t *)((const char *)slots + (size_t)i * stride + gen_off);
            if (state[i] == WAITING && __atomic_load_n(g, __ATOMIC_ACQUIRE) != gen)
                pending++;
        }
        if (pending == 0 || dbr_now_ms() >= deadline)
            return;
        dbr_sleep_ms(1);
    }
}

/* ---- census state ----
 * Written by the agent thread only while no handler reads it: g_cs_gen is 0 (no
 * census open) and g_cs_active is 0 (no handler between its generation check and
 * its last read).  A handler that finds no census open answers nothing.  The stack
 * table is allocated per census and freed once the census is closed and no handler
 * is inside; if one still is after CENSUS_SETTLE_MS, the table is left allocated. */
struct cslot {
    int32_t  tid;
    uint32_t done_gen;  /* == the generation the answer is for */
    uint64_t pc;
    uint64_t first;     /* first word found in a range */
    uint32_t refs;      /* words found in ranges (saturating) */
    uint32_t flags;     /* DBR_CENSUS_F_* */
};

struct span {
    uint64_t lo, hi;
};

/* Candidate stacks, ascending; a handler loads the pointer once, so it sees one
 * whole table (or none) however late it runs. */
struct stack_table {
    size_t n;
    struct span e[];
};

static struct cslot g_cslots[DBR_CENSUS_SLOTS];
static unsigned g_ncslots;
static uint32_t g_cs_gen;          /* generation of the open census, 0: none */
static uint32_t g_cs_counter;      /* last generation used */
static int g_cs_active;            /* handlers inside the critical part */
static struct dbr_range g_cs_ranges[CS_RANGES_MAX];
static uint32_t g_cs_nranges;
static uint32_t g_cs_refs[CS_RANGES_MAX];  /* words found per range (atomic) */
static uint64_t g_cs_words;        /* words read by this census's handlers (atomic) */
static struct stack_table *g_cs_table;  /* this census's candidate stacks, or NULL */

/* Handler: add one, saturating at UINT32_MAX. */
static void sat_inc(uint32_t *p)
{
    uint32_t v = __atomic_load_n(p, __ATOMIC_RELAXED);

    while (v != UINT32_MAX &&
           !__atomic_compare_exchange_n(p, &v, v + 1, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED))
        ;
}

struct scan {
    const struct dbr_range *r;
    uint32_t n;
    uint64_t lo, span;     /* r[0].lo, r[n-1].hi - r[0].lo: one compare rejects most words */
    uint64_t first;
    uint32_t refs;
};

/* Handler: count `v` if it lies in a range; 1 if it does. */
static int scan_word(struct scan *s, uint64_t v)
{
    uint32_t lo = 0, hi = s->n;

    if (v - s->lo >= s->span)
        return 0;
    while (lo < hi) {              /* binary search: ranges ascending, disjoint */
        uint32_t mid = lo + (hi - lo) / 2;
        if (v < s->r[mid].lo)
            hi = mid;
        else if (v >= s->r[mid].hi)
            lo = mid + 1;
        else {
            if (s->refs == 0)
                s->first = v;
            if (s->refs != UINT32_MAX)
                s->refs++;
            sat_inc(&g_cs_refs[mid]);
            return 1;
        }
    }
    return 0;
}

/* Handler: every aligned word of [lo, hi). */
static void scan_words(struct scan *s, uint64_t lo, uint64_t hi)
{
    const uint64_t *p = (const uint64_t *)(uintptr_t)lo, *end = (const uint64_t *)(uintptr_t)hi;

    for (; p < end; p++) {
        uint64_t v = *(const volatile uint64_t *)p;
        if (v - s->lo < s->span)
            scan_word(s, v);
    }
    __atomic_add_fetch(&g_cs_words, (hi - lo) / 8, __ATOMIC_RELAXED);
}

/* Handler: the span of the stack table holding `a`, or NULL. */
static const struct span *span_of(const struct stack_table *t, uint64_t a)
{
    size_t lo = 0, hi = t ? t->n : 0;

    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (a < t->e[mid].lo)
            hi = mid;
        else if (a >= t->e[mid].hi)
            lo = mid + 1;
        else
            return &t->e[mid];
    }
    return NULL;
}

/* Handler: the thread pointer, %fs:0 (the x86-64 ABI keeps it there). */
static uint64_t thread_pointer(void)
{
    uint64_t tp;

    __asm__ volatile("movq %%fs:0, %0" : "=r"(tp));
    return tp;
}

/* Handler: scan the interrupted registers and stack of the calling thread for words
 * in the first `nr` ranges. */
static void census_scan(const ucontext_t *uc, uint32_t nr, struct cslot *out)
{
    static const int regs[] = { REG_RAX, REG_RBX, REG_RCX, REG_RDX, REG_RSI, REG_RDI, REG_RBP,
                                REG_R8, REG_R9, REG_R10, REG_R11, REG_R12, REG_R13, REG_R14,
                                REG_R15 };
    struct scan s;
    uint64_t sp = (uint64_t)uc->uc_mcontext.gregs[REG_RSP] & ~(uint64_t)7, end;
    uint64_t alt_lo = (uint64_t)(uintptr_t)uc->uc_stack.ss_sp;
    uint64_t alt_hi = alt_lo + (uint64_t)uc->uc_stack.ss_size;
    const struct span *m;
    unsigned i;

    if (uc->uc_stack.ss_size && !(uc->uc_stack.ss_flags & SS_DISABLE) &&
        sp >= alt_lo && sp < alt_hi) {
        /* on the alternate signal stack: the kernel's bounds, not the snapshot's */
        end = alt_hi;
        out->flags |= DBR_CENSUS_F_ALTSTACK;
    } else if ((m = span_of(__atomic_load_n(&g_cs_table, __ATOMIC_ACQUIRE), sp)) != NULL) {
        uint64_t tp = thread_pointer();

        end = m->hi;
        if (tp > sp && tp < end && (tp & 7) == 0 && *(const volatile uint64_t *)(uintptr_t)tp == tp)
            end = tp;
    } else {
        /* nothing counted: the agent asks again with maps read again */
        out->flags |= DBR_CENSUS_F_NOSTACK;
        return;
    }
    if (end - sp > SCAN_CAP) {
        end = sp + SCAN_CAP;
        out->flags |= DBR_CENSUS_F_CAPPED;
    }
    s.r = g_cs_ranges;
    s.n = nr;
    s.lo = s.r[0].lo;
    s.span = s.r[s.n - 1].hi - s.r[0].lo;
    s.first = 0;
    s.refs = 0;
    for (i = 0; i < sizeof regs / sizeof regs[0]; i++)
        if (scan_word(&s, (uint64_t)uc->uc_mcontext.gregs[regs[i]]))
            out->flags |= DBR_CENSUS_F_REG;
    scan_words(&s, sp, end);
    out->first = s.first;
    out->refs = s.refs;
}

/* Handler: the census answer of the calling thread, if a census is open. */
static void census_answer(const ucontext_t *uc)
{
    pid_t tid;
    uint32_t gen, nr;
    unsigned i, n;

    __atomic_add_fetch(&g_cs_active, 1, __ATOMIC_SEQ_CST);
    gen = __atomic_load_n(&g_cs_gen, __ATOMIC_SEQ_CST);
    if (gen != 0) {
        tid = dbr_gettid();
        n = __atomic_load_n(&g_ncslots, __ATOMIC_ACQUIRE);
        for (i = 0; i < n; i++) {
            struct cslot *c = &g_cslots[i];
            struct cslot a;

            if (c->tid != tid)
                continue;
            a.pc = (uint64_t)uc->uc_mcontext.gregs[REG_RIP];
            a.first = 0;
            a.refs = 0;
            a.flags = 0;
            nr = __atomic_load_n(&g_cs_nranges, __ATOMIC_RELAXED);
            if (nr > 0 && nr <= CS_RANGES_MAX)
                census_scan(uc, nr, &a);
            __atomic_store_n(&c->pc, a.pc, __ATOMIC_RELAXED);
            __atomic_store_n(&c->first, a.first, __ATOMIC_RELAXED);
            __atomic_store_n(&c->refs, a.refs, __ATOMIC_RELAXED);
            __atomic_store_n(&c->flags, a.flags, __ATOMIC_RELAXED);
            __atomic_store_n(&c->done_gen, gen, __ATOMIC_RELEASE);
            break;
        }
    }
    __atomic_sub_fetch(&g_cs_active, 1, __ATOMIC_SEQ_CST);
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
        dbr_transfer_handler(uc, (uint32_t)cookie);
        return;
    }
    census_answer(uc);
}

void dbr_census_init(void)
{
    dbr_signal_install(g_cfg.census_sig, census_handler, SA_SIGINFO | SA_RESTART | SA_ONSTACK, NULL);
}

int dbr_queue_signal_value(pid_t tid, uint64_t value)
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
    return dbr_queue_signal_value(tid, CENSUS_COOKIE);
}

static uint64_t now_us(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

/* Agent thread: wait (bounded) until no handler counts itself in *active. */
int dbr_wait_idle(int *active, unsigned ms)
{
    uint64_t deadline = dbr_now_ms() + ms;

    while (__atomic_load_n(active, __ATOMIC_SEQ_CST) != 0) {
        if (dbr_now_ms() >= deadline)
            return DBR_E_BUSY;
        dbr_sleep_ms(1);
    }
    return DBR_OK;
}

/* Agent thread: the candidate stacks of /proc/self/maps (private, readable and
 * writable, anonymous: thread stacks, [stack], the heap; adjacent ones joined, so
 * that a stack split in two mappings is one span).  NULL if out of memory. */
static struct stack_table *stacks_read(void)
{
    struct dbr_maps maps;
    struct stack_table *t;
    size_t i, n = 0;

    if (dbr_maps_read(&maps) != DBR_OK)
        return NULL;
    t = dbr_alloc(sizeof *t + (maps.n ? maps.n : 1) * sizeof t->e[0]);
    for (i = 0; t && i < maps.n; i++) {
        const struct dbr_map_ent *e = &maps.e[i];

        if ((e->prot & (PROT_READ | PROT_WRITE)) != (PROT_READ | PROT_WRITE) || e->shared ||
            e->ino != 0 || e->special)
            continue;
        if (n > 0 && t->e[n - 1].hi == e->lo) {
            t->e[n - 1].hi = e->hi;
        } else {
            t->e[n].lo = e->lo;
            t->e[n].hi = e->hi;
            n++;
        }
    }
    if (t)
        t->n = n;
    dbr_maps_free(&maps);
    return t;
}

/* Agent thread: close the open census round; its stack table is freed once no
 * handler reads it (else left allocated).  Returns whether handlers are idle. */
static int census_close(void)
{
    struct stack_table *t = g_cs_table;
    int idle;

    __atomic_store_n(&g_cs_gen, 0, __ATOMIC_SEQ_CST);
    idle = dbr_wait_idle(&g_cs_active, CENSUS_SETTLE_MS) == DBR_OK;
    __atomic_store_n(&g_cs_table, NULL, __ATOMIC_RELEASE);
    if (idle)
        dbr_free(t);
    else
        dbr_log("census: a handler is still scanning after %u ms: its stack table is left "
                "allocated", CENSUS_SETTLE_MS);
    return idle;
}

#define ANSWERED 0xfeu  /* state of a thread whose answer is copied out */

/* Agent thread: one round: open a generation, signal the threads whose state is
 * WAITING, wait for their answers, close, copy the answers into ans[]. */
static void census_round(const pid_t *tids, uint8_t *state, struct cslot *ans, int n,
                         uint32_t timeout_ms, struct stack_table *table)
{
    uint32_t gen;
    int i;

    gen = ++g_cs_counter;
    if (gen == 0)
        gen = ++g_cs_counter;
    __atomic_store_n(&g_cs_table, table, __ATOMIC_RELEASE);
    __atomic_store_n(&g_cs_gen, gen, __ATOMIC_SEQ_CST);    /* open: handlers answer */
    for (i = 0; i < n; i++)
        if (state[i] == WAITING && queue_signal(tids[i]) < 0)
            state[i] = errno == ESRCH ? DBR_CENSUS_GONE : DBR_CENSUS_NO_REPLY;
    dbr_wait_answers_at(g_cslots, sizeof g_cslots[0], offsetof(struct cslot, done_gen), state, n,
                        gen, timeout_ms);
    census_close();
    for (i = 0; i < n; i++) {
        if (state[i] != WAITING ||
            __atomic_load_n(&g_cslots[i].done_gen, __ATOMIC_ACQUIRE) != gen)
            continue;
        ans[i].pc = __atomic_load_n(&g_cslots[i].pc, __ATOMIC_RELAXED);
        ans[i].first = __atomic_load_n(&g_cslots[i].first, __ATOMIC_RELAXED);
        ans[i].refs = __atomic_load_n(&g_cslots[i].refs, __ATOMIC_RELAXED);
        ans[i].flags = __atomic_load_n(&g_cslots[i].flags, __ATOMIC_RELAXED);
        state[i] = ANSWERED;
    }
}

/* Agent thread: a census that found nothing out (bad ranges, no memory). */
static int census_fail(uint32_t req_id, uint32_t n_ranges, int result)
{
    struct dbr_census c;

    memset(&c, 0, sizeof c);
    c.req_id = req_id;
    c.result = result;
    c.n_ranges = n_ranges;
    return dbr_send(&c, DBR_MSG_PC_CENSUS, sizeof c, -1, 0);
}

/* Agent thread: list the threads and signal each (but the agent's and the caller's)
 * for `ranges` (n_ranges <= CS_RANGES_MAX, checked by the caller); a thread whose
 * stack pointer lay in no known stack gets a second round with maps read again.
 * tids[i], state[i] (ANSWERED: ans[i] holds the answer; else DBR_CENSUS_AGENT,
 * _GONE, _NO_REPLY or WAITING: signalled, no answer) for the threads listed; the
 * per-range totals stay in g_cs_refs.  Returns their number, or -1 when the stack
 * table could not be made.  *again: threads asked twice. */
static int census_collect(const struct dbr_range *ranges, uint32_t n_ranges, uint32_t timeout_ms,
                          pid_t *tids, uint8_t *state, struct cslot *ans, int *again)
{
    struct stack_table *table = NULL;
    int n, i;
    uint32_t k;

    *again = 0;
    if (n_ranges > 0 && (table = stacks_read()) == NULL)
        return -1;
    n = dbr_list_threads(tids, DBR_CENSUS_SLOTS);
    if (n < 0)
        return -1;          /* threads unknown: no census rather than one that misses some */
    if (n > (int)DBR_CENSUS_SLOTS)
        n = DBR_CENSUS_SLOTS;   /* the rest cannot be reported */

    /* The census is closed (the last one closed before it answered): a late handler
     * of an earlier one answers nothing, and at worst counts words in the totals. */
    __atomic_store_n(&g_ncslots, 0, __ATOMIC_RELEASE);
    for (i = 0; i < n; i++) {
        g_cslots[i].tid = tids[i];
        __atomic_store_n(&g_cslots[i].done_gen, 0, __ATOMIC_RELAXED);
        state[i] = tids[i] == g_agent_tid || tids[i] == dbr_gettid() ? DBR_CENSUS_AGENT : WAITING;
    }
    memcpy(g_cs_ranges, ranges, n_ranges * sizeof ranges[0]);
    __atomic_store_n(&g_cs_nranges, n_ranges, __ATOMIC_RELAXED);
    for (k = 0; k < CS_RANGES_MAX; k++)
        __atomic_store_n(&g_cs_refs[k], 0, __ATOMIC_RELAXED);
    __atomic_store_n(&g_cs_words, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&g_ncslots, (unsigned)n, __ATOMIC_RELEASE);

    census_round(tids, state, ans, n, timeout_ms, table);
    /* A stack pointer in no mapping the table knows: a stack mapped since maps was
     * read.  Once more for those threads, with maps read again. */
    for (i = 0; i < n; i++)
        if (state[i] == ANSWERED && (ans[i].flags & DBR_CENSUS_F_NOSTACK)) {
            state[i] = WAITING;
            (*again)++;
        }
    if (*again > 0) {
        table = stacks_read();
        if (table) {
            census_round(tids, state, ans, n, timeout_ms, table);
        } else {
            for (i = 0; i < n; i++)
                if (state[i] == WAITING)
                    state[i] = ANSWERED;   /* the first answer stands: NOSTACK, UNKNOWN */
        }
    }
    return n;
}

/* an answer whose stack was not scanned whole */
#define CENSUS_F_PARTIAL (DBR_CENSUS_F_ALTSTACK | DBR_CENSUS_F_CAPPED | DBR_CENSUS_F_NOSTACK)

int dbr_census_run(uint32_t req_id, uint32_t timeout_ms, const struct dbr_range *ranges,
                   uint32_t n_ranges)
{
    pid_t *tids = NULL;
    uint8_t *state = NULL;
    struct cslot *ans = NULL;
    struct dbr_census *msg = NULL;
    int n, rc = DBR_OK, again = 0, unknown = 0;
    uint32_t k, sent;
    uint64_t t0 = now_us(), t1, t2;

    for (k = 0; k < n_ranges; k++)
        if (ranges[k].lo >= ranges[k].hi || (k > 0 && ranges[k].lo < ranges[k - 1].hi))
            return census_fail(req_id, n_ranges, DBR_E_INVAL);
    tids = dbr_alloc(DBR_CENSUS_SLOTS * sizeof *tids);
    state = dbr_alloc(DBR_CENSUS_SLOTS);
    ans = dbr_alloc(DBR_CENSUS_SLOTS * sizeof *ans);
    msg = dbr_alloc(sizeof *msg + DBR_MAX_CENSUS * sizeof msg->entries[0]);
    t1 = now_us();
    if (!tids || !state || !ans || !msg ||
        (n = census_collect(ranges, n_ranges, timeout_ms, tids, state, ans, &again)) < 0) {
        rc = census_fail(req_id, n_ranges, DBR_E_NOMEM);
        goto out;
    }
    t2 = now_us();

    /* reply: ceil(n / DBR_MAX_CENSUS) messages (one with n = 0 if no thread) */
    msg->req_id = req_id;
    msg->result = DBR_OK;
    msg->n_ranges = n_ranges;
    for (k = 0; k < DBR_MAX_CENSUS_RANGES; k++)
        msg->range_refs[k] = k < n_ranges ? __atomic_load_n(&g_cs_refs[k], __ATOMIC_RELAXED) : 0;
    sent = 0;
    do {
        uint32_t m = (uint32_t)n - sent > DBR_MAX_CENSUS ? DBR_MAX_CENSUS : (uint32_t)n - sent;

        msg->n = m;
        msg->n_total = (uint32_t)n;
        msg->flags = sent + m < (uint32_t)n ? DBR_CENSUS_MORE : 0;
        for (k = 0; k < m; k++) {
            struct dbr_census_entry *e = &msg->entries[k];
            unsigned s = sent + k;

            memset(e, 0, sizeof *e);
            e->tid = (uint32_t)tids[s];
            if (state[s] == ANSWERED) {
                e->pc = ans[s].pc;
                e->first_ref = ans[s].first;
                e->refs = ans[s].refs;
                e->flags = ans[s].flags;
                e->state = ans[s].flags & CENSUS_F_PARTIAL ? DBR_CENSUS_UNKNOWN : DBR_CENSUS_OK;
                unknown += e->state == DBR_CENSUS_UNKNOWN;
            } else if (state[s] != WAITING) {
                e->state = state[s];
            } else if (syscall(SYS_tgkill, getpid(), tids[s], 0) < 0 && errno == ESRCH) {
                e->state = DBR_CENSUS_GONE;     /* exited before answering */
            } else {
                e->state = DBR_CENSUS_NO_REPLY;
            }
        }
        rc = dbr_send(msg, DBR_MSG_PC_CENSUS, (uint32_t)(sizeof *msg + m * sizeof msg->entries[0]), -1, 0);
        sent += m;
    } while (rc == DBR_OK && sent < (uint32_t)n);
    if (n_ranges > 0)
        dbr_log("census: %d threads, %u ranges, %llu words read, %d unknown, %d again; "
                "maps %llu us, signals to answers %llu us", n, n_ranges,
                (unsigned long long)__atomic_load_n(&g_cs_words, __ATOMIC_RELAXED), unknown, again,
                (unsigned long long)(t1 - t0), (unsigned long long)(t2 - t1));
out:
    dbr_free(tids);
    dbr_free(state);
    dbr_free(ans);
    dbr_free(msg);
    return rc;
}

int dbr_census_inside(const struct dbr_range *ranges, uint32_t n_ranges, uint8_t *hit)
{
    pid_t *tids;
    uint8_t *state;
    struct cslot *ans;
    int n, i, again, blind = 0, rc = DBR_OK;
    uint32_t k;

    if (n_ranges == 0 || n_ranges > CS_RANGES_MAX)
        return DBR_E_INVAL;
    for (k = 0; k < n_ranges; k++)
        if (ranges[k].lo >= ranges[k].hi || (k > 0 && ranges[k].lo < ranges[k - 1].hi))
            return DBR_E_INVAL;
    tids = dbr_alloc(DBR_CENSUS_SLOTS * sizeof *tids);
    state = dbr_alloc(DBR_CENSUS_SLOTS);
    ans = dbr_alloc(DBR_CENSUS_SLOTS * sizeof *ans);
    if (!tids || !state || !ans ||
        (n = census_collect(ranges, n_ranges, CENSUS_WAIT_DEFAULT_MS, tids, state, ans,
                            &again)) < 0) {
        rc = DBR_E_NOMEM;
        goto out;
    }
    memset(hit, 0, n_ranges);
    for (i = 0; i < n; i++) {
        if (state[i] == ANSWERED) {
            uint32_t lo = 0, hi = n_ranges;

            if (ans[i].flags & CENSUS_F_PARTIAL)
                blind++;
            while (lo < hi) {           /* the PC: strictly inside a site? */
                uint32_t mid = lo + (hi - lo) / 2;
                if (ans[i].pc < ranges[mid].lo)
                    hi = mid;
                else if (ans[i].pc >= ranges[mid].hi)
                    lo = mid + 1;
                else {
                    hit[mid] = 1;
                    break;
                }
            }
        } else if (state[i] == WAITING || state[i] == DBR_CENSUS_NO_REPLY) {
            /* no answer: a thread stopped (ptrace, SIGSTOP) or the signal blocked;
             * it may be anywhere, unless it has exited */
            if (!(syscall(SYS_tgkill, getpid(), tids[i], 0) < 0 && errno == ESRCH))
                blind++;
        }
    }
    for (k = 0; k < n_ranges; k++)
        if (__atomic_load_n(&g_cs_refs[k], __ATOMIC_RELAXED))
            hit[k] = 1;
    if (blind)
        memset(hit, 1, n_ranges);
    dbr_log("entry census: %d threads, %u sites, %d unknown, %d again", n, n_ranges, blind, again);
out:
    dbr_free(tids);
    dbr_free(state);
    dbr_free(ans);
    return rc;
}

void dbr_census_fork_child(void)
{
    /* A census the parent's agent thread had open, and its handlers, are not the
     * child's; its table is the parent's (a copy here, left as it is: no thread
     * here frees it) */
    __atomic_store_n(&g_cs_gen, 0, __ATOMIC_SEQ_CST);
    __atomic_store_n(&g_cs_active, 0, __ATOMIC_SEQ_CST);
    __atomic_store_n(&g_cs_table, NULL, __ATOMIC_SEQ_CST);
    g_ncslots = 0;
}
