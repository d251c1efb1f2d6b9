"""Loop-nesting forest of a super-region, irreducible loops included.

The forest is Steensgaard's (as characterised by Ramalingam, "On loops,
dominators, and dominance frontiers", TOPLAS 2002): the outermost loops are the
non-trivial strongly connected components of the body graph; a loop's *headers*
are its entry nodes (blocks with a predecessor outside the SCC, START
included); its *back edges* are the edges from inside the loop to a header;
removing the back edges and repeating on the loop's blocks gives the inner
loops.  For a reducible loop this is the natural loop of its single header
(exactly what Havlak's algorithm gives); an irreducible loop simply has several
headers and ``reducible`` is False.

The root of the forest is not a loop: it holds every block and the outermost
loops as children (patent fig. 12).  Also here: the small graph helpers the
other passes share (deterministic node order, DFS preorder, patchability).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Iterator

import networkx as nx

from dbr_service.region.model import END, START, CloneKey, NodeKey, SuperRegion

#: An x86-64 ``jmp rel32`` patch needs a first instruction at least this long.
PATCH_LEN = 5


# ---- shared graph helpers ------------------------------------------------------
def node_key(k: NodeKey) -> tuple:
    """Total order on node keys: START, original blocks by address, clones, END."""
    if k == START:
        return (0, 0, ())
    if k == END:
        return (3, 0, ())
    if isinstance(k, CloneKey):
        return (2, k.start, k.path)
    return (1, k, ())


def sorted_nodes(nodes: Iterable[NodeKey]) -> list[NodeKey]:
    return sorted(nodes, key=node_key)


def dfs_preorder(g: nx.DiGraph, source: NodeKey = START) -> list[NodeKey]:
    """DFS preorder from ``source``, successors visited in :func:`node_key` order.

    Every dominator of a block comes before it in this order, which is what
    makes "earlier in DFS order" mean "further out" for patch-point selection.
    """
    seen = {source}
    order = [source]
    stack: list[Iterator[NodeKey]] = [iter(sorted_nodes(g.successors(source)))]
    while stack:
        for v in stack[-1]:
            if v not in seen:
                seen.add(v)
                order.append(v)
                stack.append(iter(sorted_nodes(g.successors(v))))
                break
        else:
            stack.pop()
    return order


def body_graph(sr: SuperRegion) -> nx.DiGraph:
    """The SR's body blocks and the edges among them (no START/END)."""
    return sr.g.subgraph(sr.body_nodes())


def is_patchable(sr: SuperRegion, k: NodeKey) -> bool:
    """May block ``k`` hold a patch point (possibly after splitting off a short top)?"""
    if k in (START, END) or isinstance(k, CloneKey):
        return False
    bb = sr.block(k)
    if bb.unpatchable or not bb.known_exec or bb.is_clone:
        return False
    a = bb.first_patchable(PATCH_LEN)
    if a is None:
        return False
    # Splitting at ``a`` must not collide with another block's key.
    return a == bb.start or a not in sr.g


def body_bytes(sr: SuperRegion) -> int:
    """Bytes of body code, clones included (approximates replacement code size)."""
    return sum(bb.size for _, bb in sr.blocks())


