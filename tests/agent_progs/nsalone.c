/* nsalone WHAT: calls the kernel refuses to a multi-threaded process.
 *   user  unshare(CLONE_NEWUSER)
 *   mnt   setns into our own mount namespace, nstype CLONE_NEWNS
 *   mnt0  the same with nstype 0 (the namespace fd tells its type)
 *   fork-user  the same as user, in a fork child
 * Prints "ready", waits for a line on stdin (the test's session is up by then),
 * makes the call, and prints its result and the threads left in the process. */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tasks.h"

static int call(const char *what)
{
    int rc;

    if (!strcmp(what, "user")) {
        rc = unshare(CLONE_NEWUSER);
    } else {
        int fd = open("/proc/self/ns/mnt", O_RDONLY | O_CLOEXEC);
        if (fd < 0)
            return 2;
        rc = setns(fd, strcmp(what, "mnt0") ? CLONE_NEWNS : 0);
        close(fd);
    }
    if (rc)
        printf("%s: %s\n", what, strerror(errno));
    else
        printf("%s: ok, threads %d\n", what, count_tasks());
    fflush(stdout);
    return rc ? 1 : 0;
}

int main(int argc, char **argv)
{
    const char *what = argc > 1 ? argv[1] : "user";
    char line[16];
    int st;
    pid_t c;

    printf("ready\n");
    fflush(stdout);
    if (!fgets(line, sizeof line, stdin))
        return 3;
    if (strncmp(what, "fork-", 5))
        return call(what);
    c = fork();
    if (c == 0)
        _exit(call(what + 5));
    if (c < 0 || waitpid(c, &st, 0) != c)
        return 4;
    return WIFEXITED(st) ? WEXITSTATUS(st) : 5;
}
