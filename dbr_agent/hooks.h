/*
 * hooks.h — what hooks.c and hooks_proc.c share: the real functions behind the
 * interposed ones, resolved lazily with dlsym(RTLD_NEXT) (hooks.c).
 */
#ifndef DBR_HOOKS_H
#define DBR_HOOKS_H

#include "agent.h"

/* *slot, or the real `name` stored there first */
void *dbr_resolve(void **slot, const char *name);
#define REAL(var, name) ((__typeof__(var))dbr_resolve((void **)&(var), (name)))
void dbr_hooks_proc_resolve(void);   /* hooks_proc.c's real functions, now */

#endif /* DBR_HOOKS_H */
