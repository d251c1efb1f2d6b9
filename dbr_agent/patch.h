/*
 * patch.h — what patch.c (tables, validation, batches) and patch_write.c (the
 * write protocols) share.  g_agent_mu is held throughout.
 */
#ifndef DBR_PATCH_H
#define DBR_PATCH_H

#include <stddef.h>
#include <stdint.h>

#include "agent.h"

/* one validated site of a batch being written */
struct op {
    uint64_t addr;
    uint8_t old[5], new[5];
    uint8_t variant;
    uint32_t idx;       /* index into the request / result arrays */
    int rc;
    uint8_t inner;      /* an entry site's inner boundaries (0: one instruction) */
    struct dbr_site_ent *ent;
};

/* whether a write protocol can be used at this site's offset */
int dbr_variant_fits(uint8_t variant, uint64_t site);
/* Apply the ops (all validated).  Sets op->rc for failures (PROTECT, MISMATCH,
 * INSIDE). */
void dbr_write_ops(struct op *ops, size_t n, const struct dbr_maps *maps, int unpatch);

#endif /* DBR_PATCH_H */
