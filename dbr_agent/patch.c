/*
 * patch.c — the site table, the region table, PATCH/UNPATCH validation and
 * the cross-modifying-code protocols (docs/architecture.md, "Invariants" 5),
 * and the SIGTRAP handler of the int3 variant.
 *
 * A patch is always `E9 rel32` at `site`.  A batch is validated completely
 * before any byte is written; the valid sites are then written phase by phase
 * (all sites' step 1, sync, all sites' step 2, sync, step 3, sync), with each
 * touched page made RWX for the duration and its original protection
 * restored afterwards.  Every store is an aligned atomic store (1 byte, or a
 * compare-exchange of the aligned 8-byte word holding a 2- or 5-byte span).
 *
 * Entry sites (DBR_SITE_F_ENTRY, docs/architecture.md, "Invariants" 3): the first
 * instructions of a function, together >= 5 bytes, so the patch overwrites
 * instruction boundaries.  The service has seen no branch into bytes 1-4; what is
 * left is a thread already inside them, or one that will resume there (a PC saved
 * in a signal frame).  Int3 only.  After the CC is stored and synced no thread can
 * newly enter bytes 1-4 (byte 0 traps to the replacement entry, nothing branches
 * there), so a census taken then is final: every thread's PC, registers and stack
 * words are looked at (census.c, dbr_census_inside); if any lies in bytes 1-4 of
 * the site, or a thread's whereabouts are unknown, byte 0 is restored and the site
 * answers E_INSIDE, else bytes 1-4 and byte 0 are written as usual.  While the
 * jmp is in place nothing can reach bytes 1-4 either, so removal needs no census.
 */
#include <assert.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <ucontext.h>

#include "agent.h"

static struct dbr_site_ent g_sites[DBR_SITE_TABLE_MAX];
static unsigned g_n_sites;   /* published entries (release/acquire) */
unsigned g_n_installed;

struct region_ent {
    uint32_t id;             /* 0: free */
    uint32_t n_exits;
    uint32_t stale;          /* code it depends on was unmapped/reprotected: no TRANSFER */
    uint32_t reserved;
    uint64_t code_lo, code_hi;
    struct dbr_range exits[DBR_MAX_EXITS];
};
static struct region_ent g_regions[DBR_REGION_TABLE_MAX];
unsigned g_n_regions;

/* ---------------- site table ---------------- */

static struct dbr_site_ent *site_find(uint64_t site)
{
    unsigned i, n = __atomic_load_n(&g_n_sites, __ATOMIC_ACQUIRE);

    for (i = 0; i < n; i++)
        if (g_sites[i].site == site)
            return &g_sites[i];
    return NULL;
}

int dbr_sites_target_buffer(uint32_t buffer_id)
{
    unsigned i, n = __atomic_load_n(&g_n_sites, __ATOMIC_ACQUIRE);

    for (i = 0; i < n; i++)
        if (__atomic_load_n(&g_sites[i].installed, __ATOMIC_ACQUIRE) && g_sites[i].buffer_id == buffer_id)
            return 1;
    return 0;
}

/* any installed site with a byte in [lo, hi) */
int dbr_site_overlaps_installed(uint64_t lo, uint64_t hi)
{
    unsigned i, n = __atomic_load_n(&g_n_sites, __ATOMIC_ACQUIRE);

    for (i = 0; i < n; i++)
        if (__atomic_load_n(&g_sites[i].installed, __ATOMIC_ACQUIRE) && g_sites[i].site < hi &&
            lo < g_sites[i].site + DBR_PATCH_LEN)
            return 1;
    return 0;
}

/* `a` lies strictly inside an installed site: an instruction boundary the site's
 * jmp has overwritten (a thread sent there would run the middle of the jmp) */
int dbr_inside_installed_site(uint64_t a)
{
    const struct dbr_site_ent *at = site_find(a);

    /* installed sites never overlap one another (validate_patch): a byte of one, and
     * not the start of an installed one, is inside it */
    return dbr_site_overlaps_installed(a, a + 1) &&
           !(at && __atomic_load_n(&at->installed, __ATOMIC_ACQUIRE));
}

