/*
 * util.c — configuration, logging, /proc parsing, raw syscalls.
 */
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
    const char *v = secure_getenv(name);
    char *end;
    long s;

    if (!v || !*v)
        return def;
    s = strtol(v, &end, 0);
    if (*end || s < SIGRTMIN || s > SIGRTMAX)
        return def;
    return (int)s;
}

/* A small file (one read of at most cap - 1 bytes) into buf, NUL-terminated:
 * the bytes read (0 when the read fails), or -1 if it cannot be opened.  path is
 * relative to dfd (AT_FDCWD: as open() takes it); flags are added to
 * O_RDONLY | O_CLOEXEC. */
ssize_t dbr_read_small_at(int dfd, const char *path, int flags, char *buf, size_t cap)
{
    ssize_t n;
    int fd = openat(dfd, path, O_RDONLY | O_CLOEXEC | flags);

    if (fd < 0)
        return -1;
    n = read(fd, buf, cap - 1);
    close(fd);
    if (n < 0)
        n = 0;
    buf[n] = 0;
    return n;
}

ssize_t dbr_read_small(const char *path, int flags, char *buf, size_t cap)
{
    return dbr_read_small_at(AT_FDCWD, path, flags, buf, cap);
}

/* The value of field `key` ("\nName:") of a /proc status file, read into buf:
 * its first character after the blanks, or NULL. */
static const char *status_field(const char *path, const char *key, char *buf, size_t cap)
{
    const char *p;

    if (dbr_read_small(path, 0, buf, cap) <= 0)
        return NULL;
    p = strstr(buf, key);
    if (!p)
        return NULL;
    for (p += strlen(key); *p == ' ' || *p == '\t'; p++)
        ;
    return p;
}

/* The seccomp mode of the calling thread ("Seccomp:" of /proc/thread-self/status):
 * 0 none, 1 strict, 2 filter, -1 unknown. */
static int seccomp_mode(void)
{
    char buf[4096];
    const char *p = status_field("/proc/thread-self/status", "\nSeccomp:", buf, sizeof buf);

    return p && *p >= '0' && *p <= '9' ? *p - '0' : -1;
}

/* A count of milliseconds as the user or the service wrote it: decimal digits
 * after optional blanks, then optionally one newline; over max is max.  0, or -1
 * for anything else (a sign, other characters, nothing). */
int dbr_parse_ms(const char *s, unsigned max, unsigned *out)
{
    unsigned long q;
    char *end;

    while (*s == ' ' || *s == '\t')
        s++;
    if (*s < '0' || *s > '9')
        return -1;
    q = strtoul(s, &end, 10);
    if (*end == '\n')
        end++;
    if (*end)
        return -1;
    *out = q > max ? max : (unsigned)q;
    return 0;
}

/* Every DBR_* variable (and XDG_RUNTIME_DIR) is read with secure_getenv: in a
 * set-user-ID or capability-raising exec (AT_SECURE) they come from a user who
 * is not the process's owner, and must not choose its service.  The agent then
 * keeps its defaults: /run/dbr only if the real uid is root, else no service. */
