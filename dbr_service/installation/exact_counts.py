"""Exact counts of a region in its counting phase (docs/decisions/0041-exact-counts.md):
where its counters go, the block and edge counts they give, the region rebuilt from
them, and how far the sample-inferred counts were from them.

A counting region's copy counts every block's entries and, for each ``jcc`` block,
the side its copy does not jump to (codegen/blocks.py).  From those:

* a ``jcc`` block's edges: the counted side, and the block's entries less it for the
  other side;
* a block with one way on (fall-through, ``jmp``, an inlined ``ret``): all its
  entries; a direct call: its entries both to its callee (clone or exit) and to its
  continuation;
* an indirect jump or call with several known targets (a compare cascade): not
  derivable from block counts alone; split by the targets' own counts and marked
  inexact (``inexact`` lists such blocks);
* an entry edge: its block's entries that no in-region edge explains.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from dbr_service.codegen.blocks import CountPlan
from dbr_service.region.model import END, START, EdgeKind, NodeKey, SuperRegion, TermKind
from dbr_service.region.prune import remove_cold_tails, remove_unreachable

#: Blocks of at least this share of the hottest block's exact count are the hot blocks
#: the error report is taken over.
HOT_SHARE = 0.01
#: Kinds of in-region edge that carry control on from a block.
_ON = (EdgeKind.FLOW, EdgeKind.FALLTHROUGH, EdgeKind.CALL, EdgeKind.RETURN)


def plan_counters(sr: SuperRegion, alloc: Callable[[], int]) -> CountPlan:
    """A counter (``alloc()``: a fresh data-buffer address) per block of ``sr`` and
    one more per ``jcc`` block for its side."""
    plan = CountPlan()
    for k, bb in sorted(sr.blocks(), key=lambda kb: (kb[1].start, str(kb[0]))):
        plan.blocks[k] = alloc()
        if bb.term is TermKind.JCC:
            plan.sides[k] = alloc()
    return plan


@dataclass
class ExactProfile:
    """Counts a counting region's counters gave."""

    blocks: dict[NodeKey, int] = field(default_factory=dict)
    #: In-region edge (u, v) -> count.
    edges: dict[tuple[NodeKey, NodeKey], int] = field(default_factory=dict)
    #: Block -> {original exit target: count}.
    exits: dict[NodeKey, dict[int, int]] = field(default_factory=dict)
    #: Entry block -> entries no in-region edge explains.
    entries: dict[NodeKey, int] = field(default_factory=dict)
    #: Blocks whose out-edge counts are not derived exactly (indirect branches).
    inexact: list[NodeKey] = field(default_factory=list)


def _ways_on(sr: SuperRegion, k: NodeKey) -> dict[int, tuple[str, Any]]:
    """Original address -> ("in", successor key) or ("exit", target) for each way on."""
    out: dict[int, tuple[str, Any]] = {}
    for _, v, d in sr.g.out_edges(k, data=True):
        if v == END:
            for t in d.get("exits", {}):
                out.setdefault(t, ("exit", t))
        elif d.get("kind") in _ON:
            out[sr.block(v).start] = ("in", v)
    return out


def derive(sr: SuperRegion, plan: CountPlan, sides: Mapping[NodeKey, int],
           read: Callable[[int], int]) -> ExactProfile:
    """The exact profile of ``sr`` emitted with ``plan`` (``sides``: the emitted code's
    ``counted_sides``) from the counters' values (``read(address)``)."""
    prof = ExactProfile()
    for k in plan.blocks:
        prof.blocks[k] = read(plan.blocks[k])

    def put(k: NodeKey, way: tuple[str, Any], n: int) -> None:
        if way[0] == "in":
            prof.edges[(k, way[1])] = prof.edges.get((k, way[1]), 0) + n
        else:
            ex = prof.exits.setdefault(k, {})
            ex[way[1]] = ex.get(way[1], 0) + n

    for k, bb in sr.blocks():
        n = prof.blocks.get(k, 0)
        ways = _ways_on(sr, k)
        if not ways or bb.term is TermKind.HALT:
            continue
        if k in sides and k in plan.sides:
            side = min(read(plan.sides[k]), n)
            other = [a for a in ways if a != sides[k]]
            if not other:                    # both sides go to one place
                put(k, ways[sides[k]], n)
                continue
            if sides[k] in ways:
                put(k, ways[sides[k]], side)
            put(k, ways[other[0]], n - side)
            continue
        if bb.term in (TermKind.CALL, TermKind.ICALL) and \
                (len(ways) == 1 or not bb.targets or len(bb.targets) == 1):
            # the call leaves (or enters its clone) and comes back to its continuation
            for w in ways.values():
                put(k, w, n)
            continue
        if len(ways) == 1:
            put(k, next(iter(ways.values())), n)
            continue
        # several ways on without a side counter: by the in-region targets' counts
        prof.inexact.append(k)
        inside = {a: w for a, w in ways.items() if w[0] == "in"}
        left = n
        for a, w in sorted(inside.items()):
            share = min(left, prof.blocks.get(w[1], 0))
            put(k, w, share)
            left -= share
        rest = [w for w in ways.values() if w[0] == "exit"]
        if rest and left:
            put(k, rest[0], left)
    for v, _ in sr.entry_edges():
        came = sum(c for (u, w), c in prof.edges.items() if w == v)
        prof.entries[v] = max(0, prof.blocks.get(v, 0) - came)
    return prof


