"""Block layout of a super-region from its edge counts: ext-TSP (codegen/exttsp.py) or
Pettis-Hansen style chains, against the compiler's own order.

Hot edges that the emitter can turn into a fall-through (plain fall-through, direct jmp,
either side of a jcc, call pseudo-instruction into its inlined callee, inlined return into
its continuation, real or promoted call into its continuation) glue blocks into chains,
hottest edge first, loop back edges last (so a loop is laid out head first, its latch
branches back to an aligned head and its exit falls through, the classic compiler
shape); a loop whose head is its exit test is then rotated so that the head comes last
(one branch an iteration, not two).  The chain holding the hottest entry comes first,
then the other chains by heat, cold chains (no count) last.  The ext-TSP order
(codegen/exttsp.py: fall-throughs plus short forward and backward jumps, by distance)
is the other candidate made from the counts; of the two, the one with fewer taken
branches (ext-TSP on a tie) competes with
the original one (the compiler's own layout: blocks in address order, each inlined
callee's clones right after its call site, blocks without counts moved last): the
emitter gets whichever costs fewer taken branches and inserted jumps by the edge counts
(:func:`layout_cost`), the original unless the chains are clearly better
(``CHAIN_MARGIN``).  The counts are inferred from IP samples, so a chain order
that only ties the compiler's would trade a known layout for a guess: on xz's
binary-tree match finder the chains turned a loop of one taken branch an iteration
into one of two on average, and the replacement code ran slower than the original.
A loop head (target of a back edge of a depth-first search from START) is aligned when
it pays: its back edges run at least ``ALIGN_RATIO`` times as often as its layout
predecessor falls into it (the padding NOPs run only on that fall-in; when the back edge
itself is the fall-in, padding would run every iteration, so it is not aligned).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dbr_service.codegen.blockorder import (
    block_heat,
    can_fall_into,
    node_sort_key,
    original_order,
)
from dbr_service.codegen.exttsp import order_region
from dbr_service.region.model import END, START, NodeKey, SuperRegion, TermKind

ALIGN = 16
ALIGN_RATIO = 4.0
#: The chain order replaces the original one only when it costs at most this fraction
#: of the original's taken branches (inferred counts: a near tie is no evidence).
CHAIN_MARGIN = 0.9


@dataclass
class Layout:
    """The order of the body blocks in the code buffer."""

    order: list[NodeKey]
    #: Blocks whose start is aligned to ``ALIGN``.
    aligned: set[NodeKey] = field(default_factory=set)
    #: Which order won: "ext-tsp" or "chains" (from the edge counts) or "original" (the
    #: compiler's); "given" for an order made elsewhere.
    kind: str = "given"

    def next_of(self) -> dict[NodeKey, NodeKey | None]:
        """Each block's successor in the layout (None for the last)."""
        return {k: (self.order[i + 1] if i + 1 < len(self.order) else None)
                for i, k in enumerate(self.order)}


def compute_layout(sr: SuperRegion) -> Layout:
    """The ext-TSP order, the chain order or the original one: of the two made from the
    counts, the one with fewer taken branches (ext-TSP on a tie: it also weighs jump
    distances), if it clearly beats the original (``CHAIN_MARGIN``); else the original."""
    orig = original_order(sr)
    limit = CHAIN_MARGIN * layout_cost(sr, orig)
    best: tuple[float, int, list[NodeKey], str] | None = None
    for rank, (kind, order) in enumerate((("ext-tsp", order_region(sr)),
                                          ("chains", chain_order(sr)))):
        cost = layout_cost(sr, order)
        if cost < limit and (best is None or (cost, rank) < best[:2]):
            best = (cost, rank, order, kind)
    if best is not None:
        order = head_first(sr, best[2])
        return Layout(order, _aligned(sr, order), best[3])
    return Layout(orig, _aligned(sr, orig), "original")


def head_first(sr: SuperRegion, order: list[NodeKey]) -> list[NodeKey]:
    """Move a loop's head block in front of the block it falls into, when that block
    comes first.

    Patch-point selection splits a loop's head before its first instruction of 5 bytes
    or more, so a head ``M: mov rdx, rax`` falls into the region's entry ``E``.  With
    ``E`` first, the order ends the loop ``L: cmp; je exit`` then ``M; jmp E``: two
    branches and a jump an iteration.  With ``M`` first (the region's code is entered
    by jumps only, so nothing needs ``E`` at its start), ``L`` ends in one jcc back to
    ``M``, as a compiler lays out a bottom-tested loop.  The cost in taken branches is
    the same (:func:`layout_cost`): one jump instruction fewer an iteration.  Done for
    a ``M`` laid out right after a latch ``L`` whose jcc's other side leaves the loop,
    when ``M -> E`` runs at least as often as anything else enters ``E``."""
    if len(order) < 3:
        return order
    e = order[0]
    for i in range(2, len(order)):
        m, latch = order[i], order[i - 1]
        bm, bl = sr.block(m), sr.block(latch)
        if bm.term not in (TermKind.FALLTHROUGH, TermKind.JMP) or bl.term is not TermKind.JCC:
            continue
        if list(sr.g.successors(m)) != [e] or not can_fall_into(sr, m, e) or \
                not sr.g.has_edge(latch, m):
            continue
        back = sr.g.edges[m, e].get("count", 0.0)
        other = sum(d.get("count", 0.0) for u, _, d in sr.g.in_edges(e, data=True) if u != m)
        if back <= 0 or back < other:
            continue
        new = [m] + order[:i] + order[i + 1:]
        if layout_cost(sr, new) <= layout_cost(sr, order):
            return new
    return order


