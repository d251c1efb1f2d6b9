"""PARTITION-CODE (patent fig. 11): one SR per connected component, then
CONNECT-TERMINALS so START reaches every block and every block reaches END.

Discovery puts everything it found into one SR.  Calls are two pseudo edges
(call block -> END, START -> callee entry), so routines fall into different
weakly connected components; each becomes its own SR with a new id, which makes
the inliner's per-SR budget a per-routine budget and lets hot areas be managed
independently.  CONNECT-TERMINALS works on the SCC condensation: only source
SCCs without an entry edge need one, only sink SCCs without an exit edge need
one (then dominators and post-dominators are defined).
"""

from __future__ import annotations

import copy
from collections import Counter
from typing import Iterable

import networkx as nx

from dbr_service.region import graphs
from dbr_service.region.loops import body_graph, is_patchable, node_key, sorted_nodes
from dbr_service.region.model import END, START, CloneKey, EdgeKind, NodeKey, SuperRegion


def separate_connected_components(sr: SuperRegion) -> list[SuperRegion]:
    """SEPARATE-CONNECTED-COMPONENTS: each weakly connected component of the body
    graph (entry and exit edges ignored) as its own SR with a new id, keeping its
    entry and exit edges.  Components come out ordered by their lowest block; an
    SR that is already one component is returned as is (same id)."""
    comps = sorted(nx.weakly_connected_components(body_graph(sr)),
                   key=lambda c: node_key(min(c, key=node_key)))
    if len(comps) <= 1:
        return [sr]
    out = []
    for comp in comps:
        sub = sr.subregion(set(comp))
        sub.info = {k: copy.deepcopy(v) for k, v in sr.info.items()
                    if k not in ("loops", "patch_points")}
        _keep_own_sites(sr, sub)
        out.append(sub)
    return out


def _keep_own_sites(sr: SuperRegion, sub: SuperRegion) -> None:
    """Inlining decisions about call blocks now in another component go there."""
    sites = sub.info.get("inline", {}).get("sites")
    if sites:
        for k in [k for k in sites if k in sr.g and k not in sub.g]:
            del sites[k]


def connect_terminals(sr: SuperRegion, prefer: Iterable[NodeKey] = (),
                      counters: Counter | None = None) -> None:
    """CONNECT-TERMINALS: add an entry edge to every source SCC that has none and
    an exit edge to every sink SCC that has none.

    The entry goes to a block in ``prefer`` if the SCC has one, else to its first
    patchable block, else to its lowest non-clone block.  A source SCC made only of
    clones cannot be entered (a clone is entered from its call site only), so its
    blocks are removed instead and the condensation recomputed.  An exit edge
    leaves from the SCC's lowest block and targets the address that block's code
    continues at (fall-through, else first target, else its end).
    """
    counters = counters if counters is not None else Counter()
    prefer = set(prefer)
    succ = sr.g._succ                    # plain adjacency: see region/graphs.py
    while True:
        body = set(sr.body_nodes())
        sources, _ = graphs.condensation_ends(succ, graphs.sccs(succ, body))
        doomed: list[NodeKey] = []
        for scc in sources:
            if any(sr.g.has_edge(START, n) for n in scc):
                continue
            cands = [n for n in scc if not isinstance(n, CloneKey)]
            if not cands:
                doomed.extend(scc)
                continue
            target = _entry_choice(sr, cands, prefer)
            sr.add_edge(START, target, EdgeKind.ENTRY, 0.0)
            counters["entries-added"] += 1
        if not doomed:
            break
        sr.g.remove_nodes_from(doomed)
        counters["unenterable-clones-removed"] += len(doomed)
    body = set(sr.body_nodes())
    _, sinks = graphs.condensation_ends(succ, graphs.sccs(succ, body))
    for scc in sinks:
        if any(sr.g.has_edge(n, END) for n in scc):
            continue
        n = sorted_nodes(scc)[0]
        bb = sr.block(n)
        if bb.fallthrough is not None:
            tgt = bb.fallthrough
        elif bb.targets:
            tgt = bb.targets[0]
        else:
            tgt = bb.end
        sr.add_edge(n, END, EdgeKind.EXIT, 0.0, target=tgt)
        counters["exits-added"] += 1


def _entry_choice(sr: SuperRegion, cands: list[NodeKey], prefer: set[NodeKey]) -> NodeKey:
    pref = [n for n in cands if n in prefer]
    if pref:
        return sorted_nodes(pref)[0]
    good = [n for n in cands if is_patchable(sr, n)]
    return sorted_nodes(good or cands)[0]


def partition_code(sr: SuperRegion, counters: Counter | None = None) -> list[SuperRegion]:
    """PARTITION-CODE: separate components, then connect the terminals of each."""
    counters = counters if counters is not None else Counter()
    parts = separate_connected_components(sr)
    counters["components"] += len(parts)
    for p in parts:
        connect_terminals(p, counters=counters)
    return parts
