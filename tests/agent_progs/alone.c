/* alone MODE: what glibc believes about this process's threads, with the agent's
 * thread running beside it.
 *   single  print "single S tasks N": __libc_single_threaded (glibc's own word on
 *           whether the process has had a second thread) and the threads the
 *           kernel lists
 *   fork    the same, from a fork child (after its agent thread has started)
 *   creds   (root) drop to nobody with setgroups, setgid and setuid, then print
 *           "creds same N" if every thread of the process has the same uid, gid
 *           and groups as main (N threads), else "creds differ" and the lines
 *   creds-res  the same with setresgid and setresuid
 *   creds-temp (root) seteuid(nobody), compare, seteuid(0) (back through the saved
 *           uid), compare: prints "creds same N" after each step
 *   creds-fail (root) keep capabilities (PR_SET_KEEPCAPS, a per-thread flag) across
 *           setresuid(nobody), compare, raise CAP_SETUID again and setresuid(0):
 *           a thread without the flag cannot follow.  Waits (bounded) for one
 *           task, then compares
 *   spawn   start and join 300 threads one after another; print "spawn woke N": how
 *           often the agent's thread went to sleep meanwhile (its
 *           voluntary_ctxt_switches), or "spawn no agent thread"
 *   spawn-orphan  the same from a second thread, once main has ended with
 *           pthread_exit (the second thread's return then ends the process), with
 *           1 ms between a join and the next start
 *   policy  print "policy P N" for main, then for every other thread: its
 *           scheduling policy (sched_getscheduler) and nice value
 *   creds-early   (root) the drop of creds before "ready", in the agent thread's
 *           first milliseconds; after "go" the comparison, then policy
 *   fork-policy   policy, from a fork child (after its agent thread has started)
 * Prints "ready", waits for a line on stdin (the test's session is up by then). */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <grp.h>
#include <linux/capability.h>
#include <pthread.h>
#include <sched.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <sys/types.h>
#include <unistd.h>

#include "tasks.h"

extern char __libc_single_threaded;

/* the Uid:, Gid: and Groups: lines of one thread */
static void creds_of(const char *tid, char *out, size_t cap)
{
    char path[128], line[512];
    FILE *f;

    snprintf(path, sizeof path, "/proc/self/task/%s/status", tid);
    out[0] = 0;
    if (!(f = fopen(path, "r")))
        return;
    while (fgets(line, sizeof line, f))
        if (!strncmp(line, "Uid:", 4) || !strncmp(line, "Gid:", 4) || !strncmp(line, "Groups:", 7))
            strncat(out, line, cap - strlen(out) - 1);
    fclose(f);
}

/* print "creds same N" if every thread has main's uid, gid and groups */
static int compare_creds(void)
{
    char mine[1024], other[1024], self[32];
    DIR *d;
    struct dirent *e;
    int n = 0;

    snprintf(self, sizeof self, "%d", (int)syscall(SYS_gettid));
    creds_of(self, mine, sizeof mine);
    if (!(d = opendir("/proc/self/task")))
        return 1;
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.')
            continue;
        creds_of(e->d_name, other, sizeof other);
        if (strcmp(mine, other) != 0) {
            printf("creds differ\n%s---\n%s", mine, other);
            closedir(d);
            return 1;
        }
        n++;
    }
    closedir(d);
    printf("creds same %d\n", n);
    return 0;
}

static int drop(int res)
{
    gid_t nobody = 65534;

    if (setgroups(1, &nobody) != 0 || (res ? setresgid(nobody, nobody, nobody) : setgid(nobody)) != 0 ||
        (res ? setresuid(nobody, nobody, nobody) : setuid(nobody)) != 0) {
        perror("drop");
        return 1;
    }
    return 0;
}

static int creds(int res)
{
    return drop(res) || compare_creds();
}

/* a privilege drop undone: the way back needs the saved uid, not the capabilities
 * the thread no longer has */
static int creds_temp(void)
{
    if (seteuid(65534) != 0) {
        perror("seteuid(nobody)");
        return 1;
    }
    if (compare_creds())
        return 1;
    if (seteuid(0) != 0) {
        perror("seteuid(0)");
        return 1;
    }
    return compare_creds();
}

static void single(void)
{
    printf("single %d tasks %d\n", (int)__libc_single_threaded, count_tasks());
}

/* the agent's hidden thread cannot take these credentials: it must step aside */
static int creds_fail(void)
{
    struct __user_cap_header_struct h = { _LINUX_CAPABILITY_VERSION_3, 0 };
    struct __user_cap_data_struct d[2];

    if (prctl(PR_SET_KEEPCAPS, 1L, 0L, 0L, 0L) != 0 || setresuid(65534, 65534, 65534) != 0) {
        perror("keepcaps/setresuid(nobody)");
        return 1;
    }
    if (compare_creds())
        return 1;
    if (syscall(SYS_capget, &h, d) != 0) {
        perror("capget");
        return 1;
    }
    d[0].effective |= 1u << CAP_SETUID;    /* still permitted: KEEPCAPS */
    if (syscall(SYS_capset, &h, d) != 0 || setresuid(0, 0, 0) != 0) {
        perror("capset/setresuid(0)");
        return 1;
    }
    for (int i = 0; i < 300 && count_tasks() > 1; i++)
        usleep(10000);
    return compare_creds();
}

