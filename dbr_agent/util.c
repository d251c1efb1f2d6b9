/*
 * util.c — configuration, logging, /proc parsing, raw syscalls.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#include <linux/membarrier.h>

#include "agent.h"

struct dbr_config g_cfg = { .on_disconnect_env = -1 };

void dbr_log(const char *fmt, ...)
{
    char buf[512];
    int n, k;
    va_list ap;

    if (!g_cfg.debug)
        return;
    n = snprintf(buf, sizeof buf, "dbr-agent[%d]: ", (int)getpid());
    if (n < 0 || n >= (int)sizeof buf)
        return;
    va_start(ap, fmt);
    k = vsnprintf(buf + n, sizeof buf - n - 1, fmt, ap);
    va_end(ap);
    if (k < 0)
        return;
    n += k;
    if (n > (int)sizeof buf - 2)
        n = (int)sizeof buf - 2;
    buf[n++] = '\n';
    if (write(2, buf, n) < 0) {
        /* nothing to do */
    }
}

pid_t dbr_gettid(void)
{
    return (pid_t)syscall(SYS_gettid);
}

uint64_t dbr_now_ms(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

void dbr_sleep_ms(unsigned ms)
{
    struct timespec ts = { ms / 1000u, (long)(ms % 1000u) * 1000000L };

    while (nanosleep(&ts, &ts) < 0 && errno == EINTR)
        ;
}

long dbr_page_size(void)
{
    static long ps;

    if (!ps)
        ps = sysconf(_SC_PAGESIZE);
    return ps;
}

static int env_signal(const char *name, int def)
{
    const char *v = getenv(name);
    char *end;
    long s;

    if (!v || !*v)
        return def;
    s = strtol(v, &end, 0);
    if (*end || s < SIGRTMIN || s > SIGRTMAX)
        return def;
    return (int)s;
}

void dbr_config_load(void)
{
    const char *v, *dir;
    char tmp[sizeof g_cfg.sock_path + 16];
    int n;

    v = getenv("DBR_AGENT_DISABLE");
    g_cfg.disabled = v && strcmp(v, "1") == 0;
    v = getenv("DBR_AGENT_DEBUG");
    g_cfg.debug = v && strcmp(v, "1") == 0;
    v = getenv("DBR_ON_DISCONNECT");
    g_cfg.on_disconnect_env = -1;
    if (v && strcmp(v, "revert") == 0)
        g_cfg.on_disconnect_env = DBR_DISCONNECT_REVERT;
    else if (v && strcmp(v, "keep") == 0)
        g_cfg.on_disconnect_env = DBR_DISCONNECT_KEEP;
    g_cfg.census_sig = env_signal("DBR_AGENT_CENSUS_SIGNAL", SIGRTMIN + 8);
    g_cfg.sampler_sig = env_signal("DBR_AGENT_SAMPLER_SIGNAL", SIGRTMIN + 9);
    if (g_cfg.sampler_sig == g_cfg.census_sig)
        g_cfg.sampler_sig = g_cfg.census_sig == SIGRTMIN + 9 ? SIGRTMIN + 8 : SIGRTMIN + 9;

    g_cfg.sock_path[0] = 0;
    dir = getenv("DBR_RUNTIME_DIR");
    if (dir && *dir) {
        n = snprintf(tmp, sizeof tmp, "%s/agent.sock", dir);
    } else if (getuid() == 0) {
        n = snprintf(tmp, sizeof tmp, "/run/dbr/agent.sock");
    } else {
        dir = getenv("XDG_RUNTIME_DIR");
        n = (dir && *dir) ? snprintf(tmp, sizeof tmp, "%s/dbr/agent.sock", dir) : -1;
    }
    if (n > 0 && n < (int)sizeof g_cfg.sock_path)
        memcpy(g_cfg.sock_path, tmp, (size_t)n + 1);
}

/* ---- /proc/self/maps ---- */

static char *read_whole(const char *path, size_t *len)
{
    size_t cap = 16384, n = 0;
    char *buf = malloc(cap), *nb;
    ssize_t k;
    int fd = open(path, O_RDONLY | O_CLOEXEC);

    if (fd < 0 || !buf)
        goto fail;
    for (;;) {
        if (n + 1 >= cap) {
            nb = realloc(buf, cap * 2);
            if (!nb)
                goto fail;
            buf = nb;
            cap *= 2;
        }
        k = read(fd, buf + n, cap - n - 1);
        if (k < 0 && errno == EINTR)
            continue;
        if (k < 0)
            goto fail;
        if (k == 0)
            break;
        n += (size_t)k;
    }
    close(fd);
    buf[n] = 0;
    *len = n;
    return buf;
fail:
    if (fd >= 0)
        close(fd);
    free(buf);
    return NULL;
}

int dbr_maps_read(struct dbr_maps *m)
{
    size_t len, cap = 0;
    /* thread-self: after main's pthread_exit the leader is a zombie and
     * /proc/self/maps reads empty (before Linux 3.17: self) */
    char *text = read_whole("/proc/thread-self/maps", &len), *line, *save = NULL;
    struct dbr_map_ent *e = NULL, *ne;
    int rc = DBR_OK;

    m->e = NULL;
    m->n = 0;
    if (!text)
        text = read_whole("/proc/self/maps", &len);
    if (!text)
        return DBR_E_NOMEM;
    for (line = strtok_r(text, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        unsigned long lo, hi;
        char perms[8] = "";
        int off = 0;

        if (sscanf(line, "%lx-%lx %7s %*s %*s %*s%n", &lo, &hi, perms, &off) < 3)
            continue;
        if (m->n == cap) {
            cap = cap ? cap * 2 : 256;
            ne = realloc(e, cap * sizeof *e);
            if (!ne) {
                rc = DBR_E_NOMEM;
                goto out;
            }
            e = ne;
        }
        e[m->n].lo = lo;
        e[m->n].hi = hi;
        e[m->n].prot = (perms[0] == 'r' ? PROT_READ : 0) | (perms[1] == 'w' ? PROT_WRITE : 0) |
                       (perms[2] == 'x' ? PROT_EXEC : 0);
        e[m->n].shared = perms[3] == 's';
        e[m->n].special = off > 0 && (strstr(line + off, "[vdso]") || strstr(line + off, "[vvar]") ||
                                      strstr(line + off, "[vsyscall]"));
        m->n++;
    }
out:
    free(text);
    m->e = e;
    if (rc != DBR_OK) {
        free(e);
        m->e = NULL;
        m->n = 0;
    }
    return rc;
}

void dbr_maps_free(struct dbr_maps *m)
{
    free(m->e);
    m->e = NULL;
    m->n = 0;
}

const struct dbr_map_ent *dbr_maps_find(const struct dbr_maps *m, uint64_t addr)
{
    size_t lo = 0, hi = m->n;

    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (addr < m->e[mid].lo)
            hi = mid;
        else if (addr >= m->e[mid].hi)
            lo = mid + 1;
        else
            return &m->e[mid];
    }
    return NULL;
}

int dbr_list_threads(pid_t *tids, int max)
{
    DIR *d = opendir("/proc/self/task");
    struct dirent *de;
    int n = 0;

    if (!d)
        return 0;
    while ((de = readdir(d)) != NULL) {
        char *end;
        long t;

        if (de->d_name[0] < '0' || de->d_name[0] > '9')
            continue;
        t = strtol(de->d_name, &end, 10);
        if (*end || t <= 0)
            continue;
        if (tids && n < max)
            tids[n] = (pid_t)t;
        n++;
    }
    closedir(d);
    return n;
}

char dbr_thread_state(pid_t tid)
{
    char path[64], buf[512];
    const char *p;
    ssize_t n;
    int fd;

    snprintf(path, sizeof path, "/proc/self/task/%d/stat", (int)tid);
    fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return '?';
    n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0)
        return '?';
    buf[n] = 0;
    p = strrchr(buf, ')');       /* comm may hold spaces and parentheses */
    return p && p[1] == ' ' && p[2] ? p[2] : '?';
}

int dbr_count_threads(void)
{
    return dbr_list_threads(NULL, 0);
}

int dbr_sys_mprotect(void *addr, size_t len, int prot)
{
    return (int)syscall(SYS_mprotect, addr, len, prot);
}

int dbr_sys_munmap(void *addr, size_t len)
{
    return (int)syscall(SYS_munmap, addr, len);
}

int dbr_membarrier_sync(void)
{
    return (int)syscall(SYS_membarrier, MEMBARRIER_CMD_PRIVATE_EXPEDITED_SYNC_CORE, 0, 0);
}