int dbr_any_installed(void)
{
    return __atomic_load_n(&g_n_installed, __ATOMIC_ACQUIRE) != 0;
}

/* ---------------- SIGTRAP ---------------- */

static void trap_handler(int sig, siginfo_t *si, void *ucv)
{
    ucontext_t *uc = ucv;
    uint64_t rip = (uint64_t)uc->uc_mcontext.gregs[REG_RIP];
    unsigned i, n;
    uint64_t census;         /* a kernel sigset */

    if (si->si_code > 0 && rip > 0) {        /* kernel-generated (int3: SI_KERNEL) */
        n = __atomic_load_n(&g_n_sites, __ATOMIC_ACQUIRE);
        for (i = 0; i < n; i++) {
            struct dbr_site_ent *s = &g_sites[i];
            uint8_t b;

            if (s->site != rip - 1)
                continue;
            b = __atomic_load_n((uint8_t *)s->site, __ATOMIC_ACQUIRE);
            if (b == 0xCC)
                uc->uc_mcontext.gregs[REG_RIP] = (greg_t)__atomic_load_n(&s->target, __ATOMIC_ACQUIRE);
            else
                uc->uc_mcontext.gregs[REG_RIP] = (greg_t)s->site;
            return;
        }
    }
    /* not ours: the program's handler runs with the census signal as it was before */
    if (!sigismember(&uc->uc_sigmask, g_cfg.census_sig)) {
        int saved_errno = errno;

        census = 1ull << (g_cfg.census_sig - 1);
        syscall(SYS_rt_sigprocmask, SIG_UNBLOCK, &census, NULL, sizeof census);
        errno = saved_errno;
    }
    dbr_signal_chain(sig, si, ucv);
}

/*
 * The census signal is blocked while the handler runs.  A thread that traps on
 * the CC of an entry site has, in its signal frame, the PC after the CC: byte 1
 * of the site, where it never resumes (the handler sends it elsewhere).  A census
 * answered from inside the handler, or from a frame the kernel set up together
 * with this one, would find that word on the stack and call the site busy; with
 * the signal blocked it is answered after the handler's sigreturn.
 */
void dbr_patch_init(void)
{
    struct sigaction sa;

    if (dbr_signal_install(SIGTRAP, trap_handler, SA_SIGINFO | SA_ONSTACK | SA_RESTART |
                           SA_NODEFER) != DBR_OK)
        return;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = trap_handler;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_RESTART | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    sigaddset(&sa.sa_mask, g_cfg.census_sig);
    if (dbr_real_sigaction(SIGTRAP, &sa, NULL) < 0)
        dbr_log("SIGTRAP: cannot block the census signal in the handler");
}

/* ---------------- regions ---------------- */

int dbr_region_set(const struct dbr_region *r)
{
    struct region_ent *e = NULL;
    unsigned i;

    if (r->region_id == 0 || r->n_exits > DBR_MAX_EXITS || r->code_lo > r->code_hi)
        return DBR_E_INVAL;
    for (i = 0; i < r->n_exits; i++)
        if (r->exits[i].lo > r->exits[i].hi)
            return DBR_E_INVAL;
    for (i = 0; i < DBR_REGION_TABLE_MAX; i++)
        if (g_regions[i].id == r->region_id) {
            e = &g_regions[i];
            break;
        }
    for (i = 0; !e && i < DBR_REGION_TABLE_MAX; i++)
        if (g_regions[i].id == 0) {
            e = &g_regions[i];
            __atomic_add_fetch(&g_n_regions, 1, __ATOMIC_RELEASE);
        }
    if (!e)
        return DBR_E_LIMIT;
    e->id = r->region_id;
    e->stale = 0;
    e->code_lo = r->code_lo;
    e->code_hi = r->code_hi;
    e->n_exits = r->n_exits;
    memcpy(e->exits, r->exits, r->n_exits * sizeof r->exits[0]);
    return DBR_OK;
}

