/* tasks.h — the threads the kernel lists for this process (/proc/self/task), -1 if
 * unreadable.  For the test programs that check what the agent's thread does to it. */
#ifndef TASKS_H
#define TASKS_H
#include <dirent.h>

/* the entries of a /proc/PID/task directory */
static int count_tasks_in(const char *dir)
{
    DIR *d = opendir(dir);
    struct dirent *e;
    int n = 0;

    if (!d)
        return -1;
    while ((e = readdir(d)))
        n += e->d_name[0] != '.';
    closedir(d);
    return n;
}

static int count_tasks(void)
{
    return count_tasks_in("/proc/self/task");
}
#endif
