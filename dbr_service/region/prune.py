"""PRUNE-CODE (seed 001, fig. 8): keep only hot code worth a patch.

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
"""

from __future__ import annotations

from collections import Counter

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


def prune_code(sr: SuperRegion, *, hot_threshold: float, min_loop_trip_count: float,
               min_region_size: int, counters: Counter | None = None) -> list[SuperRegion]:
    """PRUNE-CODE on one SR; returns the surviving SRs (zero or more)."""
    counters = counters if counters is not None else Counter()
    counters["unreachable-removed"] += remove_unreachable(sr)
    counters["cold-removed"] += len(remove_cold_tails(sr, hot_threshold))
    kept = []
    for part in separate_connected_components(sr):
        if len(part) == 0:
            counters["dropped-empty"] += 1
            continue
        forest = loop_forest(part)
        part.info["loops"] = forest
        part.info["patch_points"] = part.entry_points()     # [] when transfer-only
        if not part.entry_edges():
            counters["dropped-no-patch-point"] += 1
        elif body_bytes(part) < min_region_size:
            counters["dropped-small"] += 1
        elif not any(lp.trip_count >= min_loop_trip_count for lp in forest.loops()):
            counters["dropped-no-hot-loop"] += 1
        else:
            kept.append(part)
    counters["kept"] += len(kept)
    return kept
