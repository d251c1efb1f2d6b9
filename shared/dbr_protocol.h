/*
 * dbr_protocol.h — the wire protocol between libdbr_agent.so (in each client)
 * and the dbr service.  This header is the single source of truth: the agent
 * includes it, and dbr_service/wire/protocol.py mirrors it (tests/unit/test_protocol_layout.py
 * compiles a probe against this file and proves every size and offset equal).
 *
 * Transport: one AF_UNIX SOCK_SEQPACKET connection per client process, to
 * $DBR_RUNTIME_DIR/agent.sock.  One datagram is one message.  Every message
 * starts with struct dbr_msg_hdr; `length` is the whole datagram including the
 * header and must equal the number of bytes received.  All integers are
 * little-endian (x86-64 native), all structs are naturally aligned with
 * explicit padding so that no compiler inserts any.
 *
 * File descriptors travel as SCM_RIGHTS ancillary data, only on
 * DBR_MSG_CODE_BUFFER and DBR_MSG_SAMPLER_RING.
 *
 * Ordering: the agent sends HELLO first; the service answers HELLO_ACK; only
 * then may either side send anything else.  Requests carry a req_id (or
 * batch_id) that the reply echoes.  A message of unknown type, wrong magic,
 * wrong version, wrong length, or out of order closes the session (the agent
 * first sends DBR_MSG_ERROR naming the offending seq when it can).
 *
 * Keep in sync with dbr_service/wire/protocol.py (a test enforces it).
 */
#ifndef DBR_PROTOCOL_H
#define DBR_PROTOCOL_H

#include <stdint.h>

#define DBR_PROTO_MAGIC   0x31524244u /* "DBR1" as little-endian bytes */
#define DBR_PROTO_VERSION 5u /* 2: PC_CENSUS_REQ carries ranges; census entries report
                              * stack words found in them; 3: FRAMES_ADD, FRAMES_DEL;
                              * 4: patch sites at function entries (DBR_SITE_F_ENTRY);
                              * 5: data buffers (DBR_BUFFER_F_DATA) */

#define DBR_MSG_MAX        65536u /* largest datagram either side accepts */
#define DBR_MAX_SITES      512u   /* sites in one PATCH/UNPATCH batch */
#define DBR_MAX_CENSUS     1024u  /* thread entries in one PC_CENSUS message */
#define DBR_MAX_CENSUS_RANGES 64u /* address ranges one PC_CENSUS_REQ asks about */
#define DBR_MAX_EXITS      32u    /* exit ranges in one REGION message */
#define DBR_MAX_TRANSFER   2048u  /* points in one TRANSFER message */
#define DBR_EXE_MAX        256u   /* bytes of exe path in HELLO (NUL padded) */
#define DBR_BUILD_ID_MAX   32u
#define DBR_ERRMSG_MAX     120u
#define DBR_PATCH_LEN      5u     /* a patch is always `jmp rel32` (E9 xx xx xx xx) */

