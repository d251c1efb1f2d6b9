/*
 * patch_write.c — writing a validated PATCH/UNPATCH batch with the
 * cross-modifying-code protocols (docs/architecture.md, "Invariants" 5).
 *
 * The valid sites are written phase by phase (all sites' step 1, sync, all
 * sites' step 2, sync, step 3, sync), with each touched page made RWX for the
 * duration and its original protection restored afterwards.  Every store is an
 * aligned atomic store (1 byte, or a compare-exchange of the aligned 8-byte word
 * holding a 2- or 5-byte span).
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
#include <signal.h>
#include <string.h>
#include <sys/mman.h>

#include "patch.h"

/* ---------------- writing ---------------- */

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

int dbr_variant_fits(uint8_t variant, uint64_t site)
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

#define TRAP_BIT (1ull << (SIGTRAP - 1))
#define TRAP_LOOKS 5            /* looks, 1 ms apart: glibc's own blocks are brief */

/* tid of a thread with SIGTRAP blocked, 0 when there is none, -1 unknown (treated
 * as blocked: the caller looks again) */
static pid_t trap_blocker(void)
{
    int n = dbr_list_threads(NULL, 0), k, i;
    pid_t *tids, found = 0;
    uint64_t m;

    if (n < 0)
        return -1;
    if (n == 0)
        return 0;
    tids = dbr_alloc((size_t)(n + 64) * sizeof *tids);
    if (!tids)
        return -1;
    k = dbr_list_threads(tids, n + 64);
    if (k < 0 || k > n + 64) {           /* more threads than the list holds: some go unseen */
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
        if (dbr_variant_fits(DBR_VARIANT_SELF_BRANCH, o->addr) && (!o->inner || unpatch))
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

void dbr_write_ops(struct op *ops, size_t n, const struct dbr_maps *maps, int unpatch)
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
