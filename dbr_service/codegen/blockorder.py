"""What both block orders (codegen/layout.py, codegen/exttsp.py) take from a region:
which edges the emitter can turn into a fall-through, and the compiler's own order
that every computed order competes with."""

from __future__ import annotations

from dbr_service.region.model import CloneKey, EdgeKind, NodeKey, SuperRegion, TermKind

#: Terminators after which the next laid-out block can be reached without a jump.
_CHAINABLE = {TermKind.FALLTHROUGH, TermKind.JMP, TermKind.JCC, TermKind.CALL, TermKind.RET,
              TermKind.ICALL}


def can_fall_into(sr: SuperRegion, u: NodeKey, v: NodeKey) -> bool:
    """Whether placing ``v`` right after ``u`` lets the emitter drop a jump to ``v``."""
    bb, d = sr.block(u), sr.g.edges[u, v]
    kind = d.get("kind")
    if bb.term not in _CHAINABLE or kind in (EdgeKind.ENTRY, EdgeKind.EXIT):
        return False
    if bb.term is TermKind.ICALL:
        # kept with promoted targets (an inlined one has no fall-through edge): its
        # hottest call returns into the continuation
        return kind is EdgeKind.FALLTHROUGH
    if bb.term is TermKind.CALL:
        if kind is EdgeKind.CALL:
            return True
        # a real call (kept, not inlined): it returns into its continuation
        return kind is EdgeKind.FALLTHROUGH and not any(
            e.get("kind") is EdgeKind.CALL for _, _, e in sr.g.out_edges(u, data=True))
    if bb.term is TermKind.RET:
        return kind is EdgeKind.RETURN and isinstance(u, CloneKey)
    if kind in (EdgeKind.CALL, EdgeKind.RETURN):
        return False
    start = sr.block(v).start
    if bb.term is TermKind.FALLTHROUGH:
        return start == (bb.fallthrough if bb.fallthrough is not None else bb.end)
    if bb.term is TermKind.JMP:
        return start in bb.targets
    return start in bb.targets or start == bb.fallthrough       # jcc (loop: see emitter)


def node_sort_key(k: NodeKey) -> tuple:
    """Original blocks by address, then clones by address and call path."""
    if isinstance(k, CloneKey):
        return (1, k.start, k.path)
    return (0, k, ())


def original_order(sr: SuperRegion) -> list[NodeKey]:
    """The compiler's layout: original blocks in address order, the clones of each
    inlined call right after the block that makes the call (in their own address
    order, nested calls after their caller's clones), blocks no count reaches last."""
    nodes = sr.body_nodes()
    plain = sorted((k for k in nodes if not isinstance(k, CloneKey)), key=node_sort_key)
    clones = sorted((k for k in nodes if isinstance(k, CloneKey)), key=lambda k: (k.path, k.start))
    after: dict[NodeKey, list[NodeKey]] = {}
    for k in clones:
        site = next((b for b in plain if sr.block(b).contains(k.path[0])), None) \
            if k.path else None
        after.setdefault(site, []).append(k)
    order: list[NodeKey] = []
    for k in plain:
        order.append(k)
        order.extend(after.pop(k, []))
    for rest in after.values():          # a call site outside the region's blocks
        order.extend(rest)
    heat = block_heat(sr, order)
    return [k for k in order if heat[k] > 0] + [k for k in order if heat[k] <= 0]


def block_heat(sr: SuperRegion, nodes: list[NodeKey]) -> dict[NodeKey, float]:
    """Each block's count: the sum over the edges into it."""
    return {k: sum(d.get("count", 0.0) for _, _, d in sr.g.in_edges(k, data=True))
            for k in nodes}
