"""Basic-block ordering by ext-TSP (extended travelling salesman).

The objective (Newell & Pupyrev, "Improved Basic Block Reordering", IEEE TC 2020)
scores an order by its jumps.  With ``d`` the bytes from the end of a jump's source to
the start of its target, a jump executed ``c`` times earns ``c * 1.0`` as a
fall-through (``d == 0``) from a block with several successors, ``c * 1.05`` from a
block with one; ``c * 0.1 * (1 - d / 1024)`` forward within 1024 bytes;
``c * 0.1 * (1 - d / 640)`` backward within 640 bytes (``d`` from the source's end back
to the target's start); nothing farther.  These are LLVM's constants
(``llvm/lib/Transforms/Utils/CodeLayout.cpp``, options ``ext-tsp-*``); :func:`score`
is that file's ``calcExtTspScore``.

The optimiser follows ``computeExtTspLayout`` there (BOLT's ``-reorder-blocks=ext-tsp``):

1. each block is a chain; *forced pairs* (a block whose only successor has it as
   its only predecessor, the successor not the entry) are joined first;
2. chains are merged greedily, best gain first.  For a pair (X, Y) the candidates are
   X·Y and, X split at k into X1·X2, X1·Y·X2, Y·X2·X1 and X2·X1·Y: at the k after a
   jump into Y's first block or before a target of a jump from Y's last block, and
   at every k when X has at most ``CHAIN_SPLIT_THRESHOLD`` (128) blocks except where
   X1's last block jumps to X2's first or is forced.  No merge may move the entry
   from the front, make a chain of ``MAX_CHAIN_SIZE`` (512) blocks, or join chains
   whose densities (count per byte) differ by more than ``MAX_MERGE_DENSITY_RATIO``;
3. the remaining chains are joined where an edge leads from one's last block to
   another's first, hot with hot and cold with cold, and placed entry first, then by
   decreasing density, then by input position.

Differences from LLVM:

* Speed.  A pair enters a heap with an upper bound of its gain (the jumps between X
  and Y that could fall through at full weight, the others at 0.1, plus X's best
  rotation) and is evaluated when the bound comes first; stale entries are skipped by
  chain versions.  Within an evaluation, a jump inside X1 or X2 keeps its distance and
  a jump between them changes by an amount independent of k (X2·X1 is a rotation,
  X1·Y·X2 inserts ``|Y|`` bytes), so these changes are summed for all k at once with
  difference arrays; only jumps between X and Y are scored per candidate.  Gains
  are LLVM's; ties may resolve differently.
* Profiles here are inferred and need not be flow-consistent.  A forced pair needs its
  jump to be the heaviest at both of its blocks (true of every forced pair of a
  consistent profile); otherwise a light u -> v could pin u before v against a heavy
  v -> u.  Forced pairs join hot with hot and cold with cold only, so every hot block
  (positive count) precedes every cold one.
* The result competes with the input order (entry first, then hot and cold blocks
  each in input order) and loses ties: the greedy search is not optimal, and a
  guessed profile is no reason to move code.

Cost: an evaluation is O(|X| + jumps within X + candidates * jumps between X and Y),
at most ~3 * 128 candidates.  Measured (CPU time, tests/unit/test_layout_exttsp.py): 1,000
CFG-like blocks ~0.1 s; 1,000 blocks with 3,000 random all-hot edges ~1.4 s.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from dbr_service.codegen.blockorder import can_fall_into, original_order
from dbr_service.region.model import NodeKey, SuperRegion

K = TypeVar("K", bound=Hashable)

FALLTHROUGH_WEIGHT_COND = 1.0
FALLTHROUGH_WEIGHT_UNCOND = 1.05
FORWARD_WEIGHT = 0.1
BACKWARD_WEIGHT = 0.1
FORWARD_DISTANCE = 1024
BACKWARD_DISTANCE = 640
MAX_CHAIN_SIZE = 512
CHAIN_SPLIT_THRESHOLD = 128
MAX_MERGE_DENSITY_RATIO = 100.0
EPS = 1e-8

# Merge types: how X (split at k into X1, X2) and Y are concatenated.
X_Y, X1_Y_X2, Y_X2_X1, X2_X1_Y = range(4)


def _jump_score(g: int, wft: float, count: float) -> float:
    """Score of a jump whose target starts ``g`` bytes after its source ends
    (0: fall-through, negative: backward).  ``wft``: its fall-through score."""
    if g == 0:
        return wft
    if g > 0:
        return FORWARD_WEIGHT * count * (1.0 - g / FORWARD_DISTANCE) \
            if g <= FORWARD_DISTANCE else 0.0
    return BACKWARD_WEIGHT * count * (1.0 + g / BACKWARD_DISTANCE) \
        if g >= -BACKWARD_DISTANCE else 0.0


@dataclass
class ExtTspResult(Generic[K]):
    """An order and how it compares with the input's own."""

    order: list[K]
    score: float
    #: Score of the original order (entry first, hot blocks, then cold ones).
    original_score: float
    #: "ext-tsp" when the optimised order won, "original" when the input's did.
    kind: str


