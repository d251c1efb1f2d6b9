/*
 * patch.c — the site table, the region table, PATCH/UNPATCH validation and
 * batches, agent-initiated unpatching, and the SIGTRAP handler of the int3
 * variant.
 *
 * A patch is always `E9 rel32` at `site`.  A batch is validated completely
 * before any byte is written; patch_write.c then writes the valid sites (and
 * says how entry sites, DBR_SITE_F_ENTRY, are installed).
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <ucontext.h>

#include "patch.h"

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
    sigset_t mask;

    sigemptyset(&mask);
    sigaddset(&mask, g_cfg.census_sig);
    if (dbr_signal_install(SIGTRAP, trap_handler, SA_SIGINFO | SA_ONSTACK | SA_RESTART |
                           SA_NODEFER, &mask) != DBR_OK)
        dbr_log("SIGTRAP: the agent's handler cannot be installed");
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
    if (!dbr_variant_fits(s->variant, s->site))
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
    dbr_write_ops(ops, nops, &maps, unpatch);
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
