/*
 * census.h — what census.c (the census signal's handler, PC census) and
 * transfer.c (TRANSFER, EVICT) share.
 */
#ifndef DBR_CENSUS_H
#define DBR_CENSUS_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>
#include <ucontext.h>

#include "agent.h"

/* TRANSFER signals carry (TRANSFER_MAGIC << 32) | generation in si_value */
#define TRANSFER_MAGIC 0x7AF5u
#define WAITING 0xffu   /* state of a signalled thread whose answer is awaited */

/* Agent thread: wait (bounded) until every slot in state WAITING has answered
 * generation gen (census.c says how) */
void dbr_wait_answers_at(const void *slots, size_t stride, size_t gen_off, const uint8_t *state,
                         int n, uint32_t gen, uint32_t timeout_ms);
/* Agent thread: the census signal with `value` in si_value, to thread tid */
int dbr_queue_signal_value(pid_t tid, uint64_t value);
/* Agent thread: wait (bounded) until no handler counts itself in *active */
int dbr_wait_idle(int *active, unsigned ms);
/* census signal handler: a TRANSFER's or an EVICT's signal of generation gen */
void dbr_transfer_handler(ucontext_t *uc, uint32_t gen);
void dbr_census_fork_child(void);   /* fork child: no census open, no handler inside */

#endif /* DBR_CENSUS_H */
