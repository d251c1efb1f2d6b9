/*
 * frames.c — unwind information for replacement code (FRAMES_ADD, FRAMES_DEL).
 *
 * Replacement code that makes real calls leaves return addresses into code buffers on
 * the stack, and unwinders (C++ exceptions, backtrace(), _Unwind_Backtrace,
 * pthread_cancel) look a frame's rules up by such an address.  The service writes an
 * .eh_frame blob (CIE + FDEs + zero terminator) for the code beside it in the buffer
 * and names it with FRAMES_ADD; the agent checks it once (frames_check) and keeps one
 * table entry per FDE: its code range and the FDE's address.
 *
 * Why not libgcc's __register_frame.  The agent's thread is hidden from glibc
 * (thread.c), and libgcc's registration is not safe to call from it: __register_frame
 * calls malloc, __deregister_frame frees the sorted table with free(), and both take
 * libgcc's object_mutex, a private mutex that glibc locks and unlocks with plain
 * stores and no wake-up while it believes the process has one thread
 * (docs/decisions/0003-agent-thread-hidden-from-glibc.md); finding the functions with
 * dlsym takes the loader's lock, off limits to that thread for the same reason.  Nor
 * from a signal handler on a program thread.
 *
 * How unwinders find the blob instead: the agent defines _Unwind_Find_FDE.  libgcc_s
 * calls it through its PLT for every frame (uw_frame_state_for,
 * _Unwind_FindEnclosingFunction), and the preloaded agent comes before libgcc_s in the
 * global scope, also when glibc dlopens libgcc_s locally for backtrace() and
 * pthread_cancel, or when libgcc_s is loaded only after the blob was added: nothing
 * waits for an unwinder to appear.  For a PC inside a registered FDE the agent
 * answers from its table (bases: func = the FDE's start, no text or data base: the
 * service's blobs use absolute or pc-relative pointers only); for any other PC it
 * calls the definition it hides (real_find_fde): the caller's own, found from the
 * return address through dl_iterate_phdr and the caller's dynamic symbol table (the
 * lock libgcc_s's own lookup takes next anyway), else the first other object's.
 * Unwinders that do not look frames up through the dynamic linker's
 * _Unwind_Find_FDE (libgcc linked statically, LLVM's or the nongnu libunwind, gdb)
 * do not see the blobs.
 *
 * The table is read by program threads at any time, signal handlers included, and
 * written only by the agent's thread with g_agent_mu held: a sequence lock (odd while
 * being written; readers retry, never block the writer, never take a lock).  It is one
 * fixed array, mapped at the first FRAMES_ADD and never freed, so a reader never
 * touches unmapped memory whatever it reads meanwhile.  A fork child keeps it (fork
 * waits for g_agent_mu) with its privatised buffers at the same addresses.
 */
#include <dlfcn.h>
#include <elf.h>
#include <link.h>
#include <sched.h>
#include <string.h>

#include "agent.h"

#define FRAMES_MAX      16384u  /* FDEs registered at once */
#define BLOB_FDES_MAX   1024u   /* FDEs in one blob */
#define BLOB_CIES_MAX   64u     /* CIEs in one blob */
#define CALLERS_MAX     16u     /* call sites of _Unwind_Find_FDE remembered */

struct frame_ent {
    uint64_t lo, hi;     /* code [lo, hi) the FDE covers */
    uint64_t fde;        /* address of the FDE record (its length field) */
    uint64_t blob;       /* address of the blob's first record (FRAMES_ADD.addr) */
    uint32_t region_id;
    uint32_t reserved;
};

static struct frame_ent *g_fr;   /* FRAMES_MAX entries sorted by lo, disjoint */
static unsigned g_fr_n;
static unsigned g_fr_seq;        /* odd while the table is being written */

struct dwarf_eh_bases {          /* libgcc's unwind-dw2-fde.h */
    void *tbase;
    void *dbase;
    void *func;
};
typedef const void *(*find_fde_fn)(void *, struct dwarf_eh_bases *);
DBR_EXPORT const void *_Unwind_Find_FDE(void *pc, struct dwarf_eh_bases *bases);