/* Message types.  Direction: A = agent -> service, S = service -> agent. */
enum dbr_msg_type {
    DBR_MSG_HELLO            = 1,  /* A: first message of a session */
    DBR_MSG_HELLO_ACK        = 2,  /* S: session accepted */
    DBR_MSG_THREAD_NEW       = 3,  /* A: a thread started (advisory) */
    DBR_MSG_THREAD_EXIT      = 4,  /* A: a thread ended (advisory) */
    DBR_MSG_MAP_CHANGED      = 5,  /* A: dlclose/munmap/mprotect/dlopen notice */
    DBR_MSG_ACK              = 6,  /* A or S: generic reply {req_id, result} */
    DBR_MSG_CODE_BUFFER_REQ  = 7,  /* S: allocate a code buffer near an address */
    DBR_MSG_CODE_BUFFER      = 8,  /* A: the buffer (fd in SCM_RIGHTS) or failure */
    DBR_MSG_CODE_BUFFER_FREE = 9,  /* S: unmap a buffer; reply ACK */
    DBR_MSG_REGION           = 10, /* S: describe a region (code range, exit ranges); reply ACK */
    DBR_MSG_REGION_FORGET    = 11, /* S: region removed; reply ACK */
    DBR_MSG_PATCH            = 12, /* S: batch of sites to patch */
    DBR_MSG_UNPATCH          = 13, /* S: batch of sites to restore */
    DBR_MSG_PATCH_RESULT     = 14, /* A: one result per site of a PATCH/UNPATCH */
    DBR_MSG_PC_CENSUS_REQ    = 15, /* S: collect every thread's PC and its stack words
                                    * inside listed ranges */
    DBR_MSG_PC_CENSUS        = 16, /* A: census entries (may span several messages) */
    DBR_MSG_SAMPLER_START    = 17, /* S: start the agent-timer sampler */
    DBR_MSG_SAMPLER_RING     = 18, /* A: the sampler ring (fd in SCM_RIGHTS) or failure */
    DBR_MSG_SAMPLER_STOP     = 19, /* S: stop the agent-timer sampler; reply ACK */
    DBR_MSG_BYE              = 20, /* A or S: orderly end of session */
    DBR_MSG_ERROR            = 21, /* A or S: protocol error report */
    DBR_MSG_TRANSFER         = 22, /* S: move threads stopped at listed original PCs into a region */
    DBR_MSG_TRANSFER_RESULT  = 23, /* A: what TRANSFER did */
    DBR_MSG_NOTICES          = 24, /* S: which advisory notices to send (agents with
                                    * DBR_HELLO_QUIET_THREADS); reply ACK */
    DBR_MSG_SAMPLER_THREAD   = 25, /* S: arm or delete one thread's timer of a listed
                                    * sampler (agents with DBR_HELLO_SAMPLER_LISTED); reply ACK */
    DBR_MSG_EVICT            = 26, /* S: move threads stopped at listed replacement PCs of a
                                    * region back to original code (agents with
                                    * DBR_HELLO_EVICT); reply TRANSFER_RESULT */
    DBR_MSG_FRAMES_ADD       = 27, /* S: unwind information (.eh_frame records) for code in a
                                    * buffer; reply ACK (agents with DBR_HELLO_FRAMES) */
    DBR_MSG_FRAMES_DEL       = 28, /* S: withdraw it; reply ACK */
    DBR_MSG_TYPE_MAX         = 28
};

/* Result codes: 0 is success, errors are negative. */
enum dbr_result {
    DBR_OK             = 0,
    DBR_E_MISMATCH     = -1,  /* bytes at the site are not the expected ones */
    DBR_E_NOT_EXEC     = -2,  /* site not inside an executable mapping */
    DBR_E_TARGET       = -3,  /* target not inside one of the agent's code buffers */
    DBR_E_BUSY         = -4,  /* site already patched, or overlaps another patched site */
    DBR_E_ALIGN        = -5,  /* this protocol variant cannot be used at this site's offset */
    DBR_E_PROTECT      = -6,  /* mprotect of the site's page failed */
    DBR_E_NOSYNC       = -7,  /* membarrier SYNC_CORE unavailable: no live patching */
    DBR_E_INVAL        = -8,  /* malformed field (bad variant, bad length, ...) */
    DBR_E_NOMEM        = -9,  /* allocation failed */
    DBR_E_RANGE        = -10, /* no free space within +-2 GiB of the requested address */
    DBR_E_VERSION      = -11, /* protocol version mismatch */
    DBR_E_PROTO        = -12, /* unknown type, bad length, out-of-order message */
    DBR_E_NOT_PATCHED  = -13, /* UNPATCH of a site the agent has not patched */
    DBR_E_TIMEOUT      = -14, /* bounded wait expired */
    DBR_E_IN_USE       = -15, /* buffer still targeted by installed sites */
    DBR_E_FORBIDDEN    = -16, /* site inside the agent itself or inside a code buffer */
    DBR_E_UNKNOWN      = -17, /* unknown buffer/region id */
    DBR_E_DENIED       = -18, /* refused by policy (uid, pid mismatch, ...) */
    DBR_E_LIMIT        = -19, /* a table is full (sites, buffers, regions) */
    DBR_E_INSIDE       = -20  /* a thread is, or may be, inside an entry site's bytes:
                               * nothing of it was left written; try again later */
};

