"""Graph primitives the passes call thousands of times per job, on plain adjacency.

networkx's algorithms on a ``G.subgraph(nodes)`` view go through filtered adjacency
views on every step; region selection ran a strongly-connected-components search on
such a view for every candidate patch and every partition component, which made
patch-point selection alone take 6 s on sqlite3's flat profile.  These functions take
the graph's successor mapping (``G.succ`` or, inside the passes, ``G._succ``: the
dict-of-dicts networkx itself iterates in its algorithms) and the node set to restrict
to, and do the same work with plain dict and set operations.

Results do not depend on iteration order except where documented.
"""

from __future__ import annotations

from typing import Hashable, Iterable, Mapping

Node = Hashable


def sccs(succ: Mapping[Node, Iterable[Node]], nodes: Iterable[Node]) -> list[set[Node]]:
    """Strongly connected components of the subgraph induced by ``nodes`` (iterative
    Tarjan).  Components come out in reverse topological order of the condensation
    (a component before every component that reaches it)."""
    within = nodes if isinstance(nodes, (set, frozenset, dict)) else set(nodes)
    index: dict[Node, int] = {}
    low: dict[Node, int] = {}
    stack: list[Node] = []
    on_stack: set[Node] = set()
    out: list[set[Node]] = []
    counter = 0
    for root in within:
        if root in index:
            continue
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        work = [(root, iter(succ[root]))]
        while work:
            v, it = work[-1]
            for w in it:
                if w not in within:
                    continue
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(succ[w])))
                    break
                if w in on_stack and index[w] < low[v]:
                    low[v] = index[w]
            else:
                work.pop()
                if work:
                    u = work[-1][0]
                    if low[v] < low[u]:
                        low[u] = low[v]
                if low[v] == index[v]:
                    comp: set[Node] = set()
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.add(w)
                        if w == v:
                            break
                    out.append(comp)
    return out


def is_cyclic_scc(succ: Mapping[Node, Iterable[Node]], comp: set[Node]) -> bool:
    """Whether an SCC holds a cycle: more than one node, or a self-loop."""
    if len(comp) > 1:
        return True
    (n,) = comp
    return n in succ[n]


def cyclic_nodes(succ: Mapping[Node, Iterable[Node]], nodes: Iterable[Node]) -> set[Node]:
    """The nodes that lie on a cycle of the subgraph induced by ``nodes``."""
    return {n for c in sccs(succ, nodes) if is_cyclic_scc(succ, c) for n in c}


def reaching(pred: Mapping[Node, Iterable[Node]], targets: Iterable[Node],
             nodes: set[Node] | frozenset[Node]) -> set[Node]:
    """The nodes of ``nodes`` from which some node of ``targets`` is reachable along
    paths inside ``nodes`` (targets included): a backward search over ``pred``."""
    seen = {t for t in targets if t in nodes}
    work = list(seen)
    while work:
        v = work.pop()
        for u in pred[v]:
            if u in nodes and u not in seen:
                seen.add(u)
                work.append(u)
    return seen


def condensation_ends(succ: Mapping[Node, Iterable[Node]], components: list[set[Node]]
                      ) -> tuple[list[set[Node]], list[set[Node]]]:
    """(source components: no edge enters them from another component, sink
    components: no edge leaves them to another component), among ``components``
    (which partition the node set considered: edges to nodes outside are ignored)."""
    where = {n: i for i, c in enumerate(components) for n in c}
    has_in = [False] * len(components)
    has_out = [False] * len(components)
    for i, c in enumerate(components):
        for u in c:
            for v in succ[u]:
                j = where.get(v)
                if j is not None and j != i:
                    has_out[i] = True
                    has_in[j] = True
    return ([c for i, c in enumerate(components) if not has_in[i]],
            [c for i, c in enumerate(components) if not has_out[i]])
