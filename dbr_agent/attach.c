/*
 * attach.c — the agent loaded into a running process by `dbr attach` (dlopen, not
 * LD_PRELOAD): knowing it, and being woken by the attaching process.  What the
 * attached agent does without its hooks: docs/agent.md, "Attached".
 */
#include <dlfcn.h>
#include <string.h>

#include "session.h"

/* Loaded by dlopen (`dbr attach`) rather than LD_PRELOAD: the process's libc
 * functions are then not the agent's.  One dlsym, in the constructor only. */
int dbr_loaded_by_dlopen(void)
{
    Dl_info ours, found;
    void *p = dlsym(RTLD_DEFAULT, "munmap");

    if (!p || !dladdr(p, &found) || !dladdr((void *)&dbr_agent_poke, &ours))
        return 1;
    return found.dli_fbase != ours.dli_fbase;
}

/* `dbr attach`: called on a program thread by the attaching process (ptrace, after
 * its dlopen of the agent).  runtime_dir (NULL: the agent's default) names where
 * agent.sock is; it is checked at each connection like DBR_RUNTIME_DIR (connect.c:
 * the directory's owner and mode, the listener's uid).  Stores and a write to the
 * wake pipe only: the thread may have been stopped anywhere.  0 activated; 1
 * already active; -1 runtime_dir too long or not absolute; -2 no agent thread;
 * -3 the agent is inert (DBR_AGENT_DISABLE, a seccomp filter); -4 it stepped aside. */
DBR_EXPORT int dbr_agent_activate(const char *runtime_dir)
{
    static const char sock[] = "/agent.sock";
    size_t n = 0;

    if (g_cfg.disabled)
        return -3;
    if (__atomic_load_n(&g_retired, __ATOMIC_ACQUIRE))
        return -4;
    if (!dbr_agent_thread_started())
        return -2;
    if (!__atomic_load_n(&g_dormant, __ATOMIC_ACQUIRE))
        return 1;
    if (runtime_dir && runtime_dir[0]) {
        if (runtime_dir[0] != '/')
            return -1;
        while (runtime_dir[n] && n + sizeof sock <= sizeof g_cfg.sock_path)
            n++;
        if (n + sizeof sock > sizeof g_cfg.sock_path)
            return -1;
        /* the agent's thread reads the path only after it sees g_dormant cleared */
        memcpy(g_cfg.sock_path, runtime_dir, n);
        memcpy(g_cfg.sock_path + n, sock, sizeof sock);
    }
    __atomic_store_n(&g_dormant, 0, __ATOMIC_RELEASE);
    dbr_agent_poke();
    return 0;
}