/* Cross-modifying-code protocol of one site (docs/architecture.md, "Invariants" 5). */
enum dbr_variant {
    DBR_VARIANT_INT3        = 0, /* CC, sync, bytes 1-4, sync, byte 0, sync (default) */
    DBR_VARIANT_SELF_BRANCH = 1, /* EB FE, sync, bytes 2-4, sync, bytes 0-1, sync */
    DBR_VARIANT_SINGLE      = 2  /* 5 bytes inside one aligned 8-byte word, one store, sync */
};

/* HELLO.flags */
#define DBR_HELLO_FORKED     0x1u /* this process is a fork child of a patched process */
#define DBR_HELLO_SYNC_CORE  0x2u /* membarrier SYNC_CORE offered (registered at the first code buffer): live patching possible */
#define DBR_HELLO_INHERITED  0x4u /* carries patches inherited across fork */
#define DBR_HELLO_HIDDEN_THREAD 0x8u /* the agent's thread is hidden from glibc (else a pthread) */
#define DBR_HELLO_QUIET_THREADS 0x10u /* THREAD_NEW/THREAD_EXIT only while DBR_MSG_NOTICES
                                       * asks for them (else always) */
#define DBR_HELLO_SAMPLER_LISTED 0x20u /* SAMPLER_START takes DBR_SAMPLER_LISTED and
                                        * DBR_MSG_SAMPLER_THREAD names the threads */
#define DBR_HELLO_EVICT      0x40u /* DBR_MSG_EVICT understood */
#define DBR_HELLO_FRAMES     0x80u /* DBR_MSG_FRAMES_ADD/DEL understood */
#define DBR_HELLO_ENTRY_SITES 0x100u /* PATCH takes DBR_SITE_F_ENTRY sites */
#define DBR_HELLO_ATTACHED   0x200u /* loaded by `dbr attach` (dlopen), not LD_PRELOAD: no libc
                                     * call is interposed; no thread notices (docs/agent.md) */

/* dbr_patch_site.flags */
#define DBR_SITE_F_ENTRY     0x1u /* several instructions at a function entry that together
                                   * span at least 5 bytes (docs/architecture.md,
                                   * "Invariants" 3): `inner` names the instruction
                                   * boundaries the patch overwrites; int3 variant only */

/* SAMPLER_START.flags */
#define DBR_SAMPLER_LISTED   0x1u /* no thread gets a timer until SAMPLER_THREAD names it
                                   * (threads started later neither); else every thread */

/* NOTICES.flags */
#define DBR_NOTICE_THREADS   0x1u /* send THREAD_NEW and THREAD_EXIT */

/* HELLO_ACK.on_disconnect (the environment variable DBR_ON_DISCONNECT overrides) */
#define DBR_DISCONNECT_KEEP   0u
#define DBR_DISCONNECT_REVERT 1u

/* MAP_CHANGED.kind */
enum dbr_map_kind {
    DBR_MAP_DLCLOSE  = 1, /* waits for ACK (bounded) before the call proceeds */
    DBR_MAP_MUNMAP   = 2, /* waits for ACK (bounded) */
    DBR_MAP_MPROTECT = 3, /* waits for ACK (bounded) */
    DBR_MAP_DLOPEN   = 4, /* advisory, req_id 0, no reply */
    DBR_MAP_MMAP_EXEC = 5 /* advisory, req_id 0, no reply */
};

/* BYE.flags */
#define DBR_BYE_REVERT 0x1u /* S->A: revert every patch before closing */
#define DBR_BYE_DORMANT 0x2u /* S->A (`dbr detach`): revert every patch, stop the sampler and
                              * connect no more until `dbr attach` activates the agent again */

/* The agent's quiet start (dbr_agent/connect.c, "quiet while the program starts"):
 * its thread waits this long before its first connection.  DBR_AGENT_QUIET_MS in
 * the program's environment sets it; else a service that samples younger programs
 * writes a shorter one, as decimal ms, to DBR_QUIET_FILE beside agent.sock
 * (daemon/service.py, write_quiet_hint); else the default.  Over the maximum is the
 * maximum. */
#define DBR_QUIET_DEFAULT_MS 50u
#define DBR_QUIET_MAX_MS     5000u
#define DBR_QUIET_FILE       "agent-quiet-ms"
/* A later quiet for one program, beside DBR_QUIET_FILE (dbr_service/daemon/shortruns.py):
 * the executable's st_dev, st_ino and st_mtim.tv_sec, in hex (paths.program_key) */
