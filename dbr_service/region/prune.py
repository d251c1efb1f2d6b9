"""PRUNE-CODE (patent fig. 8): keep only hot code worth a patch.

1. Remove blocks START no longer reaches (patch-point selection moved entries).
2. Remove cold tails: blocks that are not hot (count < ``hot_threshold``) and
   cannot reach a hot block.  Their predecessors exit to original code at the
   removed block's address instead (for a clone that is the original address of
   the cloned code, which is right: the inlined call pushed the original return
   address, so original code carries on exactly as the clone would have).
3. Separate connected components again (inlining, entry moves and pruning may
   have split a region).
4. Drop regions with fewer than ``min_region_size`` bytes of body code (sum of
   block sizes, clones included), regions with no loop whose estimated trip
   count reaches ``min_loop_trip_count`` (loopless ones included), and regions
   left without a patch point.  ``sr.info["loops"]`` = the final loop forest.

*Hot functions* (``function_threshold``, a sample count; None: off).  In a flat
profile no loop is hot and no single block reaches ``hot_threshold``, yet a few
hundred functions hold the time; their copies, calling each other for real, are the
hot text.  An SR patched at a known function entry (``sr.info["function_entries"]``)
whose blocks hold at least ``function_threshold`` samples is a *hot function*: its
cold tails are the blocks below FUNCTION_TAIL_SHARE of its hottest block's count
(instead of ``hot_threshold``), and a part that keeps the function entry's patch
point is kept without a hot loop (``info["hot_function"]``).  ``info["functions"]``
counts the hot functions' entries among a kept part's patch points.  With hot text
(region/functions.py, ``FunctionEntries.samples``) a function's samples are counted
over the whole function, wherever its blocks' SRs lie, and a part patched only where
a hot function's call that leaves the copy returns (no entry of its own) is kept too.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable

import networkx as nx

from dbr_service.region.loops import body_bytes, loop_forest, sorted_nodes
from dbr_service.region.model import END, START, EdgeKind, NodeKey, SuperRegion
from dbr_service.region.partition import separate_connected_components


def remove_unreachable(sr: SuperRegion) -> int:
    """Drop every body block START does not reach; return how many."""
    dead = set(sr.body_nodes()) - nx.descendants(sr.g, START)
    sr.g.remove_nodes_from(dead)
    return len(dead)


def remove_cold_tails(sr: SuperRegion, hot_threshold: float) -> set[NodeKey]:
    """Remove blocks that are cold and reach no hot block; return them."""
    body = set(sr.body_nodes())
    keep = {k for k in body if sr.block(k).count >= hot_threshold}
    work = list(keep)
    while work:
        b = work.pop()
        for p in sr.g.predecessors(b):
            if p != START and p not in keep:
                keep.add(p)
                work.append(p)
    cold = body - keep
    for c in sorted_nodes(cold):
        for p in list(sr.g.predecessors(c)):
            if p in keep:
                sr.add_edge(p, END, EdgeKind.EXIT, sr.g.edges[p, c]["count"],
                            target=sr.block(c).start)
    sr.g.remove_nodes_from(cold)
    return cold


#: A hot function's blocks below this share of its hottest block's count are cold.
FUNCTION_TAIL_SHARE = 0.02


def function_entry_points(sr: SuperRegion) -> list[int]:
    """``sr``'s patch points that are known function entries."""
    functions = sr.info.get("function_entries")
    if not functions:
        return []
    return [a for a in sr.entry_points() if a in functions]


def prune_code(sr: SuperRegion, *, hot_threshold: float, min_loop_trip_count: float,
               min_region_size: int, counters: Counter | None = None,
               function_threshold: float | None = None) -> list[SuperRegion]:
    """PRUNE-CODE on one SR; returns the surviving SRs (zero or more)."""
    counters = counters if counters is not None else Counter()
    counters["unreachable-removed"] += remove_unreachable(sr)
    fn_entries: set[int] = set()
    in_hot_function: Callable[[int], bool] | None = None
    tail_threshold = hot_threshold
    if function_threshold is not None and not sr.transfer_only:
        blocks = [sr.block(k) for k in sr.body_nodes()]
        own = sum(b.samples for b in blocks)
        # hot text counts a function's samples wherever they are (calls it makes
        # through pointers split it into several SRs): FunctionEntries.samples
        functions = sr.info.get("function_entries")
        per_fn = getattr(functions, "samples", None) or {}
        fn_entries = {e for e in function_entry_points(sr)
                      if max(own, per_fn.get(e, 0.0)) >= function_threshold}
        if per_fn:     # hot text: code a hot function's return comes back into too
            def in_hot_function(p: int) -> bool:
                return per_fn.get(functions.function_start(p), 0.0) >= function_threshold
        if fn_entries or (in_hot_function is not None
                          and any(in_hot_function(p) for p in sr.entry_points())):
            hottest = max(b.count for b in blocks)
            tail_threshold = min(hot_threshold, max(1e-9, FUNCTION_TAIL_SHARE * hottest))
    counters["cold-removed"] += len(remove_cold_tails(sr, tail_threshold))
    kept = []
    for part in separate_connected_components(sr):
        if len(part) == 0:
            counters["dropped-empty"] += 1
            continue
        forest = loop_forest(part)
        part.info["loops"] = forest
        part.info["patch_points"] = part.entry_points()     # [] when transfer-only
        own_entries = fn_entries & set(part.info["patch_points"])
        if not part.entry_edges():
            counters["dropped-no-patch-point"] += 1
        elif body_bytes(part) < min_region_size:
            counters["dropped-small"] += 1
        elif any(lp.trip_count >= min_loop_trip_count for lp in forest.loops()):
            if own_entries:
                part.info["functions"] = len(own_entries)
            kept.append(part)
        elif own_entries:
            part.info["hot_function"] = True
            part.info["functions"] = len(own_entries)
            counters["kept-hot-functions"] += 1
            kept.append(part)
        elif in_hot_function is not None and any(map(in_hot_function, part.entry_points())):
            part.info["hot_function"] = True     # a hot function's code after a call
            part.info["functions"] = 0           # that leaves its copy (no entry here)
            counters["kept-hot-function-parts"] += 1
            kept.append(part)
        else:
            counters["dropped-no-hot-loop"] += 1
    counters["kept"] += len(kept)
    return kept