def summed_edges(sizes: Mapping[K, int], edges: Iterable[tuple[K, K, float]],
                 what: str = "edge") -> dict[tuple[K, K], float]:
    """Edges as {(src, dst): count}, duplicates summed; checks that both endpoints
    have a size and that counts are finite and non-negative (``what`` names an edge
    in the error)."""
    out: dict[tuple[K, K], float] = {}
    for u, v, c in edges:
        if u not in sizes or v not in sizes:
            raise ValueError(f"{what} {u!r}->{v!r} has an endpoint without a size")
        c = float(c)
        if not 0.0 <= c < float("inf"):
            raise ValueError(f"{what} {u!r}->{v!r} has count {c!r}")
        out[(u, v)] = out.get((u, v), 0.0) + c
    return out


def _score(order: Sequence[K], sizes: Mapping[K, int], edges: dict[tuple[K, K], float]) -> float:
    addr: dict[K, int] = {}
    a = 0
    for k in order:
        addr[k] = a
        a += max(1, int(sizes[k]))
    outdeg = Counter(u for u, _ in edges)
    s = 0.0
    for (u, v), c in edges.items():
        if c > 0:
            wft = c * (FALLTHROUGH_WEIGHT_COND if outdeg[u] > 1 else FALLTHROUGH_WEIGHT_UNCOND)
            s += _jump_score(addr[v] - addr[u] - max(1, int(sizes[u])), wft, c)
    return s


def score(order: Sequence[K], sizes: Mapping[K, int], edges: Iterable[tuple[K, K, float]]) -> float:
    """The ext-TSP score of ``order`` (must hold every endpoint of ``edges``).

    Blocks are laid out back to back from address 0, sizes below 1 count as 1, a block's
    out-degree (edges with any count, self loops included) decides whether its
    fall-through is conditional.  A self loop scores a constant: a backward jump over
    its own block."""
    return _score(order, sizes, summed_edges(sizes, edges))


#: A jump within a chain that scores: (lo, hi, gap, fall-through score, count, score).
_Live = tuple[int, int, int, float, float, float]


@dataclass
class _Chain:
    id: int
    nodes: list[int]
    size: int
    count: float
    #: Bumped on every merge into this chain: heap entries carry the version they saw.
    ver: int = 0
    #: Other chain id -> jumps between the two (one list shared by both chains);
    #: own id -> jumps within the chain.
    links: dict[int, list[int]] = field(default_factory=dict)
    #: (ver, rotation deltas, scoring inner jumps) cached by :meth:`_ExtTsp._inner`.
    inner: tuple[int, list[float], list[_Live], float] | None = None


