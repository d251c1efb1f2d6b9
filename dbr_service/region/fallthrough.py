"""COMPUTE-FALL-THROUGH-ONLY (the patent, docs/architecture.md): estimate the counts
sampling cannot give.

Only control transfers carry sample counts.  Counts are unknown on:

* *fall-through-only* edges: the FALLTHROUGH edge out of a block that ends
  without a control transfer (``TermKind.FALLTHROUGH``);
* pseudo edges: entry edges without a count (discovery gives a callee's entry
  edge the count of the calls to it; that one is known), exit edges out of
  blocks ending in ``FALLTHROUGH`` or ``STOP`` (control just runs on into
  original code), and a ``ret``'s exit edge without a count.

A call block's continuation edge (the call assumed to return) gets the call's
count, i.e. the count of its exit edge to the callee.

Maximal chains of fall-through-only edges are scanned (a block without any is a
chain of one).  Forward (the default): a block's count is the sum of its known
incoming counts, its fall-through-only out edge gets that minus its known
outgoing counts.  A chain with an entry edge and no pseudo exit is scanned
backwards from the last block's known outgoing counts, and the head's entry
edge gets what its known predecessors do not explain.  A chain with both an
entry and a pseudo exit assumes 0 for the entry (the patent) and is scanned
forwards; its pseudo exit gets the remainder.  When several fall-through-only
edges reach one block (overlapping code) the lowest predecessor's is used, the
others are ignored, as the patent says.  Clamped at 0 throughout.

*IP-only profiles.*  The patent's HPM (IBS) gives branch directions, so branch
edges carry counts.  A plain IP sampler (``cpu-clock``, this machine) gives none:
discovery then leaves every edge at 0.  When no edge of the SR has a count but
blocks have samples, counts are estimated from sample density instead
(:func:`estimate_from_samples`): blocks that must execute equally often (a
fall-through-only edge or a call's continuation edge that is its source's only
way on and its target's only way in) form a group whose
count is its samples per instruction (pooled over the group, so short blocks
that missed samples take their neighbours' density); an edge gets its source's
count, split over several successors in proportion to their counts (exits get
nothing unless all successors are unsampled); an entry edge gets what the
block's in-region predecessors do not explain.  Units are then samples per
instruction; loops whose entries were never sampled get an infinite trip count.
"""

from __future__ import annotations

import math
from collections import Counter

from dbr_service.region.loops import dfs_preorder, sorted_nodes
from dbr_service.region.model import END, START, EdgeKind, NodeKey, SuperRegion, TermKind

_CALLS = (TermKind.CALL, TermKind.ICALL)


def _is_ft_only(sr: SuperRegion, u: NodeKey, v: NodeKey) -> bool:
    return (u not in (START, END) and v not in (START, END)
            and sr.g.edges[u, v]["kind"] == EdgeKind.FALLTHROUGH
            and sr.block(u).term == TermKind.FALLTHROUGH)


def _is_pseudo_exit(sr: SuperRegion, u: NodeKey) -> bool:
    return sr.g.has_edge(u, END) and sr.block(u).term in (TermKind.FALLTHROUGH, TermKind.STOP)


def _unknown_edges(sr: SuperRegion) -> set[tuple[NodeKey, NodeKey]]:
    """Edges whose count sampling cannot give (see the module doc)."""
    out = set()
    for u, v, d in sr.g.edges(data=True):
        if u == START:
            if d["count"] <= 0:                   # callee entries carry the call counts
                out.add((u, v))
        elif v == END:
            if _is_pseudo_exit(sr, u) or (sr.block(u).term == TermKind.RET and d["count"] <= 0):
                out.add((u, v))
        elif _is_ft_only(sr, u, v):
            out.add((u, v))
    return out


def _is_call_ft(sr: SuperRegion, u: NodeKey, v: NodeKey) -> bool:
    return (u not in (START, END) and v != END and sr.block(u).term in _CALLS
            and sr.g.edges[u, v]["kind"] == EdgeKind.FALLTHROUGH)