def rebuilt(sr: SuperRegion, prof: ExactProfile) -> SuperRegion:
    """A copy of ``sr`` carrying the exact counts, its blocks that never ran during the
    phase and reach no block that did removed (their predecessors exit there): what
    the optimised region is laid out from."""
    out = copy.deepcopy(sr)
    for k, bb in out.blocks():
        bb.count = float(prof.blocks.get(k, 0))
    for u, v, d in out.g.edges(data=True):
        if u == START:
            d["count"] = float(prof.entries.get(v, 0))
        elif v == END:
            ex = prof.exits.get(u, {})
            d["exits"] = {t: float(ex.get(t, 0)) for t in d.get("exits", {})}
            d["count"] = float(sum(d["exits"].values()))
        else:
            d["count"] = float(prof.edges.get((u, v), 0))
    if any(bb.count >= 1 for _, bb in out.blocks()):
        remove_cold_tails(out, 1.0)
        remove_unreachable(out)
    out.verify()
    return out


def _rel(a: float, b: float) -> float:
    return abs(a - b) / b


def sample_error(sr: SuperRegion, prof: ExactProfile, sides: Mapping[NodeKey, int]
                 ) -> dict[str, Any]:
    """How far the counts region selection inferred from samples (``sr``'s) were from
    the exact ones.  Inferred counts are in samples, so they are scaled by the ratio of
    the hot blocks' exact and inferred totals first.  Over the hot blocks (at least
    HOT_SHARE of the hottest block's exact count): the mean relative error of block
    counts and of in-region edge counts, and the share of ``jcc`` blocks whose more
    frequent direction the inference got wrong (a tie counts as wrong)."""
    hottest = max(prof.blocks.values(), default=0)
    hot = [k for k, n in prof.blocks.items() if hottest and n >= HOT_SHARE * hottest]
    if not hot:
        return {"hot_blocks": 0}
    inferred = {k: sr.block(k).count for k in hot}
    tot_i = sum(inferred.values())
    scale = sum(prof.blocks[k] for k in hot) / tot_i if tot_i > 0 else 0.0
    block_err = sum(_rel(scale * inferred[k], prof.blocks[k]) for k in hot) / len(hot)
    hot_set = set(hot)
    edges = [(e, n) for e, n in prof.edges.items() if e[0] in hot_set and n > 0]
    edge_err = (sum(_rel(scale * sr.g.edges[e].get("count", 0.0), n) for e, n in edges)
                / len(edges)) if edges else None
    judged = wrong = 0
    for k in hot:
        if k not in sides:
            continue
        ways = _ways_on(sr, k)
        if len(ways) != 2 or sides[k] not in ways:
            continue
        side_n = prof.edges.get((k, ways[sides[k]][1]), None) if ways[sides[k]][0] == "in" \
            else prof.exits.get(k, {}).get(sides[k])
        if side_n is None:
            continue
        other_n = prof.blocks[k] - side_n
        if side_n == other_n:
            continue

        def inf(w: tuple[str, Any]) -> float:
            if w[0] == "in":
                return sr.g.edges[k, w[1]].get("count", 0.0)
            return sr.g.edges[k, END].get("exits", {}).get(w[1], 0.0)
        other = next(w for a, w in ways.items() if a != sides[k])
        i_side, i_other = inf(ways[sides[k]]), inf(other)
        judged += 1
        wrong += (i_side > i_other) != (side_n > other_n) or i_side == i_other
    return {"hot_blocks": len(hot), "block_count_error": round(block_err, 4),
            "edge_count_error": None if edge_err is None else round(edge_err, 4),
            "branches_judged": judged,
            "branch_direction_wrong": round(wrong / judged, 4) if judged else None}


def too_thin(sr: SuperRegion, samples_per_block: float) -> bool:
    """Whether ``sr``'s samples are too thin to decide its layout: fewer than
    ``samples_per_block`` samples per block on average (its clones not counted)."""
    own = [bb for _, bb in sr.blocks() if not bb.is_clone]
    return bool(own) and sum(bb.samples for bb in own) / len(own) < samples_per_block
