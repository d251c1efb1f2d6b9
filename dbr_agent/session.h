/*
 * session.h — what the files of the session with the service share: agent.c
 * (start-up, the agent thread, birth, fork, exit), transport.c (the socket),
 * messages.c (validation and handlers), connect.c (trust, connect, HELLO, the
 * quiet hint) and session.c (the session loop, waits, map-change ACKs).  agent.h
 * holds what the rest of the agent uses.  Every symbol here is hidden.
 */
#ifndef DBR_SESSION_H
#define DBR_SESSION_H

#include <pthread.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/stat.h>
#include <sys/types.h>

#include "agent.h"

/* validation state of a session (dbr_msg_validate) */
enum { ST_HANDSHAKE, ST_SESSION };
/* how a session ends (handlers and the session loop) */
enum { END_NONE = 0, END_EOF, END_ERROR, END_BYE };

/* ---- agent.c ---- */
extern int g_sync_avail;   /* the kernel offers membarrier SYNC_CORE */
extern int g_forked;       /* this process is a fork child (HELLO flags) */
extern int g_exiting;      /* the destructor ran */
extern int g_retired;      /* the agent stopped for good here (dbr_agent_retire) */
int dbr_agent_thread_started(void);

/* ---- attach.c ---- */
int dbr_loaded_by_dlopen(void);

/* ---- transport.c: the session socket (g_send_mu guards sending and closing it) ---- */
/* Identity of the agent's own fds: a program may close fds it does not know
 * about (daemons close everything) and reuse the numbers; the agent then must
 * never read, write or close them. */
struct fd_id {
    dev_t dev;
    ino_t ino;
};
void dbr_fd_id_take(int fd, struct fd_id *id);
int dbr_fd_is(int fd, const struct fd_id *id);

extern pthread_mutex_t g_send_mu;
extern int g_sock;
extern int g_sock_lost;      /* the program closed our socket fd (number may be reused) */
extern struct fd_id g_sock_id;
extern int g_ready;          /* HELLO_ACK received: anything may be sent */
extern uint32_t g_seq;
extern int g_bye_sent;       /* this session's BYE went out */
extern uint8_t g_rx[DBR_MSG_MAX];   /* the datagram received last (agent thread only) */

int dbr_send_ack(uint32_t req_id, int result);
void dbr_send_error(int code, uint32_t ref_seq, const char *text);
uint32_t dbr_rx_seq(void);
ssize_t dbr_recv_one(int fd, const char **why);

/* ---- messages.c: the datagram in g_rx ---- */
int dbr_msg_validate(size_t n, int state);
int dbr_msg_handle(void);

/* ---- connect.c ---- */
int dbr_connect_service(void);
int dbr_send_hello(void);
unsigned dbr_quiet_ms(int *hinted);

/* ---- session.c ---- */
#define MAP_WAIT_SLOTS 64u
/* bounded waits of map-changing hooks for the service's ACK */
struct map_wait {
    uint32_t req_id;   /* 0: free */
    int acked;
    int result;
};
extern pthread_mutex_t g_wait_mu;
extern pthread_cond_t g_wait_cv;
extern struct map_wait g_waits[MAP_WAIT_SLOTS];
extern uint32_t g_notices;   /* DBR_NOTICE_* the service asked for in this session */
extern int g_wake[2];        /* the agent thread's wake pipe */
extern struct fd_id g_wake_id[2];
extern sigset_t g_prog_sigmask;  /* mask of the thread that started the agent's */

void dbr_map_ack_deliver(uint32_t req_id, int result);
int dbr_stopping(void);
void dbr_wait_until(uint64_t until);
int dbr_session_run(void);

#endif /* DBR_SESSION_H */
