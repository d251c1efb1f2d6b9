/* birth MODE MS: when the agent's thread is made, under a service hint that plans
 * its birth (dbr_agent/agent.c, "born when the service would look").  Every line
 * printed is "WHAT ..." with times in ms since main started.
 *   busy    run (spin) for MS ms; print "tasks N at T" at the start and at each
 *           change of the task count, then "end tasks N"
 *   sleep   one nanosleep of MS ms: "slept RC ERRNO" (a signal would cut it short:
 *           -1 4), then "end tasks N"
 *   block   block every signal with pthread_sigmask first, then as busy
 *   fork    run MS/2 ms, fork; the child runs 2*MS ms as busy, prefixed "child ",
 *           then prints "parent tasks N" (the parent's, asleep in waitpid all the
 *           while); the parent waits for it, then "end tasks N"
 *   fork-late  the same, the parent running 2*MS ms before it forks
 *   unshare unshare(CLONE_NEWUSER) first ("unshare RC"), then as busy
 *   seccomp install an allow-all seccomp filter on main with prctl first
 *           ("seccomp RC"), then as busy, then "agent seccomp S" for every other
 *           thread (its Seccomp: line; 0 none, 2 filter)
 *   seccomp-sys  the same with syscall(SYS_seccomp), as libseccomp does
 *   pinned  pin main to CPU 0 first, then as busy, then "cpus LIST" for every
 *           other thread (its Cpus_allowed_list)
 *   starts  start and join a thread at once ("start early wrapped W"), then as
 *           busy, then another ("start late wrapped W"): W 1 if the thread's start
 *           routine was called from the agent library (its start wrapper), else 0 */
#define _GNU_SOURCE
#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "tasks.h"

static struct timespec g_t0;
static const char *g_prefix = "";

static long ms_since_start(void)
{
    struct timespec t;

    clock_gettime(CLOCK_MONOTONIC, &t);
    return (t.tv_sec - g_t0.tv_sec) * 1000 + (t.tv_nsec - g_t0.tv_nsec) / 1000000;
}

/* one line of /proc/self/task/TID/status for every thread but this one */
static void others_status(const char *key, const char *what)
{
    pid_t self = (pid_t)syscall(SYS_gettid);
    DIR *d = opendir("/proc/self/task");
    struct dirent *e;
    char path[300], line[256];
    FILE *f;

    if (!d)
        return;
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.' || atoi(e->d_name) == self)
            continue;
        snprintf(path, sizeof path, "/proc/self/task/%s/status", e->d_name);
        if (!(f = fopen(path, "r")))
            continue;
        while (fgets(line, sizeof line, f))
            if (!strncmp(line, key, strlen(key))) {
                char *v = line + strlen(key);

                v += strspn(v, " \t");
                printf("%s %s", what, v);
            }
        fclose(f);
    }
    closedir(d);
}

static void busy(long ms)
{
    volatile unsigned long x = 0;
    long start = ms_since_start(), now;
    int last = -1, n;

    do {
        for (int i = 0; i < 20000; i++)
            x += i;
        now = ms_since_start();
        n = count_tasks();
        if (n != last) {
            printf("%stasks %d at %ld\n", g_prefix, n, now);
            last = n;
        }
    } while (now - start < ms);
}

/* 1 if called from the agent library: its start wrapper calls the program's
 * routine (not a tail call: it returns through the wrapper) */
__attribute__((noinline)) static void *called_from(void *arg)
{
    Dl_info di;
    void *ra = __builtin_return_address(0);

    (void)arg;
    return (void *)(intptr_t)(dladdr(ra, &di) && di.dli_fname &&
                              strstr(di.dli_fname, "libdbr_agent") != NULL);
}

static int start_one(const char *when)
{
    pthread_t t;
    void *r;

    if (pthread_create(&t, NULL, called_from, NULL) != 0 || pthread_join(t, &r) != 0)
        return -1;
    printf("start %s wrapped %d\n", when, (int)(intptr_t)r);
    return 0;
}

int main(int argc, char **argv)
{
    const char *mode = argc > 1 ? argv[1] : "busy";
    long ms = argc > 2 ? atol(argv[2]) : 1000;

    clock_gettime(CLOCK_MONOTONIC, &g_t0);
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (!strcmp(mode, "busy")) {
        busy(ms);
    } else if (!strcmp(mode, "sleep")) {
        struct timespec s = { ms / 1000, (ms % 1000) * 1000000L };
        int rc = nanosleep(&s, &s);

        printf("slept %d %d\n", rc, rc ? errno : 0);
    } else if (!strcmp(mode, "block")) {
        sigset_t all;

        sigfillset(&all);
        pthread_sigmask(SIG_BLOCK, &all, NULL);
        busy(ms);
    } else if (!strcmp(mode, "fork") || !strcmp(mode, "fork-late")) {
        pid_t p;
        int st;

        busy(!strcmp(mode, "fork") ? ms / 2 : 2 * ms);
        p = fork();
        if (p == 0) {
            clock_gettime(CLOCK_MONOTONIC, &g_t0);
            g_prefix = "child ";
            busy(2 * ms);
            char dir[64];

            snprintf(dir, sizeof dir, "/proc/%d/task", (int)getppid());
            printf("child end tasks %d\n", count_tasks());
            printf("parent tasks %d\n", count_tasks_in(dir));
            fflush(stdout);
            _exit(0);
        }
        if (p < 0 || waitpid(p, &st, 0) != p || !WIFEXITED(st) || WEXITSTATUS(st))
            return 1;
    } else if (!strcmp(mode, "unshare")) {
        printf("unshare %d\n", unshare(CLONE_NEWUSER));
        busy(ms);
    } else if (!strcmp(mode, "seccomp") || !strcmp(mode, "seccomp-sys")) {
        struct sock_filter allow = BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW);
        struct sock_fprog prog = { 1, &allow };

        if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0)
            return 1;
        if (!strcmp(mode, "seccomp"))
            printf("seccomp %d\n", prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog, 0, 0));
        else
            printf("seccomp %ld\n", syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, 0, &prog));
        busy(ms);
        others_status("Seccomp:", "agent seccomp");
    } else if (!strcmp(mode, "pinned")) {
        cpu_set_t one;

        CPU_ZERO(&one);
        CPU_SET(0, &one);
        if (sched_setaffinity(0, sizeof one, &one) != 0)
            return 1;
        busy(ms);
        others_status("Cpus_allowed_list:", "cpus");
    } else if (!strcmp(mode, "starts")) {
        if (start_one("early") < 0)
            return 1;
        busy(ms);
        if (start_one("late") < 0)
            return 1;
    } else {
        return 2;
    }
    printf("end tasks %d\n", count_tasks());
    return 0;
}