#define DBR_QUIET_PROGRAM    DBR_QUIET_FILE ".%lx-%lx-%llx"

/* PC_CENSUS entry.state */
#define DBR_CENSUS_OK       0u /* pc is the thread's interrupted user PC; its registers and
                                * its whole stack were scanned (refs, first_ref) */
#define DBR_CENSUS_NO_REPLY 1u /* thread did not answer within the bound: assume anywhere */
#define DBR_CENSUS_AGENT    2u /* the agent's own thread (never in replacement code) */
#define DBR_CENSUS_GONE     3u /* thread exited during the census */
#define DBR_CENSUS_UNKNOWN  4u /* pc is valid, but its stack was not scanned whole (entry
                                * flags say why): assume it holds every range */

/* PC_CENSUS entry.flags: why a stack scan is incomplete, and what was found where */
#define DBR_CENSUS_F_ALTSTACK 0x1u /* interrupted on its sigaltstack: that scanned, the
                                    * thread's normal stack not (UNKNOWN) */
#define DBR_CENSUS_F_CAPPED   0x2u /* stack longer than the scan cap (UNKNOWN) */
#define DBR_CENSUS_F_NOSTACK  0x4u /* stack pointer in no private writable anonymous
                                    * mapping, even after maps was read again (UNKNOWN) */
#define DBR_CENSUS_F_REG      0x8u /* an interrupted register holds a word in a range */

/* PC_CENSUS.flags */
#define DBR_CENSUS_MORE 0x1u /* more messages of this census follow */

struct dbr_msg_hdr {
    uint32_t magic;    /* DBR_PROTO_MAGIC */
    uint16_t version;  /* DBR_PROTO_VERSION */
    uint16_t type;     /* enum dbr_msg_type */
    uint32_t length;   /* whole datagram in bytes, header included */
    uint32_t seq;      /* sender's message counter, from 1 */
};

struct dbr_hello {
    struct dbr_msg_hdr hdr;
    uint32_t pid;
    uint32_t ppid;
    uint32_t uid;
    uint32_t flags;          /* DBR_HELLO_* */
    uint32_t agent_version;  /* agent build version (informational) */
    uint32_t n_threads;      /* threads at HELLO time */
    uint32_t page_size;
    uint32_t census_signal;  /* signal number the agent uses for PC census */
    uint32_t build_id_len;
    uint32_t sampler_signal; /* signal number of the agent-timer sampler */
    uint8_t  build_id[DBR_BUILD_ID_MAX]; /* GNU build-id of the main executable */
    char     exe[DBR_EXE_MAX];           /* readlink(/proc/self/exe), NUL padded */
};

struct dbr_hello_ack {
    struct dbr_msg_hdr hdr;
    uint32_t service_pid;   /* the agent calls prctl(PR_SET_PTRACER, service_pid) */
    uint32_t on_disconnect; /* DBR_DISCONNECT_* */
    uint64_t session_id;
    uint32_t map_wait_ms;   /* bound on waiting for an ACK to MAP_CHANGED */
    uint32_t flags;         /* reserved, 0 */
};

struct dbr_thread {
    struct dbr_msg_hdr hdr;
    uint32_t tid;
    uint32_t reserved;
};

struct dbr_notices {
    struct dbr_msg_hdr hdr;
    uint32_t req_id;
    uint32_t flags;    /* DBR_NOTICE_*: the notices wanted from now on (0: none) */
};

struct dbr_map_changed {
    struct dbr_msg_hdr hdr;
    uint32_t req_id;   /* 0 for advisory kinds */
    uint32_t kind;     /* enum dbr_map_kind */
    uint64_t lo;       /* affected address range [lo, hi) */
    uint64_t hi;
    uint32_t prot;     /* new protection for MPROTECT */
    uint32_t reserved;
};

struct dbr_ack {
    struct dbr_msg_hdr hdr;
    uint32_t req_id;
    int32_t  result;   /* enum dbr_result */
};

/* CODE_BUFFER_REQ flags.  A data buffer is mapped read-write (never executable) in
 * the client, for counters that replacement code increments and the service reads
 * through its own mapping of the memfd; at most DBR_DATA_BUFFER_MAX bytes.  It is
 * never a patch, frame or transfer target, and CODE_BUFFER_FREE of it is refused
 * (DBR_E_IN_USE) while a code buffer lies within +-2 GiB of it: code there may
 * address it. */