class _ExtTsp:
    """The optimiser on dense indices; block 0 is the entry."""

    def __init__(self, size: list[int], count: list[float],
                 edges: dict[tuple[int, int], float]) -> None:
        n = len(size)
        self.size = [max(1, int(s)) for s in size]
        self.count = list(count)
        self.count[0] = max(self.count[0], 1.0)        # the entry is always hot
        self.succ: list[list[int]] = [[] for _ in range(n)]
        self.pred: list[list[int]] = [[] for _ in range(n)]
        self.hot_succ: list[set[int]] = [set() for _ in range(n)]
        outdeg = [0] * n
        js: list[int] = []
        jd: list[int] = []
        jc: list[float] = []
        for (u, v), c in edges.items():
            outdeg[u] += 1
            if u == v:
                continue                                # order-independent
            self.succ[u].append(v)
            self.pred[v].append(u)
            if c > 0:
                js.append(u)
                jd.append(v)
                jc.append(c)
                self.hot_succ[u].add(v)
                self.count[u] = max(self.count[u], c)
                self.count[v] = max(self.count[v], c)
        self.js, self.jd, self.jc = js, jd, jc
        self.jcount = dict(zip(zip(js, jd), jc))
        self.jw = [c * (FALLTHROUGH_WEIGHT_COND if outdeg[u] > 1 else FALLTHROUGH_WEIGHT_UNCOND)
                   for u, c in zip(js, jc)]
        self.chain_of = list(range(n))
        self.idx = [0] * n
        self.off = [0] * n
        self.chains = {i: _Chain(i, [i], self.size[i], self.count[i]) for i in range(n)}
        for j, (u, v) in enumerate(zip(js, jd)):
            links = self.chains[u].links
            if v not in links:
                links[v] = self.chains[v].links[u] = []
            links[v].append(j)
        self.forced = [False] * n

    def run(self) -> list[int]:
        self._merge_forced()
        self._merge_pairs()
        self._merge_cold()
        chains = sorted(self.chains.values(),
                        key=lambda c: (c.nodes[0] != 0, -c.count / c.size, c.id))
        return [v for c in chains for v in c.nodes]

    # ---- merging -------------------------------------------------------
    def _merge(self, xid: int, yid: int, k: int, t: int) -> None:
        """Merge chain ``yid`` into ``xid`` by merge type ``t`` at offset ``k`` of X."""
        x, y = self.chains[xid], self.chains.pop(yid)
        xs, ys = x.nodes, y.nodes
        if t == X_Y:
            nodes = xs + ys
        elif t == X1_Y_X2:
            nodes = xs[:k] + ys + xs[k:]
        elif t == Y_X2_X1:
            nodes = ys + xs[k:] + xs[:k]
        else:
            nodes = xs[k:] + xs[:k] + ys
        x.nodes, x.size, x.count, x.ver = nodes, x.size + y.size, x.count + y.count, x.ver + 1
        a = 0
        for i, v in enumerate(nodes):
            self.chain_of[v], self.idx[v], self.off[v] = xid, i, a
            a += self.size[v]
        inner = x.links.pop(xid, []) + x.links.pop(yid, []) + y.links.pop(yid, [])
        y.links.pop(xid, None)
        for oid, jl in y.links.items():
            o = self.chains[oid]
            del o.links[yid]
            if oid in x.links:
                x.links[oid].extend(jl)
            else:
                x.links[oid] = o.links[xid] = jl
        if inner:
            x.links[xid] = inner

    def _merge_forced(self) -> None:
        n = len(self.size)
        fsucc, fpred = [-1] * n, [-1] * n
        hot = [c > 0 for c in self.count]
        # The heaviest jump at each block: a forced link must be as heavy at both ends.
        # (Always so with consistent counts; inferred ones may disagree, e.g. a light
        # u -> v with a heavy v -> u, and then u·v is a poor choice.)
        heavy = [0.0] * n
        for (u, v), c in self.jcount.items():
            heavy[u], heavy[v] = max(heavy[u], c), max(heavy[v], c)
        for u in range(n):
            if len(self.succ[u]) == 1:
                v = self.succ[u][0]
                c = self.jcount.get((u, v), 0.0)
                if v != 0 and len(self.pred[v]) == 1 and hot[u] == hot[v] \
                        and c >= heavy[u] and c >= heavy[v]:
                    fsucc[u], fpred[v] = v, u
        # Forced links form paths and cycles; the links of a cycle have equal counts (each
        # is the heaviest at both ends): break it before its lowest block, as LLVM does.
        seen = [False] * n
        for u in [u for u in range(n) if fpred[u] < 0] + list(range(n)):
            if not seen[u]:
                if fpred[u] >= 0:
                    fsucc[fpred[u]], fpred[u] = -1, -1
                v = u
                while v >= 0 and not seen[v]:
                    seen[v] = True
                    v = fsucc[v]
        for u in range(n):
            if fpred[u] < 0 and fsucc[u] >= 0:
                v = u
                while fsucc[v] >= 0:
                    v = fsucc[v]
                    self._merge(self.chain_of[u], self.chain_of[v], 0, X_Y)
        self.forced = [v >= 0 for v in fsucc]

    def _merge_pairs(self) -> None:
        """Greedy merging, lazily: a pair enters the heap with an upper bound of its gain
        and is evaluated only when that bound comes first; an exact gain that comes
        first is the best of all pairs."""
        heap: list[tuple[float, int, int, int, int, int, int]] = []
        js, jd, jc, jw = self.js, self.jd, self.jc, self.jw
        near = max(FORWARD_WEIGHT, BACKWARD_WEIGHT)

        def push(x: _Chain, y: _Chain) -> None:
            if len(x.nodes) + len(y.nodes) >= MAX_CHAIN_SIZE:
                return
            dx, dy = x.count / x.size, y.count / y.size
            if max(dx, dy) > MAX_MERGE_DENSITY_RATIO * min(dx, dy):
                return
            # Only a jump into Y's first or out of Y's last block can fall through, other
            # jumps between X and Y earn at most 0.1 each; X's own gain at most by rotation.
            bound = self._inner(x)[2]
            first, last = y.nodes[0], y.nodes[-1]
            for j in x.links[y.id]:
                bound += jw[j] if jd[j] == first or js[j] == last else near * jc[j]
            if bound > EPS:
                heapq.heappush(heap, (-bound, x.id, y.id, x.ver, y.ver, 0, -1))

        for x in list(self.chains.values()):
            for yid in x.links:
                if yid != x.id:
                    push(x, self.chains[yid])
        while heap:
            _, xid, yid, vx, vy, k, t = heapq.heappop(heap)
            x, y = self.chains.get(xid), self.chains.get(yid)
            if x is None or y is None or x.ver != vx or y.ver != vy:
                continue
            if t < 0:
                gain, k, t = self._best_merge(x, y)
                if gain > EPS:
                    heapq.heappush(heap, (-gain, xid, yid, vx, vy, k, t))
                continue
            self._merge(xid, yid, k, t)
            for oid in list(x.links):
                if oid != xid:
                    o = self.chains[oid]
                    push(x, o)
                    push(o, x)

    def _merge_cold(self) -> None:
        """Glue chains along any edge from a chain's last block to another's first."""
        for u in range(len(self.size)):
            for v in reversed(self.succ[u]):
                cu, cv = self.chains[self.chain_of[u]], self.chains[self.chain_of[v]]
                if cu is not cv and v != 0 and cu.nodes[-1] == u and cv.nodes[0] == v \
                        and (cu.count > 0) == (cv.count > 0):
                    self._merge(cu.id, cv.id, 0, X_Y)

    # ---- gains ---------------------------------------------------------
    def _inner(self, x: _Chain) -> tuple[list[float], list[_Live], float]:
        """Per chain version: the change of the score of X's own jumps when X is rotated
        at each offset k (X2·X1), the jumps within X that score now (only those can
        lose when |Y| bytes are inserted; a jump crosses offset k when lo <= k < hi),
        and the best rotation change (at least 0) for a bound."""
        if x.inner is not None and x.inner[0] == x.ver:
            return x.inner[1], x.inner[2], x.inner[3]
        size, idx, off = self.size, self.idx, self.off
        js, jd, jc, jw = self.js, self.jd, self.jc, self.jw
        sx, m = x.size, len(x.nodes)
        d_rot = [0.0] * (m + 1)
        live = []
        for j in x.links.get(x.id, ()):
            s, d = js[j], jd[j]
            g = off[d] - off[s] - size[s]
            w, cnt = jw[j], jc[j]
            old = _jump_score(g, w, cnt)
            lo, hi = (idx[s] + 1, idx[d] + 1) if idx[s] < idx[d] else (idx[d] + 1, idx[s] + 1)
            dr = _jump_score(g - sx if g >= 0 else g + sx, w, cnt) - old
            d_rot[lo] += dr
            d_rot[hi] -= dr
            if old > 0:
                live.append((lo, hi, g, w, cnt, old))
        for i in range(1, m + 1):
            d_rot[i] += d_rot[i - 1]
        best_rot = max([0.0] + [d_rot[k] for k in range(1, m) if not self.forced[x.nodes[k - 1]]])
        x.inner = (x.ver, d_rot, live, best_rot)
        return d_rot, live, best_rot

    def _best_merge(self, x: _Chain, y: _Chain) -> tuple[float, int, int]:
        """(gain, k, type) of the best way to merge Y into X (X may be split)."""
        size, idx, off, chain_of = self.size, self.idx, self.off, self.chain_of
        js, jd, jc, jw = self.js, self.jd, self.jc, self.jw
        sx, sy, xn = x.size, y.size, x.nodes
        m = len(xn)
        # Jumps between X and Y: target - source end = const + sign * (Y base - X block address).
        cross: list[tuple[int, int, int, int, float, float]] = []
        # Offsets where a jump between X and Y can become a fall-through, and how.
        seam: dict[int, set[int]] = {}
        for j in x.links[y.id]:
            s, d = js[j], jd[j]
            if chain_of[s] == x.id:
                cross.append((idx[s], off[s], off[d] - size[s], 1, jw[j], jc[j]))
                if d == y.nodes[0]:
                    seam.setdefault(idx[s] + 1, set()).update((X1_Y_X2, X2_X1_Y))
            else:
                cross.append((idx[d], off[d], -off[s] - size[s], -1, jw[j], jc[j]))
                if s == y.nodes[-1]:
                    seam.setdefault(idx[d], set()).update((X1_Y_X2, Y_X2_X1))
        y_entry = y.nodes[0] == 0
        allowed = {Y_X2_X1} if y_entry else {X1_Y_X2} if xn[0] == 0 else {X1_Y_X2, Y_X2_X1, X2_X1_Y}
        best: tuple[float, int, int] = (-1.0, 0, X_Y)
        if not y_entry:
            best = (sum(_jump_score(c + sg * (sx - o), w, cnt)
                        for _, o, c, sg, w, cnt in cross), 0, X_Y)
        ok = [k for k in range(1, m) if not self.forced[xn[k - 1]]]
        cands = [(k, t) for k in ok if k in seam for t in sorted(seam[k] & allowed)]
        if m <= CHAIN_SPLIT_THRESHOLD:
            cands += [(k, t) for k in ok if xn[k] not in self.hot_succ[xn[k - 1]]
                      for t in sorted(allowed - seam.get(k, set()))]
        if not cands:
            return best
        # Jumps within X that cross offset k change by the same amount for every k.
        d_rot, live, _ = self._inner(x)
        d_ins = [0.0] * (m + 1)
        if any(t == X1_Y_X2 for _, t in cands):
            for lo, hi, g, w, cnt, old in live:
                di = _jump_score(g + sy if g >= 0 else g - sy, w, cnt) - old
                d_ins[lo] += di
                d_ins[hi] -= di
            for i in range(1, m + 1):
                d_ins[i] += d_ins[i - 1]
        # Away from a seam no jump between X and Y falls through: a bound to skip by.
        far = max(FORWARD_WEIGHT, BACKWARD_WEIGHT) * sum(c[5] for c in cross)
        for k, t in cands:
            gain = d_ins[k] if t == X1_Y_X2 else d_rot[k]
            if gain + far <= best[0] and t not in seam.get(k, ()):
                continue
            # X blocks before offset k move by lo, the others by hi, relative to Y.
            ak = off[xn[k]]
            if t == X1_Y_X2:
                lo, hi = ak, ak - sy
            elif t == Y_X2_X1:
                lo, hi = -sy - sx + ak, -sy + ak
            else:
                lo, hi = ak, sx + ak
            for i, o, c, sg, w, cnt in cross:        # _jump_score, inlined
                g = c + sg * ((lo if i < k else hi) - o)
                if g == 0:
                    gain += w
                elif g > 0:
                    if g <= FORWARD_DISTANCE:
                        gain += FORWARD_WEIGHT * cnt * (1.0 - g / FORWARD_DISTANCE)
                elif g >= -BACKWARD_DISTANCE:
                    gain += BACKWARD_WEIGHT * cnt * (1.0 + g / BACKWARD_DISTANCE)
            if gain > best[0]:
                best = (gain, k, t)
        return best


