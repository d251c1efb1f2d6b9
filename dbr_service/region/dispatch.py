"""CUT-WIDE-DISPATCH: an indirect jump with more known targets than code generation
turns into a compare cascade (:data:`~dbr_service.region.model.MAX_CASCADE_TARGETS`)
stays the original indirect jump in replacement code, an exit.  Its edges to the
targets are cut here and become exits, so every later pass sees the graph the code
will have.

Without this, an interpreter's dispatch loop (``for (;;) switch (*pc++)``) looked
like a hot loop: it was selected and installed, and every iteration then left the
replacement code at the dispatch and came back through a patch site.  Measured on
the bench's 12-way interpreter: the program ran 12-25% slower than native while the
region was installed.  After the cut such a loop is no loop at all and prune drops
the region; loops inside one case still make regions of their own.

A PC-relative jump-table dispatch that code generation translates
(:func:`~dbr_service.codegen.dispatch.region_dispatch_plan`: checked table look-ups, no
cascade) keeps its edges whatever its width: it stays in replacement code.
"""

from __future__ import annotations

from collections import Counter

from dbr_service.codegen.dispatch import region_dispatch_plan
from dbr_service.region.model import END, EdgeKind, SuperRegion, TermKind


def cut_wide_dispatch(sr: SuperRegion, max_targets: int, counters: Counter) -> None:
    """Turn the edges of every indirect jump with more than ``max_targets`` known
    targets into exit edges to those targets (counts kept).  A target may lose its only
    predecessor: PARTITION-CODE, which runs right after, gives it an entry edge."""
    for k, bb in list(sr.blocks()):
        if bb.term is not TermKind.IJMP or len(bb.targets) <= max_targets:
            continue
        if region_dispatch_plan(sr, k) is not None:
            counters["translated-dispatches"] += 1
            continue
        counters["wide-dispatches"] += 1
        for _, v, d in list(sr.g.out_edges(k, data=True)):
            if v == END:
                continue
            sr.g.remove_edge(k, v)
            sr.add_edge(k, END, EdgeKind.EXIT, d.get("count", 0.0), target=sr.block(v).start)
            counters["edges-cut"] += 1
