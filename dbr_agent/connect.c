/*
 * connect.c — reaching the service: the checks of the runtime dir and of the
 * listener the agent trusts, the connection, HELLO, and the quiet the agent's
 * thread keeps while the program starts (the service's hint, read from that
 * runtime dir).
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "session.h"

#define SEND_TIMEOUT_MS  2000u

/* ---------------- what the agent trusts ----------------
 *
 * The service sends code that the agent runs in its process, as whoever the
 * process is: the agent talks only to a listener it trusts.  The runtime dir
 * must be a directory (not a symbolic link), owned by root or by our effective
 * uid, and writable by no one else: nobody else can then put a socket or a
 * hint file there, nor move ours aside.  It is opened once and everything in
 * it is reached through that descriptor, so no path is looked up again after
 * the check.  The listener must run as root or as our effective uid
 * (SO_PEERCRED: the credentials it had at listen()).  Anything else: no HELLO,
 * no hint read; the agent stays dormant and tries again later.  Each reason is
 * logged once (DBR_AGENT_DEBUG). */
enum {
    DISTRUST_DIR = 1u,      /* cannot be opened as a directory without following a link */
    DISTRUST_OWNER = 2u,
    DISTRUST_MODE = 4u,
    DISTRUST_SOCK = 8u,     /* agent.sock is not a socket */
    DISTRUST_PROC = 16u,    /* no connection through /proc/thread-self/fd */
    DISTRUST_PEER = 32u,
};
static unsigned g_distrust_said;

static int say_once(unsigned reason)
{
    return !(__atomic_fetch_or(&g_distrust_said, reason, __ATOMIC_RELAXED) & reason);
}

/* Root, the agent's own euid, or the service uid the process's owner named */
static int trusted_uid(uid_t uid)
{
    return uid == 0 || uid == geteuid() ||
           (g_cfg.service_uid >= 0 && (long)uid == g_cfg.service_uid);
}

/* The runtime dir (agent.sock's), opened if it can be trusted, else -1.  Its
 * path goes to dir (cap bytes), the socket's name in it to *name, its fstat to
 * *st.  Trailing slashes are dropped: "link/" would follow the link despite
 * O_NOFOLLOW. */
static int open_runtime_dir(char *dir, size_t cap, const char **name, struct stat *st)
{
    const char *slash = strrchr(g_cfg.sock_path, '/');
    size_t len;
    uid_t me;
    int fd;

    if (!slash || !slash[1])
        return -1;
    *name = slash + 1;
    len = (size_t)(slash - g_cfg.sock_path);
    while (len > 1 && g_cfg.sock_path[len - 1] == '/')
        len--;
    if (len == 0)
        len = 1;   /* "/agent.sock": the root dir */
    if (len >= cap)
        return -1;
    memcpy(dir, g_cfg.sock_path, len);
    dir[len] = 0;
    fd = open(dir, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) {
        if (errno != ENOENT && say_once(DISTRUST_DIR))
            dbr_log("not connecting: %s %s (errno %d)", dir,
                    errno == ELOOP || errno == ENOTDIR ? "is a symbolic link or not a directory"
                                                       : "cannot be opened", errno);
        return -1;
    }
    if (fstat(fd, st) < 0 || !S_ISDIR(st->st_mode)) {
        close(fd);
        return -1;
    }
    if (!trusted_uid(st->st_uid)) {
        me = geteuid();
        if (say_once(DISTRUST_OWNER))
            dbr_log("not connecting: %s is owned by uid %u, neither root nor %u", dir,
                    (unsigned)st->st_uid, (unsigned)me);
        close(fd);
        return -1;
    }
    if (st->st_mode & 022) {
        if (say_once(DISTRUST_MODE))
            dbr_log("not connecting: %s is writable by group or others (mode %04o)", dir,
                    (unsigned)(st->st_mode & 07777));
        close(fd);
        return -1;
    }
    return fd;
}

/* Close one of the agent's fds only if it is still the file it opened (the
 * program may have closed the number and reused it meanwhile) */
static void close_own(int fd, const struct stat *was)
{
    struct fd_id id = { was->st_dev, was->st_ino };

    if (dbr_fd_is(fd, &id))
        close(fd);
}

/* ---------------- connecting ---------------- */

/* A connection to the service in a trusted runtime dir, from a trusted
 * listener (above), or -1.  The socket file is opened with O_PATH (no
 * link followed), checked, and connected to through /proc/thread-self/fd:
 * the connection reaches that very file.  thread-self, not self: once main
 * has ended (pthread_exit) /proc/self/fd is gone. */