int dbr_region_forget(uint32_t id)
{
    unsigned i;

    if (id == 0)
        return DBR_E_UNKNOWN;
    for (i = 0; i < DBR_REGION_TABLE_MAX; i++)
        if (g_regions[i].id == id) {
            g_regions[i].id = 0;
            __atomic_sub_fetch(&g_n_regions, 1, __ATOMIC_RELEASE);
            return DBR_OK;
        }
    return DBR_E_UNKNOWN;
}

void dbr_regions_clear(void)
{
    memset(g_regions, 0, sizeof g_regions);
    __atomic_store_n(&g_n_regions, 0, __ATOMIC_RELEASE);
}

static int region_exits_hit(const struct region_ent *e, uint64_t lo, uint64_t hi)
{
    unsigned k;

    for (k = 0; k < e->n_exits; k++)
        if (e->exits[k].lo < hi && lo < e->exits[k].hi)
            return 1;
    return 0;
}

int dbr_region_exits_intersect(uint64_t lo, uint64_t hi)
{
    unsigned i;

    for (i = 0; i < DBR_REGION_TABLE_MAX; i++)
        if (g_regions[i].id && region_exits_hit(&g_regions[i], lo, hi))
            return 1;
    return 0;
}

static const struct region_ent *region_find(uint32_t id)
{
    unsigned i;

    for (i = 0; id && i < DBR_REGION_TABLE_MAX; i++)
        if (g_regions[i].id == id)
            return &g_regions[i];
    return NULL;
}

int dbr_region_code(uint32_t id, uint64_t *lo, uint64_t *hi)
{
    const struct region_ent *e = region_find(id);

    if (!e || e->stale)
        return DBR_E_UNKNOWN;
    *lo = e->code_lo;
    *hi = e->code_hi;
    return DBR_OK;
}

/* ---------------- writing ---------------- */

struct op {
    uint64_t addr;
    uint8_t old[5], new[5];
    uint8_t variant;
    uint32_t idx;       /* index into the request / result arrays */
    int rc;
    uint8_t inner;      /* an entry site's inner boundaries (0: one instruction) */
    struct dbr_site_ent *ent;
};

/* Replace n bytes at addr (inside one aligned 8-byte word) by one 8-byte
 * compare-exchange; `expect` (may be NULL) must match the current bytes. */
