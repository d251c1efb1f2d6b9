"""PATCH-POINT-SELECTION (patent fig. 12): the fewest patches that cover
every loop, each as far out as possible; then split and move the entry edges.

*Covered.*  Original code enters the SR only along its entry edges.  With patch
set P, the blocks original code can run before hitting a patch are those START
reaches without passing through P.  A loop is covered when none of its cycles
lies wholly in that set: original code then enters replacement code within one
iteration.  This is SUPERCEDES generalised from one patch to the set: p
dominating b (every way to b passes p), and within a loop p post-dominating b
(b's iteration runs into p, the back edge brings it round) both mean b cannot
run a whole iteration in original code.

*Selection* (NESTED-PATCHES), candidates in DFS preorder from START (dominators
come first, so earlier = further out), only patchable blocks
(:func:`~dbr_service.region.loops.is_patchable`):

1. root patches: a block in no loop is chosen when original code can still reach
   it and it leads to an uncovered loop (dominator-style: it cuts paths in);
2. then each loop, outermost first, children in DFS order: a block of the loop
   (not of a nested loop) is chosen when it lies on an uncovered cycle; then
   its nested loops are done the same way;
3. minimise: a patch whose removal uncovers no loop is dropped, latest chosen
   first (so an outer patch made useless by an inner one goes, not the inner).

If nothing was chosen (no loop, or no loop coverable) the first patchable block
in DFS order is the patch, so the SR stays well formed; PRUNE-CODE judges it.
An SR without any patchable block is dropped.

*Moving entries.*  A chosen block whose first instruction is shorter than 5
bytes is split before its first instruction of >= 5 bytes (top keeps the
in-edges, tail the out-edges, a fall-through edge joins them) and the patch is
the tail.  Old entry edges go; each patch gets an entry edge counting the flow
that reaches it from original code.  Blocks START no longer reaches are removed
here (not only in PRUNE-CODE) so that the SR verifies after this pass.
Invariant: every entry target starts with a >= 5-byte instruction, is known to
execute, not unpatchable and not a clone -- or is an entry site.

*Entry sites* (docs/architecture.md, "Invariants" 3).  A block at a known function
entry (``functions``: :class:`~dbr_service.region.functions.FunctionEntries`, else
``sr.info["function_entries"]``) whose first instruction is shorter than 5 bytes
may be patched at its start when its first k instructions together span at least 5
bytes and nothing known branches into bytes 1..4: no other block starts or
overlaps there, and no block's branch target, fall-through or exit lies there
(discovery splits a block at every target it knows, so such a target would also
have cut the entry block short), nor may any direct branch of the whole module
(``functions.may_branch_into``, region/branchindex.py, where ``functions`` has it).
Never in a clone, never an unpatchable block.  The site is then the block start,
unsplit; ``sr.info["entry_sites"]`` maps it to its inner instruction boundaries
(addresses), which go to the agent with the patch (SITE_F_ENTRY): the agent
installs it with the int3 protocol once its census finds no thread inside.  An entry
site is preferred to splitting the block before a later 5-byte instruction: it catches
every call at the door.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

from dbr_service.region import graphs
from typing import Callable, Container

from dbr_service.region.loops import PATCH_LEN, Loop, dfs_preorder, is_patchable, loop_forest
from dbr_service.region.model import END, START, CloneKey, EdgeKind, NodeKey, SuperRegion, TermKind
from dbr_service.region.prune import remove_unreachable


class _Coverage:
    """Answers "what can original code still reach / loop in" for a patch set."""

    def __init__(self, sr: SuperRegion) -> None:
        self.g = sr.g
        self._cache: dict[frozenset, tuple[set, set]] = {}
        self._to_cycle: dict[frozenset, set] = {}

    def state(self, patches: frozenset) -> tuple[set[NodeKey], set[NodeKey]]:
        """(blocks original code reaches before any patch, blocks on such cycles)."""
        if patches not in self._cache:
            succ = self.g._succ          # plain adjacency: see region/graphs.py
            reach: set[NodeKey] = set()
            work = [v for v in succ[START] if v not in patches and v != END]
            reach.update(work)
            while work:
                u = work.pop()
                for v in succ[u]:
                    if v != END and v not in patches and v not in reach:
                        reach.add(v)
                        work.append(v)
            self._cache[patches] = (reach, graphs.cyclic_nodes(succ, reach))
        return self._cache[patches]

    def leads_to_cycle(self, b: NodeKey, patches: frozenset) -> bool:
        """Whether original code at ``b`` can run into a cycle without meeting a patch."""
        if patches not in self._to_cycle:
            reach, cyc = self.state(patches)
            self._to_cycle[patches] = graphs.reaching(self.g._pred, cyc, reach)
        return b in self._to_cycle[patches]


def entry_site_inner(sr: SuperRegion, k: NodeKey,
                     functions: Container[int] | None) -> list[int] | None:
    """The inner instruction boundaries of an entry site at block ``k``'s start (see
    the module docstring), or None when ``k`` cannot hold one."""
    if functions is None or k in (START, END) or isinstance(k, CloneKey):
        return None
    bb = sr.block(k)
    if bb.is_clone or bb.unpatchable or not bb.known_exec or not bb.insns or \
            bb.insns[0][0] != bb.start or bb.insns[0][1] >= PATCH_LEN or bb.start not in functions:
        return None
    inner: list[int] = []
    end = bb.start
    for a, n in bb.insns:
        if a >= bb.start + PATCH_LEN:
            break
        if a > bb.start:
            inner.append(a)
        end = a + n
    if end - bb.start < PATCH_LEN:
        return None                  # the block ends before 5 bytes
    lo, hi = bb.start + 1, bb.start + PATCH_LEN
    for ok, ob in sr.blocks():
        if ok != k and not ob.is_clone and ob.start < hi and bb.start < ob.end:
            return None              # another decoded entry overlaps the site
        if any(lo <= t < hi for t in ob.targets) or \
                (ob.fallthrough is not None and lo <= ob.fallthrough < hi):
            return None
    for _, exits in sr.exit_edges():
        if any(lo <= t < hi for t in exits):
            return None
    may_branch_into = getattr(functions, "may_branch_into", None)
    if may_branch_into is not None and may_branch_into(lo, hi):
        return None                  # code discovery never decoded may branch there
    return inner


def _entry_sites(sr: SuperRegion, functions: Container[int] | None) -> dict[NodeKey, list[int]]:
    if functions is None:
        return {}
    out = {}
    for k in sr.body_nodes():
        inner = entry_site_inner(sr, k, functions)
        if inner is not None:
            out[k] = inner
    return out


def choose_patch_blocks(sr: SuperRegion, counters: Counter | None = None, *,
                        patchable: Callable[[NodeKey], bool] | None = None,
                        prefer: Callable[[NodeKey], bool] | None = None,
                        doors: Callable[[NodeKey], bool] | None = None) -> list[NodeKey]:
    """The blocks to patch (before splitting), in selection order; ``patchable``
    (default :func:`is_patchable`) says which blocks may hold a patch; the fallback
    patch of an SR without a loop to cover is the first ``prefer`` block if any, and
    every ``doors`` block original code still reaches is patched too."""
    counters = counters if counters is not None else Counter()
    if patchable is None:
        def patchable(b: NodeKey) -> bool:
            return is_patchable(sr, b)
    forest = loop_forest(sr)
    order = [k for k in dfs_preorder(sr.g) if k not in (START, END)]
    cov = _Coverage(sr)
    P: list[NodeKey] = []
    root_own = forest.root.own_blocks
    for b in order:
        if b in root_own and patchable(b) and cov.leads_to_cycle(b, frozenset(P)):
            P.append(b)
            counters["root-patches"] += 1

    def nested(lp: Loop) -> None:
        own = lp.own_blocks
        for b in order:
            if b in own and patchable(b) and b in cov.state(frozenset(P))[1]:
                P.append(b)
                counters["loop-patches"] += 1
        for child in lp.children:
            nested(child)

    for lp in forest.root.children:
        nested(lp)
    base = cov.state(frozenset(P))[1]
    for p in reversed(list(P)):
        rest = frozenset(q for q in P if q != p)
        if cov.state(rest)[1] == base:
            P.remove(p)
            counters["minimised-away"] += 1
    if not P:
        first = next((b for b in order if prefer is not None and prefer(b) and patchable(b)),
                     None)
        if first is None:
            first = next((b for b in order if patchable(b)), None)
        if first is not None:
            P.append(first)
            counters["fallback-patches"] += 1
    if doors is not None:        # every other door original code still comes in by
        for b in order:
            if doors(b) and b not in P and patchable(b) and \
                    b in cov.state(frozenset(P))[0]:
                P.append(b)
                counters["entry-patches"] += 1
    counters["uncovered-loop-blocks"] += len(base)
    return P


def split_for_patch(sr: SuperRegion, k: NodeKey) -> NodeKey:
    """Split block ``k`` before its first >= 5-byte instruction unless it already
    starts with one; return the key of the block that starts with it."""
    bb = sr.block(k)
    a = bb.first_patchable(PATCH_LEN)
    assert a is not None and isinstance(k, int)
    if a == bb.start:
        return k
    cut = a - bb.start
    frac = cut / bb.size
    top = replace(bb, size=cut, insns=[i for i in bb.insns if i[0] < a], data=bb.data[:cut],
                  term=TermKind.FALLTHROUGH, targets=[], fallthrough=a, unknown_target=False,
                  samples=bb.samples * frac)
    tail = replace(bb, start=a, size=bb.size - cut, insns=[i for i in bb.insns if i[0] >= a],
                   data=bb.data[cut:], targets=list(bb.targets), samples=bb.samples * (1 - frac))
    out = [(v, dict(d)) for _, v, d in sr.g.out_edges(k, data=True)]
    for v, _ in out:
        sr.g.remove_edge(k, v)
    sr.g.nodes[k]["bb"] = top
    sr.add_block(tail, a)
    for v, d in out:
        sr.g.add_edge(a, k if v == k else v, **d)
    sr.add_edge(k, a, EdgeKind.FALLTHROUGH, bb.count)
    sites = sr.info.get("inline", {}).get("sites", {})
    if k in sites:  # an inlined call: its decision follows the call instruction
        sites[a] = sites.pop(k)
    return a


def _entry_inflow(sr: SuperRegion, P: list[NodeKey]) -> dict[NodeKey, float]:
    """How often original code reaches each patch: the old entry counts pushed
    through the blocks original code runs before any patch, each block passing
    on the share of its out-edge counts (in DFS order; exact when those blocks
    form no cycle, i.e. when every loop is covered)."""
    g = sr.g
    reach, _ = _Coverage(sr).state(frozenset(P))
    orig: dict[NodeKey, float] = {START: 1.0}   # fraction of START's flow: all of it

    def share(u: NodeKey, v: NodeKey) -> float:
        if u == START:
            return g.edges[u, v]["count"]
        out = sum(d["count"] for _, _, d in g.out_edges(u, data=True))
        return orig.get(u, 0.0) * g.edges[u, v]["count"] / out if out > 0 else 0.0

    for v in dfs_preorder(g):
        if v in reach:
            orig[v] = sum(share(u, v) for u in g.predecessors(v) if u == START or u in reach)
    return {p: sum(share(u, p) for u in g.predecessors(p) if u == START or u in reach)
            for p in P}


def select_patch_points(sr: SuperRegion, counters: Counter | None = None, *,
                        transfer_only: bool = False,
                        functions: Container[int] | None = None,
                        entry_sites: bool = True, prefer_entries: bool = False) -> bool:
    """PATCH-POINT-SELECTION on one SR.  Returns False when the SR has no
    patchable block at all (the caller drops it) -- unless ``transfer_only``: then
    the SR is kept with its entry edges as they are, marked
    ``info["transfer_only"]`` and without patch points; threads enter it only when
    the agent moves them there from its original code (a loop that runs once, long:
    a worker's only call, a dlopened library's loop with no 5-byte instruction).

    ``functions``: the known function entries (default ``sr.info["function_entries"]``,
    if any), for entry sites; without them (or with ``entry_sites`` False) there are
    none.  ``prefer_entries`` (hot text): every known function entry of the SR, and
    every block it was entered at, that original code still reaches is patched as well
    (an SR with no loop to cover at its first function entry), so that each function
    can be a hot function (region/prune.py) and a call that leaves the copy (through a
    pointer to an unknown callee) returns into it."""
    counters = counters if counters is not None else Counter()
    if functions is None:
        functions = sr.info.get("function_entries")        # type: ignore[assignment]
    esites = _entry_sites(sr, functions) if entry_sites else {}
    def at_entry(b: NodeKey) -> bool:
        return b in esites or (not isinstance(b, CloneKey) and functions is not None
                               and sr.block(b).start in functions)

    # hot text's doors: function entries, and where original code comes back into the
    # SR (after a call that leaves it: a pointer call of unknown target returns there)
    entered = set(sr.g.successors(START)) if prefer_entries else set()
    P = choose_patch_blocks(sr, counters,
                            patchable=lambda b: b in esites or is_patchable(sr, b),
                            prefer=at_entry if prefer_entries else None,
                            doors=(lambda b: b in entered or at_entry(b))
                            if prefer_entries else None)
    if not P:
        if transfer_only and sr.entry_edges():
            counters["transfer-only"] += 1
            sr.info["transfer_only"] = True
            sr.info["patch_points"] = []
            sr.info["loops"] = loop_forest(sr)
            return True
        counters["dropped-unpatchable"] += 1
        return False
    inflow = _entry_inflow(sr, P)
    sr.g.remove_edges_from([(START, v) for v in list(sr.g.successors(START))])
    chosen: dict[int, list[int]] = {}
    for p in P:
        if p in esites:
            q = p                        # patched at its start, unsplit
            chosen[sr.block(p).start] = esites[p]
            counters["entry-sites"] += 1
        else:
            q = split_for_patch(sr, p)
            if q != p:
                counters["blocks-split"] += 1
        sr.add_edge(START, q, EdgeKind.ENTRY, inflow[p])
    counters["patch-points"] += len(P)
    counters["unreachable-removed"] += remove_unreachable(sr)
    sr.info["patch_points"] = sorted(sr.block(v).start for v, _ in sr.entry_edges())
    sr.info["entry_sites"] = {a: chosen[a] for a in sr.info["patch_points"] if a in chosen}
    sr.info["loops"] = loop_forest(sr)
    return True


def check_entry_invariant(sr: SuperRegion) -> None:
    """Raise AssertionError unless every entry target is a valid patch site: one
    instruction of >= 5 bytes, or an entry site whose recorded inner boundaries are
    the block's instruction starts inside its first 5 bytes."""
    esites = sr.info.get("entry_sites") or {}
    for v, _ in ([] if sr.transfer_only else sr.entry_edges()):
        bb = sr.block(v)
        assert not bb.is_clone and not bb.unpatchable and bb.known_exec, (sr.id, v)
        if bb.start in esites:               # type: ignore[operator]
            inner = [a for a, _ in bb.insns if bb.start < a < bb.start + PATCH_LEN]
            assert list(esites[bb.start]) == inner and inner, (sr.id, v)    # type: ignore[index]
            assert bb.size >= PATCH_LEN, (sr.id, v)
        else:
            assert bb.insns[0][1] >= PATCH_LEN, (sr.id, v, bb.insns[0])