int dbr_connect_service(void)
{
    struct sockaddr_un sa;
    struct timeval tv = { SEND_TIMEOUT_MS / 1000u, (SEND_TIMEOUT_MS % 1000u) * 1000 };
    struct ucred peer;
    socklen_t peer_len = sizeof peer;
    char dir[sizeof g_cfg.sock_path];
    const char *name;
    struct stat st;
    int fd, dfd, sfd, fl, rc, e;
    uid_t me;

    if (!g_cfg.sock_path[0])
        return -1;
    dfd = open_runtime_dir(dir, sizeof dir, &name, &st);
    if (dfd < 0)
        return -1;
    sfd = openat(dfd, name, O_PATH | O_NOFOLLOW | O_CLOEXEC);
    close_own(dfd, &st);
    if (sfd < 0)
        return -1;
    if (fstat(sfd, &st) < 0 || !S_ISSOCK(st.st_mode)) {
        if (say_once(DISTRUST_SOCK))
            dbr_log("not connecting: %s/%s is not a socket", dir, name);
        close(sfd);
        return -1;
    }
    fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) {
        close_own(sfd, &st);
        return -1;
    }
    memset(&sa, 0, sizeof sa);
    sa.sun_family = AF_UNIX;
    snprintf(sa.sun_path, sizeof sa.sun_path, "/proc/thread-self/fd/%d", sfd);
    rc = connect(fd, (struct sockaddr *)&sa, sizeof sa);
    e = errno;
    close_own(sfd, &st);
    if (rc < 0) {
        /* ENOENT, ENOTDIR: no /proc here (refused, stale: ECONNREFUSED, EACCES) */
        if ((e == ENOENT || e == ENOTDIR) && say_once(DISTRUST_PROC))
            dbr_log("not connecting: no connection through /proc/thread-self/fd (errno %d)", e);
        close(fd);
        return -1;
    }
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &peer, &peer_len) < 0 || peer_len < sizeof peer)
        peer.uid = (uid_t)-1;
    me = geteuid();
    if (!trusted_uid(peer.uid)) {
        if (say_once(DISTRUST_PEER))
            dbr_log("not connecting: listener uid %d is neither root nor %u", (int)peer.uid,
                    (unsigned)me);
        close(fd);
        return -1;
    }
    fl = fcntl(fd, F_GETFL);
    fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    return fd;
}

int dbr_send_hello(void)
{
    struct dbr_hello m;
    ssize_t k;

    memset(&m, 0, sizeof m);
    m.pid = (uint32_t)getpid();
    m.ppid = (uint32_t)getppid();
    m.uid = (uint32_t)getuid();
    m.flags = (g_sync_avail ? DBR_HELLO_SYNC_CORE : 0) | (g_forked ? DBR_HELLO_FORKED : 0) |
              (g_forked && dbr_any_installed() ? DBR_HELLO_INHERITED : 0) |
              (dbr_thread_hidden() ? DBR_HELLO_HIDDEN_THREAD : 0) |
              /* attached: pthread_create is not interposed, so no thread notices at all */
              (g_attached ? DBR_HELLO_ATTACHED : DBR_HELLO_QUIET_THREADS) |
              DBR_HELLO_SAMPLER_LISTED | DBR_HELLO_EVICT |
              DBR_HELLO_FRAMES | DBR_HELLO_ENTRY_SITES;
    m.agent_version = DBR_AGENT_VERSION;
    m.n_threads = (uint32_t)dbr_count_threads();
    m.page_size = (uint32_t)dbr_page_size();
    m.census_signal = (uint32_t)g_cfg.census_sig;
    m.sampler_signal = (uint32_t)g_cfg.sampler_sig;
    m.build_id_len = g_build_id_len;
    memcpy(m.build_id, g_build_id, g_build_id_len);
    /* thread-self: once main has ended (pthread_exit) /proc/self/exe is unreadable */
    k = readlink("/proc/thread-self/exe", m.exe, sizeof m.exe - 1);
    if (k < 0)
        k = readlink("/proc/self/exe", m.exe, sizeof m.exe - 1);
    if (k < 0)
        m.exe[0] = 0;
    return dbr_send(&m, DBR_MSG_HELLO, sizeof m, -1, 0);
}

/* ---- quiet while the program starts ----
 *
 * For its first DBR_AGENT_QUIET_MS (default DBR_QUIET_DEFAULT_MS) the agent's
 * thread only waits: no connection, no HELLO, no /proc reads.  A program's
 * first tens of milliseconds are when the scheduler knows least about its
 * threads (their load and utilisation averages are young), and any extra
 * activity then, on the program's CPUs or the service's threads woken by it,
 * tips where the program's first threads are placed: a thread put beside a busy
 * one waits for the next tick.  Measured with a copy of bench `churn` that
 * times each start and join
 * (docs/decisions/0006-agent-quiet-while-the-program-starts.md):
 * stalls of over 1 ms in the loop's first 40 ms, per run, were 2.7 natively,
 * 6.9 with the agent's thread born at the program's policy and connecting at
 * once, 4.0-4.7 with it quiet for 30, 60 or 120 ms.  A thread that only exists
 * and sleeps for good gave 3.8-4.1: the birth itself is the rest.  A service
 * run with --aggressive has it 0 (below): it wants code patched from the
 * program's first moments.  A program that ends within the quiet never had a
 * session (the service does not sample such young clients anyway). */