def compute_fall_through_only(sr: SuperRegion, counters: Counter | None = None,
                              ip_only: bool | None = None,
                              floors: dict[NodeKey, float] | None = None) -> None:
    """Fill in unknown edge counts and every block's ``count`` (see module doc).

    ``ip_only``: the profile has no branch counts, estimate from samples; None
    decides from this SR alone (the pipeline decides once for all SRs, since a
    small SR may just have no branch of its own).  ``floors``: IP-only, the least
    count of some blocks (:func:`call_site_floors`)."""
    counters = counters if counters is not None else Counter()
    g = sr.g
    if ip_only is None:
        ip_only = not has_branch_counts(sr)
    if ip_only and (floors or any(b.samples > 0 for _, b in sr.blocks())):
        estimate_from_samples(sr, floors=floors)
        counters["ip-only-estimates"] += 1
        counters["blocks"] += len(sr)
        return
    unknown = _unknown_edges(sr)
    # Calls are assumed to return: the continuation runs as often as the call.
    for u, v in list(g.edges):
        if _is_call_ft(sr, u, v):
            call = g.edges[u, END]["count"] if g.has_edge(u, END) else 0.0
            g.edges[u, v]["count"] = max(call, g.edges[u, v]["count"])

    def known_in(b: NodeKey) -> float:
        return sum(d["count"] for u, _, d in g.in_edges(b, data=True) if (u, b) not in unknown)

    def known_out(b: NodeKey) -> float:
        return sum(d["count"] for _, v, d in g.out_edges(b, data=True)
                   if (b, v) not in unknown and not _is_call_ft(sr, b, v))

    # Chains: ft_next[u] = v for fall-through-only edges; one chosen predecessor each.
    ft_next: dict[NodeKey, NodeKey] = {}
    ft_prev: dict[NodeKey, NodeKey] = {}
    for u in sorted_nodes(sr.body_nodes()):
        for v in g.successors(u):
            if v != END and _is_ft_only(sr, u, v) and v not in ft_prev:
                ft_next[u] = v
                ft_prev[v] = u
                break
    heads = [b for b in sorted_nodes(sr.body_nodes()) if b not in ft_prev]
    done: set[NodeKey] = set()
    for head in heads:
        chain = [head]
        while chain[-1] in ft_next and ft_next[chain[-1]] not in done:
            chain.append(ft_next[chain[-1]])
        done.update(chain)
        has_entry = any((START, b) in unknown for b in chain)
        has_pexit = any((b, END) in unknown for b in chain)
        if has_entry and not has_pexit:
            _scan_backward(sr, chain, known_in, known_out, unknown)
            counters["chains-backward"] += 1
        else:
            for b in chain:
                if (START, b) in unknown:
                    g.edges[START, b]["count"] = 0.0
            _scan_forward(sr, chain, known_in, known_out, unknown)
            counters["chains-entry-exit-zero" if has_entry else "chains-forward"] += 1
    counters["blocks"] += len(sr)


def _scan_forward(sr, chain, known_in, known_out, unknown) -> None:
    g = sr.g
    running = known_in(chain[0])
    for i, b in enumerate(chain):
        sr.block(b).count = running
        rest = max(0.0, running - known_out(b))
        if i + 1 < len(chain):
            nxt = chain[i + 1]
            g.edges[b, nxt]["count"] = rest
            running = rest + known_in(nxt)
        elif (b, END) in unknown:
            _set_exit(sr, b, rest)
    for b in chain[:-1]:
        if (b, END) in unknown:
            _set_exit(sr, b, 0.0)


def _scan_backward(sr, chain, known_in, known_out, unknown) -> None:
    g = sr.g
    running = known_out(chain[-1])
    for i in range(len(chain) - 1, -1, -1):
        b = chain[i]
        sr.block(b).count = running
        if i > 0:
            if (START, b) in unknown:
                g.edges[START, b]["count"] = 0.0
            ft = max(0.0, running - known_in(b))
            prev = chain[i - 1]
            g.edges[prev, b]["count"] = ft
            running = ft + known_out(prev)
        elif (START, b) in unknown:
            g.edges[START, b]["count"] = max(0.0, running - known_in(b))


def _set_exit(sr: SuperRegion, b: NodeKey, count: float) -> None:
    d = sr.g.edges[b, END]
    exits = d["exits"]
    if exits:
        share = count / len(exits)
        for t in exits:
            exits[t] = share
    d["count"] = count


def has_branch_counts(sr: SuperRegion) -> bool:
    """Does any edge carry a measured count (a callee's entry edge counts: it has
    the count of the calls to it)?"""
    for u, v, d in sr.g.edges(data=True):
        if d["count"] <= 0:
            continue
        if u == START:
            return True
        if v == END and _is_pseudo_exit(sr, u):
            continue
        if v != END and _is_ft_only(sr, u, v):
            continue
        return True
    return False