def _counts(nodes: Iterable[K], edges: Iterable[tuple[K, K, float]]) -> dict[K, float]:
    """Each node's larger of its incoming and outgoing edge counts (other endpoints ignored)."""
    cin = {k: 0.0 for k in nodes}
    cout = dict(cin)
    for u, v, c in edges:
        if u in cout:
            cout[u] += c
        if v in cin:
            cin[v] += c
    return {k: max(cin[k], cout[k]) for k in cin}


def ext_tsp_layout(sizes: Mapping[K, int], edges: Iterable[tuple[K, K, float]], entry: K,
                   counts: Mapping[K, float] | None = None,
                   original: Sequence[K] | None = None) -> ExtTspResult[K]:
    """Order the blocks of ``sizes`` (id -> bytes) by ext-TSP, ``entry`` first.

    ``edges`` are (src, dst, count).  ``counts`` gives block execution counts (default:
    the larger of a block's incoming and outgoing edge counts; raised to the largest
    count of an edge at the block either way).  ``original`` is the order to compete
    with and to break ties by (default: the order of ``sizes``)."""
    if entry not in sizes:
        raise ValueError(f"entry {entry!r} is not a block")
    e = summed_edges(sizes, edges)
    orig = list(sizes) if original is None else list(original)
    if len(orig) != len(sizes) or set(orig) != set(sizes):
        raise ValueError("original must hold every block exactly once")
    keys = [entry] + [k for k in orig if k != entry]
    pos = {k: i for i, k in enumerate(keys)}
    if counts is None:
        counts = _counts(keys, ((u, v, c) for (u, v), c in e.items()))
    impl = _ExtTsp([sizes[k] for k in keys], [float(counts.get(k, 0.0)) for k in keys],
                   {(pos[u], pos[v]): c for (u, v), c in e.items()})
    order = [keys[i] for i in impl.run()]
    base = [k for k, c in zip(keys, impl.count) if c > 0] + \
        [k for k, c in zip(keys, impl.count) if c <= 0]
    s_new, s_old = _score(order, sizes, e), _score(base, sizes, e)
    if s_old >= s_new:           # no evidence for a change
        return ExtTspResult(base, s_old, s_old, "original")
    return ExtTspResult(order, s_new, s_old, "ext-tsp")


