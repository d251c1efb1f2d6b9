/*
 * buffers.c — code buffers: memfd-backed R-X mappings within +-2 GiB of a
 * requested address.  The client mapping is never writable (W^X); the service
 * writes through its own RW mapping of the memfd.  Data buffers (DBR_BUFFER_F_DATA)
 * are placed the same way but mapped RW and never executable: counters that
 * replacement code increments RIP-relatively and the service reads.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "agent.h"

#ifndef MAP_FIXED_NOREPLACE
#define MAP_FIXED_NOREPLACE 0x100000
#endif
#ifndef MFD_EXEC
#define MFD_EXEC 0x10u
#endif

#define REACH_MARGIN  (64u * 1024u)                      /* slack kept inside rel32 reach */
#define REACH         ((uint64_t)(1u << 31) - REACH_MARGIN)
#define USER_LO       0x10000ull                         /* above mmap_min_addr */
#define USER_HI       0x7ffffffff000ull                  /* top of the 47-bit user half */
#define MAX_CANDIDATES 64

struct dbr_buffer g_buffers[DBR_BUFFER_TABLE_MAX];
unsigned g_n_buffers;
static uint32_t next_buffer_id = 1;

struct cand {
    uint64_t addr, dist;
};

static int cand_cmp(const void *a, const void *b)
{
    const struct cand *x = a, *y = b;

    return x->dist < y->dist ? -1 : x->dist > y->dist;
}

static uint64_t absdiff(uint64_t a, uint64_t b)
{
    return a > b ? a - b : b - a;
}

/* The gap [glo, ghi) clipped to the window: best-placed buffer start, or 0. */
static uint64_t place_in_gap(uint64_t glo, uint64_t ghi, uint64_t wlo, uint64_t whi,
                             uint64_t near, uint64_t size, uint64_t pg)
{
    uint64_t lo = glo > wlo ? glo : wlo, hi = ghi < whi ? ghi : whi, a;

    lo = (lo + pg - 1) & ~(pg - 1);
    hi &= ~(pg - 1);
    if (hi <= lo || hi - lo < size)
        return 0;
    a = near & ~(pg - 1);          /* as close to `near` as the gap allows */
    if (a < lo)
        a = lo;
    if (a > hi - size)
        a = hi - size;
    return a;
}