def estimate_from_samples(sr: SuperRegion, sweeps: int = 8,
                          floors: dict[NodeKey, float] | None = None) -> None:
    """Counts from sample density for IP-only profiles (see the module doc).

    Blocks that must run equally often form a group (a fall-through-only or call
    continuation edge that is its source's only way on and its target's only way
    in from the body; entry edges do not count: discovery puts them at sampled
    seeds).  A group's count is the larger of its samples per instruction and the
    flow into it from the body, so a short block that samples missed takes the
    count its predecessors send it; edges out of a block split its count over its
    successors in proportion to their counts.  Sweeps in DFS order until stable.
    Flow is only ever split, never created, so a cycle cannot inflate counts.
    ``floors`` raise some blocks' groups to a least count (a call site to the
    count of its callee's entry, :func:`call_site_floors`).  Every edge count is
    recomputed from 0, so the estimate can run again with new floors.
    """
    g = sr.g
    for u, v, d in g.edges(data=True):
        d["count"] = 0.0
        if v == END:
            d["exits"] = {t: 0.0 for t in d["exits"]}
    body = sorted_nodes(sr.body_nodes())
    group = {b: b for b in body}

    def find(b: NodeKey) -> NodeKey:
        while group[b] != b:
            group[b] = group[group[b]]
            b = group[b]
        return b

    def body_in_degree(v: NodeKey) -> int:
        return sum(1 for u in g.predecessors(v) if u != START)

    for u, v in g.edges:
        if u in (START, END) or v in (START, END):
            continue
        if (_is_ft_only(sr, u, v) or _is_call_ft(sr, u, v)) and body_in_degree(v) == 1 \
                and (g.out_degree(u) == 1 or _is_call_ft(sr, u, v)):
            group[find(u)] = find(v)
    samples: Counter = Counter()
    insns: Counter = Counter()
    for b in body:
        samples[find(b)] += sr.block(b).samples
        insns[find(b)] += len(sr.block(b).insns)
    dens = {r: (samples[r] / insns[r] if insns[r] else 0.0) for r in set(map(find, body))}
    cnt = dict(dens)
    for b, floor in (floors or {}).items():
        if b in group:
            cnt[find(b)] = max(cnt[find(b)], floor)
    doomed = doomed_blocks(sr)
    order = [b for b in dfs_preorder(g) if b not in (START, END)]
    order += [b for b in body if b not in set(order)]
    for _ in range(sweeps):
        changed = False
        for u in order:
            r = find(u)
            inflow = sum(d["count"] for p, _, d in g.in_edges(u, data=True)
                         if p != START and find(p) != r)
            if inflow > cnt[r] + 1e-9:
                cnt[r] = inflow
                changed = True
            _split_out_edges(sr, u, cnt[r], lambda v: cnt[find(v)],
                             lambda v: (dens[find(v)], insns[find(v)]), doomed)
        if not changed:
            break
    for b in body:
        sr.block(b).count = cnt[find(b)]
    for v in list(g.successors(START)):
        inflow = sum(d["count"] for u, _, d in g.in_edges(v, data=True) if u != START)
        g.edges[START, v]["count"] = max(0.0, sr.block(v).count - inflow)


def call_site_floors(regions: list[SuperRegion]) -> dict[str, dict[NodeKey, float]]:
    """IP-only: the least count of each direct call site, from its callee's entry.

    A call block and its callee's entry run equally often, but their sample
    densities need not agree: a loop whose body is a call (``main`` calling
    ``step`` in the calls workload) draws few samples of its own, the callee
    many, more so where the CPU's skid moves samples past the short caller (on
    an AMD EPYC 3 of 796 samples, 0.5 per instruction against the callee's 17:
    the call was not hot enough to inline and the loop was lost).  Each callee
    entry's count is shared by its known direct call sites (in any SR), in
    proportion to their own counts (evenly when none has one); a site's floor is
    its share when that is more than it has.  Only call sites discovery found
    share: a caller it did not find would make this an overestimate, which the
    evaluation of an installed region corrects.  Returns {sr.id: {call block: floor}}.
    """
    entry_count: dict[int, float] = {}
    for sr in regions:
        for v in sr.g.successors(START):
            if isinstance(v, int):
                entry_count[v] = max(entry_count.get(v, 0.0), sr.block(v).count)
    sites: dict[int, list[tuple[SuperRegion, NodeKey]]] = {}
    for sr in regions:
        for k, bb in sr.blocks():
            if bb.term == TermKind.CALL and len(bb.targets) == 1 and not bb.unknown_target \
                    and bb.targets[0] in entry_count:
                sites.setdefault(bb.targets[0], []).append((sr, k))
    out: dict[str, dict[NodeKey, float]] = {}
    for t, calls in sites.items():
        e = entry_count[t]
        have = [sr.block(k).count for sr, k in calls]
        if e <= sum(have) + 1e-9:
            continue
        tot = sum(have)
        for (sr, k), c in zip(calls, have):
            share = e * (c / tot if tot > 0 else 1.0 / len(calls))
            if share > c + 1e-9:
                out.setdefault(sr.id, {})[k] = share
    return out