def order_region(sr: SuperRegion) -> list[NodeKey]:
    """Ext-TSP order of a super-region's body blocks, as node keys.

    Sizes are the blocks' byte sizes (``bb.size``; a clone's code is about as long as
    its original's).  Only body edges the emitter can turn into a fall-through
    (:func:`~dbr_service.codegen.blockorder.can_fall_into`) are scored: another edge
    ending next to its source would earn the fall-through weight for a jump the
    emitter still emits.  A block's count is the larger of its incoming and outgoing
    edge counts, entry and exit edges included, so a block that only leaves the region
    is still hot.  The entry is the target of the hottest entry edge; the order to
    compete with is :func:`~dbr_service.codegen.blockorder.original_order`."""
    orig = original_order(sr)
    if not orig:
        return []
    sizes = {k: sr.block(k).size for k in orig}
    counts = _counts(orig, ((u, v, float(d.get("count", 0.0)))
                            for u, v, d in sr.g.edges(data=True)))
    edges = [(u, v, float(d.get("count", 0.0))) for u, v, d in sr.body_edges()
             if u == v or can_fall_into(sr, u, v)]
    rank = {k: i for i, k in enumerate(orig)}
    entries = sorted(sr.entry_edges(), key=lambda e: (-e[1], rank[e[0]]))
    entry = entries[0][0] if entries else orig[0]
    return ext_tsp_layout(sizes, edges, entry, counts, orig).order
