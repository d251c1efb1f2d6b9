/*
 * agent.h — internal interfaces of libdbr_agent.so (the in-client agent).
 *
 * Every symbol here is hidden (-fvisibility=hidden); only the interposed
 * libc functions in hooks.c and hooks_proc.c are exported (DBR_EXPORT).
 *
 * Locking (every mutex is process-shared: dbr_mutex_init says why):
 * g_agent_mu ("the agent mutex") guards the site table, the code buffer
 * table, the region table and every write to client text.  g_send_mu
 * guards the session socket (sending, closing).  Signal handlers never take a
 * lock: the site table is append-only (entries become historical, never
 * removed) and published with release stores so the SIGTRAP handler can read
 * it at any time.
 *
 * What the service can rely on (see also shared/dbr_protocol.h):
 *  - Environment: DBR_AGENT_DISABLE=1 (no-op), DBR_AGENT_DEBUG=1 (log to
 *    stderr, else silent), DBR_RUNTIME_DIR, DBR_ON_DISCONNECT=keep|revert
 *    (overrides HELLO_ACK), DBR_AGENT_CENSUS_SIGNAL / DBR_AGENT_SAMPLER_SIGNAL
 *    (absolute numbers in SIGRTMIN..SIGRTMAX; defaults SIGRTMIN+8, +9).
 *  - Every request gets exactly one reply (PC_CENSUS: one or more messages),
 *    in request order; THREAD_NEW / THREAD_EXIT (threads made by
 *    pthread_create), MAP_CHANGED and BYE (at exit) may be interleaved.
 *  - PATCH site checks, first failure wins: INVAL, NOSYNC, NOT_EXEC,
 *    FORBIDDEN, TARGET, RANGE, ALIGN, BUSY, MISMATCH, LIMIT; while writing:
 *    PROTECT, MISMATCH, BUSY (SIGTRAP blocked), INSIDE (an entry site with a
 *    thread inside: patch_write.c).  UNPATCH: NOT_PATCHED, NOSYNC, NOT_EXEC, MISMATCH,
 *    then PROTECT; only `site` is read, the recorded variant is used.
 *  - When every program thread has ended (main's pthread_exit, then the
 *    others), the process ends: glibc ends it, since it never counted the
 *    agent's hidden thread (thread.c); with the pthread fallback the agent
 *    thread calls exit(0), as glibc would have.
 *  - FRAMES_ADD/FRAMES_DEL: unwind information for code in a buffer; unwinders find it
 *    through the agent's _Unwind_Find_FDE (frames.c says why not __register_frame).
 *  - MAP_CHANGED (DLCLOSE/MUNMAP/MPROTECT) carries a fresh non-zero req_id;
 *    the service answers ACK {req_id, DBR_OK} once done.  Before the call
 *    proceeds the agent restores any site still installed in the range or
 *    targeting it; without an OK ACK within map_wait_ms (cap 10 s) also the
 *    sites of regions whose exits intersect the range.
 */
#ifndef DBR_AGENT_H
#define DBR_AGENT_H

#include <pthread.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "dbr_protocol.h"

#define DBR_EXPORT __attribute__((visibility("default")))
#define DBR_AGENT_VERSION 2u

/* ---- limits ---- */
#define DBR_SITE_TABLE_MAX   8192u  /* sites ever patched (installed + historical) */
#define DBR_BUFFER_TABLE_MAX 256u
#define DBR_REGION_TABLE_MAX 1024u
#define DBR_CENSUS_SLOTS     4096u  /* threads one census can signal */
#define DBR_TIMER_TABLE_MAX  4096u  /* sampler timers */

/* ---- configuration (read once from the environment in the constructor) ---- */
struct dbr_config {
    int  disabled;          /* DBR_AGENT_DISABLE=1 */
    int  debug;             /* DBR_AGENT_DEBUG=1 */
    int  on_disconnect_env; /* -1: not set; else DBR_DISCONNECT_* from DBR_ON_DISCONNECT */
    int  census_sig;
    int  sampler_sig;
    unsigned start_delay_us; /* DBR_AGENT_TEST_START_DELAY_US: tests widen an unwrapped start */
    unsigned quiet_ms;      /* DBR_AGENT_QUIET_MS: the agent's thread waits this long first */
    int  quiet_from_env;    /* DBR_AGENT_QUIET_MS was given (else the service's hint may apply) */
    long service_uid;       /* DBR_SERVICE_UID: a service's uid trusted besides root, or -1 */
    char sock_path[108];    /* $DBR_RUNTIME_DIR/agent.sock; "" if unknown */
};
extern struct dbr_config g_cfg;
extern int g_attached;     /* loaded by dlopen (`dbr attach`): no libc call is interposed */
extern int g_dormant;      /* connects no more until dbr_agent_activate (attached, BYE_DORMANT) */