/* ---------------- the table: readers ---------------- */

/* The FDE covering pc and its start, or NULL. */
static const void *frames_lookup(uint64_t pc, uint64_t *func)
{
    const struct frame_ent *t = __atomic_load_n(&g_fr, __ATOMIC_ACQUIRE);
    unsigned spins = 0;

    if (!t)
        return NULL;
    for (;;) {
        unsigned s = __atomic_load_n(&g_fr_seq, __ATOMIC_ACQUIRE), n, lo = 0, hi;
        uint64_t fde = 0, start = 0;

        if (!(s & 1)) {
            n = __atomic_load_n(&g_fr_n, __ATOMIC_RELAXED);
            hi = n < FRAMES_MAX ? n : FRAMES_MAX;
            while (lo < hi) {                       /* first entry with lo > pc */
                unsigned mid = lo + (hi - lo) / 2;
                if (__atomic_load_n(&t[mid].lo, __ATOMIC_RELAXED) <= pc)
                    lo = mid + 1;
                else
                    hi = mid;
            }
            if (lo > 0 && pc < __atomic_load_n(&t[lo - 1].hi, __ATOMIC_RELAXED)) {
                fde = __atomic_load_n(&t[lo - 1].fde, __ATOMIC_RELAXED);
                start = __atomic_load_n(&t[lo - 1].lo, __ATOMIC_RELAXED);
            }
            __atomic_thread_fence(__ATOMIC_ACQUIRE);
            if (__atomic_load_n(&g_fr_seq, __ATOMIC_RELAXED) == s) {
                *func = start;
                return (const void *)fde;
            }
        }
        /* the agent's thread is writing (microseconds): it never waits for us */
        if (++spins % 64 == 0)
            sched_yield();
        else
            __builtin_ia32_pause();
    }
}

/* ---------------- the definition the agent hides ---------------- */

static struct {
    uint64_t caller;      /* return address of a call to _Unwind_Find_FDE; 0: free */
    find_fde_fn fn;
} g_callers[CALLERS_MAX];

static uint32_t gnu_hash(const char *s)
{
    uint32_t h = 5381;

    for (; *s; s++)
        h = h * 33 + (unsigned char)*s;
    return h;
}

static uint32_t sysv_hash(const char *s)
{
    uint32_t h = 0, g;

    for (; *s; s++) {
        h = (h << 4) + (unsigned char)*s;
        g = h & 0xf0000000u;
        if (g)
            h ^= g >> 24;
        h &= ~g;
    }
    return h;
}

static int sym_is(const ElfW(Sym) *sym, const char *strtab, const char *name)
{
    return sym->st_shndx != SHN_UNDEF && sym->st_value != 0 &&
           ELF64_ST_TYPE(sym->st_info) == STT_FUNC && strcmp(strtab + sym->st_name, name) == 0;
}