def doomed_blocks(sr: SuperRegion) -> set[NodeKey]:
    """Blocks every path from which ends in a call that never returns (``abort``,
    ``__cxa_throw``, ``__stack_chk_fail``...: discovery gives such calls no
    fall-through) or a ``hlt``/``ud2``, without reaching a ``ret``, an exit or a
    loop.  Compilers put these paths out of line as cold code (error reporting,
    throw sites); a run through one ends the function abnormally."""
    g = sr.g
    doomed: set[NodeKey] = set()
    for k, bb in sr.blocks():
        if bb.term == TermKind.HALT or bb.never_returns:
            doomed.add(k)
    changed = True
    while changed:
        changed = False
        for k, bb in sr.blocks():
            if k in doomed:
                continue
            outs = [v for v in g.successors(k) if v != END]
            leaves = g.has_edge(k, END) and bb.term not in _CALLS
            if outs and not leaves and all(v in doomed for v in outs):
                doomed.add(k)
                changed = True
    return doomed


def _split_out_edges(sr: SuperRegion, u: NodeKey, cu: float, count_of,
                     evidence=None, doomed: frozenset | set = frozenset()) -> None:
    """Give u's out edges its count: a call and its return both run cu times; other
    blocks split cu over body successors by their counts (exits get nothing unless
    no body successor has a count).

    ``evidence(v)`` -> (samples per instruction, instructions) of v's group.

    A successor in ``doomed`` (:func:`doomed_blocks`) next to one that is not gets
    only what its own samples show, never a share of the flow: one stray sample on a
    throw path (which runs once in 4099 calls in the throw e2e program) against an
    unsampled one-instruction ``ret`` would otherwise send it all of u's count,
    making the throw path's calls hot.

    When no other body successor was ever sampled, their counts say nothing (they
    are only the flow earlier sweeps sent them), but the missing samples do: a
    successor that ran ``c`` times over ``n`` instructions would have drawn about
    ``c * n`` samples (the units are samples per instruction), so all of cu going
    to it without one sample has likelihood ``exp(-cu * n)``.  The successors share
    cu by those likelihoods: a ``ret`` (one instruction; its samples skid onto the
    return address) beats a long unsampled path, where an even split made that
    path hot.  With few samples the split stays near even (cu = 0.05: 63/37).  An
    exit is weighed like the likeliest body successor: nothing is known of the
    code beyond it."""
    outs = list(sr.g.successors(u))
    if sr.block(u).term in _CALLS:
        for v in outs:
            _set_edge(sr, u, v, cu)
        return
    if evidence is not None and any(v in doomed for v in outs) \
            and not all(v in doomed for v in outs):
        own = {v: min(cu, evidence(v)[0]) for v in outs if v in doomed}
        for v, c in own.items():
            _set_edge(sr, u, v, c)
        cu = max(0.0, cu - sum(own.values()))
        outs = [v for v in outs if v not in doomed]
    body = [v for v in outs if v != END]
    if evidence is not None and body and all(evidence(v)[0] <= 0 for v in body):
        n = {v: max(1, evidence(v)[1]) for v in body}
        n_min = min(n.values())
        w = {v: (math.exp(-cu * (n[v] - n_min)) if v != END else 1.0) for v in outs}
    else:
        w = {v: (count_of(v) if v != END else 0.0) for v in outs}
    tot = sum(w.values())
    if tot <= 0:
        w = {v: 1.0 for v in outs}
        tot = float(len(outs))
    for v in outs:
        _set_edge(sr, u, v, cu * w[v] / tot)


def _set_edge(sr: SuperRegion, u: NodeKey, v: NodeKey, count: float) -> None:
    if v == END:
        _set_exit(sr, u, count)
    else:
        sr.g.edges[u, v]["count"] = count
