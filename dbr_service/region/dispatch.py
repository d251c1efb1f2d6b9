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
cascade) keeps its edges whatever its width: it stays in replacement code.  So does an
absolute table jump ``jmp [T + idx*8]`` with a masked index whose table code generation
copies (:func:`~dbr_service.codegen.tables.region_table_plan`, with ``translate_tables``:
the table is read here, into ``sr.info["tables"]``), and one ``mov r, [T + idx*8]; jmp
r``; its successors in the region are reached through the copy (of the register form,
those that write ``r`` before reading it), its other targets are exits, as the graph
says.
"""

from __future__ import annotations

from collections import Counter

from dbr_service.codegen.dispatch import region_dispatch_plan
from dbr_service.codegen.tables import record_tables, region_table_plan
from dbr_service.region.model import END, EdgeKind, SuperRegion, TermKind


def cut_wide_dispatch(sr: SuperRegion, max_targets: int, counters: Counter,
                      mem=None, translate_tables: bool = False) -> None:
    """Turn the edges of every indirect jump with more than ``max_targets`` known
    targets into exit edges to those targets (counts kept).  A target may lose its only
    predecessor: PARTITION-CODE, which runs right after, gives it an entry edge.

    With ``translate_tables`` (and ``mem``, the view selection reads), absolute table
    jumps that code generation will translate keep their edges, whatever their width;
    a lone one is made unpatchable (its bound comes from the block before it)."""
    if translate_tables and mem is not None:
        record_tables(sr, mem, counters)
    for k, bb in list(sr.blocks()):
        if bb.term is not TermKind.IJMP:
            continue
        tp = region_table_plan(sr, k) if translate_tables else None
        if tp is not None:
            counters["translated-tables"] += 1
            _keep_whole(sr, k, tp)
            # register form: a target that reads the register first is left by an exit
            _cut(sr, k, counters, [v for v in sr.g.successors(k)
                                   if v != END and not tp.enters(sr.block(v).start)])
            continue
        if len(bb.targets) <= max_targets:
            continue
        if region_dispatch_plan(sr, k) is not None:
            counters["translated-dispatches"] += 1
            continue
        counters["wide-dispatches"] += 1
        _cut(sr, k, counters, [v for v in sr.g.successors(k) if v != END])


def _keep_whole(sr: SuperRegion, k, tp) -> None:
    """No patch may enter between the bounding ``and`` and the jump: patch-point
    selection would split the block there (before its first instruction of 5 bytes or
    more) or patch the lone jump, and code entered there has no bound."""
    after = {tp.jmp_addr} | {ld.addr for ld in tp.loads}
    for key in {k} | {ld.key for ld in tp.loads}:
        b = sr.block(key)
        if not b.unpatchable and (len(b.insns) == 1 and key == k or
                                  b.first_patchable() in after):
            b.unpatchable, b.unpatchable_why = True, "translated table jump"


def _cut(sr: SuperRegion, k, counters: Counter, succs: list) -> None:
    """Turn the edges from ``k`` to ``succs`` into exit edges (counts kept)."""
    for v in succs:
        d = sr.g.edges[k, v]
        sr.g.remove_edge(k, v)
        sr.add_edge(k, END, EdgeKind.EXIT, d.get("count", 0.0), target=sr.block(v).start)
        counters["edges-cut"] += 1
