/* seccomp MODE [PROG ARGS...]: seccomp filters and the agent's thread.
 *   tsync      prints "ready", waits for a line on stdin (the test's session is up),
 *              installs with SECCOMP_FILTER_FLAG_TSYNC (through syscall(), as
 *              libseccomp does) a filter that kills the process at any poll or
 *              ppoll, waits 0.6 s (the agent's thread polls every 0.25 s in a
 *              session), prints "alive, threads N" and exits 0
 *   inherited  installs on itself a filter that kills the process at membarrier
 *              (which the agent calls as it loads), then execs PROG ARGS
 * Either filter allows everything else; no_new_privs is set first. */
#define _GNU_SOURCE
#include <errno.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "tasks.h"

static int install(const int *deny, int n, unsigned flags)
{
    struct sock_filter f[16];
    struct sock_fprog prog;
    int k = 0, i;

    f[k++] = (struct sock_filter)BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr));
    for (i = 0; i < n; i++) {
        f[k++] = (struct sock_filter)BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, (unsigned)deny[i], 0, 1);
        f[k++] = (struct sock_filter)BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_KILL_PROCESS);
    }
    f[k++] = (struct sock_filter)BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW);
    prog.len = (unsigned short)k;
    prog.filter = f;
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0)
        return -1;
    return (int)syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, flags, &prog);
}

int main(int argc, char **argv)
{
    char line[64];

    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc > 1 && !strcmp(argv[1], "tsync")) {
        int deny[] = { SYS_poll, SYS_ppoll };

        printf("ready\n");
        if (!fgets(line, sizeof line, stdin))
            return 2;
        if (install(deny, 2, SECCOMP_FILTER_FLAG_TSYNC) != 0) {
            printf("seccomp: %s\n", strerror(errno));
            return 1;
        }
        usleep(600000);
        printf("alive, threads %d\n", count_tasks());
        return 0;
    }
    if (argc > 2 && !strcmp(argv[1], "inherited")) {
        int deny[] = { SYS_membarrier };

        if (install(deny, 1, 0) != 0) {
            printf("seccomp: %s\n", strerror(errno));
            return 1;
        }
        execv(argv[2], argv + 2);
        printf("exec: %s\n", strerror(errno));
        return 1;
    }
    return 2;
}