void dbr_config_load(void)
{
    const char *v, *dir;
    char tmp[sizeof g_cfg.sock_path + 16];
    int n;

    v = secure_getenv("DBR_AGENT_DISABLE");
    g_cfg.disabled = v && strcmp(v, "1") == 0;
    v = secure_getenv("DBR_AGENT_DEBUG");
    g_cfg.debug = v && strcmp(v, "1") == 0;
    /* A seccomp filter inherited across exec (systemd's SystemCallFilter=, a
     * sandbox launcher) binds the agent's thread too, and its default action is
     * often to kill the process.  Which calls it allows cannot be known here:
     * the agent stays inert rather than risk the program. */
    if (!g_cfg.disabled && seccomp_mode() > 0) {
        g_cfg.disabled = 1;
        dbr_log("a seccomp filter is in force: the agent stays inert");
    }
    v = secure_getenv("DBR_ON_DISCONNECT");
    g_cfg.on_disconnect_env = -1;
    if (v && strcmp(v, "revert") == 0)
        g_cfg.on_disconnect_env = DBR_DISCONNECT_REVERT;
    else if (v && strcmp(v, "keep") == 0)
        g_cfg.on_disconnect_env = DBR_DISCONNECT_KEEP;
    /* Tests only: a pause between an unwrapped thread start's look at the flags and
     * its clone, the race dbr_wait_unwrapped_starts closes (tests/agent/test_agent_notices.py) */
    v = secure_getenv("DBR_AGENT_TEST_START_DELAY_US");
    g_cfg.start_delay_us = v ? (unsigned)strtoul(v, NULL, 10) % 1000000u : 0;
    /* How long the agent's thread waits before its first connection (agent.c,
     * "quiet while the program starts").  0 connects at once; values over
     * DBR_QUIET_MAX_MS are that maximum.  Not a number: logged, and the value is
     * left to the service's hint (agent.c, quiet_hint) or the default, as when
     * unset. */
    v = secure_getenv("DBR_AGENT_QUIET_MS");
    g_cfg.quiet_ms = DBR_QUIET_DEFAULT_MS;
    g_cfg.quiet_from_env = 0;
    if (v && *v) {
        unsigned q;

        if (dbr_parse_ms(v, DBR_QUIET_MAX_MS, &q) < 0) {
            dbr_log("DBR_AGENT_QUIET_MS=%s is not a number of ms: ignored", v);
        } else {
            g_cfg.quiet_ms = q;
            g_cfg.quiet_from_env = 1;
        }
    }
    g_cfg.census_sig = env_signal("DBR_AGENT_CENSUS_SIGNAL", SIGRTMIN + 8);
    g_cfg.sampler_sig = env_signal("DBR_AGENT_SAMPLER_SIGNAL", SIGRTMIN + 9);
    if (g_cfg.sampler_sig == g_cfg.census_sig)
        g_cfg.sampler_sig = g_cfg.census_sig == SIGRTMIN + 9 ? SIGRTMIN + 8 : SIGRTMIN + 9;

    /* A service that runs as a dedicated user (docs/security.md): its uid,
     * trusted as the listener's and the runtime dir's owner besides root and
     * the agent's own euid.  Only the process's owner sets it (secure_getenv). */
    v = secure_getenv("DBR_SERVICE_UID");
    g_cfg.service_uid = -1;
    if (v && *v) {
        char *end;
        unsigned long u = strtoul(v, &end, 10);

        if (*end || u >= 0xFFFFFFFFul)
            dbr_log("DBR_SERVICE_UID=%s is not a uid: ignored", v);
        else
            g_cfg.service_uid = (long)u;
    }
    g_cfg.sock_path[0] = 0;
    dir = secure_getenv("DBR_RUNTIME_DIR");
    if (dir && *dir) {
        n = snprintf(tmp, sizeof tmp, "%s/agent.sock", dir);
    } else if (getuid() == 0) {
        n = snprintf(tmp, sizeof tmp, "/run/dbr/agent.sock");
    } else {
        dir = secure_getenv("XDG_RUNTIME_DIR");
        n = (dir && *dir) ? snprintf(tmp, sizeof tmp, "%s/dbr/agent.sock", dir) : -1;
    }
    if (n > 0 && n < (int)sizeof g_cfg.sock_path)
        memcpy(g_cfg.sock_path, tmp, (size_t)n + 1);
}

/* ---- memory ----
 *
 * The agent never calls malloc.  Its thread is hidden from glibc (thread.c),
 * and glibc's malloc takes no lock while glibc believes the process has one
 * thread: the agent's thread must not share that heap.  Every block is its own
 * anonymous mapping, made through syscall() (never through the agent's mmap
 * and munmap hooks), preceded by a 16-byte header holding the mapping's length.  The
 * agent allocates rarely (per request, per thread), so a page or more a block
 * costs nothing that matters. */
#define ALLOC_HDR 16u

static size_t alloc_span(size_t size)
{
    size_t ps = (size_t)dbr_page_size();

    if (size > SIZE_MAX - ALLOC_HDR - ps)
        return 0;
    return (size + ALLOC_HDR + ps - 1) & ~(ps - 1);
}

void *dbr_alloc(size_t size)
{
    size_t span = alloc_span(size);
    long p;

    if (!span)
        return NULL;
    p = syscall(SYS_mmap, NULL, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == -1)    /* syscall(): -1 and errno on failure */
        return NULL;
    *(size_t *)p = span;
    return (char *)p + ALLOC_HDR;
}

void dbr_free(void *ptr)
{
    char *base;

    if (!ptr)
        return;
    base = (char *)ptr - ALLOC_HDR;
    syscall(SYS_munmap, base, *(size_t *)base);
}

void *dbr_realloc(void *ptr, size_t size)
{
    char *base;
    size_t span = alloc_span(size), old;
    long p;

    if (!ptr)
        return dbr_alloc(size);
    if (!span)
        return NULL;
    base = (char *)ptr - ALLOC_HDR;
    old = *(size_t *)base;
    if (span <= old)
        return ptr;
    p = syscall(SYS_mremap, base, old, span, MREMAP_MAYMOVE);
    if (p == -1)    /* syscall(): -1 and errno on failure */
        return NULL;
    *(size_t *)p = span;
    return (char *)p + ALLOC_HDR;
}

void dbr_mutex_init(pthread_mutex_t *m)
{
    pthread_mutexattr_t a;

    pthread_mutexattr_init(&a);
    pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED);
    pthread_mutex_init(m, &a);
    pthread_mutexattr_destroy(&a);
}