/* The address of the function `name` an object defines (its dynamic symbol table), or 0. */
static uint64_t object_defines(const struct dl_phdr_info *info, const char *name)
{
    const ElfW(Dyn) *dyn = NULL;
    const ElfW(Sym) *symtab = NULL;
    const char *strtab = NULL;
    const uint32_t *gnu = NULL, *sysv = NULL;
    uint64_t base = info->dlpi_addr;
    int i;

    for (i = 0; i < info->dlpi_phnum; i++)
        if (info->dlpi_phdr[i].p_type == PT_DYNAMIC)
            dyn = (const ElfW(Dyn) *)(base + info->dlpi_phdr[i].p_vaddr);
    if (!dyn)
        return 0;
    for (; dyn->d_tag != DT_NULL; dyn++) {
        /* ld.so relocates these in place, except in the vdso */
        uint64_t p = dyn->d_un.d_ptr < base ? dyn->d_un.d_ptr + base : dyn->d_un.d_ptr;
        switch (dyn->d_tag) {
        case DT_SYMTAB:   symtab = (const ElfW(Sym) *)p; break;
        case DT_STRTAB:   strtab = (const char *)p; break;
        case DT_GNU_HASH: gnu = (const uint32_t *)p; break;
        case DT_HASH:     sysv = (const uint32_t *)p; break;
        default: break;
        }
    }
    if (!symtab || !strtab)
        return 0;
    if (gnu) {
        uint32_t nb = gnu[0], symoff = gnu[1], bloom = gnu[2], h = gnu_hash(name), k;
        const uint32_t *buckets = (const uint32_t *)((const uint64_t *)(gnu + 4) + bloom);
        const uint32_t *chain = buckets + nb;

        if (nb == 0)
            return 0;
        k = buckets[h % nb];
        if (k < symoff)
            return 0;
        for (;; k++) {
            uint32_t h2 = chain[k - symoff];
            if ((h | 1) == (h2 | 1) && sym_is(&symtab[k], strtab, name))
                return base + symtab[k].st_value;
            if (h2 & 1)
                return 0;
        }
    }
    if (sysv) {
        uint32_t nb = sysv[0], k;
        const uint32_t *bucket = sysv + 2, *chain = bucket + nb;

        if (nb == 0)
            return 0;
        for (k = bucket[sysv_hash(name) % nb]; k != STN_UNDEF; k = chain[k])
            if (sym_is(&symtab[k], strtab, name))
                return base + symtab[k].st_value;
    }
    return 0;
}

struct find_real {
    uint64_t caller;
    uint64_t own;         /* the caller's object's definition */
    uint64_t first;       /* the first other object's */
};

static int find_real_cb(struct dl_phdr_info *info, size_t size, void *data)
{
    struct find_real *f = data;
    uint64_t def;
    int i, holds = 0;

    (void)size;
    for (i = 0; i < info->dlpi_phnum; i++) {
        const ElfW(Phdr) *ph = &info->dlpi_phdr[i];
        uint64_t a = info->dlpi_addr + ph->p_vaddr;
        if (ph->p_type == PT_LOAD && f->caller >= a && f->caller - a < ph->p_memsz)
            holds = 1;
    }
    if (!holds && f->first)
        return 0;
    def = object_defines(info, "_Unwind_Find_FDE");
    if (def == (uint64_t)_Unwind_Find_FDE)
        return 0;                              /* the agent itself */
    if (holds)
        f->own = def;
    else if (!f->first)
        f->first = def;
    return 0;
}

static find_fde_fn real_find_fde(uint64_t caller)
{
    struct find_real f = { caller, 0, 0 };
    find_fde_fn fn;
    unsigned i;

    for (i = 0; i < CALLERS_MAX; i++) {
        uint64_t c = __atomic_load_n(&g_callers[i].caller, __ATOMIC_ACQUIRE);
        if (c == caller)
            return __atomic_load_n(&g_callers[i].fn, __ATOMIC_RELAXED);
        if (c == 0)
            break;
    }
    dl_iterate_phdr(find_real_cb, &f);
    fn = (find_fde_fn)(f.own ? f.own : f.first);
    /* remember it (a lost race only means looking again next time) */
    for (i = 0; fn && i < CALLERS_MAX; i++) {
        uint64_t zero = 0;
        if (__atomic_load_n(&g_callers[i].caller, __ATOMIC_ACQUIRE) != 0)
            continue;
        __atomic_store_n(&g_callers[i].fn, fn, __ATOMIC_RELAXED);
        if (__atomic_compare_exchange_n(&g_callers[i].caller, &zero, caller, 0,
                                        __ATOMIC_RELEASE, __ATOMIC_RELAXED))
            break;
    }
    return fn;
}

