"""Function ordering for the hot text: call-graph clustering.

**C3** (Ottoni & Maher, "Optimizing Function Placement for Large-Scale Data-Center
Applications", CGO 2017; hfsort in HHVM, BOLT's ``-reorder-functions=hfsort``,
``bolt/lib/Passes/HFSort.cpp`` ``clusterize``) places a callee right after its caller so
that a call and its return stay within a page and a few cache lines:

1. every function that ran (samples, or a call with a count from or to it) starts as
   a cluster of its own; they are visited in decreasing *density* (samples per byte);
2. a visited function's cluster is appended to the cluster of its most frequent
   caller, unless that caller makes less than ``min_call_probability`` (0.1) of the
   function's calls, the merged cluster would exceed ``max_cluster_size`` bytes
   (4 KiB, a page, as in the paper; BOLT defaults to 1 MiB for huge pages), or the
   caller's cluster would lose more than ``max_density_degradation`` (8) times its
   density (BOLT's ``MinDensityDegradation``);
3. clusters are placed by decreasing density, then the functions that never ran in
   input order.

Where this module differs from BOLT: a call's probability is its count over all calls
into the callee (BOLT divides by the callee's samples, a different unit); functions
without samples that are called take part (a tiny hot leaf often misses every IP
sample; its callers' clusters are where it belongs); recursive calls are ignored;
ties go to the input order.  Complexity O(F log F + C) for F functions and C calls.

**Pettis-Hansen** (Pettis & Hansen, "Profile Guided Code Positioning", PLDI 1990;
BOLT's ``-reorder-functions=pettis-hansen``) is offered as the classic alternative:
clusters joined along the heaviest call-graph edge (calls both ways summed) first,
each join choosing which ends to put together by the heaviest call between them.
O(C log C) with a lazy heap.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

from dbr_service.codegen.exttsp import summed_edges

K = TypeVar("K", bound=Hashable)

PAGE_SIZE = 4096
MIN_CALL_PROBABILITY = 0.1
MAX_DENSITY_DEGRADATION = 8.0


@dataclass
class Cluster(Generic[K]):
    """Functions placed together, in order."""

    funcs: list[K]
    size: int
    samples: float

    @property
    def density(self) -> float:
        return self.samples / self.size


@dataclass
class CallOrder(Generic[K]):
    """A function order: the hot clusters in placement order, then the cold functions."""

    clusters: list[Cluster[K]]
    cold: list[K]

    @property
    def order(self) -> list[K]:
        return [f for c in self.clusters for f in c.funcs] + self.cold


def _calls(sizes: Mapping[K, int], calls: Iterable[tuple[K, K, float]]) -> dict[tuple[K, K], float]:
    """Calls as {(caller, callee): count}, duplicates summed, recursion and zero counts
    dropped."""
    return {e: c for e, c in summed_edges(sizes, calls, "call").items() if e[0] != e[1] and c > 0}


def c3_order(sizes: Mapping[K, int], samples: Mapping[K, float],
             calls: Iterable[tuple[K, K, float]], *, max_cluster_size: int = PAGE_SIZE,
             min_call_probability: float = MIN_CALL_PROBABILITY,
             max_density_degradation: float = MAX_DENSITY_DEGRADATION) -> CallOrder[K]:
    """Order the functions of ``sizes`` (id -> bytes) by C3.

    ``samples``: samples per function (missing: 0); ``calls``: (caller, callee, count).
    A cluster exceeds ``max_cluster_size`` only when one function alone does."""
    e = _calls(sizes, calls)
    index = {f: i for i, f in enumerate(sizes)}
    size = {f: max(1, int(s)) for f, s in sizes.items()}
    smp = {f: float(samples.get(f, 0.0)) for f in sizes}
    if any(not 0.0 <= s < float("inf") for s in smp.values()):
        raise ValueError("samples must be finite and non-negative")
    ran = {f for f, s in smp.items() if s > 0} | {f for pair in e for f in pair}
    calls_in: dict[K, float] = {}
    best_caller: dict[K, tuple[float, int, K]] = {}
    for (u, v), c in e.items():
        calls_in[v] = calls_in.get(v, 0.0) + c
        cand = (c, -index[u], u)
        if v not in best_caller or cand[:2] > best_caller[v][:2]:
            best_caller[v] = cand
    hot = sorted(ran, key=lambda f: (-smp[f] / size[f], index[f]))
    cluster_of = {f: Cluster([f], size[f], smp[f]) for f in hot}
    for f in hot:
        c = cluster_of[f]
        if f not in best_caller:
            continue
        count, _, caller = best_caller[f]
        if count < min_call_probability * calls_in[f]:
            continue
        pc = cluster_of[caller]
        if pc is c or pc.size + c.size > max_cluster_size:
            continue
        merged_density = (pc.samples + c.samples) / (pc.size + c.size)
        if pc.density > merged_density * max_density_degradation:
            continue
        pc.funcs.extend(c.funcs)
        pc.size += c.size
        pc.samples += c.samples
        for g in c.funcs:
            cluster_of[g] = pc
    clusters = list({id(cluster_of[f]): cluster_of[f] for f in hot}.values())
    clusters.sort(key=lambda cl: -cl.density)        # stable: ties keep visiting order
    return CallOrder(clusters, [f for f in sizes if f not in ran])


def pettis_hansen_order(sizes: Mapping[K, int], samples: Mapping[K, float],
                        calls: Iterable[tuple[K, K, float]]) -> CallOrder[K]:
    """Order the functions of ``sizes`` by Pettis-Hansen (same arguments as
    :func:`c3_order`): chains grown along the heaviest undirected call edges, placed by
    decreasing density, then by the weight of the calls within; functions that never
    ran last in input order."""
    index = {f: i for i, f in enumerate(sizes)}
    w: dict[K, dict[K, float]] = {}
    for (u, v), c in _calls(sizes, calls).items():
        wu, wv = w.setdefault(u, {}), w.setdefault(v, {})
        wu[v] = wu.get(v, 0.0) + c
        wv[u] = wv.get(u, 0.0) + c

    def fw(a: K, b: K) -> float:
        return w.get(a, {}).get(b, 0.0)

    ran = [f for f in sizes if f in w or float(samples.get(f, 0.0)) > 0]
    chain: dict[K, list[K]] = {f: [f] for f in ran}     # chain id (a function) -> chain
    cw: dict[K, dict[K, float]] = {f: dict(w.get(f, {})) for f in ran}   # between chains
    inner: dict[K, float] = {f: 0.0 for f in ran}
    # Entries go stale when a chain is absorbed or the weight between two chains grows.
    heap = [(-c, index[a], index[b], a, b) for a, n in cw.items() for b, c in n.items()
            if index[a] < index[b]]
    heapq.heapify(heap)
    while heap:
        negc, _, _, a, b = heapq.heappop(heap)
        if a not in chain or b not in chain or cw[a].get(b) != -negc:
            continue
        if index[b] < index[a]:
            a, b = b, a
        ca, cb = chain[a], chain.pop(b)
        # Join the ends with the heaviest call between them.
        options = [(fw(ca[-1], cb[0]), 0), (fw(ca[-1], cb[-1]), 1), (fw(ca[0], cb[0]), 2),
                   (fw(ca[0], cb[-1]), 3)]
        how = max(options, key=lambda o: (o[0], -o[1]))[1]
        left = ca if how < 2 else ca[::-1]
        right = cb if how in (0, 2) else cb[::-1]
        chain[a] = left + right
        inner[a] += inner.pop(b) - negc
        nb = cw.pop(b)
        cw[a].pop(b, None)
        for n, c in nb.items():
            if n != a:
                cw[n].pop(b)
                cw[a][n] = cw[n][a] = cw[a].get(n, 0.0) + c
                lo, hi = (a, n) if index[a] < index[n] else (n, a)
                heapq.heappush(heap, (-cw[a][n], index[lo], index[hi], lo, hi))
    clusters = [(Cluster(c, sum(max(1, int(sizes[f])) for f in c),
                         sum(float(samples.get(f, 0.0)) for f in c)), inner[h], index[h])
                for h, c in chain.items()]
    clusters.sort(key=lambda x: (-x[0].density, -x[1], x[2]))
    ran_set = set(ran)
    return CallOrder([c for c, _, _ in clusters], [f for f in sizes if f not in ran_set])