/* heapsort: qsort may allocate with malloc */
static void sort_swap(char *a, char *b, size_t size)
{
    while (size--) {
        char t = *a;
        *a++ = *b;
        *b++ = t;
    }
}

static void sort_sift(char *base, size_t root, size_t n, size_t size,
                      int (*cmp)(const void *, const void *))
{
    for (;;) {
        size_t child = 2 * root + 1;

        if (child >= n)
            return;
        if (child + 1 < n && cmp(base + child * size, base + (child + 1) * size) < 0)
            child++;
        if (cmp(base + root * size, base + child * size) >= 0)
            return;
        sort_swap(base + root * size, base + child * size, size);
        root = child;
    }
}

void dbr_sort(void *base, size_t n, size_t size, int (*cmp)(const void *, const void *))
{
    char *b = base;
    size_t i;

    if (n < 2)
        return;
    for (i = n / 2; i-- > 0;)
        sort_sift(b, i, n, size, cmp);
    for (i = n - 1; i > 0; i--) {
        sort_swap(b, b + i * size, size);
        sort_sift(b, 0, i, size, cmp);
    }
}

static const char *parse_hex(const char *p, uint64_t *v)
{
    const char *start = p;
    uint64_t x = 0;

    for (;; p++) {
        int d = *p >= '0' && *p <= '9' ? *p - '0' : *p >= 'a' && *p <= 'f' ? *p - 'a' + 10 : -1;
        if (d < 0 || p - start >= 16)
            break;
        x = x << 4 | (uint64_t)d;
    }
    *v = x;
    return p > start ? p : NULL;
}

/* ---- /proc/self/maps ---- */