#define DBR_BUFFER_F_DATA   1u
#define DBR_DATA_BUFFER_MAX (64u * 1024u)

struct dbr_code_buffer_req {
    struct dbr_msg_hdr hdr;
    uint32_t req_id;
    uint32_t flags;    /* DBR_BUFFER_F_*; any other bit: DBR_E_INVAL */
    uint64_t near;     /* every byte of the buffer lies within +-2 GiB of this */
    uint64_t size;     /* bytes, rounded up to pages by the agent */
};

struct dbr_code_buffer {
    struct dbr_msg_hdr hdr;
    uint32_t req_id;
    int32_t  result;     /* DBR_OK: one fd in SCM_RIGHTS */
    uint32_t buffer_id;
    uint32_t reserved;
    uint64_t base;       /* address of the R-X mapping in the client */
    uint64_t size;
};

struct dbr_code_buffer_free {
    struct dbr_msg_hdr hdr;
    uint32_t req_id;
    uint32_t buffer_id;
};

struct dbr_range {
    uint64_t lo;
    uint64_t hi;
};

struct dbr_region {
    struct dbr_msg_hdr hdr;
    uint32_t req_id;
    uint32_t region_id;
    uint64_t code_lo;     /* replacement code range inside a buffer */
    uint64_t code_hi;
    uint32_t n_exits;     /* entries used in exits[] */
    uint32_t reserved;
    struct dbr_range exits[DBR_MAX_EXITS]; /* original-code ranges the region exits into */
};

struct dbr_region_forget {
    struct dbr_msg_hdr hdr;
    uint32_t req_id;
    uint32_t region_id;
};

struct dbr_patch_site {
    uint64_t site;       /* address of the first byte to overwrite */
    uint64_t target;     /* replacement entry (must be in a code buffer) */
    uint32_t region_id;  /* 0 if none announced */
    uint8_t  variant;    /* enum dbr_variant */
    uint8_t  len;        /* DBR_PATCH_LEN */
    uint8_t  flags;      /* DBR_SITE_F_*; 0: the site is one instruction of >= len bytes */
    uint8_t  inner;      /* DBR_SITE_F_ENTRY: bit k (1 <= k < len) set when site + k is an
                          * instruction boundary; at least one; else 0 */
    uint8_t  orig[8];    /* expected original bytes (first len used) */
};

/* PATCH and UNPATCH share this layout; `n` sites follow the fixed part. */
struct dbr_patch_batch {
    struct dbr_msg_hdr hdr;
    uint32_t batch_id;
    uint32_t n;
    struct dbr_patch_site sites[]; /* n entries */
};

struct dbr_site_result {
    uint64_t site;
    int32_t  result;     /* enum dbr_result */
    uint32_t reserved;
};

struct dbr_patch_result {
    struct dbr_msg_hdr hdr;
    uint32_t batch_id;
    uint32_t n;
    struct dbr_site_result results[]; /* n entries, in request order */
};

/*
 * PC census.  Every thread but the agent's is signalled; its handler reports the
 * interrupted PC and, when the request lists ranges, scans the interrupted general
 * registers and the thread's stack, every aligned 8-byte word from the interrupted
 * stack pointer to the end of its mapping (at most 8 MiB), for values inside any
 * range.  The service lists the code space it wants to reuse: a return address
 * into it (a real `call` made from replacement code) or a pointer to it holds it.
 * Ranges: at most DBR_MAX_CENSUS_RANGES, each lo < hi, ascending and disjoint
 * (ranges[i].hi <= ranges[i+1].lo); else the reply says DBR_E_INVAL and lists no
 * thread.  n = 0: PCs only (refs 0, nothing scanned).
 */
struct dbr_census_req {
    struct dbr_msg_hdr hdr;
    uint32_t req_id;
    uint32_t timeout_ms;  /* bound on waiting for threads to answer */
    uint32_t n;           /* ranges that follow */
    uint32_t flags;       /* reserved, 0 */
    struct dbr_range ranges[]; /* n entries, ascending and disjoint */
};