/* A small file in the runtime dir (dfd), NUL-terminated in buf: the bytes
 * read (0 when the read fails), or -1 if it cannot be opened.  O_NONBLOCK: a
 * FIFO put there must not hold the program; O_NOFOLLOW: nor a link. */
static ssize_t read_small_at(int dfd, const char *name, char *buf, size_t cap)
{
    return dbr_read_small_at(dfd, name, O_NOFOLLOW | O_NONBLOCK, buf, cap);
}

/* A later birth for this program (DBR_QUIET_PROGRAM beside DBR_QUIET_FILE): a
 * service that saw the program's last runs each end within its short_run_s, with
 * nothing installed, writes that age for it (dbr_service/daemon/shortruns.py), and its
 * later runs that end as soon make no thread at all.  The key names the executable
 * by device, inode and mtime (a rebuilt program is another one).  Two more system
 * calls, only under a hint above 0; it can only make the birth later.  Read from
 * the runtime dir dfd (path dir); `from` is made to name the file that set *ms,
 * for the log. */
static void program_hint(int dfd, const char *dir, char *from, size_t from_len, unsigned *ms)
{
    char name[sizeof DBR_QUIET_FILE + 64], buf[16];
    struct stat st;
    unsigned later;

    if (stat("/proc/self/exe", &st) < 0)
        return;
    snprintf(name, sizeof name, DBR_QUIET_PROGRAM, (unsigned long)st.st_dev,
             (unsigned long)st.st_ino, (unsigned long long)st.st_mtim.tv_sec);
    if (read_small_at(dfd, name, buf, sizeof buf) < 0)
        return;
    if (dbr_parse_ms(buf, DBR_QUIET_MAX_MS, &later) < 0) {
        dbr_log("%s/%s does not hold a number of ms: ignored", dir, name);
        return;
    }
    if (later != *ms) {      /* later: runs end sooner; earlier: a stored profile */
        *ms = later;
        snprintf(from, from_len, "%s/%s", dir, name);
    }
}

/* Unless DBR_AGENT_QUIET_MS set it, the service says how young a client it
 * samples in DBR_QUIET_FILE beside agent.sock (daemon/service.py, write_quiet_hint:
 * min_client_age_s in ms, 0 under --aggressive): the agent's thread is not
 * needed sooner, and a host service cannot set its clients' environment.  Read
 * in the constructor (six system calls, two more for program_hint: the birth
 * is planned there), only from a runtime dir the agent trusts (open_runtime_dir):
 * another user's hint could keep its thread from ever being born.  A missing
 * or unreadable file, one that does not hold a number (logged), or a dir not
 * trusted, leaves the default. */
static int quiet_hint(char *from, size_t from_len, unsigned *ms)
{
    char dir[sizeof g_cfg.sock_path], buf[16];
    const char *name;
    struct stat st;
    int dfd, got = 0;

    if (g_cfg.quiet_from_env || !g_cfg.sock_path[0])
        return 0;
    dfd = open_runtime_dir(dir, sizeof dir, &name, &st);
    if (dfd < 0)
        return 0;
    snprintf(from, from_len, "%s/%s", dir, DBR_QUIET_FILE);
    if (read_small_at(dfd, DBR_QUIET_FILE, buf, sizeof buf) < 0)
        goto out;
    if (dbr_parse_ms(buf, DBR_QUIET_MAX_MS, ms) < 0) {
        dbr_log("%s does not hold a number of ms: ignored", from);
        goto out;
    }
    if (*ms)
        program_hint(dfd, dir, from, from_len, ms);
    got = 1;
out:
    close(dfd);
    return got;
}

/* The quiet, and whether the service's hint set it (*hinted) */
unsigned dbr_quiet_ms(int *hinted)
{
    char from[sizeof g_cfg.sock_path + sizeof DBR_QUIET_FILE + 64];
    unsigned ms = g_cfg.quiet_ms;

    *hinted = quiet_hint(from, sizeof from, &ms);
    if (*hinted)
        dbr_log("agent thread quiet for %u ms (the service's hint, %s)", ms, from);
    else if (ms)
        dbr_log("agent thread quiet for %u ms", ms);
    return ms;
}