DBR_EXPORT const void *_Unwind_Find_FDE(void *pc, struct dwarf_eh_bases *bases)
{
    find_fde_fn real;

    if (__atomic_load_n(&g_fr_n, __ATOMIC_ACQUIRE) != 0) {
        uint64_t func;
        const void *fde = frames_lookup((uint64_t)pc, &func);

        if (fde) {
            bases->tbase = NULL;
            bases->dbase = NULL;
            bases->func = (void *)func;
            return fde;
        }
    }
    real = real_find_fde((uint64_t)__builtin_return_address(0));
    return real ? real(pc, bases) : NULL;
}

/* ---------------- the table: the agent's thread (g_agent_mu held) ---------------- */

static void write_begin(void)
{
    __atomic_store_n(&g_fr_seq, g_fr_seq + 1, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
}

static void write_end(void)
{
    __atomic_store_n(&g_fr_seq, g_fr_seq + 1, __ATOMIC_RELEASE);
}

static void ent_store(struct frame_ent *d, const struct frame_ent *s)
{
    __atomic_store_n(&d->lo, s->lo, __ATOMIC_RELAXED);
    __atomic_store_n(&d->hi, s->hi, __ATOMIC_RELAXED);
    __atomic_store_n(&d->fde, s->fde, __ATOMIC_RELAXED);
    d->blob = s->blob;
    d->region_id = s->region_id;
}

/* Drop every entry `drop` selects. */
static int frames_remove(int (*drop)(const struct frame_ent *, uint64_t, uint64_t),
                         uint64_t a, uint64_t b)
{
    unsigned i, k = 0, n = g_fr_n;

    if (!g_fr || n == 0)
        return 0;
    for (i = 0; i < n && !drop(&g_fr[i], a, b); i++)
        ;
    if (i == n)
        return 0;
    write_begin();
    for (i = 0; i < n; i++)
        if (!drop(&g_fr[i], a, b)) {
            if (k != i)
                ent_store(&g_fr[k], &g_fr[i]);
            k++;
        }
    __atomic_store_n(&g_fr_n, k, __ATOMIC_RELAXED);
    write_end();
    return (int)(n - k);
}

static int drop_blob(const struct frame_ent *e, uint64_t blob, uint64_t region)
{
    return e->blob == blob && e->region_id == region;
}

static int drop_range(const struct frame_ent *e, uint64_t lo, uint64_t hi)
{
    return (e->blob >= lo && e->blob < hi) || (e->lo < hi && lo < e->hi);
}

void dbr_frames_forget_range(uint64_t lo, uint64_t hi)
{
    int k = frames_remove(drop_range, lo, hi);

    if (k)
        dbr_log("frames: %d FDEs in [%#lx,%#lx) withdrawn", k, (unsigned long)lo,
                (unsigned long)hi);
}

int dbr_frames_del(uint32_t region_id, uint64_t addr)
{
    return frames_remove(drop_blob, addr, region_id) ? DBR_OK : DBR_E_UNKNOWN;
}

/* ---------------- FRAMES_ADD's checks ---------------- */

struct rd {
    const uint8_t *p, *end;
    int bad;
};

static uint64_t rd_fixed(struct rd *r, unsigned n)
{
    uint64_t v = 0;

    if (r->bad || (size_t)(r->end - r->p) < n) {
        r->bad = 1;
        return 0;
    }
    memcpy(&v, r->p, n);
    r->p += n;
    return v;
}

static uint64_t rd_uleb(struct rd *r)
{
    uint64_t v = 0;
    unsigned shift = 0;
    uint8_t b;

    do {
        b = (uint8_t)rd_fixed(r, 1);
        if (shift < 64)
            v |= (uint64_t)(b & 0x7f) << shift;
        shift += 7;
    } while (!r->bad && (b & 0x80) && shift < 70);
    if (b & 0x80)
        r->bad = 1;
    return v;
}

/* Size of a DW_EH_PE value format (low nibble), 0 for the ones not accepted. */
static unsigned enc_size(uint8_t enc)
{
    switch (enc & 0x0f) {
    case 0x00: case 0x04: case 0x0c: return 8;
    case 0x03: case 0x0b: return 4;
    case 0x02: case 0x0a: return 2;
    default: return 0;
    }
}

/* A value of format `enc & 0x0f`, sign-extended for the signed ones. */
static uint64_t rd_enc(struct rd *r, uint8_t enc)
{
    unsigned n = enc_size(enc);
    uint64_t v = rd_fixed(r, n);

    if (n == 0)
        r->bad = 1;
    else if ((enc & 0x08) && n < 8 && (v >> (8 * n - 1)) & 1)
        v |= ~(uint64_t)0 << (8 * n);
    return v;
}

struct cie_ent {
    uint64_t off;     /* offset of the CIE in the blob */
    uint8_t fde_enc;
};

static int ent_cmp(const void *a, const void *b)
{
    const struct frame_ent *x = a, *y = b;

    return x->lo < y->lo ? -1 : x->lo > y->lo;
}

/* Parse one CIE at blob offset `off` (its body [q, end)); DBR_OK or DBR_E_INVAL. */
static int parse_cie(struct rd *r, uint8_t *fde_enc)
{
    char aug[8];
    unsigned k = 0, version = (unsigned)rd_fixed(r, 1);
    uint64_t augl;
    const uint8_t *augend;

    if (version != 1 && version != 3)
        return DBR_E_INVAL;
    for (;;) {
        char c = (char)rd_fixed(r, 1);
        if (r->bad || k == sizeof aug)
            return DBR_E_INVAL;
        aug[k++] = c;
        if (c == 0)
            break;
    }
    if (aug[0] != 'z')
        return DBR_E_INVAL;
    rd_uleb(r);                        /* code alignment */
    rd_uleb(r);                        /* data alignment (sleb: only skipped) */
    if (version == 1)
        rd_fixed(r, 1);
    else
        rd_uleb(r);
    augl = rd_uleb(r);
    if (r->bad || augl > (uint64_t)(r->end - r->p))
        return DBR_E_INVAL;
    augend = r->p + augl;
    *fde_enc = 0;                      /* DW_EH_PE_absptr without R */
    for (k = 1; aug[k]; k++) {
        uint8_t e;
        switch (aug[k]) {
        case 'P':
            e = (uint8_t)rd_fixed(r, 1);
            rd_enc(r, e);
            break;
        case 'L':
            rd_fixed(r, 1);
            break;
        case 'R':
            e = (uint8_t)rd_fixed(r, 1);
            if ((e & 0x70) > 0x10 || (e & 0x80) || enc_size(e) == 0)
                return DBR_E_INVAL;    /* absolute or pc-relative only */
            *fde_enc = e;
            break;
        case 'S':
            break;
        default:
            return DBR_E_INVAL;
        }
    }
    if (r->bad || r->p > augend)
        return DBR_E_INVAL;
    return DBR_OK;
}

/* Check the blob and collect its FDEs (sorted); DBR_OK or the refusal. */
static int frames_check(uint64_t addr, uint64_t len, struct frame_ent *fdes, unsigned *n_fdes)
{
    const uint8_t *blob = (const uint8_t *)addr;
    struct cie_ent cies[BLOB_CIES_MAX];
    unsigned n_cies = 0, n = 0, i, k;
    uint64_t off = 0;

    if (len < 4 || len > UINT32_MAX || !dbr_buffer_containing(addr, len))
        return DBR_E_TARGET;
    for (;;) {
        struct rd r = { blob + off, blob + len, 0 };
        uint64_t rlen = rd_fixed(&r, 4), id;
        const uint8_t *rec_end;

        if (r.bad)
            return DBR_E_INVAL;
        if (rlen == 0) {
            if (off + 4 != len)
                return DBR_E_INVAL;    /* the terminator ends the records */
            break;
        }
        if (rlen == 0xffffffffu || rlen < 4 || rlen > len - off - 4 - 4)
            return DBR_E_INVAL;        /* 64-bit DWARF, or past the terminator */
        rec_end = blob + off + 4 + rlen;
        r.end = rec_end;
        id = rd_fixed(&r, 4);
        if (id == 0) {
            uint8_t e;
            if (n_cies == BLOB_CIES_MAX || parse_cie(&r, &e) != DBR_OK)
                return DBR_E_INVAL;
            cies[n_cies].off = off;
            cies[n_cies++].fde_enc = e;
        } else {
            uint64_t cie_off = off + 4 - id, field, begin, range;
            uint8_t e = 0;

            if (id > off + 4)
                return DBR_E_INVAL;
            for (k = 0; k < n_cies && cies[k].off != cie_off; k++)
                ;
            if (k == n_cies || n == BLOB_FDES_MAX)
                return DBR_E_INVAL;
            e = cies[k].fde_enc;
            field = addr + (uint64_t)(r.p - blob);
            begin = rd_enc(&r, e);
            if ((e & 0x70) == 0x10)
                begin += field;
            range = rd_enc(&r, e & 0x0f);
            if (r.bad || range == 0 || begin + range < begin)
                return DBR_E_INVAL;
            fdes[n].lo = begin;
            fdes[n].hi = begin + range;
            fdes[n].fde = addr + off;
            fdes[n].blob = addr;
            n++;
        }
        off += 4 + rlen;
    }
    if (n == 0)
        return DBR_E_INVAL;
    for (i = 0; i < n; i++)
        if (!dbr_buffer_containing(fdes[i].lo, fdes[i].hi - fdes[i].lo))
            return DBR_E_TARGET;
    dbr_sort(fdes, n, sizeof fdes[0], ent_cmp);
    for (i = 1; i < n; i++)
        if (fdes[i].lo < fdes[i - 1].hi)
            return DBR_E_BUSY;
    *n_fdes = n;
    return DBR_OK;
}

int dbr_frames_add(uint32_t region_id, uint64_t addr, uint64_t len)
{
    static struct frame_ent fdes[BLOB_FDES_MAX];    /* g_agent_mu */
    uint64_t lo, hi;
    unsigned n = 0, i, j, k, total;
    int rc;

    if (dbr_region_code(region_id, &lo, &hi) != DBR_OK)
        return DBR_E_UNKNOWN;
    if (addr % 8)
        return DBR_E_ALIGN;
    rc = frames_check(addr, len, fdes, &n);
    if (rc != DBR_OK)
        return rc;
    for (i = 0; i < g_fr_n; i++)
        if (g_fr[i].blob == addr)
            return DBR_E_BUSY;
    for (i = 0, j = 0; g_fr && i < n; i++) {      /* both sorted: one merge-like pass */
        while (j < g_fr_n && g_fr[j].hi <= fdes[i].lo)
            j++;
        if (j < g_fr_n && g_fr[j].lo < fdes[i].hi)
            return DBR_E_BUSY;
    }
    if (g_fr_n + n > FRAMES_MAX)
        return DBR_E_LIMIT;
    if (!g_fr) {
        struct frame_ent *t = dbr_alloc(FRAMES_MAX * sizeof *g_fr);
        if (!t)
            return DBR_E_NOMEM;
        __atomic_store_n(&g_fr, t, __ATOMIC_RELEASE);
    }
    for (i = 0; i < n; i++)
        fdes[i].region_id = region_id;
    /* merge from the top down, so that the entries below the one written stay sorted */
    total = g_fr_n + n;
    write_begin();
    for (i = n, j = g_fr_n, k = total; i > 0;) {
        if (j > 0 && g_fr[j - 1].lo > fdes[i - 1].lo) {
            ent_store(&g_fr[--k], &g_fr[j - 1]);
            j--;
        } else {
            ent_store(&g_fr[--k], &fdes[i - 1]);
            i--;
        }
    }
    __atomic_store_n(&g_fr_n, total, __ATOMIC_RELAXED);
    write_end();
    dbr_log("frames: region %u, %u FDEs from %#lx [%#lx,%#lx)", region_id, n,
            (unsigned long)addr, (unsigned long)fdes[0].lo, (unsigned long)fdes[n - 1].hi);
    return DBR_OK;
}