struct dbr_census_entry {
    uint32_t tid;
    uint32_t state;     /* DBR_CENSUS_* */
    uint64_t pc;
    uint64_t first_ref; /* the first word found in a range (lowest address scanned:
                         * registers first, then the stack upwards), 0 if none */
    uint32_t refs;      /* words found in any range (registers and stack, saturating) */
    uint32_t flags;     /* DBR_CENSUS_F_* */
};

/* A census answers in ceil(threads / DBR_MAX_CENSUS) messages (one if none, or on
 * failure); every message carries the same result and totals. */
struct dbr_census {
    struct dbr_msg_hdr hdr;
    uint32_t req_id;
    uint32_t n;          /* entries in this message */
    uint32_t flags;      /* DBR_CENSUS_MORE */
    uint32_t n_total;    /* threads in the whole census */
    int32_t  result;     /* DBR_OK, DBR_E_INVAL (bad ranges), DBR_E_NOMEM: on failure
                          * n_total is 0 and nothing is known */
    uint32_t n_ranges;   /* ranges of the request */
    uint32_t range_refs[DBR_MAX_CENSUS_RANGES]; /* words found in each range, over every
                          * thread of the census (saturating) */
    struct dbr_census_entry entries[]; /* n entries */
};

/*
 * TRANSFER: every running thread (but the agent's) is sent the census signal; a thread
 * whose interrupted PC equals some points[i].orig continues at points[i].repl
 * (the handler rewrites the PC in its signal frame; nothing else changes).
 * The service promises that the replacement code at repl, entered with the
 * state the original has at orig, does what the original does (codegen's
 * transfer map).  The agent checks: region_id announced by REGION, points
 * sorted by orig without duplicates, every repl inside that region's code
 * range and inside one of its code buffers, every orig in executable memory
 * outside the agent and the code buffers.  First failure wins: UNKNOWN,
 * INVAL, TARGET, NOT_EXEC, FORBIDDEN, BUSY (a late handler of the previous
 * transfer still running).  One TRANSFER_RESULT answers.
 *
 * EVICT: the same message (struct dbr_transfer), the other way.  A thread whose
 * interrupted PC equals some points[i].repl continues at points[i].orig (codegen's
 * eviction map: the start of an instruction's whole translation, and the original
 * instruction it stands for).  Points are sorted by repl without duplicates.  The
 * agent checks: region_id announced by REGION and not stale (the original code it
 * copies unchanged), every repl inside that region's code range and inside one of
 * its code buffers, every orig in executable memory outside the agent and the code
 * buffers and not strictly inside a patched site.  Refusals as for TRANSFER.  The
 * result counts threads moved out, and in `left` those that answered from inside
 * the region's code at no point (the service may try again).
 */
struct dbr_transfer_point {
    uint64_t orig;       /* original instruction address */
    uint64_t repl;       /* where a thread stopped at orig continues */
};

struct dbr_transfer {
    struct dbr_msg_hdr hdr;
    uint32_t req_id;
    uint32_t region_id;
    uint32_t n;          /* points that follow */
    uint32_t timeout_ms; /* bound on waiting for threads to answer */
    struct dbr_transfer_point points[]; /* n entries, ascending orig */
};

struct dbr_transfer_result {
    struct dbr_msg_hdr hdr;
    uint32_t req_id;
    int32_t  result;     /* enum dbr_result */
    uint32_t threads;    /* threads signalled (those running) */
    uint32_t moved;      /* threads moved into the region's code */
    uint32_t no_reply;   /* threads that did not answer within the bound */
    uint32_t left;       /* EVICT: threads that answered inside the region's code but at
                          * no point, so still there (TRANSFER: 0) */
};