def layout_cost(sr: SuperRegion, order: list[NodeKey]) -> float:
    """Taken branches and inserted jumps the edge counts expect of ``order``: every body
    edge costs its count unless its target is laid out right after its source and the
    emitter can drop the jump (:func:`can_fall_into`).  Exits cost the same in any
    order, so they are left out."""
    nxt = Layout(order).next_of()
    cost = 0.0
    for u, v, d in sr.body_edges():
        c = d.get("count", 0.0)
        if c > 0 and not (nxt.get(u) == v and u != v and can_fall_into(sr, u, v)):
            cost += c
    return cost


def chain_order(sr: SuperRegion) -> list[NodeKey]:
    """Chains from hot fall-through-able edges, then chains ordered by heat."""
    nodes = sorted(sr.body_nodes(), key=node_sort_key)
    chain_of: dict[NodeKey, list[NodeKey]] = {k: [k] for k in nodes}
    edges = [(d.get("count", 0.0), u, v) for u, v, d in sr.body_edges()
             if u != v and can_fall_into(sr, u, v)]
    back = back_edges(sr)
    edges.sort(key=lambda e: ((e[1], e[2]) in back, -e[0], node_sort_key(e[1]),
                              node_sort_key(e[2])))
    for _c, u, v in edges:
        a, b = chain_of[u], chain_of[v]
        if a is b or a[-1] != u or b[0] != v:
            continue
        a.extend(b)
        for k in b:
            chain_of[k] = a
    chains = list({id(c): c for c in chain_of.values()}.values())
    for c in chains:
        _rotate_loop(sr, c, back)
    heat = block_heat(sr, nodes)
    entries = sorted(sr.entry_edges(), key=lambda e: (-e[1], node_sort_key(e[0])))
    first = chain_of[entries[0][0]] if entries else None

    def chain_key(c: list[NodeKey]) -> tuple:
        h = max(heat[k] for k in c)
        return (c is not first, h <= 0, -h, node_sort_key(c[0]))

    chains.sort(key=chain_key)
    return [k for c in chains for k in c]


def _rotate_loop(sr: SuperRegion, c: list[NodeKey], back: set[tuple[NodeKey, NodeKey]]) -> None:
    """Rotate a loop that ends its chain so that its exiting head comes last.

    Chains glue back edges last, so a loop whose head ``H`` is also its exit test
    (``H: cmp; jcc`` with the body on one side and the exit on the other, typical
    where the region is entered at a bottom-tested loop's latch) comes out as
    ``H, B1 .. T`` with ``T: jmp H``: two branches an iteration.  Moving ``H``
    after ``T`` (``B1 .. T, H``: ``T`` falls into ``H``, whose jcc jumps back to
    ``B1``, the emitter aiming a jcc with neither side next at the side that stays in
    the buffer) leaves one, as the compiler had it.  Only for a latch that ends in an
    unconditional jump or falls through.  Done when the back edge ``T -> H``
    runs more often than the block before ``H`` falls into it (which now needs a
    jump); entries into ``H`` still land on its own address."""
    if len(c) < 2:
        return
    t = c[-1]
    for i, h in enumerate(c[:-1]):
        if (t, h) not in back or not can_fall_into(sr, t, h):
            continue
        if sr.block(h).term is not TermKind.JCC or \
                sr.block(t).term not in (TermKind.FALLTHROUGH, TermKind.JMP):
            return   # a conditional latch is an exit test too: two branches either way
        rest = c[i + 1:]
        others = [v for v in sr.g.successors(h) if v != rest[0]]
        if len(others) != 1 or others[0] in rest:
            return                              # not an exit test: nothing to gain
        gain = sr.g.edges[t, h].get("count", 0.0)
        loss = sr.g.edges[c[i - 1], h].get("count", 0.0) \
            if i > 0 and sr.g.has_edge(c[i - 1], h) else 0.0
        if gain > loss:
            c[i:] = rest + [h]
        return


def back_edges(sr: SuperRegion) -> set[tuple[NodeKey, NodeKey]]:
    """Edges to a block on the stack of a depth-first search from START (loop back edges)."""
    out: set[tuple[NodeKey, NodeKey]] = set()
    state: dict[NodeKey, int] = {START: 1}
    stack = [(START, iter(sorted(sr.g.successors(START), key=node_sort_key)))]
    while stack:
        u, it = stack[-1]
        v = next(it, None)
        if v is None:
            state[u] = 2
            stack.pop()
        elif v != END and state.get(v) == 1:
            out.add((u, v))
        elif v != END and v not in state:
            state[v] = 1
            succ = [w for w in sr.g.successors(v) if w != END]
            stack.append((v, iter(sorted(succ, key=node_sort_key))))
    return out


def _aligned(sr: SuperRegion, order: list[NodeKey]) -> set[NodeKey]:
    back: dict[NodeKey, float] = {}
    for u, v in back_edges(sr):
        back[v] = back.get(v, 0.0) + sr.g.edges[u, v].get("count", 0.0)
    out = set()
    for i, v in enumerate(order):
        if i == 0 or back.get(v, 0.0) <= 0:
            continue
        prev = order[i - 1]
        fall = sr.g.edges[prev, v].get("count", 0.0) \
            if sr.g.has_edge(prev, v) and can_fall_into(sr, prev, v) else 0.0
        if back[v] >= ALIGN_RATIO * fall:
            out.add(v)
    return out
