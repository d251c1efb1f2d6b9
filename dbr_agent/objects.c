/*
 * objects.c — the loaded ELF objects: the main executable's GNU build-id,
 * the agent's own mapped range, and DBR_MAP_DLOPEN notices for objects that
 * appear during a session, found by the agent's thread polling
 * /proc/self/maps (interposing dlopen would change which object the loader
 * sees as the caller, and so its RUNPATH/$ORIGIN search).  Not through
 * dl_iterate_phdr: it takes the loader's lock, which program threads lock and
 * unlock without atomics or wake-ups while glibc believes the process has
 * one thread (thread.c).  An object is a run of mappings of one file with at
 * least one executable part; it is known by the start of that run.
 */
#include <dlfcn.h>
#include <link.h>
#include <string.h>
#include <sys/mman.h>

#include "agent.h"

#define KNOWN_OBJS_MAX 1024u

uint8_t g_build_id[DBR_BUILD_ID_MAX];
uint32_t g_build_id_len;

/* objects already known to the service (dlopen notices) */
static struct { uint64_t lo, dev, ino; } g_known_objs[KNOWN_OBJS_MAX];
static unsigned g_n_known;

void dbr_obj_range(struct dl_phdr_info *info, uint64_t *lo, uint64_t *hi)
{
    uint64_t pg = (uint64_t)dbr_page_size();
    int i;

    *lo = *hi = 0;
    for (i = 0; i < info->dlpi_phnum; i++) {
        const ElfW(Phdr) *ph = &info->dlpi_phdr[i];
        uint64_t a, b;

        if (ph->p_type != PT_LOAD)
            continue;
        a = (info->dlpi_addr + ph->p_vaddr) & ~(pg - 1);
        b = (info->dlpi_addr + ph->p_vaddr + ph->p_memsz + pg - 1) & ~(pg - 1);
        if (*hi == 0 || a < *lo)
            *lo = a;
        if (b > *hi)
            *hi = b;
    }
}

/* the agent's own code buffers are memfd mappings: never news */
static int own_buffer(uint64_t lo, uint64_t hi)
{
    int r;

    pthread_mutex_lock(&g_agent_mu);
    r = dbr_buffers_intersect(lo, hi);
    pthread_mutex_unlock(&g_agent_mu);
    return r;
}

static void objects_scan(int notify)
{
    struct dbr_maps m;
    size_t i, j, k;

    if (dbr_maps_read(&m) != DBR_OK)
        return;
    if (!notify)
        g_n_known = 0;
    for (i = 0; i < m.n; i = j) {
        int exec = 0;
        unsigned n;

        for (j = i; j < m.n && m.e[j].ino == m.e[i].ino && m.e[j].dev == m.e[i].dev; j++)
            exec |= m.e[j].prot & PROT_EXEC;
        if (m.e[i].ino == 0 || !exec || m.e[i].special || own_buffer(m.e[i].lo, m.e[j - 1].hi))
            continue;
        for (n = 0; n < g_n_known && !(g_known_objs[n].lo == m.e[i].lo &&
                                        g_known_objs[n].ino == m.e[i].ino &&
                                        g_known_objs[n].dev == m.e[i].dev); n++)
            ;
        if (n < g_n_known)
            continue;
        if (g_n_known < KNOWN_OBJS_MAX) {
            g_known_objs[g_n_known].lo = m.e[i].lo;
            g_known_objs[g_n_known].dev = m.e[i].dev;
            g_known_objs[g_n_known++].ino = m.e[i].ino;
        }
        if (notify)
            dbr_map_changed_advise(DBR_MAP_DLOPEN, m.e[i].lo, m.e[j - 1].hi);
    }
    /* forget objects whose mappings are gone (dlclose): a later object there is new */
    for (k = 0; k < g_n_known;) {
        const struct dbr_map_ent *e = dbr_maps_find(&m, g_known_objs[k].lo);

        if (e && e->ino == g_known_objs[k].ino && e->dev == g_known_objs[k].dev)
            k++;
        else
            g_known_objs[k] = g_known_objs[--g_n_known];
    }
    dbr_maps_free(&m);
}

void dbr_objects_snapshot(void)
{
    objects_scan(0);
}

void dbr_objects_poll(void)
{
    objects_scan(1);
}

struct self_scan {
    const char *agent_name;
};

static int self_scan_cb(struct dl_phdr_info *info, size_t size, void *data)
{
    struct self_scan *s = data;
    int i;

    (void)size;
    if (info->dlpi_name && info->dlpi_name[0] == 0 && g_build_id_len == 0) {
        /* the main executable: GNU build-id from its PT_NOTE segments */
        for (i = 0; i < info->dlpi_phnum && g_build_id_len == 0; i++) {
            const ElfW(Phdr) *ph = &info->dlpi_phdr[i];
            const uint8_t *p, *end;

            if (ph->p_type != PT_NOTE)
                continue;
            p = (const uint8_t *)(info->dlpi_addr + ph->p_vaddr);
            end = p + ph->p_memsz;
            while (p + sizeof(ElfW(Nhdr)) <= end) {
                const ElfW(Nhdr) *nh = (const ElfW(Nhdr) *)p;
                const uint8_t *name = p + sizeof *nh;
                const uint8_t *desc = name + ((nh->n_namesz + 3u) & ~3u);

                if (desc + nh->n_descsz > end)
                    break;
                if (nh->n_type == NT_GNU_BUILD_ID && nh->n_namesz == 4 && memcmp(name, "GNU", 4) == 0) {
                    g_build_id_len = nh->n_descsz < DBR_BUILD_ID_MAX ? nh->n_descsz : DBR_BUILD_ID_MAX;
                    memcpy(g_build_id, desc, g_build_id_len);
                    break;
                }
                p = desc + ((nh->n_descsz + 3u) & ~3u);
            }
        }
    }
    if (s->agent_name && info->dlpi_name && strcmp(info->dlpi_name, s->agent_name) == 0)
        dbr_obj_range(info, &g_agent_lo, &g_agent_hi);
    return 0;
}

void dbr_self_scan(void)
{
    Dl_info di;
    struct self_scan s = { NULL };

    if (dladdr((void *)dbr_self_scan, &di) && di.dli_fname)
        s.agent_name = di.dli_fname;
    dl_iterate_phdr(self_scan_cb, &s);
}
