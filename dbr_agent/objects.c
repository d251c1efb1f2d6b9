/*
 * objects.c — the loaded ELF objects: the main executable's GNU build-id,
 * the agent's own mapped range, and DBR_MAP_DLOPEN notices for objects that
 * appear during a session (found by polling dl_iterate_phdr's dlpi_adds from
 * the agent thread: interposing dlopen would change which object the loader
 * sees as the caller, and so its RUNPATH/$ORIGIN search).
 */
#include <dlfcn.h>
#include <link.h>
#include <string.h>

#include "agent.h"

#define KNOWN_OBJS_MAX 1024u

uint8_t g_build_id[DBR_BUILD_ID_MAX];
uint32_t g_build_id_len;

/* objects already known to the service (dlopen notices) */
static uint64_t g_known_objs[KNOWN_OBJS_MAX];
static unsigned g_n_known;
static unsigned long long g_dl_adds;

struct obj_scan {
    int mode;            /* 0: snapshot known set, 1: notify new ones */
    unsigned long long adds;
};

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

static int obj_scan_cb(struct dl_phdr_info *info, size_t size, void *data)
{
    struct obj_scan *s = data;
    uint64_t lo, hi;
    unsigned i;

    (void)size;
    s->adds = info->dlpi_adds;
    dbr_obj_range(info, &lo, &hi);
    if (hi == 0)
        return 0;
    for (i = 0; i < g_n_known; i++)
        if (g_known_objs[i] == lo)
            return 0;
    if (g_n_known < KNOWN_OBJS_MAX)
        g_known_objs[g_n_known++] = lo;
    if (s->mode == 1)
        dbr_map_changed_advise(DBR_MAP_DLOPEN, lo, hi);
    return 0;
}

static void objects_scan(int notify)
{
    struct obj_scan s = { notify, 0 };

    if (!notify)
        g_n_known = 0;
    dl_iterate_phdr(obj_scan_cb, &s);
    g_dl_adds = s.adds;
}

static int adds_cb(struct dl_phdr_info *info, size_t size, void *data)
{
    (void)size;
    *(unsigned long long *)data = info->dlpi_adds;
    return 1;
}

void dbr_objects_snapshot(void)
{
    objects_scan(0);
}

void dbr_objects_poll(void)
{
    unsigned long long adds = 0;

    dl_iterate_phdr(adds_cb, &adds);
    if (adds != g_dl_adds)
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