static int word_store(uint64_t addr, const uint8_t *bytes, unsigned n, const uint8_t *expect)
{
    uint64_t *w = (uint64_t *)(addr & ~7ull), cur, nw;
    unsigned off = (unsigned)(addr & 7);
    uint8_t b[8];

    assert(off + n <= 8);
    cur = __atomic_load_n(w, __ATOMIC_SEQ_CST);
    for (;;) {
        memcpy(b, &cur, 8);
        if (expect && memcmp(b + off, expect, n) != 0)
            return DBR_E_MISMATCH;
        memcpy(b + off, bytes, n);
        memcpy(&nw, b, 8);
        if (__atomic_compare_exchange_n(w, &cur, nw, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
            return DBR_OK;
    }
}

static void byte_store(uint64_t addr, uint8_t v)
{
    __atomic_store_n((uint8_t *)addr, v, __ATOMIC_SEQ_CST);
}

static void sync_cores(void)
{
    if (dbr_membarrier_sync() < 0)
        __atomic_thread_fence(__ATOMIC_SEQ_CST); /* registered earlier: cannot fail */
}

/*
 * A thread that meets the CC of the int3 variant with SIGTRAP blocked is killed
 * (the kernel forces a synchronous signal, resetting a blocked one to SIG_DFL).
 * The program cannot block SIGTRAP through libc: the hooks strip it from every
 * mask (hooks.c, strip_trap).  It can through a raw system call, glibc does for
 * a few microseconds around clone and fork, and a new thread inherits its
 * creator's mask.  So before a batch writes a CC, every thread's mask is
 * looked at; while one blocks SIGTRAP the batch uses the self-branch variant,
 * which needs no signal, where it fits, and refuses the other int3 sites
 * (E_BUSY: try again later).  This replaces an unblock in each new thread,
 * which cost every thread start a system call and left the blocking thread
 * itself exposed.  A thread that blocks SIGTRAP between this look and the end
 * of the batch (microseconds) is not covered.
 */
static int variant_fits(uint8_t variant, uint64_t site);

#define TRAP_BIT (1ull << (SIGTRAP - 1))
#define TRAP_LOOKS 5            /* looks, 1 ms apart: glibc's own blocks are brief */

/* tid of a thread with SIGTRAP blocked, 0 when there is none, -1 unknown (treated
 * as blocked: the caller looks again) */
static pid_t trap_blocker(void)
{
    int n = dbr_list_threads(NULL, 0), k, i;
    pid_t *tids, found = 0;
    uint64_t m;

    if (n <= 0)
        return 0;
    tids = dbr_alloc((size_t)(n + 64) * sizeof *tids);
    if (!tids)
        return -1;
    k = dbr_list_threads(tids, n + 64);
    if (k > n + 64) {           /* more threads than the list holds: some go unseen */
        dbr_free(tids);
        return -1;
    }
    for (i = 0; i < k && !found; i++)
        if (dbr_thread_sigblk(tids[i], &m) == 0 && (m & TRAP_BIT))
            found = tids[i];
    dbr_free(tids);
    return found;
}

/* Before step 1: int3 ops become self-branch ones, or are refused, while some
 * thread has SIGTRAP blocked. */
static void guard_int3(struct op *ops, size_t n, int unpatch)
{
    size_t i;
    pid_t who = 0;
    int look;

    for (i = 0; i < n; i++)
        if (ops[i].rc == DBR_OK && ops[i].variant == DBR_VARIANT_INT3)
            break;
    if (i == n)
        return;
    for (look = 0; look < TRAP_LOOKS; look++) {
        if (look)
            dbr_sleep_ms(1);
        if ((who = trap_blocker()) == 0)
            return;
    }
    dbr_log("thread %d blocks SIGTRAP: int3 sites of this batch use self-branch or wait", (int)who);
    for (i = 0; i < n; i++) {
        struct op *o = &ops[i];

        if (o->rc != DBR_OK || o->variant != DBR_VARIANT_INT3)
            continue;
        /* An entry site is installed with int3 only: EB FE over byte 1 would break a
         * thread at that boundary.  Its removal may use self-branch: no thread can be
         * in bytes 1-4 while the jmp is there. */
        if (variant_fits(DBR_VARIANT_SELF_BRANCH, o->addr) && (!o->inner || unpatch))
            o->variant = DBR_VARIANT_SELF_BRANCH;
        else
            o->rc = DBR_E_BUSY;
    }
}

struct page {
    uint64_t addr;
    int prot;    /* original protection */
    int ok;      /* made writable */
};

static int u64cmp(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;

    return x < y ? -1 : x > y;
}

/* Step 1 done and synced: no thread can newly enter bytes 1-4 of an entry site.
 * Each entry site being installed with a thread inside (or possibly inside) gets
 * its byte 0 back and E_INSIDE.  Returns whether a byte was restored. */
static int entry_census(struct op *ops, size_t n)
{
    struct dbr_range *r;
    uint32_t *idx, k = 0, j, m;
    uint8_t *hit;
    size_t i;
    int rc = DBR_E_NOMEM, restored = 0;

    for (i = 0; i < n; i++)
        if (ops[i].rc == DBR_OK && ops[i].inner)
            k++;
    if (k == 0)
        return 0;
    r = dbr_alloc(k * sizeof *r);
    idx = dbr_alloc(k * sizeof *idx);
    hit = dbr_alloc(k);
    if (r && idx && hit) {
        k = 0;
        for (i = 0; i < n; i++)
            if (ops[i].rc == DBR_OK && ops[i].inner)
                idx[k++] = (uint32_t)i;
        for (j = 1; j < k; j++) {       /* by address (insertion sort: batches are small) */
            uint32_t v = idx[j];
            for (m = j; m > 0 && ops[idx[m - 1]].addr > ops[v].addr; m--)
                idx[m] = idx[m - 1];
            idx[m] = v;
        }
        /* bytes 1-4 of each site: ascending and disjoint (sites never overlap) */
        for (j = 0; j < k; j++) {
            r[j].lo = ops[idx[j]].addr + 1;
            r[j].hi = ops[idx[j]].addr + DBR_PATCH_LEN;
        }
        rc = dbr_census_inside(r, k, hit);
    }
    for (i = 0; i < n; i++) {
        struct op *o = &ops[i];

        if (o->rc != DBR_OK || !o->inner)
            continue;
        if (rc == DBR_OK) {
            for (m = 0; m < k && idx[m] != i; m++)
                ;
            if (m < k && !hit[m])
                continue;           /* nobody inside: install */
        }
        o->rc = DBR_E_INSIDE;
        byte_store(o->addr, o->old[0]);
        restored = 1;
        dbr_log("entry site %#lx: a thread is or may be inside it (census %d): left as it was",
                (unsigned long)o->addr, rc);
    }
    dbr_free(r);
    dbr_free(idx);
    dbr_free(hit);
    return restored;
}

/* Apply the ops (all validated).  Sets op->rc for failures (PROTECT, MISMATCH,
 * INSIDE). */
static void write_ops(struct op *ops, size_t n, const struct dbr_maps *maps, int unpatch)
{
    uint64_t pg = (uint64_t)dbr_page_size(), *addrs = NULL;
    struct page *pages = NULL;
    size_t i, j, np = 0, na = 0;
    int need;

    if (n == 0)
        return;
    addrs = dbr_alloc(2 * n * sizeof *addrs);
    pages = dbr_alloc(2 * n * sizeof *pages);
    if (!addrs || !pages) {
        for (i = 0; i < n; i++)
            ops[i].rc = DBR_E_NOMEM;
        goto out;
    }
    for (i = 0; i < n; i++) {
        addrs[na++] = ops[i].addr & ~(pg - 1);
        addrs[na++] = (ops[i].addr + DBR_PATCH_LEN - 1) & ~(pg - 1);
    }
    dbr_sort(addrs, na, sizeof *addrs, u64cmp);
    for (i = 0; i < na; i++) {
        const struct dbr_map_ent *m;

        if (np && pages[np - 1].addr == addrs[i])
            continue;
        m = dbr_maps_find(maps, addrs[i]);
        pages[np].addr = addrs[i];
        pages[np].prot = m ? m->prot : (PROT_READ | PROT_EXEC);
        pages[np].ok = dbr_sys_mprotect((void *)addrs[i], pg, PROT_READ | PROT_WRITE | PROT_EXEC) == 0;
        np++;
    }
    for (i = 0; i < n; i++) {
        uint64_t a = ops[i].addr & ~(pg - 1), b = (ops[i].addr + DBR_PATCH_LEN - 1) & ~(pg - 1);
        for (j = 0; j < np; j++)
            if ((pages[j].addr == a || pages[j].addr == b) && !pages[j].ok)
                ops[i].rc = DBR_E_PROTECT;
    }

    guard_int3(ops, n, unpatch);
    /* step 1 */
    need = 0;
    for (i = 0; i < n; i++) {
        struct op *o = &ops[i];
        static const uint8_t self[2] = { 0xEB, 0xFE };

        if (o->rc != DBR_OK)
            continue;
        if (o->variant == DBR_VARIANT_INT3) {
            byte_store(o->addr, 0xCC);
        } else if (o->variant == DBR_VARIANT_SELF_BRANCH) {
            o->rc = word_store(o->addr, self, 2, o->old);
        } else {
            o->rc = word_store(o->addr, o->new, 5, o->old);
        }
        need = 1;
    }
    if (need)
        sync_cores();
    /* entry sites being installed: is a thread inside? (restored ones synced below) */
    need = unpatch ? 0 : entry_census(ops, n);
    /* step 2: the tail bytes (no thread can execute them now) */
    for (i = 0; i < n; i++) {
        struct op *o = &ops[i];
        unsigned k;

        if (o->rc != DBR_OK || o->variant == DBR_VARIANT_SINGLE)
            continue;
        for (k = o->variant == DBR_VARIANT_INT3 ? 1 : 2; k < DBR_PATCH_LEN; k++)
            byte_store(o->addr + k, o->new[k]);
        need = 1;
    }
    if (need)
        sync_cores();
    /* step 3: the head */
    need = 0;
    for (i = 0; i < n; i++) {
        struct op *o = &ops[i];

        if (o->rc != DBR_OK || o->variant == DBR_VARIANT_SINGLE)
            continue;
        if (o->variant == DBR_VARIANT_INT3)
            byte_store(o->addr, o->new[0]);
        else
            word_store(o->addr, o->new, 2, NULL);
        need = 1;
    }
    if (need)
        sync_cores();

    for (j = 0; j < np; j++)
        if (pages[j].ok && dbr_sys_mprotect((void *)pages[j].addr, pg, pages[j].prot) < 0)
            dbr_log("cannot restore protection of page %#lx", (unsigned long)pages[j].addr);
out:
    dbr_free(addrs);
    dbr_free(pages);
}

/* ---------------- validation ---------------- */

static int range_exec(const struct dbr_maps *maps, uint64_t lo, uint64_t hi, int *special)
{
    uint64_t a = lo;

    *special = 0;
    while (a < hi) {
        const struct dbr_map_ent *m = dbr_maps_find(maps, a);
        if (!m || (m->prot & (PROT_EXEC | PROT_READ)) != (PROT_EXEC | PROT_READ))
            return 0;
        if (m->special || m->shared)
            *special = 1;
        a = m->hi;
    }
    return 1;
}

static int variant_fits(uint8_t variant, uint64_t site)
{
    switch (variant) {
    case DBR_VARIANT_INT3:
        return 1;
    case DBR_VARIANT_SELF_BRANCH:
        return (site & 7) != 7;
    case DBR_VARIANT_SINGLE:
        return (site & 7) <= 3;
    default:
        return 0;
    }
}

/* bits of dbr_patch_site.inner that may be set: offsets 1 .. DBR_PATCH_LEN-1 */
#define ENTRY_INNER_BITS ((uint8_t)(((1u << DBR_PATCH_LEN) - 1) & ~1u))

static int overlaps(uint64_t a, uint64_t b)
{
    return a < b + DBR_PATCH_LEN && b < a + DBR_PATCH_LEN;
}

static int validate_patch(const struct dbr_patch_site *s, const struct dbr_maps *maps,
                          const struct op *ops, size_t nops, uint32_t *buffer_id)
{
    const struct dbr_buffer *b;
    struct dbr_site_ent *e;
    uint64_t end = s->site + DBR_PATCH_LEN;
    int64_t rel;
    int special;
    size_t i;

    if (s->len != DBR_PATCH_LEN || s->variant > DBR_VARIANT_SINGLE)
        return DBR_E_INVAL;
    if (s->flags & ~DBR_SITE_F_ENTRY)
        return DBR_E_INVAL;
    if ((s->flags & DBR_SITE_F_ENTRY) ? s->inner == 0 || (s->inner & ~ENTRY_INNER_BITS) ||
                                        s->variant != DBR_VARIANT_INT3
                                      : s->inner != 0)
        return DBR_E_INVAL;
    if (!dbr_sync_core_ready())
        return DBR_E_NOSYNC;
    if (end < s->site || !range_exec(maps, s->site, end, &special))
        return DBR_E_NOT_EXEC;
    if (special || (s->site < g_agent_hi && g_agent_lo < end) || dbr_buffers_intersect(s->site, end))
        return DBR_E_FORBIDDEN;
    b = dbr_buffer_containing(s->target, 1);
    if (!b)
        return DBR_E_TARGET;
    *buffer_id = b->id;
    rel = (int64_t)(s->target - end);
    if (rel < INT32_MIN || rel > INT32_MAX)
        return DBR_E_RANGE;
    if (!variant_fits(s->variant, s->site))
        return DBR_E_ALIGN;
    e = site_find(s->site);
    if ((e && e->installed) || dbr_site_overlaps_installed(s->site, end))
        return DBR_E_BUSY;
    for (i = 0; i < nops; i++)
        if (overlaps(ops[i].addr, s->site))
            return DBR_E_BUSY;
    if (memcmp((const void *)s->site, s->orig, DBR_PATCH_LEN) != 0)
        return DBR_E_MISMATCH;
    return DBR_OK;
}

static int validate_unpatch(const struct dbr_patch_site *s, const struct dbr_maps *maps,
                            const struct op *ops, size_t nops, struct dbr_site_ent **out)
{
    struct dbr_site_ent *e = site_find(s->site);
    int special;
    size_t i;

    if (!e || !e->installed)
        return DBR_E_NOT_PATCHED;
    for (i = 0; i < nops; i++)
        if (ops[i].addr == s->site)
            return DBR_E_NOT_PATCHED;   /* duplicate in this batch */
    if (!dbr_sync_core_ready())
        return DBR_E_NOSYNC;
    if (!range_exec(maps, s->site, s->site + DBR_PATCH_LEN, &special))
        return DBR_E_NOT_EXEC;
    if (memcmp((const void *)s->site, e->jmp, DBR_PATCH_LEN) != 0)
        return DBR_E_MISMATCH;
    *out = e;
    return DBR_OK;
}

/* g_agent_mu held.  res[i] gets the result of sites[i]. */
void dbr_patch_batch(const struct dbr_patch_site *sites, uint32_t n, int unpatch,
                     struct dbr_site_result *res)
{
    struct dbr_maps maps = { 0 };
    struct op *ops = NULL;
    size_t nops = 0, i;
    int rc;

    for (i = 0; i < n; i++) {
        res[i].site = sites[i].site;
        res[i].result = DBR_E_NOMEM;
        res[i].reserved = 0;
    }
    if (n == 0)
        goto out;
    ops = dbr_alloc(n * sizeof *ops);
    if (!ops || dbr_maps_read(&maps) != DBR_OK)
        goto out;

    for (i = 0; i < n; i++) {
        const struct dbr_patch_site *s = &sites[i];
        struct op *o = &ops[nops];
        struct dbr_site_ent *e = NULL;
        uint32_t buffer_id = 0;

        rc = unpatch ? validate_unpatch(s, &maps, ops, nops, &e)
                     : validate_patch(s, &maps, ops, nops, &buffer_id);
        res[i].result = rc;
        if (rc != DBR_OK)
            continue;
        o->addr = s->site;
        o->idx = (uint32_t)i;
        o->rc = DBR_OK;
        if (unpatch) {
            memcpy(o->old, e->jmp, 5);
            memcpy(o->new, e->orig, 5);
            o->variant = e->variant;
            o->inner = e->inner;
            o->ent = e;
        } else {
            int32_t rel = (int32_t)(s->target - (s->site + DBR_PATCH_LEN));

            memcpy(o->old, s->orig, 5);
            o->new[0] = 0xE9;
            memcpy(o->new + 1, &rel, 4);
            o->variant = s->variant;
            o->inner = (s->flags & DBR_SITE_F_ENTRY) ? s->inner : 0;
            e = site_find(s->site);
            if (!e) {
                unsigned k = __atomic_load_n(&g_n_sites, __ATOMIC_ACQUIRE);
                if (k >= DBR_SITE_TABLE_MAX) {
                    res[i].result = DBR_E_LIMIT;
                    continue;
                }
                e = &g_sites[k];
                memset(e, 0, sizeof *e);
                e->site = s->site;
                /* fields below are set before the entry can matter to the trap handler */
                __atomic_store_n(&e->target, s->target, __ATOMIC_RELEASE);
                __atomic_store_n(&g_n_sites, k + 1, __ATOMIC_RELEASE);
            }
            __atomic_store_n(&e->target, s->target, __ATOMIC_RELEASE);
            e->region_id = s->region_id;
            e->buffer_id = buffer_id;
            e->variant = s->variant;
            e->inner = o->inner;
            memcpy(e->orig, s->orig, 5);
            memcpy(e->jmp, o->new, 5);
            o->ent = e;
        }
        nops++;
    }
    write_ops(ops, nops, &maps, unpatch);
    for (i = 0; i < nops; i++) {
        struct op *o = &ops[i];

        res[o->idx].result = o->rc;
        if (o->rc != DBR_OK)
            continue;
        __atomic_store_n(&o->ent->installed, unpatch ? 0 : 1, __ATOMIC_RELEASE);
        if (unpatch)
            __atomic_sub_fetch(&g_n_installed, 1, __ATOMIC_RELEASE);
        else
            __atomic_add_fetch(&g_n_installed, 1, __ATOMIC_RELEASE);
    }
    dbr_log("%s batch: %u sites, %zu written", unpatch ? "unpatch" : "patch", n, nops);
out:
    dbr_maps_free(&maps);
    dbr_free(ops);
}

/* ---------------- agent-initiated unpatching ---------------- */

/* takes g_agent_mu; sel(e) chooses the installed sites to restore */
static int unpatch_selected(uint64_t lo, uint64_t hi, int with_exits, int all)
{
    unsigned i, n;
    struct dbr_patch_site *req = NULL;
    struct dbr_site_result *res = NULL;
    uint32_t k = 0, done = 0;

    pthread_mutex_lock(&g_agent_mu);
    n = __atomic_load_n(&g_n_sites, __ATOMIC_ACQUIRE);
    if (!dbr_any_installed() || n == 0)
        goto out;
    req = dbr_alloc(n * sizeof *req);
    res = dbr_alloc(n * sizeof *res);
    if (!req || !res)
        goto out;
    for (i = 0; i < n; i++) {
        struct dbr_site_ent *e = &g_sites[i];
        const struct region_ent *r;
        int hit = all;

        if (!e->installed)
            continue;
        if (!hit && e->site < hi && lo < e->site + DBR_PATCH_LEN)
            hit = 1;
        if (!hit && e->target >= lo && e->target < hi)
            hit = 1;
        if (!hit && with_exits && (r = region_find(e->region_id)) != NULL && region_exits_hit(r, lo, hi))
            hit = 1;
        if (!hit)
            continue;
        req[k].site = e->site;
        req[k].len = DBR_PATCH_LEN;
        req[k].variant = e->variant;
        k++;
    }
    if (k)
        dbr_patch_batch(req, k, 1, res);
    for (i = 0; i < k; i++)
        if (res[i].result == DBR_OK)
            done++;
    if (k)
        dbr_log("agent-initiated unpatch: %u of %u sites restored", done, k);
out:
    pthread_mutex_unlock(&g_agent_mu);
    dbr_free(req);
    dbr_free(res);
    return (int)done;
}

int dbr_unpatch_affected(uint64_t lo, uint64_t hi, int with_exits)
{
    int n = unpatch_selected(lo, hi, with_exits, 0);
    unsigned i;

    /* whatever the service said: no thread is moved into a region whose original
     * code or exit targets were in the range (it may hold other code next) */
    pthread_mutex_lock(&g_agent_mu);
    for (i = 0; i < DBR_REGION_TABLE_MAX; i++)
        if (g_regions[i].id && region_exits_hit(&g_regions[i], lo, hi))
            g_regions[i].stale = 1;
    pthread_mutex_unlock(&g_agent_mu);
    return n;
}

int dbr_unpatch_all(void)
{
    return unpatch_selected(0, 0, 0, 1);
}