# ---- the forest ------------------------------------------------------------------
@dataclass(eq=False)
class Loop:
    """One loop of the forest (or the root, which is not a loop)."""

    #: 0 for the root, then 1, 2, ... in DFS order of the headers.
    id: int
    #: Entry blocks of the loop; exactly one when ``reducible``.
    headers: list[NodeKey]
    #: Every block of the loop, nested loops' blocks included.
    blocks: set[NodeKey]
    #: Edges from inside the loop to one of its headers.
    back_edges: list[tuple[NodeKey, NodeKey]] = field(default_factory=list)
    #: Edges from outside the loop (START included) to one of its headers.
    entry_edges: list[tuple[NodeKey, NodeKey]] = field(default_factory=list)
    #: Directly nested loops, in DFS order.
    children: list["Loop"] = field(default_factory=list)
    parent: "Loop | None" = None
    #: False for a multi-entry (irreducible) loop.
    reducible: bool = True
    #: 0 for the root, 1 for outermost loops, ...
    depth: int = 0
    #: Sum of the headers' block counts.
    header_count: float = 0.0
    #: Sum of the entry edges' counts.
    entry_count: float = 0.0
    #: Estimated iterations per entry: header_count / entry_count.
    trip_count: float = 0.0

    @property
    def is_root(self) -> bool:
        return self.id == 0

    @property
    def own_blocks(self) -> set[NodeKey]:
        """Blocks of this loop that are in no nested loop."""
        inner: set[NodeKey] = set()
        for c in self.children:
            inner |= c.blocks
        return self.blocks - inner

    def walk(self) -> Iterator["Loop"]:
        """This loop and all nested ones, parents first, in DFS order."""
        yield self
        for c in self.children:
            yield from c.walk()

    def describe(self) -> dict:
        """Plain data (for tests, dumps and ``dbr ctl region``)."""
        return {
            "id": self.id, "headers": list(self.headers), "blocks": sorted_nodes(self.blocks),
            "back_edges": sorted(self.back_edges, key=lambda e: (node_key(e[0]), node_key(e[1]))),
            "reducible": self.reducible, "depth": self.depth, "trip_count": self.trip_count,
            "children": [c.describe() for c in self.children],
        }


@dataclass
class LoopForest:
    """The loop-nesting forest of one SR: ``root`` holds the outermost loops."""

    root: Loop
    #: Innermost loop (root for none) of every body block.
    innermost: dict[NodeKey, Loop]

    def loops(self) -> list[Loop]:
        """Every real loop, parents first, in DFS order."""
        return [lp for lp in self.root.walk() if not lp.is_root]

    def max_trip_count(self) -> float:
        return max((lp.trip_count for lp in self.loops()), default=0.0)


def loop_forest(sr: SuperRegion) -> LoopForest:
    """Compute the loop-nesting forest of ``sr`` (see the module docstring)."""
    g = sr.g
    order = {k: i for i, k in enumerate(dfs_preorder(g))}
    body = sr.body_nodes()
    # Blocks START cannot reach (only in inconsistent SRs) go last, by address.
    for k in sorted_nodes(body):
        order.setdefault(k, len(order))
    root = Loop(id=0, headers=[], blocks=set(body))
    innermost = {k: root for k in body}
    counter = [0]

    def find(parent: Loop, nodes: set[NodeKey], removed: set[tuple[NodeKey, NodeKey]]) -> None:
        sub = nx.DiGraph()
        sub.add_nodes_from(nodes)
        sub.add_edges_from((u, v) for u, v in g.subgraph(nodes).edges if (u, v) not in removed)
        sccs = [c for c in nx.strongly_connected_components(sub)
                if len(c) > 1 or any(sub.has_edge(n, n) for n in c)]
        sccs.sort(key=lambda c: min(order[n] for n in c))
        for scc in sccs:
            headers = [n for n in scc if any(p not in scc for p in g.predecessors(n))]
            if not headers:
                headers = [min(scc, key=order.__getitem__)]
            headers.sort(key=order.__getitem__)
            back = [(u, h) for h in headers for u in g.predecessors(h)
                    if u in scc and sub.has_edge(u, h)]
            entries = [(u, h) for h in headers for u in g.predecessors(h) if u not in scc]
            counter[0] += 1
            lp = Loop(id=counter[0], headers=headers, blocks=set(scc), back_edges=back,
                      entry_edges=entries, parent=parent, reducible=len(headers) == 1,
                      depth=parent.depth + 1)
            _estimate_trips(sr, lp)
            parent.children.append(lp)
            for n in scc:
                innermost[n] = lp
            find(lp, set(scc), removed | set(back))

    find(root, set(body), set())
    return LoopForest(root=root, innermost=innermost)


def _estimate_trips(sr: SuperRegion, lp: Loop) -> None:
    """Trip count = header executions per loop entry, from block and edge counts."""
    lp.header_count = sum(sr.block(h).count for h in lp.headers)
    lp.entry_count = sum(sr.g.edges[u, v].get("count", 0.0) for u, v in lp.entry_edges)
    if lp.entry_count > 0:
        lp.trip_count = lp.header_count / lp.entry_count
    else:
        lp.trip_count = float("inf") if lp.header_count > 0 else 0.0