static int make_memfd(int data)
{
    int fd;

    if (data)
        return (int)syscall(SYS_memfd_create, "dbr-data", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    fd = (int)syscall(SYS_memfd_create, "dbr-code", MFD_CLOEXEC | MFD_EXEC | MFD_ALLOW_SEALING);
    if (fd < 0 && errno == EINVAL)
        fd = (int)syscall(SYS_memfd_create, "dbr-code", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    return fd;
}

/* Size a memfd and seal its size: the service maps it too, and a file shrunk under
 * that mapping would kill the service (SIGBUS) on its next write; the service
 * refuses a buffer without F_SEAL_SHRINK.  0, or -1 with errno. */
int dbr_memfd_size_sealed(int fd, uint64_t size)
{
    if (ftruncate(fd, (off_t)size) < 0)
        return -1;
    return fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
}

int dbr_buffer_alloc(uint64_t near, uint64_t size, uint32_t flags, uint32_t *id,
                     uint64_t *base, uint64_t *rsize, int *fd_out)
{
    uint64_t pg = (uint64_t)dbr_page_size(), wlo, whi, prev;
    struct dbr_maps maps = { 0 };
    struct cand cands[MAX_CANDIDATES];
    int nc = 0, fd = -1, rc = DBR_E_RANGE, slot = -1, data = (flags & DBR_BUFFER_F_DATA) != 0;
    int prot = data ? PROT_READ | PROT_WRITE : PROT_READ | PROT_EXEC;
    void *p = MAP_FAILED;
    size_t i;

    *fd_out = -1;
    if (size == 0 || (flags & ~DBR_BUFFER_F_DATA) || (data && size > DBR_DATA_BUFFER_MAX)) {
        rc = DBR_E_INVAL;
        goto out;
    }
    if (size > REACH) {
        rc = DBR_E_RANGE;
        goto out;
    }
    size = (size + pg - 1) & ~(pg - 1);
    for (i = 0; i < DBR_BUFFER_TABLE_MAX; i++)
        if (g_buffers[i].id == 0) {
            slot = (int)i;
            break;
        }
    if (slot < 0) {
        rc = DBR_E_LIMIT;
        goto out;
    }
    /* every byte b of [a, a+size) must satisfy |b - near| < REACH */
    wlo = near > REACH + USER_LO ? near - REACH : USER_LO;
    whi = near < USER_HI - REACH ? near + REACH : USER_HI;
    if (near >= USER_HI || whi <= wlo) {
        rc = DBR_E_RANGE;
        goto out;
    }
    rc = dbr_maps_read(&maps);
    if (rc != DBR_OK)
        goto out;
    prev = USER_LO;
    for (i = 0; i <= maps.n && nc < MAX_CANDIDATES; i++) {
        uint64_t ghi = i < maps.n ? maps.e[i].lo : USER_HI, a;

        if (ghi > prev) {
            a = place_in_gap(prev, ghi, wlo, whi, near, size, pg);
            if (a) {
                cands[nc].addr = a;
                cands[nc].dist = absdiff(a, near) > absdiff(a + size, near) ? absdiff(a, near)
                                                                            : absdiff(a + size, near);
                nc++;
            }
        }
        if (i < maps.n && maps.e[i].hi > prev)
            prev = maps.e[i].hi;
    }
    dbr_maps_free(&maps);
    dbr_sort(cands, (size_t)nc, sizeof cands[0], cand_cmp);

    fd = make_memfd(data);
    if (fd < 0 || dbr_memfd_size_sealed(fd, size) < 0) {
        rc = DBR_E_NOMEM;
        goto out;
    }
    rc = DBR_E_RANGE;
    for (i = 0; i < (size_t)nc; i++) {
        p = mmap((void *)cands[i].addr, size, prot, MAP_SHARED | MAP_FIXED_NOREPLACE, fd, 0);
        if (p == (void *)cands[i].addr)
            break;
        if (p != MAP_FAILED) {           /* kernel without NOREPLACE: treated as a hint */
            dbr_sys_munmap(p, size);
            p = MAP_FAILED;
            continue;
        }
        if (errno == ENOMEM && i + 1 == (size_t)nc)
            rc = DBR_E_NOMEM;
        if (errno != EEXIST && errno != ENOMEM) {
            rc = DBR_E_NOMEM;            /* e.g. EPERM: exec memfd refused */
            break;
        }
    }
    if (p == MAP_FAILED)
        goto out;
    g_buffers[slot].id = next_buffer_id++;
    if (next_buffer_id == 0)
        next_buffer_id = 1;
    g_buffers[slot].flags = data ? DBR_BUFFER_F_DATA : 0;
    g_buffers[slot].base = (uint64_t)p;
    g_buffers[slot].size = size;
    __atomic_add_fetch(&g_n_buffers, 1, __ATOMIC_RELEASE);
    *id = g_buffers[slot].id;
    *base = (uint64_t)p;
    *rsize = size;
    *fd_out = fd;
    fd = -1;
    rc = DBR_OK;
    dbr_log("%s buffer %u at %#lx size %#lx (near %#lx)", data ? "data" : "code", *id,
            (unsigned long)*base, (unsigned long)size, (unsigned long)near);
out:
    if (fd >= 0)
        close(fd);
    return rc;
}

/* a code buffer lies within rel32 reach of data buffer d: its code may address d */
static int code_reaches(const struct dbr_buffer *d)
{
    unsigned i;

    for (i = 0; i < DBR_BUFFER_TABLE_MAX; i++) {
        const struct dbr_buffer *b = &g_buffers[i];
        if (b->id && !(b->flags & DBR_BUFFER_F_DATA) &&
            absdiff(b->base, d->base + d->size) < REACH + REACH_MARGIN &&
            absdiff(b->base + b->size, d->base) < REACH + REACH_MARGIN)
            return 1;
    }
    return 0;
}

int dbr_buffer_free(uint32_t id)
{
    unsigned i;

    if (id == 0)
        return DBR_E_UNKNOWN;
    for (i = 0; i < DBR_BUFFER_TABLE_MAX; i++) {
        if (g_buffers[i].id != id)
            continue;
        if ((g_buffers[i].flags & DBR_BUFFER_F_DATA) ? code_reaches(&g_buffers[i])
                                                     : dbr_sites_target_buffer(id))
            return DBR_E_IN_USE;
        dbr_frames_forget_range(g_buffers[i].base, g_buffers[i].base + g_buffers[i].size);
        dbr_sys_munmap((void *)g_buffers[i].base, g_buffers[i].size);
        g_buffers[i].id = 0;
        __atomic_sub_fetch(&g_n_buffers, 1, __ATOMIC_RELEASE);
        dbr_log("code buffer %u freed", id);
        return DBR_OK;
    }
    return DBR_E_UNKNOWN;
}

const struct dbr_buffer *dbr_buffer_containing(uint64_t addr, uint64_t len)
{
    unsigned i;

    for (i = 0; i < DBR_BUFFER_TABLE_MAX; i++) {
        const struct dbr_buffer *b = &g_buffers[i];
        if (b->id && !(b->flags & DBR_BUFFER_F_DATA) && addr >= b->base && addr - b->base < b->size && len <= b->size - (addr - b->base))
            return b;
    }
    return NULL;
}

int dbr_buffers_intersect(uint64_t lo, uint64_t hi)
{
    unsigned i;

    for (i = 0; i < DBR_BUFFER_TABLE_MAX; i++) {
        const struct dbr_buffer *b = &g_buffers[i];
        if (b->id && b->base < hi && lo < b->base + b->size)
            return 1;
    }
    return 0;
}

/* The program unmapped [lo, hi): drop every buffer it touched from the table
 * (their ids become unknown; installed sites targeting them were restored by
 * the munmap hook before the call). */
void dbr_buffers_forget(uint64_t lo, uint64_t hi)
{
    unsigned i;

    for (i = 0; i < DBR_BUFFER_TABLE_MAX; i++) {
        struct dbr_buffer *b = &g_buffers[i];
        if (b->id && b->base < hi && lo < b->base + b->size) {
            dbr_log("buffer %u unmapped by the program", b->id);
            dbr_frames_forget_range(b->base, b->base + b->size);
            b->id = 0;
            __atomic_sub_fetch(&g_n_buffers, 1, __ATOMIC_RELEASE);
        }
    }
}

/* Fork child: replace every inherited (shared with the parent's memfd) buffer
 * by a private copy at the same address without ever unmapping it. */
void dbr_buffers_privatise(void)
{
    unsigned i;

    for (i = 0; i < DBR_BUFFER_TABLE_MAX; i++) {
        struct dbr_buffer *b = &g_buffers[i];
        void *tmp, *r;

        if (!b->id)
            continue;
        tmp = mmap(NULL, b->size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (tmp == MAP_FAILED)
            continue;
        memcpy(tmp, (void *)b->base, b->size);
        if (!(b->flags & DBR_BUFFER_F_DATA) &&
            dbr_sys_mprotect(tmp, b->size, PROT_READ | PROT_EXEC) < 0) {
            dbr_sys_munmap(tmp, b->size);
            continue;
        }
        r = mremap(tmp, b->size, b->size, MREMAP_MAYMOVE | MREMAP_FIXED, (void *)b->base);
        if (r == MAP_FAILED)
            dbr_sys_munmap(tmp, b->size);
    }
}
