/*
 * census.c — PC census: every thread reports its interrupted PC.
 *
 * The agent thread queues the census signal to each thread with
 * rt_tgsigqueueinfo (the tgkill of a signal with a payload): si_code SI_QUEUE,
 * si_pid our pid and a cookie in si_value mark it as the agent's, so the
 * handler can chain any other delivery of that signal to the program.  The
 * handler writes the PC into the slot keyed by its tid with atomic stores only.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <ucontext.h>
#include <unistd.h>

#include "agent.h"

#define CENSUS_COOKIE  0x0DBC3A5
#define CENSUS_WAIT_MAX_MS 1000u
#define CENSUS_WAIT_DEFAULT_MS 200u

struct slot {
    int32_t  tid;
    uint32_t done_gen;  /* == g_gen when pc is valid for this census */
    uint64_t pc;
};

static struct slot g_slots[DBR_CENSUS_SLOTS];
static unsigned g_nslots;
static uint32_t g_gen;

static void census_handler(int sig, siginfo_t *si, void *ucv)
{
    ucontext_t *uc = ucv;
    unsigned i, n;
    uint32_t gen;
    pid_t tid;

    if (si->si_code != SI_QUEUE || si->si_pid != getpid() || si->si_value.sival_int != CENSUS_COOKIE) {
        dbr_signal_chain(sig, si, ucv);
        return;
    }
    gen = __atomic_load_n(&g_gen, __ATOMIC_ACQUIRE);
    n = __atomic_load_n(&g_nslots, __ATOMIC_ACQUIRE);
    tid = dbr_gettid();
    for (i = 0; i < n; i++) {
        if (g_slots[i].tid != tid)
            continue;
        __atomic_store_n(&g_slots[i].pc, (uint64_t)uc->uc_mcontext.gregs[REG_RIP], __ATOMIC_RELAXED);
        __atomic_store_n(&g_slots[i].done_gen, gen, __ATOMIC_RELEASE);
        break;
    }
}

void dbr_census_init(void)
{
    dbr_signal_install(g_cfg.census_sig, census_handler, SA_SIGINFO | SA_RESTART | SA_ONSTACK);
}

static int queue_signal(pid_t tid)
{
    siginfo_t si;

    memset(&si, 0, sizeof si);
    si.si_signo = g_cfg.census_sig;
    si.si_code = SI_QUEUE;
    si.si_pid = getpid();
    si.si_uid = getuid();
    si.si_value.sival_int = CENSUS_COOKIE;
    return (int)syscall(SYS_rt_tgsigqueueinfo, getpid(), tid, g_cfg.census_sig, &si);
}

int dbr_census_run(uint32_t req_id, uint32_t timeout_ms)
{
    pid_t *tids = NULL;
    uint8_t *state = NULL;
    struct dbr_census *msg = NULL;
    int n, i, rc = DBR_OK, pending;
    unsigned nslots;
    uint32_t gen, k, sent;
    uint64_t deadline;

    tids = calloc(DBR_CENSUS_SLOTS, sizeof *tids);
    state = calloc(DBR_CENSUS_SLOTS, 1);
    msg = calloc(1, sizeof *msg + DBR_MAX_CENSUS * sizeof msg->entries[0]);
    if (!tids || !state || !msg) {
        rc = DBR_E_NOMEM;
        goto out;
    }
    n = dbr_list_threads(tids, DBR_CENSUS_SLOTS);
    if (n > (int)DBR_CENSUS_SLOTS)
        n = DBR_CENSUS_SLOTS;   /* the rest cannot be reported */
    nslots = (unsigned)n;
    __atomic_store_n(&g_nslots, 0, __ATOMIC_RELEASE);
    for (i = 0; i < n; i++) {
        g_slots[i].tid = tids[i];
        g_slots[i].pc = 0;
        __atomic_store_n(&g_slots[i].done_gen, 0, __ATOMIC_RELAXED);
    }
    gen = __atomic_add_fetch(&g_gen, 1, __ATOMIC_RELEASE);
    if (gen == 0)
        gen = __atomic_add_fetch(&g_gen, 1, __ATOMIC_RELEASE);
    __atomic_store_n(&g_nslots, nslots, __ATOMIC_RELEASE);

    pending = 0;
    for (i = 0; i < n; i++) {
        if (tids[i] == g_agent_tid || tids[i] == dbr_gettid()) {
            state[i] = DBR_CENSUS_AGENT;
        } else if (queue_signal(tids[i]) < 0) {
            state[i] = errno == ESRCH ? DBR_CENSUS_GONE : DBR_CENSUS_NO_REPLY;
        } else {
            state[i] = 0xff;   /* waiting */
            pending++;
        }
    }
    if (timeout_ms == 0)
        timeout_ms = CENSUS_WAIT_DEFAULT_MS;
    if (timeout_ms > CENSUS_WAIT_MAX_MS)
        timeout_ms = CENSUS_WAIT_MAX_MS;
    deadline = dbr_now_ms() + timeout_ms;
    while (pending > 0) {
        pending = 0;
        for (i = 0; i < n; i++)
            if (state[i] == 0xff && __atomic_load_n(&g_slots[i].done_gen, __ATOMIC_ACQUIRE) != gen)
                pending++;
        if (pending == 0 || dbr_now_ms() >= deadline)
            break;
        dbr_sleep_ms(1);
    }

    /* reply: ceil(n / DBR_MAX_CENSUS) messages (one with n = 0 if no thread) */
    sent = 0;
    do {
        uint32_t m = (uint32_t)n - sent > DBR_MAX_CENSUS ? DBR_MAX_CENSUS : (uint32_t)n - sent;

        msg->req_id = req_id;
        msg->n = m;
        msg->n_total = (uint32_t)n;
        msg->flags = sent + m < (uint32_t)n ? DBR_CENSUS_MORE : 0;
        for (k = 0; k < m; k++) {
            struct dbr_census_entry *e = &msg->entries[k];
            unsigned s = sent + k;

            e->tid = (uint32_t)tids[s];
            e->pc = 0;
            if (state[s] != 0xff) {
                e->state = state[s];
            } else if (__atomic_load_n(&g_slots[s].done_gen, __ATOMIC_ACQUIRE) == gen) {
                e->state = DBR_CENSUS_OK;
                e->pc = __atomic_load_n(&g_slots[s].pc, __ATOMIC_RELAXED);
            } else if (syscall(SYS_tgkill, getpid(), tids[s], 0) < 0 && errno == ESRCH) {
                e->state = DBR_CENSUS_GONE;     /* exited before answering */
            } else {
                e->state = DBR_CENSUS_NO_REPLY;
            }
        }
        rc = dbr_send(msg, DBR_MSG_PC_CENSUS, (uint32_t)(sizeof *msg + m * sizeof msg->entries[0]), -1, 0);
        sent += m;
    } while (rc == DBR_OK && sent < (uint32_t)n);
out:
    free(tids);
    free(state);
    free(msg);
    return rc;
}