static void *nothing(void *arg)
{
    return arg;
}

/* voluntary_ctxt_switches of the one thread other than main, -1 if none */
static long agent_thread_switches(void)
{
    char path[128], line[256];
    DIR *d = opendir("/proc/self/task");
    struct dirent *e;
    long n = -1;
    int tid = 0;
    FILE *f;

    if (!d)
        return -1;
    while ((e = readdir(d)))
        if (e->d_name[0] != '.' && atoi(e->d_name) != (int)getpid() &&
            atoi(e->d_name) != (int)syscall(SYS_gettid))
            tid = atoi(e->d_name);
    closedir(d);
    if (!tid)
        return -1;
    snprintf(path, sizeof path, "/proc/self/task/%d/status", tid);
    if (!(f = fopen(path, "r")))
        return -1;
    while (fgets(line, sizeof line, f))
        if (!strncmp(line, "voluntary_ctxt_switches:", 24))
            n = atol(line + 24);
    fclose(f);
    return n;
}

static int spawn(unsigned pause_us)
{
    long before = agent_thread_switches(), after;

    for (int i = 0; i < 300; i++) {
        pthread_t t;

        if (pthread_create(&t, NULL, nothing, NULL) != 0 || pthread_join(t, NULL) != 0)
            return 1;
        if (pause_us)
            usleep(pause_us);
    }
    after = agent_thread_switches();
    if (before < 0 || after < 0)
        printf("spawn no agent thread\n");
    else
        printf("spawn woke %ld\n", after - before);
    return 0;
}

/* spawn-orphan: main is a zombie (bounded wait), then spawn */
static void *orphan(void *arg)
{
    char path[64], buf[256];
    const char *p;

    (void)arg;
    snprintf(path, sizeof path, "/proc/self/task/%d/stat", (int)getpid());
    for (int i = 0; i < 5000; i++) {
        FILE *f = fopen(path, "r");
        size_t n = f ? fread(buf, 1, sizeof buf - 1, f) : 0;

        if (f)
            fclose(f);
        buf[n] = 0;
        p = strrchr(buf, ')');
        if (!f || (p && (p[2] == 'Z' || p[2] == 'X')))
            break;
        usleep(1000);
    }
    /* 1 ms after each join: a woken agent thread has time to go back to sleep, so
     * each ending thread's wake-up is counted (back to back, a loaded machine merged
     * them: 75 of 300 once) */
    if (spawn(1000) != 0)
        printf("spawn failed\n");
    return NULL;
}

static void policy_of(pid_t tid)
{
    errno = 0;
    int nice = getpriority(PRIO_PROCESS, (id_t)tid);

    printf("policy %d %d\n", sched_getscheduler(tid), errno ? 99 : nice);
}

static int policy(void)
{
    pid_t self = (pid_t)syscall(SYS_gettid);
    DIR *d = opendir("/proc/self/task");
    struct dirent *e;

    if (!d)
        return 1;
    policy_of(self);
    while ((e = readdir(d)))
        if (e->d_name[0] != '.' && atoi(e->d_name) != self)
            policy_of(atoi(e->d_name));
    closedir(d);
    return 0;
}

static int single_ok(void)
{
    single();
    return 0;
}

/* fn in a fork child, once its agent thread has started (bounded wait); 0 if it
 * returned 0 */
static int in_fork_child(int (*fn)(void))
{
    pid_t p = fork();
    int st;

    if (p == 0) {
        int rc;

        for (int i = 0; i < 200 && count_tasks() < 2; i++)
            usleep(10000);
        rc = fn();
        fflush(stdout);
        _exit(rc);
    }
    return p < 0 || waitpid(p, &st, 0) != p || !WIFEXITED(st) || WEXITSTATUS(st);
}

int main(int argc, char **argv)
{
    const char *mode = argc > 1 ? argv[1] : "single";
    char line[64];

    setvbuf(stdout, NULL, _IOLBF, 0);
    if (!strcmp(mode, "creds-early") && drop(0))   /* while the agent's thread is new */
        return 1;
    printf("ready\n");
    if (!fgets(line, sizeof line, stdin))
        return 2;
    if (!strcmp(mode, "single")) {
        single();
    } else if (!strcmp(mode, "fork")) {
        return in_fork_child(single_ok);
    } else if (!strcmp(mode, "creds") || !strcmp(mode, "creds-res")) {
        return creds(!strcmp(mode, "creds-res"));
    } else if (!strcmp(mode, "creds-temp")) {
        return creds_temp();
    } else if (!strcmp(mode, "creds-fail")) {
        return creds_fail();
    } else if (!strcmp(mode, "spawn")) {
        return spawn(0);
    } else if (!strcmp(mode, "spawn-orphan")) {
        pthread_t t;

        if (pthread_create(&t, NULL, orphan, NULL) != 0)
            return 1;
        pthread_exit(NULL);
    } else if (!strcmp(mode, "policy")) {
        return policy();
    } else if (!strcmp(mode, "creds-early")) {
        return compare_creds() || policy();
    } else if (!strcmp(mode, "fork-policy")) {
        return in_fork_child(policy);
    } else {
        return 2;
    }
    return 0;
}