/*
 * FRAMES_ADD: [addr, addr + len) lies inside one of the agent's code buffers and holds
 * .eh_frame records (CIEs and FDEs, LSB "Exception Frames") ending with a zero
 * terminator in its last 4 bytes; what they point to (LSDAs, personality slots) is
 * the service's business.  From the reply on, unwinders that look frames up through
 * _Unwind_Find_FDE (libgcc_s: C++ exceptions, backtrace(), _Unwind_Backtrace,
 * pthread_cancel) find every FDE of the blob for PCs in its range.  The agent checks,
 * first failure wins: region_id announced by REGION (UNKNOWN); addr 8-aligned (ALIGN);
 * the records inside one code buffer (TARGET); records well formed: 32-bit lengths,
 * CIE version 1 or 3 with a "z" augmentation of P, L, R, S only, each FDE's CIE earlier
 * in the blob, FDE pointers absolute or pc-relative, at least one FDE (INVAL); every
 * FDE's code range inside one code buffer (TARGET); no FDE overlapping another of
 * the blob or one registered before, and the blob not registered already (BUSY); room
 * in the agent's table (LIMIT).
 * FRAMES_DEL: the blob registered at addr (same region_id) is withdrawn; UNKNOWN if none.
 * CODE_BUFFER_FREE (or the program unmapping a buffer) withdraws those inside the
 * buffer.  REGION_FORGET does not: the service forgets a region when it unpatches it,
 * and threads may return into its code until the censuses free it.  A fork child keeps
 * them.
 */
struct dbr_frames {
    struct dbr_msg_hdr hdr;
    uint32_t req_id;
    uint32_t region_id;
    uint64_t addr;       /* first record */
    uint64_t len;        /* bytes of records, the terminator included */
};

struct dbr_sampler_start {
    struct dbr_msg_hdr hdr;
    uint32_t req_id;
    uint32_t period_us;    /* per-thread CPU-time period */
    uint32_t ring_entries; /* power of two */
    uint32_t flags;        /* DBR_SAMPLER_*; 0 from a service that predates them */
};

/* One thread of a listed sampler (DBR_SAMPLER_LISTED): on arms its timer (again,
 * from a full period), off deletes it.  ACK: DBR_OK, DBR_E_UNKNOWN (no such thread
 * in this process), DBR_E_INVAL (the agent's thread, or no listed sampler running),
 * DBR_E_LIMIT (timer table full). */
struct dbr_sampler_thread {
    struct dbr_msg_hdr hdr;
    uint32_t req_id;
    int32_t  tid;
    uint32_t on;
    uint32_t reserved;
};

struct dbr_sampler_ring {
    struct dbr_msg_hdr hdr;
    uint32_t req_id;
    int32_t  result;       /* DBR_OK: one fd in SCM_RIGHTS */
    uint64_t ring_bytes;   /* size of the shared ring mapping */
};

struct dbr_bye {
    struct dbr_msg_hdr hdr;
    uint32_t reason;   /* enum dbr_result or 0 */
    uint32_t flags;    /* DBR_BYE_* */
};

struct dbr_error {
    struct dbr_msg_hdr hdr;
    int32_t  code;     /* enum dbr_result */
    uint32_t ref_seq;  /* seq of the offending message, 0 if none */
    char     msg[DBR_ERRMSG_MAX]; /* NUL-terminated */
};

/*
 * Agent-timer sampler ring (shared memfd, mapped RW by both sides).
 * Producers: the agent's SIGPROF-style handler on any thread.  A producer
 * reserves slot `head` with a CAS (head - tail < capacity, else it counts a
 * drop), fills pc/tid, then stores seq = (uint32_t)(slot + 1) with release
 * ordering.  The consumer (service) reads slots from tail while
 * entry.seq == (uint32_t)(slot + 1), then advances tail.
 */
#define DBR_RING_MAGIC 0x474e5252u /* "RRNG" */

struct dbr_ring_header {
    uint32_t magic;
    uint32_t version;   /* DBR_PROTO_VERSION */
    uint32_t capacity;  /* entries, power of two */
    uint32_t entry_size;
    uint64_t head;      /* next slot to reserve (producers) */
    uint64_t tail;      /* next slot to consume (service) */
    uint64_t dropped;   /* samples lost because the ring was full */
    uint64_t in_kernel; /* timer signals not taken as samples: delivered on the way
                         * out of a system call (the tick came in the kernel) */
    uint64_t reserved[2];
};

struct dbr_ring_entry {
    uint64_t pc;
    uint32_t tid;
    uint32_t seq;
};

#ifndef __cplusplus
_Static_assert(sizeof(struct dbr_msg_hdr) == 16, "hdr");
_Static_assert(sizeof(struct dbr_patch_site) == 32, "patch site");
_Static_assert(sizeof(struct dbr_ring_header) == 64, "ring header");
#endif

#endif /* DBR_PROTOCOL_H */