/* ---- util.c ---- */
void dbr_log(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
int  dbr_parse_ms(const char *s, unsigned max, unsigned *out);
ssize_t dbr_read_small(const char *path, int flags, char *buf, size_t cap);
ssize_t dbr_read_small_at(int dfd, const char *path, int flags, char *buf, size_t cap);
pid_t dbr_gettid(void);
uint64_t dbr_now_ms(void);
void dbr_sleep_ms(unsigned ms);
void dbr_config_load(void);
long dbr_page_size(void);
/* memory and sorting without malloc (util.c: why) */
void *dbr_alloc(size_t size);     /* zeroed; NULL if out of memory */
void *dbr_realloc(void *p, size_t size);
void dbr_free(void *p);
/* Every mutex and condition variable the agent shares between threads is
 * process-shared: glibc 2.34+ locks and unlocks a private mutex without atomics
 * and without waking waiters while it believes the process has one thread, which
 * it does beside the agent's hidden thread (thread.c). */
void dbr_mutex_init(pthread_mutex_t *m);
void dbr_sort(void *base, size_t n, size_t size, int (*cmp)(const void *, const void *));

struct dbr_map_ent {
    uint64_t lo, hi;
    int prot;     /* PROT_* */
    int special;  /* [vdso], [vvar], [vsyscall]: never patched */
    int shared;   /* MAP_SHARED: writes would reach the file / other mappings */
    uint64_t dev, ino;  /* the mapped file (device major:minor, inode); ino 0: anonymous */
};
struct dbr_maps {
    struct dbr_map_ent *e;
    size_t n;
};
int dbr_maps_read(struct dbr_maps *m);       /* DBR_OK or DBR_E_NOMEM */
void dbr_maps_free(struct dbr_maps *m);
const struct dbr_map_ent *dbr_maps_find(const struct dbr_maps *m, uint64_t addr);
int dbr_count_threads(void);
int dbr_list_threads(pid_t *tids, int max);  /* number found (may exceed max: only max stored); -1 unknown */
char dbr_thread_state(pid_t tid);            /* /proc state letter ('R' running), '?' unknown */
int dbr_thread_sigblk(pid_t tid, uint64_t *mask); /* blocked signals (bit n-1: signal n); -1 gone */

/* raw syscalls: the agent's own calls never go through its hooks */
int dbr_sys_mprotect(void *addr, size_t len, int prot);
int dbr_sys_munmap(void *addr, size_t len);
int dbr_membarrier_sync(void);

/* ---- hooks.c ---- */
int dbr_real_sigaction(int sig, const struct sigaction *act, struct sigaction *old);
int dbr_real_pthread_create(pthread_t *t, const pthread_attr_t *attr,
                            void *(*start)(void *), void *arg);
void dbr_hooks_resolve(void);          /* constructor, inert or not */
/* Install the agent's handler for `sig` (recording what the program had),
 * `handler` is the agent's SA_SIGINFO handler. */
int dbr_signal_install(int sig, void (*handler)(int, siginfo_t *, void *), int flags,
                       const sigset_t *mask);
void dbr_signals_reclaim(void);
/* Give a signal the agent does not own to the program's recorded action. */
void dbr_signal_chain(int sig, siginfo_t *si, void *uc);
void dbr_unblock_trap(void);          /* calling thread: SIGTRAP unblocked */

/* ---- hooks_proc.c ---- */
void dbr_hooks_init(void);
void dbr_atfork_register(void);
int dbr_wait_unwrapped_starts(void);  /* agent thread: unwrapped thread starts done */

/* ---- agent.c: start-up, the agent thread, fork ---- */
extern pthread_mutex_t g_agent_mu;
extern pid_t g_agent_tid;           /* tid of the agent thread, 0 if none */
int dbr_sync_core_ready(void);      /* register SYNC_CORE if not yet; whether it is */
extern uint64_t g_agent_lo, g_agent_hi; /* the agent library's own mapped range */
void dbr_agent_start_thread(int forked);   /* now, or planned under the hint */
/* program thread, before a call that needs a single-threaded process: end the
 * session and the agent thread for good; 1 once the kernel no longer counts it */
int dbr_agent_retire(const char *why);
#define DBR_BIRTH_COOKIE 0xDBB17E0000000001ull   /* the birth timer's si_value */
void dbr_agent_birth_signal(void);    /* census.c: the birth timer fired (signal handler) */
int dbr_agent_birth_pending(void);    /* the agent's thread is still to be made by a timer */
void dbr_agent_birth_now(const char *why); /* hooks*.c: make it now, if pending */
void dbr_fork_child_reset(void);

/* ---- transport.c, session.c: the session (the rest of it: session.h) ---- */
int dbr_connected(void);
int dbr_thread_notices(void);   /* the service wants THREAD_NEW/THREAD_EXIT now */
/* Send one message from any thread. fds: -1 or an fd for SCM_RIGHTS.
 * from_client: the caller is a program thread (never blocks long). */
int dbr_send(void *msg, uint32_t type, uint32_t len, int fd, int from_client);
/* MAP_CHANGED with bounded wait for the service's ACK: DBR_OK if acked,
 * DBR_E_TIMEOUT or DBR_E_PROTO (not connected / session ended) otherwise. */
int dbr_map_changed_wait(uint32_t kind, uint64_t lo, uint64_t hi, uint32_t prot);
void dbr_map_changed_advise(uint32_t kind, uint64_t lo, uint64_t hi);
void dbr_agent_poke(void);           /* any thread: wake the agent thread */

/* ---- objects.c ---- */
struct dl_phdr_info;
extern uint8_t g_build_id[DBR_BUILD_ID_MAX];
extern uint32_t g_build_id_len;
void dbr_obj_range(struct dl_phdr_info *info, uint64_t *lo, uint64_t *hi); /* PT_LOAD span, pages */
void dbr_self_scan(void);        /* build-id of the executable, g_agent_lo/hi */
void dbr_objects_snapshot(void); /* objects at session start: known to the service */
void dbr_objects_poll(void);     /* DBR_MAP_DLOPEN notices for new objects */

/* ---- buffers.c ---- */
struct dbr_buffer {
    uint32_t id;      /* 0: free slot */
    uint32_t flags;   /* DBR_BUFFER_F_DATA: read-write data, never code */
    uint64_t base, size;
};
extern struct dbr_buffer g_buffers[DBR_BUFFER_TABLE_MAX];
extern unsigned g_n_buffers;  /* live buffers (atomic read outside the lock) */
/* a memfd sized and sealed against shrinking and growing (buffers.c) */
int dbr_memfd_size_sealed(int fd, uint64_t size);
/* all with g_agent_mu held */
int dbr_buffer_alloc(uint64_t near, uint64_t size, uint32_t flags, uint32_t *id,
                     uint64_t *base, uint64_t *rsize, int *fd);
int dbr_buffer_free(uint32_t id);
/* the code buffer (never a data buffer) holding [addr, addr+len), or NULL */
const struct dbr_buffer *dbr_buffer_containing(uint64_t addr, uint64_t len);
int dbr_buffers_intersect(uint64_t lo, uint64_t hi);
void dbr_buffers_privatise(void);  /* fork child */
void dbr_buffers_forget(uint64_t lo, uint64_t hi);  /* program unmapped them */

/* ---- patch.c ---- */
struct dbr_site_ent {
    uint64_t site;
    uint64_t target;      /* atomic: read by the SIGTRAP handler */
    uint32_t region_id;
    uint32_t buffer_id;
    uint8_t  variant;
    uint8_t  inner;       /* an entry site's inner boundaries (dbr_patch_site.inner), or 0 */
    uint8_t  orig[5];
    uint8_t  jmp[5];
    int      installed;   /* atomic: 1 installed, 0 historical */
};
extern unsigned g_n_installed; /* atomic */
void dbr_patch_init(void);
/* with g_agent_mu held */
void dbr_patch_batch(const struct dbr_patch_site *sites, uint32_t n, int unpatch,
                     struct dbr_site_result *res);
int dbr_sites_target_buffer(uint32_t buffer_id);
int dbr_site_overlaps_installed(uint64_t lo, uint64_t hi);
/* Unpatch every installed site in [lo,hi), whose target lies in [lo,hi), or (if
 * with_exits) whose region's exits intersect [lo,hi).  Returns sites unpatched. */
int dbr_unpatch_affected(uint64_t lo, uint64_t hi, int with_exits);
int dbr_unpatch_all(void);
int dbr_any_installed(void);

/* regions (patch.c) */
extern unsigned g_n_regions;
int dbr_region_set(const struct dbr_region *r);
int dbr_region_forget(uint32_t id);
int dbr_region_exits_intersect(uint64_t lo, uint64_t hi);
int dbr_region_code(uint32_t id, uint64_t *lo, uint64_t *hi); /* DBR_OK or DBR_E_UNKNOWN */
void dbr_regions_clear(void);

/* ---- frames.c (g_agent_mu held) ---- */
int dbr_frames_add(uint32_t region_id, uint64_t addr, uint64_t len);
int dbr_frames_del(uint32_t region_id, uint64_t addr);
void dbr_frames_forget_range(uint64_t lo, uint64_t hi);  /* blobs or code in [lo,hi) */

/* ---- census.c ---- */
void dbr_census_init(void);
/* run one census (ranges: the request's, unchecked); sends its PC_CENSUS replies,
 * a failure too; returns the send's result */
int dbr_census_run(uint32_t req_id, uint32_t timeout_ms, const struct dbr_range *ranges,
                   uint32_t n_ranges);
int dbr_inside_installed_site(uint64_t a);   /* strictly inside an installed site */
/* Agent thread, no census open: whether any thread's PC, registers or stack words
 * lie in each of ranges[0..n) (ascending, disjoint, n <= DBR_MAX_SITES); hit[k] = 1
 * if so, and for every k when a thread's whereabouts are unknown.  DBR_OK, or
 * DBR_E_NOMEM / DBR_E_INVAL (nothing known). */
int dbr_census_inside(const struct dbr_range *ranges, uint32_t n, uint8_t *hit);

/* ---- transfer.c ---- */
/* TRANSFER (g_agent_mu held): checks, signals every thread, fills res->threads,
 * moved, no_reply; returns the result code */
int dbr_transfer_run(uint32_t region_id, const struct dbr_transfer_point *p, uint32_t n,
                     uint32_t timeout_ms, int evict, struct dbr_transfer_result *res);
/* fork child: no transfer or census open, no handler inside */
void dbr_transfer_fork_child(void);

/* ---- thread.c ---- */
void dbr_thread_init(void);                  /* constructor */
int dbr_thread_start_hidden(int (*fn)(void), int rt_birth_ok); /* 0, or -1: use pthread_create */
int dbr_thread_prepare(void);                /* stack and TLS made ahead: 0, or -1 */
int dbr_thread_launch(int (*fn)(void), int rt_birth_ok); /* the prepared thread; 0, or -1 */
int dbr_thread_hidden(void);                 /* the agent's thread is hidden and alive */
int dbr_thread_settle(void);                 /* its thread, first: off SCHED_FIFO; -1 refused */
int dbr_thread_reap(unsigned timeout_ms);    /* after it returned: free its stack and TLS */
void dbr_thread_fork_child(void);
const char *dbr_thread_mode(void);           /* "hidden", or why not */
int dbr_thread_sync_creds(const char *what); /* program thread, after set*id/setgroups */
int dbr_thread_apply_creds(void);            /* agent thread: 1 applied, 0 none, -1 failed */

/* ---- sampler.c ---- */
void dbr_sampler_init(void);
int dbr_sampler_start(uint32_t period_us, uint32_t ring_entries, uint32_t flags, int *fd,
                      uint64_t *bytes);
int dbr_sampler_thread(pid_t tid, int on);   /* listed sampler: arm/delete one thread's timer */
int dbr_sampler_stop(void);
void dbr_sampler_thread_start(void);  /* calling thread: arm its timer if running */
void dbr_sampler_thread_exit(void);   /* calling thread: delete its timer */
int dbr_sampler_arms_new(void);       /* timers armed for new threads (running, not listed) */
void dbr_sampler_fork_child(void);

/* ---- jitdump.c ---- */
/* Constructor: with DBR_JITDUMP=1, /tmp/jit-PID.dump with its header, mapped
 * executable, for `perf inject --jit`; the service appends the records. */
void dbr_jitdump_open(void);

#endif /* DBR_AGENT_H */
