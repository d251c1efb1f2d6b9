"""Random discovery-like super-regions through every pass: the invariants hold.

Random contiguous blocks (random instruction lengths), random terminators and
targets (in and out of the region, self-loops, direct and indirect calls, with
the call -> END / START -> callee representation of discovery), random counts
and samples, random unpatchable / not-known-to-execute flags, random entries.
"""

from __future__ import annotations

import networkx as nx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dbr_service.region.fallthrough import compute_fall_through_only
from dbr_service.region.loops import PATCH_LEN, is_patchable, loop_forest
from dbr_service.region.model import END, START, CloneKey, EdgeKind, SuperRegion, TermKind
from dbr_service.region.partition import partition_code
from dbr_service.region.patchpoints import _Coverage, choose_patch_blocks
from dbr_service.region.pipeline import RegionConfig, run_pipeline

from region_graphs import bb

T = TermKind
OUTSIDE = 0x9000
TERMS = [T.FALLTHROUGH] * 6 + [T.JMP] * 2 + [T.JCC] * 8 + [T.CALL] * 3 + [T.ICALL, T.STOP, T.HALT] \
    + [T.RET] * 3
SETTINGS = settings(max_examples=120, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@st.composite
def discovery_sr(draw) -> SuperRegion:
    n = draw(st.integers(1, 16))
    sizes = [draw(st.lists(st.integers(1, 8), min_size=1, max_size=4)) for _ in range(n)]
    addrs, a = [], 0x1000
    for s in sizes:
        addrs.append(a)
        a += sum(s)
    terms = [draw(st.sampled_from(TERMS)) for _ in range(n)]
    # Mostly in-region targets: loops, calls into routines of the region.
    target = st.integers(0, 7).flatmap(
        lambda r: st.just(OUTSIDE) if r == 0 else st.sampled_from(addrs))
    cnt = st.integers(0, 60).map(float)
    sr = SuperRegion("discovered")
    for i, (addr, s, term) in enumerate(zip(addrs, sizes, terms)):
        nxt = addr + sum(s)
        tg: list[int] = []
        if term in (T.JMP, T.JCC, T.CALL):
            tg = [draw(target)]
        elif term == T.ICALL:
            tg = sorted(set(draw(st.lists(target, min_size=0, max_size=3))))
        blk = bb(addr, s, term, targets=tg,
                 ft=None if term in (T.JMP, T.RET, T.HALT) else nxt,
                 samples=draw(cnt), known_exec=draw(st.booleans()) or draw(st.booleans()),
                 unpatchable=draw(st.integers(0, 4)) == 0,
                 unknown_target=term == T.ICALL and draw(st.booleans()))
        sr.add_block(blk)
    for i, addr in enumerate(addrs):
        blk = sr.block(addr)
        nxt_in = i + 1 < n and draw(st.integers(0, 5)) > 0
        if blk.term in (T.FALLTHROUGH, T.STOP):
            if blk.term == T.FALLTHROUGH and nxt_in:
                sr.add_edge(addr, addrs[i + 1], EdgeKind.FALLTHROUGH, 0.0)
            else:
                sr.add_edge(addr, END, EdgeKind.EXIT, 0.0, target=blk.fallthrough)
        if blk.term in (T.JMP, T.JCC):
            t, c = blk.targets[0], draw(cnt)
            if t in sr.g:
                sr.add_edge(addr, t, EdgeKind.FLOW, c)
            else:
                sr.add_edge(addr, END, EdgeKind.EXIT, c, target=t)
        if blk.term == T.JCC:
            c = draw(cnt)
            if nxt_in:
                sr.add_edge(addr, addrs[i + 1], EdgeKind.FALLTHROUGH, c)
            else:
                sr.add_edge(addr, END, EdgeKind.EXIT, c, target=blk.fallthrough)
        if blk.term in (T.CALL, T.ICALL):
            total = 0.0
            for t in blk.targets or [OUTSIDE]:
                c = draw(cnt)
                total += c
                sr.add_edge(addr, END, EdgeKind.EXIT, c, target=t)
                if t in sr.g:
                    sr.add_edge(START, t, EdgeKind.ENTRY, 0.0)
            if nxt_in:
                sr.add_edge(addr, addrs[i + 1], EdgeKind.FALLTHROUGH, total)
        if blk.term == T.RET:
            sr.add_edge(addr, END, EdgeKind.EXIT, draw(cnt), target=0)
        if draw(st.integers(0, 3)) == 0:
            sr.add_edge(START, addr, EdgeKind.ENTRY, 0.0)
    return sr


configs = st.builds(
    RegionConfig, hot_threshold=st.sampled_from([1.0, 5.0, 20.0]),
    min_loop_trip_count=st.sampled_from([0.0, 1.0, 3.0]),
    min_region_size=st.sampled_from([0, 8, 24]), inline_budget=st.sampled_from([0.0, 0.5, 3.0]),
    inline_min_budget_bytes=st.sampled_from([0, 16, 256]),
    measured_counts=st.booleans(), keep_stages=st.just(True), fail_fast=st.just(True))


def _check_clone_and_call_rules(sr: SuperRegion) -> None:
    sites = sr.info.get("inline", {}).get("sites", {})
    for k, b in sr.blocks():
        assert b.count >= 0 and b.samples >= 0
        if isinstance(k, CloneKey):
            assert b.unpatchable and b.clone_of == k.start
        if b.term in (T.CALL, T.ICALL):   # no call may remain un-inlined
            assert sites[k]["decision"] == "inlined", (sr.id, k)
    for u, v, d in sr.g.edges(data=True):
        if d["kind"] == EdgeKind.CALL:
            assert sites[u]["decision"] == "inlined" and isinstance(v, CloneKey)


def _check_entries(sr: SuperRegion) -> None:
    for v, _ in sr.entry_edges():
        b = sr.block(v)
        assert not isinstance(v, CloneKey) and not b.is_clone
        assert not b.unpatchable and b.known_exec and b.insns[0][1] >= PATCH_LEN


@SETTINGS
@given(discovery_sr(), configs)
def test_every_stage_verifies_and_patch_points_are_patchable(sr, cfg):
    res = run_pipeline(sr, None, cfg)  # fail_fast + verify: any broken SR raises here
    assert res.failures == []
    names = [n for n, _ in res.stages]
    for name, regions in res.stages[1:]:
        for r in regions:
            r.verify()
            if names.index(name) >= names.index("inline-hot-calls"):
                _check_clone_and_call_rules(r)
            if name in ("patch-point-selection", "prune-code"):
                _check_entries(r)
                assert r.entry_edges()
    for r in res.regions:
        assert r.state.value == "selected"
        assert r.info["loops"].max_trip_count() >= cfg.min_loop_trip_count
        assert sum(b.size for _, b in r.blocks()) >= cfg.min_region_size


@SETTINGS
@given(discovery_sr())
def test_partition_and_fall_through_keep_terminals_and_counts(sr):
    body = set(sr.body_nodes())
    parts = partition_code(sr)
    assert set().union(*(set(p.body_nodes()) for p in parts)) == body
    for p in parts:
        p.verify()
        assert nx.is_weakly_connected(p.g.subgraph(p.body_nodes()))
        compute_fall_through_only(p)
        p.verify()
        assert all(b.count >= 0 for _, b in p.blocks())


@SETTINGS
@given(discovery_sr())
def test_loop_forest_is_a_forest_of_strongly_connected_loops(sr):
    [p, *_] = partition_code(sr)
    f = loop_forest(p)
    body = p.g.subgraph(p.body_nodes())
    top = {frozenset(c) for c in nx.strongly_connected_components(body)
           if len(c) > 1 or body.has_edge(next(iter(c)), next(iter(c)))}
    assert {frozenset(lp.blocks) for lp in f.root.children} == top
    for lp in f.loops():
        assert set(lp.headers) <= lp.blocks and lp.headers
        assert lp.reducible == (len(lp.headers) == 1)
        assert all(c.blocks < lp.blocks or c.blocks <= lp.blocks - set(lp.headers)
                   for c in lp.children)
        sub = body.subgraph(lp.blocks).copy()
        assert nx.is_strongly_connected(sub)
        for c1 in lp.children:
            for c2 in lp.children:
                assert c1 is c2 or not (c1.blocks & c2.blocks)
        for u, v in lp.back_edges:
            assert u in lp.blocks and v in lp.headers
        for u, v in lp.entry_edges:
            assert u not in lp.blocks and v in lp.headers


@SETTINGS
@given(discovery_sr(), configs)
def test_patch_choice_covers_every_coverable_loop_and_each_patch_is_needed(sr, cfg):
    """After selection no patchable block lies on a cycle original code can run
    without meeting a patch, and dropping any chosen patch uncovers some loop."""
    res = run_pipeline(sr, None, RegionConfig(**{**cfg.__dict__, "keep_stages": True}))
    [before] = [regions for name, regions in res.stages if name == "inline-hot-calls"]
    for r in before:
        patches = choose_patch_blocks(r)
        cov = _Coverage(r)
        _, cyc = cov.state(frozenset(patches))
        assert not any(is_patchable(r, b) for b in cyc)
        if cyc == cov.state(frozenset())[1]:
            continue                                  # nothing covered: the fallback patch
        for p in patches:
            assert cov.state(frozenset(patches) - {p})[1] != cyc