static char *read_whole(const char *path, size_t *len)
{
    size_t cap = 16384, n = 0;
    char *buf = dbr_alloc(cap), *nb;
    ssize_t k;
    int fd = open(path, O_RDONLY | O_CLOEXEC);

    if (fd < 0 || !buf)
        goto fail;
    for (;;) {
        if (n + 1 >= cap) {
            nb = dbr_realloc(buf, cap * 2);
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
    dbr_free(buf);
    return NULL;
}

int dbr_maps_read(struct dbr_maps *m)
{
    size_t len, cap = 0;
    /* thread-self: after main's pthread_exit the leader is a zombie and
     * /proc/self/maps reads empty (before Linux 3.17: self) */
    char *text = read_whole("/proc/thread-self/maps", &len), *line, *next;
    struct dbr_map_ent *e = NULL, *ne;
    int rc = DBR_OK;

    m->e = NULL;
    m->n = 0;
    if (!text)
        text = read_whole("/proc/self/maps", &len);
    if (!text)
        return DBR_E_NOMEM;
    for (line = text; line < text + len; line = next) {
        uint64_t lo, hi, dev_major = 0, dev_minor = 0, ino = 0;
        const char *p = line, *perms, *path;
        char *nl = memchr(line, '\n', (size_t)(text + len - line));
        int f;

        next = nl ? nl + 1 : text + len;
        if (nl)
            *nl = 0;
        /* "lo-hi perms offset dev inode   path" */
        if (!(p = parse_hex(p, &lo)) || *p++ != '-' || !(p = parse_hex(p, &hi)) || *p++ != ' ')
            continue;
        perms = p;
        if (strlen(perms) < 4)
            continue;
        for (f = 0, path = perms; f < 4 && path; f++) {   /* perms, offset, dev, inode */
            path = strchr(path, ' ');
            if (path)
                path++;
            if (f == 1 && path) {        /* dev "major:minor" in hex */
                const char *q = parse_hex(path, &dev_major);
                dev_minor = 0;
                if (!q || *q != ':' || !parse_hex(q + 1, &dev_minor))
                    dev_major = dev_minor = 0;
            } else if (f == 2 && path) { /* inode, decimal */
                const char *q = path;
                for (ino = 0; *q >= '0' && *q <= '9'; q++)
                    ino = ino * 10 + (uint64_t)(*q - '0');
            }
        }
        if (m->n == cap) {
            cap = cap ? cap * 2 : 256;
            ne = dbr_realloc(e, cap * sizeof *e);
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
        e[m->n].dev = dev_major << 32 | dev_minor;
        e[m->n].ino = ino;
        e[m->n].special = path && (strstr(path, "[vdso]") || strstr(path, "[vvar]") ||
                                   strstr(path, "[vsyscall]"));
        m->n++;
    }
out:
    dbr_free(text);
    m->e = e;
    if (rc != DBR_OK) {
        dbr_free(e);
        m->e = NULL;
        m->n = 0;
    }
    return rc;
}

void dbr_maps_free(struct dbr_maps *m)
{
    dbr_free(m->e);
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

/* getdents64, not opendir: opendir allocates with malloc (see dbr_alloc) */
struct dbr_dirent64 {
    uint64_t d_ino;
    int64_t d_off;
    unsigned short d_reclen;
    unsigned char d_type;
    char d_name[];
};

/* The process's thread count as the kernel keeps it ("Threads:" of the calling
 * thread's status: one number, read at once, counting an ended leader that
 * lingers as a zombie).  Unlike a listing of /proc/self/task, which can skip a
 * live thread while others end during the walk, it never misses one.  -1 unknown. */
static int status_threads(void)
{
    char buf[4096];
    const char *p = status_field("/proc/thread-self/status", "\nThreads:", buf, sizeof buf);
    long n = 0;

    if (!p || *p < '0' || *p > '9')
        return -1;
    for (; *p >= '0' && *p <= '9' && n < (1L << 30); p++)
        n = n * 10 + (*p - '0');
    return (int)n;
}

/* One walk of /proc/self/task: tids found (the first max stored), *calls the
 * getdents calls that returned entries. */
static int list_walk(char *buf, size_t cap, pid_t *tids, int max, int *calls)
{
    int fd = open("/proc/self/task", O_RDONLY | O_DIRECTORY | O_CLOEXEC), n = 0;
    long k, off;

    *calls = 0;
    if (fd < 0)
        return -1;
    while ((k = syscall(SYS_getdents64, fd, buf, cap)) > 0) {
        (*calls)++;
        for (off = 0; off < k; off += ((struct dbr_dirent64 *)(buf + off))->d_reclen) {
            const char *name = ((struct dbr_dirent64 *)(buf + off))->d_name;
            long t = 0;

            if (*name < '0' || *name > '9')
                continue;
            for (; *name >= '0' && *name <= '9' && t < (1L << 31); name++)
                t = t * 10 + (*name - '0');
            if (*name || t <= 0 || t >= (1L << 31))
                continue;
            if (tids && n < max)
                tids[n] = (pid_t)t;
            n++;
        }
    }
    close(fd);
    return k < 0 ? -1 : n;
}

/* The kernel walks a thread group's list from the leader and can stop early
 * while threads end (it stands on one that ended); a later getdents call then
 * resumes by position, and with threads gone that position skips live ones.
 * A walk is taken only when it came in one call and listed at least as many
 * threads as the kernel counted just before it: a walk cut short lists only
 * threads that stand before the one it missed (new threads join at the end),
 * fewer than that count.  So every thread alive through a walk that is taken
 * is in it.  Else it is walked again, with room for every thread.  -1 when no
 * walk was taken (threads ending all the time, or no memory): callers treat
 * the answer as unknown. */
#define LIST_TRIES     32
#define LIST_DIRENT_SZ 32      /* a dirent64 naming a tid of up to 12 digits */

int dbr_list_threads(pid_t *tids, int max)
{
    char small[4096] __attribute__((aligned(8)));
    char *buf = small, *big = NULL;
    size_t cap = sizeof small;
    int try, n = -1, calls, before;

    for (try = 0; try < LIST_TRIES; try++) {
        before = status_threads();
        n = list_walk(buf, cap, tids, max, &calls);
        if (n < 0 || before < 0)
            break;
        if (calls <= 1 && n >= before)
            goto out;
        if (calls > 1) {          /* more than the buffer held: room for all, and some */
            size_t want = ((size_t)(n > before ? n : before) * 2 + 64) * LIST_DIRENT_SZ;

            if (want > cap) {
                dbr_free(big);
                big = dbr_alloc(want);
                if (!big)
                    break;
                buf = big;
                cap = want;
            }
        }
    }
    n = -1;
out:
    dbr_free(big);
    return n;
}

char dbr_thread_state(pid_t tid)
{
    char path[64], buf[512];
    const char *p;

    snprintf(path, sizeof path, "/proc/self/task/%d/stat", (int)tid);
    if (dbr_read_small(path, 0, buf, sizeof buf) <= 0)
        return '?';
    p = strrchr(buf, ')');       /* comm may hold spaces and parentheses */
    return p && p[1] == ' ' && p[2] ? p[2] : '?';
}

/* The thread's blocked-signal mask (SigBlk of /proc/self/task/TID/status, bit
 * n-1 for signal n).  0 read, -1 not readable (the thread has ended). */
int dbr_thread_sigblk(pid_t tid, uint64_t *mask)
{
    char path[64], buf[2048];
    const char *p;
    uint64_t m;

    snprintf(path, sizeof path, "/proc/self/task/%d/status", (int)tid);
    p = status_field(path, "\nSigBlk:", buf, sizeof buf);
    if (!p || !parse_hex(p, &m))
        return -1;
    *mask = m;
    return 0;
}

int dbr_count_threads(void)
{
    int n = dbr_list_threads(NULL, 0);

    return n < 0 ? status_threads() : n;
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
