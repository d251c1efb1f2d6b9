"""Each region-selection pass on small hand-built super-regions, exact results."""

from __future__ import annotations

from collections import Counter

import networkx as nx
import pytest

from dbr_service.common.errors import RegionError
from dbr_service.region.fallthrough import compute_fall_through_only
from dbr_service.region.inline import inline_hot_calls, remove_call_blocks
from dbr_service.region.loops import loop_forest
from dbr_service.region.model import END, START, CloneKey, EdgeKind, SuperRegion
from dbr_service.region.partition import connect_terminals, partition_code
from dbr_service.region.patchpoints import check_entry_invariant, select_patch_points
from dbr_service.region.pipeline import PASSES, RegionConfig, run_pipeline
from dbr_service.region.prune import prune_code, remove_cold_tails

from region_graphs import FT, Builder, T, edge_count
from region_graphs import bb as bb_


def entries(sr: SuperRegion) -> list[int]:
    return sorted(v for v, _ in sr.entry_edges())


# ---- COMPUTE-FALL-THROUGH-ONLY --------------------------------------------------------
def loop_with_chains() -> Builder:
    """A -> B -> C (jcc back to A 90 / on to D 10), D jmp out; entered at A.
    True counts: A=B=C=100, D=10, entry 10."""
    b = Builder()
    b.block(0x100, (3, 4))
    b.block(0x107, (2, 5))
    b.block(0x10E, (6,), T.JCC, targets=[0x100])
    b.block(0x114, (5,), T.JMP, targets=[0x900])
    b.ft(0x100, 0x107)
    b.ft(0x107, 0x10E)
    b.flow(0x10E, 0x100, 90)
    b.ft(0x10E, 0x114, 10)
    b.exit(0x114, 0x900, 10)
    b.entry(0x100)
    return b


def test_fallthrough_backward_chain_from_entry_reproduces_true_counts():
    b = loop_with_chains()
    c = Counter()
    compute_fall_through_only(b.sr, c)
    sr = b.sr
    assert [sr.block(k).count for k in (0x100, 0x107, 0x10E, 0x114)] == [100, 100, 100, 10]
    assert edge_count(sr, 0x100, 0x107) == 100 and edge_count(sr, 0x107, 0x10E) == 100
    assert edge_count(sr, START, 0x100) == 10
    assert c["chains-backward"] == 1 and c["chains-forward"] == 1
    sr.verify()


def test_fallthrough_forward_chain_reproduces_true_counts():
    """X jcc: taken 30 -> Y, not taken 70 -> M -> N -> Y; Y jcc back to X 90 / out 10."""
    b = Builder()
    b.block(0x200, (2, 6), T.JCC, targets=[0x230])
    b.block(0x208, (3,))
    b.block(0x20B, (5,))
    b.block(0x230, (2,), T.JCC, targets=[0x200], ft=0x232)
    b.flow(0x200, 0x230, 30)
    b.ft(0x200, 0x208, 70)
    b.ft(0x208, 0x20B)      # fall-through-only: unknown
    b.ft(0x20B, 0x230)      # (not adjacent in this toy, but fall-through-only)
    b.flow(0x230, 0x200, 90)
    b.exit(0x230, 0x232, 10)
    b.entry(0x200)
    sr = b.sr
    sr.block(0x20B).fallthrough = 0x230
    compute_fall_through_only(sr)
    assert [sr.block(k).count for k in (0x200, 0x208, 0x20B, 0x230)] == [100, 70, 70, 100]
    assert edge_count(sr, 0x208, 0x20B) == 70 and edge_count(sr, 0x20B, 0x230) == 70
    assert edge_count(sr, START, 0x200) == 10


def test_fallthrough_chain_with_entry_and_exit_assumes_zero_for_pseudo_edges():
    """S -> T falls out of the region; S is entered; Q jumps into T 5 times."""
    b = Builder()
    b.block(0x300, (4,))
    b.block(0x304, (4,))
    b.block(0x400, (5,), T.JMP, targets=[0x304])
    b.ft(0x300, 0x304)
    b.exit(0x304, 0x308)
    b.flow(0x400, 0x304, 5)
    b.entry(0x300)
    b.entry(0x400)
    c = Counter()
    compute_fall_through_only(b.sr, c)
    sr = b.sr
    assert edge_count(sr, START, 0x300) == 0
    assert sr.block(0x300).count == 0 and sr.block(0x304).count == 5
    assert edge_count(sr, 0x304, END) == 5 and sr.g.edges[0x304, END]["exits"] == {0x308: 5}
    assert c["chains-entry-exit-zero"] == 1
    # Q's chain is a one-block chain with an entry: backward, entry = its jmp count.
    assert sr.block(0x400).count == 5 and edge_count(sr, START, 0x400) == 5


def test_fallthrough_callee_entry_count_is_known_and_ret_exit_inferred():
    """Discovery gives a callee's entry edge the count of its calls; its ret exit has
    none.  F -> G -> R(ret): scanned forwards from the entry."""
    b = Builder()
    b.block(0x100, (3,))
    b.block(0x103, (4,), T.JCC, targets=[0x10A])
    b.block(0x107, (3,))
    b.block(0x10A, (1,), T.RET)
    b.ft(0x100, 0x103)
    b.flow(0x103, 0x10A, 10)
    b.ft(0x103, 0x107, 15)
    b.ft(0x107, 0x10A)
    b.exit(0x10A, 0)
    b.entry(0x100, 25)
    c = Counter()
    compute_fall_through_only(b.sr, c)
    sr = b.sr
    assert [sr.block(k).count for k in (0x100, 0x103, 0x107, 0x10A)] == [25, 25, 15, 25]
    assert edge_count(sr, START, 0x100) == 25 and edge_count(sr, 0x10A, END) == 25
    assert c["chains-forward"] == 2 and c["chains-backward"] == 0


def test_fallthrough_call_continuation_runs_as_often_as_the_call():
    b = Builder()
    b.block(0x10, (5,), T.CALL, targets=[0x900])
    b.block(0x15, (5,), T.JMP, targets=[0x10])
    b.call(0x10, 0x900, 40, cont=None)
    b.ft(0x10, 0x15, 0)
    b.flow(0x15, 0x10, 39)
    b.entry(0x10)
    compute_fall_through_only(b.sr)
    sr = b.sr
    assert edge_count(sr, 0x10, 0x15) == 40
    assert sr.block(0x10).count == 40 and sr.block(0x15).count == 40
    assert edge_count(sr, START, 0x10) == 1


def test_measured_counts_skip_fall_through_pass():
    assert not PASSES[1]().applies(RegionConfig(measured_counts=True))
    assert PASSES[1]().applies(RegionConfig())


# ---- PARTITION-CODE ---------------------------------------------------------------
def two_routines() -> Builder:
    """main: A -> C(call f) -> K -> A (loop); f: F -> R(ret).  Plus an island
    Z -> W -> Z with neither entry nor exit."""
    b = Builder("first")
    b.block(0x10, (5,))
    b.block(0x15, (5,), T.CALL, targets=[0x100])
    b.block(0x1A, (2,), T.JMP, targets=[0x10])
    b.block(0x100, (5,))
    b.block(0x105, (1,), T.RET)
    b.block(0x300, (5,))
    b.block(0x305, (5,), T.JMP, targets=[0x300])
    b.ft(0x10, 0x15)
    b.call(0x15, 0x100, 50, cont=0x1A)
    b.flow(0x1A, 0x10, 49)
    b.ft(0x100, 0x105)
    b.exit(0x105, 0, 50)
    b.entry(0x10)
    b.ft(0x300, 0x305)
    b.flow(0x305, 0x300)
    return b


def test_partition_one_region_per_component_with_terminals_connected():
    b = two_routines()
    c = Counter()
    parts = partition_code(b.sr, c)
    assert [sorted(p.body_nodes()) for p in parts] == [
        [0x10, 0x15, 0x1A], [0x100, 0x105], [0x300, 0x305]]
    assert len({p.id for p in parts}) == 3 and "first" not in {p.id for p in parts}
    for p in parts:
        p.verify()
        assert set(nx.descendants(p.g, START)) >= set(p.body_nodes())
        assert set(nx.ancestors(p.g, END)) >= set(p.body_nodes())
    island = parts[2]
    assert entries(island) == [0x300]
    assert island.exit_edges() == [(0x300, {0x305: 0.0})]
    assert c["components"] == 3 and c["entries-added"] == 1 and c["exits-added"] == 1
    assert entries(parts[1]) == [0x100]


def test_partition_keeps_each_inline_decision_with_its_call_block():
    main, f = caller_callee()
    inline_hot_calls([main, f], hot_threshold=10, inline_budget=1.0)
    both = SuperRegion("both")
    for part in (main, f):
        both.g.add_nodes_from(part.g.nodes(data=True))
        both.g.add_edges_from(part.g.edges(data=True))
    both.info["inline"] = {"budget": 0, "growth": 0,
                           "sites": {**main.info["inline"]["sites"], 0x999: {"decision": "exit"}}}
    p_main, p_f = partition_code(both)
    assert set(p_main.info["inline"]["sites"]) == {0x15, 0x999}     # 0x999: a removed block
    assert set(p_f.info["inline"]["sites"]) == {0x999}


def test_connect_terminals_prefers_patchable_block_of_a_source_scc():
    b = Builder()
    b.block(0x10, (2,), unpatchable=True)
    b.block(0x12, (5,), T.JCC, targets=[0x10])
    b.ft(0x10, 0x12)
    b.flow(0x12, 0x10)
    b.exit(0x12, 0x17)
    connect_terminals(b.sr)
    assert entries(b.sr) == [0x12]
    b.sr.verify()


def test_unreachable_region_fails_verification():
    b = two_routines()
    with pytest.raises(RegionError):
        b.sr.verify()


# ---- loop-nesting forest ----------------------------------------------------------
def nested_loops() -> Builder:
    """START -> A -> H1 -> H2 -> B -> H2 (inner), B -> C -> H1 (outer), C -> X -> out."""
    b = Builder()
    b.block(0x10, (5,))
    b.block(0x20, (5,))
    b.block(0x30, (5,))
    b.block(0x40, (5,), T.JCC, targets=[0x30])
    b.block(0x50, (5,), T.JCC, targets=[0x20])
    b.block(0x60, (5,), T.JMP, targets=[0x900])
    b.ft(0x10, 0x20, 1)
    b.ft(0x20, 0x30, 10)
    b.ft(0x30, 0x40, 100)
    b.flow(0x40, 0x30, 90)
    b.ft(0x40, 0x50, 10)
    b.flow(0x50, 0x20, 9)
    b.ft(0x50, 0x60, 1)
    b.exit(0x60, 0x900, 1)
    b.entry(0x10, 1)
    sr = b.sr
    for k, n in {0x10: 1, 0x20: 10, 0x30: 100, 0x40: 100, 0x50: 10, 0x60: 1}.items():
        sr.block(k).count = n
    return b


def test_loops_nested_exact_forest_and_trip_counts():
    f = loop_forest(nested_loops().sr)
    d = f.root.describe()
    assert d["headers"] == [] and d["blocks"] == [0x10, 0x20, 0x30, 0x40, 0x50, 0x60]
    [outer] = d["children"]
    assert outer["headers"] == [0x20] and outer["blocks"] == [0x20, 0x30, 0x40, 0x50]
    assert outer["back_edges"] == [(0x50, 0x20)] and outer["reducible"] and outer["depth"] == 1
    [inner] = outer["children"]
    assert inner["headers"] == [0x30] and inner["blocks"] == [0x30, 0x40]
    assert inner["back_edges"] == [(0x40, 0x30)] and inner["children"] == []
    assert outer["trip_count"] == 10.0 and inner["trip_count"] == 10.0
    assert f.innermost[0x40].headers == [0x30] and f.innermost[0x10].is_root
    assert [lp.id for lp in f.loops()] == [1, 2]


def test_loops_multiple_back_edges_one_loop():
    b = Builder()
    b.block(0x10, (5,), T.JCC, targets=[0x30])
    b.block(0x15, (5,), T.JMP, targets=[0x10])
    b.block(0x30, (5,), T.JCC, targets=[0x10])
    b.block(0x35, (5,), T.JMP, targets=[0x900])
    b.ft(0x10, 0x15)
    b.flow(0x15, 0x10)
    b.flow(0x10, 0x30)
    b.flow(0x30, 0x10)
    b.ft(0x30, 0x35)
    b.exit(0x35, 0x900)
    b.entry(0x10)
    [lp] = loop_forest(b.sr).root.children
    assert lp.headers == [0x10] and lp.blocks == {0x10, 0x15, 0x30}
    assert sorted(lp.back_edges) == [(0x15, 0x10), (0x30, 0x10)] and lp.children == []
    assert lp.entry_edges == [(START, 0x10)]


def irreducible() -> Builder:
    """START -> A; A -> B, A -> C; B <-> C; C -> X -> out; plus D self-loop after X."""
    b = Builder()
    b.block(0x10, (5,), T.JCC, targets=[0x30])
    b.block(0x20, (5,), T.JMP, targets=[0x30])
    b.block(0x30, (5,), T.JCC, targets=[0x20])
    b.block(0x40, (5,))
    b.block(0x50, (5,), T.JCC, targets=[0x50])
    b.ft(0x10, 0x20)
    b.flow(0x10, 0x30)
    b.flow(0x20, 0x30)
    b.flow(0x30, 0x20)
    b.ft(0x30, 0x40)
    b.ft(0x40, 0x50)
    b.flow(0x50, 0x50)
    b.exit(0x50, 0x55)
    b.entry(0x10)
    return b


def test_loops_irreducible_two_headers_and_self_loop():
    d = loop_forest(irreducible().sr).root.describe()
    irr, selfloop = d["children"]
    assert irr["headers"] == [0x20, 0x30] and not irr["reducible"]
    assert irr["blocks"] == [0x20, 0x30] and irr["children"] == []
    assert irr["back_edges"] == [(0x20, 0x30), (0x30, 0x20)]
    assert selfloop["headers"] == [0x50] and selfloop["reducible"]
    assert selfloop["blocks"] == [0x50] and selfloop["back_edges"] == [(0x50, 0x50)]


def test_loops_irreducible_loop_with_inner_loop():
    """Two-entry loop {B, C, D} where D <-> C also loops: inner loop is {C, D}? No:
    after removing the edges into both headers B and C, only D's self-loop stays."""
    b = irreducible()
    b.block(0x60, (5,), T.JCC, targets=[0x60])
    b.sr.g.remove_edge(0x30, 0x20)
    b.flow(0x30, 0x60)
    b.flow(0x60, 0x20)
    [irr, selfloop] = loop_forest(b.sr).root.children
    assert irr.headers == [0x20, 0x30] and irr.blocks == {0x20, 0x30, 0x60}
    b.flow(0x60, 0x60)
    [irr, _] = loop_forest(b.sr).root.children
    [inner] = irr.children
    assert inner.headers == [0x60] and inner.blocks == {0x60} and inner.depth == 2


# ---- INLINE-HOT-CALLS ---------------------------------------------------------------
def caller_callee(call_count=100.0, other_calls=100.0, callee_calls_self=False):
    """main loop M: A -> C(call f) -> K -> A.  f: F -> R(ret), entered
    ``call_count + other_calls`` times in all."""
    m = Builder("main")
    m.block(0x10, (5,))
    m.block(0x15, (5,), T.CALL, targets=[0x100], count=call_count)
    m.block(0x1A, (2, 3), T.JCC, targets=[0x10], count=call_count)
    m.block(0x1F, (5,), T.JMP, targets=[0x900], count=1)
    m.ft(0x10, 0x15, call_count)
    m.exit(0x15, 0x100, call_count)
    m.ft(0x15, 0x1A, call_count)
    m.flow(0x1A, 0x10, call_count - 1)
    m.ft(0x1A, 0x1F, 1)
    m.exit(0x1F, 0x900, 1)
    m.entry(0x10, 1)
    m.sr.block(0x10).count = call_count
    total = call_count + other_calls
    f = Builder("f")
    f.block(0x100, (5,), T.JCC, targets=[0x110], count=total)
    f.block(0x105, (5,), count=total / 2)
    f.block(0x110, (1,), T.RET, count=total)
    f.ft(0x100, 0x105, total / 2)
    f.flow(0x100, 0x110, total / 2)
    f.ft(0x105, 0x110, total / 2)
    f.exit(0x110, 0, total)
    f.entry(0x100, total)
    if callee_calls_self:
        f.block(0x108, (5,), T.CALL, targets=[0x100], count=total / 2, ft=0x10D)
        f.sr.g.remove_edge(0x105, 0x110)
        f.ft(0x105, 0x108, total / 2)
        f.exit(0x108, 0x100, total / 2)
        f.block(0x10D, (3,), T.JMP, targets=[0x110], count=total / 2)
        f.ft(0x108, 0x10D, total / 2)
        f.flow(0x10D, 0x110, total / 2)
    return m.sr, f.sr


def test_inline_scales_clone_counts_and_subtracts_from_original():
    main, f = caller_callee()
    c = Counter()
    inline_hot_calls([main, f], hot_threshold=10, inline_budget=1.0, counters=c)
    main.verify()
    f.verify()
    path = (0x15,)
    clones = sorted(k for k in main.body_nodes() if isinstance(k, CloneKey))
    assert clones == [CloneKey(path, 0x100), CloneKey(path, 0x105), CloneKey(path, 0x110)]
    assert [main.block(k).count for k in clones] == [100, 50, 100]
    assert all(main.block(k).unpatchable and main.block(k).clone_of == k.start for k in clones)
    assert [f.block(k).count for k in (0x100, 0x105, 0x110)] == [100, 50, 100]
    assert edge_count(f, 0x100, 0x105) == 50 and edge_count(f, 0x110, END) == 100
    assert edge_count(f, START, 0x100) == 100                # 200 calls, 100 now inlined
    assert main.g.edges[0x15, CloneKey(path, 0x100)] == {"kind": EdgeKind.CALL, "count": 100}
    assert main.g.edges[CloneKey(path, 0x110), 0x1A]["kind"] == EdgeKind.RETURN
    assert not main.g.has_edge(0x15, END) and not main.g.has_edge(0x15, 0x1A)
    site = main.info["inline"]["sites"][0x15]
    assert site["decision"] == "inlined" and site["return_address"] == 0x1A
    assert site["targets"] == {0x100: CloneKey(path, 0x100)} and site["fallback_exit"] is None
    assert c["inlined"] == 1 and main.info["inline"]["growth"] == 11


def test_inline_respects_budget_and_removes_uninlined_call_block():
    main, f = caller_callee()
    c = Counter()
    inline_hot_calls([main, f], hot_threshold=10, inline_budget=0.1, inline_min_budget_bytes=8,
                     counters=c)
    assert c["rejected-budget"] == 1 and c["inlined"] == 0
    assert 0x15 not in main.g
    assert main.g.edges[0x10, END]["exits"] == {0x15: 100}
    assert entries(main) == [0x10, 0x1A]          # CONNECT-TERMINALS: at the continuation
    assert main.info["inline"]["sites"][0x15]["reason"] == "budget"
    assert not any(isinstance(k, CloneKey) for k in main.body_nodes())
    main.verify()


def test_inline_cold_call_not_inlined():
    main, f = caller_callee(call_count=5)
    c = Counter()
    inline_hot_calls([main, f], hot_threshold=10, inline_budget=1.0, counters=c)
    assert c["inlined"] == 0 and 0x15 not in main.g
    assert main.info["inline"]["sites"][0x15]["reason"] == "cold"


def test_inline_never_inlines_recursion_nor_its_callers():
    main, f = caller_callee(callee_calls_self=True)
    c = Counter()
    inline_hot_calls([main, f], hot_threshold=10, inline_budget=5.0, counters=c)
    assert c["inlined"] == 0
    assert f.info["inline"]["sites"][0x108]["reason"] == "recursive"
    assert main.info["inline"]["sites"][0x15]["reason"] == "callee-has-hot-calls"
    assert 0x108 not in f.g and 0x15 not in main.g
    main.verify()
    f.verify()


def test_inline_mutual_recursion_is_rejected():
    g = Builder("g")
    g.block(0x200, (5,), T.CALL, targets=[0x300], count=50)
    g.block(0x205, (1,), T.RET, count=50)
    g.exit(0x200, 0x300, 50)
    g.ft(0x200, 0x205, 50)
    g.exit(0x205, 0, 50)
    g.entry(0x200, 50)
    h = Builder("h")
    h.block(0x300, (5,), T.CALL, targets=[0x200], count=50)
    h.block(0x305, (1,), T.RET, count=50)
    h.exit(0x300, 0x200, 50)
    h.ft(0x300, 0x305, 50)
    h.exit(0x305, 0, 50)
    h.entry(0x300, 50)
    c = Counter()
    inline_hot_calls([g.sr, h.sr], hot_threshold=10, inline_budget=9.0, counters=c)
    assert c["inlined"] == 0 and c["rejected-recursive"] == 2


def test_inline_bottom_up_nests_clone_paths():
    """main -> g -> f, all hot: f goes into g first, then g (with f's clone) into main."""
    main, f = caller_callee()
    g = Builder("g")
    g.block(0x200, (5,), T.CALL, targets=[0x100], count=100)
    g.block(0x205, (1,), T.RET, count=100)
    g.exit(0x200, 0x100, 100)
    g.ft(0x200, 0x205, 100)
    g.exit(0x205, 0, 100)
    g.entry(0x200, 100)
    main.block(0x15).targets[:] = [0x200]
    main.g.edges[0x15, END]["exits"] = {0x200: 100}
    c = Counter()
    inline_hot_calls([main, g.sr, f], hot_threshold=10, inline_budget=9.0, counters=c)
    assert c["inlined"] == 2
    for sr in (main, g.sr, f):
        sr.verify()
    outer, inner = (0x15,), (0x15, 0x200)
    assert main.g.edges[0x15, CloneKey(outer, 0x200)]["kind"] == EdgeKind.CALL
    assert main.g.edges[CloneKey(outer, 0x200), CloneKey(inner, 0x100)]["kind"] == EdgeKind.CALL
    assert main.g.edges[CloneKey(inner, 0x110), CloneKey(outer, 0x205)]["kind"] == EdgeKind.RETURN
    assert main.g.edges[CloneKey(outer, 0x205), 0x1A]["kind"] == EdgeKind.RETURN
    assert main.info["inline"]["sites"][CloneKey(outer, 0x200)]["decision"] == "inlined"
    # f was inlined into g only (g's site went first): f's original counts all went there.
    assert f.block(0x100).count == 100 and g.sr.block(0x200).count == 0


def test_inline_indirect_call_with_two_targets_is_a_cascade():
    main, f = caller_callee(other_calls=0)
    f2 = Builder("f2")
    f2.block(0x400, (1,), T.RET, count=30)
    f2.exit(0x400, 0, 30)
    f2.entry(0x400, 30)
    cb = main.block(0x15)
    cb.term, cb.targets, cb.unknown_target = T.ICALL, [0x100, 0x400, 0x500], False
    main.g.edges[0x15, END]["exits"] = {0x100: 60, 0x400: 30, 0x500: 10}
    inline_hot_calls([main, f, f2.sr], hot_threshold=10, inline_budget=9.0)
    site = main.info["inline"]["sites"][0x15]
    assert site["kind"] == "cascade" and site["fallback_exit"] == 0x15
    assert site["targets"] == {0x100: CloneKey((0x15,), 0x100), 0x400: CloneKey((0x15,), 0x400)}
    assert main.g.edges[0x15, END]["exits"] == {0x15: 10}
    assert edge_count(main, 0x15, CloneKey((0x15,), 0x100)) == 60
    assert main.block(CloneKey((0x15,), 0x100)).count == 60
    main.verify()


def test_remove_call_blocks_predecessors_exit_and_clones_stay_enterable_only_by_call():
    main, f = caller_callee()
    remove_call_blocks(main, set())
    assert 0x15 not in main.g and entries(main) == [0x10, 0x1A]
    main.verify()


# ---- PATCH-POINT-SELECTION ---------------------------------------------------------------
def single_loop(pre_sizes=(5,), hdr_sizes=(5,), pre_unpatchable=False, hdr_unpatchable=False):
    """START -> P -> H <-> B; H -> X -> out."""
    b = Builder()
    b.block(0x10, pre_sizes, unpatchable=pre_unpatchable, count=1)
    b.block(0x20, hdr_sizes, T.JCC, targets=[0x40], unpatchable=hdr_unpatchable, count=100,
            ft=0x20 + sum(hdr_sizes))
    b.block(0x30, (5,), T.JMP, targets=[0x20], count=99)
    b.block(0x40, (5,), T.JMP, targets=[0x900], count=1)
    b.sr.block(0x20).fallthrough = 0x30
    b.ft(0x10, 0x20, 1)
    b.ft(0x20, 0x30, 99)
    b.flow(0x30, 0x20, 99)
    b.flow(0x20, 0x40, 1)
    b.exit(0x40, 0x900, 1)
    b.entry(0x10, 1)
    return b


def selected(sr: SuperRegion) -> list[int]:
    assert select_patch_points(sr)
    sr.verify()
    check_entry_invariant(sr)
    return entries(sr)


def test_patch_single_loop_at_preheader():
    assert selected(single_loop().sr) == [0x10]


def test_patch_single_loop_header_when_preheader_unpatchable():
    b = single_loop(pre_unpatchable=True)
    assert selected(b.sr) == [0x20]
    assert 0x10 not in b.sr.g                         # no longer reachable: removed
    assert edge_count(b.sr, START, 0x20) == 1         # inflow from original code
    [lp] = b.sr.info["loops"].loops()
    assert lp.trip_count == 100


def test_patch_short_first_insn_preheader_counts_as_unpatchable():
    assert selected(single_loop(pre_sizes=(2, 2)).sr) == [0x20]


def test_patch_block_split_before_first_long_insn():
    b = single_loop(pre_unpatchable=True, hdr_sizes=(2, 5, 3))
    assert selected(b.sr) == [0x22]
    sr = b.sr
    top, tail = sr.block(0x20), sr.block(0x22)
    assert top.insns == [(0x20, 2)] and top.term == T.FALLTHROUGH and top.fallthrough == 0x22
    assert tail.insns == [(0x22, 5), (0x27, 3)] and tail.term == T.JCC
    assert sr.g.edges[0x20, 0x22] == {"kind": FT, "count": 100}
    assert sr.g.has_edge(0x30, 0x20) and sr.g.has_edge(0x22, 0x30) and sr.g.has_edge(0x22, 0x40)
    assert top.size + tail.size == 10 and tail.data == b"\x90" * 8


def test_patch_unpatchable_header_moves_patch_into_the_loop():
    b = single_loop(pre_unpatchable=True, hdr_unpatchable=True)
    assert selected(b.sr) == [0x30]
    # Original code runs H once per loop entry, then B is patched: 1 * 99/100.
    assert edge_count(b.sr, START, 0x30) == pytest.approx(0.99)
    [lp] = b.sr.info["loops"].loops()
    assert lp.headers == [0x30] and lp.trip_count == pytest.approx(100)


def test_patch_nested_loops_one_patch_outside():
    assert selected(nested_loops().sr) == [0x10]
    b = nested_loops()
    b.sr.block(0x10).unpatchable = True
    assert selected(b.sr) == [0x20]                    # outer header, not the inner one


def sibling_loops(split_patchable=True) -> Builder:
    """START -> A (jcc); A -> P1 -> L1 (H1 <-> B1) -> out; A -> P2 -> L2 (H2 <-> B2) -> out."""
    b = Builder()
    b.block(0x10, (5,), T.JCC, targets=[0x50], unpatchable=not split_patchable)
    for p, h, body in ((0x15, 0x20, 0x30), (0x50, 0x60, 0x70)):
        b.block(p, (5,))
        b.block(h, (5,), T.JCC, targets=[h + 0x8], ft=body)
        b.block(body, (5,), T.JMP, targets=[h])
        b.block(h + 0x8, (5,), T.JMP, targets=[0x900])
        b.ft(p, h)
        b.ft(h, body)
        b.flow(body, h)
        b.flow(h, h + 0x8)
        b.exit(h + 0x8, 0x900)
    b.ft(0x10, 0x15)
    b.flow(0x10, 0x50)
    b.entry(0x10)
    return b


def test_patch_two_sibling_loops_minimal_sets():
    assert selected(sibling_loops().sr) == [0x10]
    assert selected(sibling_loops(split_patchable=False).sr) == [0x15, 0x50]


def test_patch_irreducible_loop_needs_both_entries_covered():
    b = irreducible()
    b.sr.block(0x10).unpatchable = True
    b.sr.block(0x40).unpatchable = True
    assert selected(b.sr) == [0x20, 0x50]        # B is on every cycle of {B, C}
    b = irreducible()
    b.sr.block(0x10).unpatchable = True
    b.sr.block(0x40).unpatchable = True
    b.flow(0x30, 0x30)                             # C loops on its own: C is on every
    assert selected(b.sr) == [0x30]                # cycle and cuts the way to D too
    b = irreducible()
    b.sr.block(0x10).unpatchable = True
    b.flow(0x30, 0x30)
    b.flow(0x20, 0x20)                             # B loops on its own too: both needed
    assert selected(b.sr) == [0x20, 0x30]
    b = irreducible()
    assert selected(b.sr) == [0x10]


def test_patch_outer_patch_dropped_when_useless():
    """A root block that reaches the loop but does not cut the other way in."""
    b = single_loop(pre_unpatchable=False)
    b.block(0x80, (5,), T.JMP, targets=[0x20], unpatchable=True)
    b.flow(0x80, 0x20)
    b.entry(0x80)
    assert selected(b.sr) == [0x20]


def test_patch_no_patchable_block_drops_region():
    b = single_loop(pre_unpatchable=True, hdr_unpatchable=True)
    for k in (0x30, 0x40):
        b.sr.block(k).unpatchable = True
    assert not select_patch_points(b.sr)


def test_patch_no_patchable_block_transfer_only_keeps_the_region():
    """With ``transfer_only`` the SR stays, entry edges untouched and no patch point:
    threads reach it only by TRANSFER; PRUNE-CODE judges its loop as usual."""
    b = single_loop(pre_unpatchable=True, hdr_unpatchable=True)
    for k in (0x30, 0x40):
        b.sr.block(k).unpatchable = True
    before = sorted((v, c) for v, c in b.sr.entry_edges())
    c = Counter()
    assert select_patch_points(b.sr, c, transfer_only=True)
    sr = b.sr
    sr.verify()
    check_entry_invariant(sr)                     # nothing to check: no patch site
    assert sr.transfer_only and sr.entry_points() == [] and sr.info["patch_points"] == []
    assert sorted((v, c) for v, c in sr.entry_edges()) == before
    assert c["transfer-only"] == 1 and c["dropped-unpatchable"] == 0
    [kept] = prune_code(sr, hot_threshold=1, min_loop_trip_count=4, min_region_size=5)
    assert kept.transfer_only and kept.entry_points() == []
    # a patchable SR is never made transfer-only
    b2 = single_loop()
    assert select_patch_points(b2.sr, transfer_only=True) and not b2.sr.transfer_only


# ---- PRUNE-CODE -------------------------------------------------------------------------
def test_prune_removes_exactly_the_cold_tails():
    b = single_loop()
    b.block(0x50, (5,), count=0)                      # cold tail after X ...
    b.block(0x58, (5,), T.JMP, targets=[0x900], count=0)
    b.sr.g.remove_edge(0x40, END)
    b.flow(0x40, 0x50, 1)
    b.ft(0x50, 0x58)
    b.exit(0x58, 0x900)
    b.block(0x28, (5,), T.JMP, targets=[0x30], count=0)  # cold but leads back into the loop
    b.flow(0x20, 0x28)
    b.flow(0x28, 0x30)
    cold = remove_cold_tails(b.sr, hot_threshold=1)
    assert cold == {0x50, 0x58}
    assert b.sr.g.edges[0x40, END]["exits"] == {0x50: 1}
    b.sr.verify()


def test_prune_drops_loopless_small_and_short_trip_regions():
    c = Counter()
    kept = prune_code(single_loop().sr, hot_threshold=1, min_loop_trip_count=4,
                      min_region_size=16, counters=c)
    assert len(kept) == 1 and kept[0].info["loops"].max_trip_count() == 100
    assert prune_code(single_loop().sr, hot_threshold=1, min_loop_trip_count=101,
                      min_region_size=16, counters=c) == []
    assert prune_code(single_loop().sr, hot_threshold=1, min_loop_trip_count=4,
                      min_region_size=21, counters=c) == []
    b = Builder()
    b.block(0x10, (5,), T.JMP, targets=[0x900], count=5)
    b.exit(0x10, 0x900, 5)
    b.entry(0x10, 5)
    assert prune_code(b.sr, hot_threshold=1, min_loop_trip_count=0,
                      min_region_size=0, counters=c) == []
    assert c["dropped-no-hot-loop"] == 2 and c["dropped-small"] == 1


def test_prune_separates_components_again():
    b = sibling_loops()
    for k in b.sr.body_nodes():
        b.sr.block(k).count = 50
    b.sr.g.remove_edge(0x10, 0x50)
    b.entry(0x50)
    parts = prune_code(b.sr, hot_threshold=1, min_loop_trip_count=0, min_region_size=0)
    assert [sorted(p.body_nodes()) for p in parts] == [
        [0x10, 0x15, 0x20, 0x28, 0x30], [0x50, 0x60, 0x68, 0x70]]
    assert [p.info["patch_points"] for p in parts] == [[0x10], [0x50]]
    for p in parts:
        p.verify()


# ---- the pass manager ---------------------------------------------------------------------
def discovery_like() -> SuperRegion:
    """main loop calling f, f, and a cold island: one SR as discovery leaves it."""
    main, f = caller_callee()
    sr = SuperRegion("first")
    for part in (main, f):
        sr.g.add_nodes_from(part.g.nodes(data=True))
        sr.g.add_edges_from(part.g.edges(data=True))
    for k, _ in sr.blocks():
        sr.block(k).count = 0.0
    return sr


def test_pipeline_end_to_end_with_stages_counters_and_timings(tmp_path):
    cfg = RegionConfig(hot_threshold=10, min_loop_trip_count=4, min_region_size=8,
                       keep_stages=True, dump_dir=str(tmp_path), fail_fast=True)
    res = run_pipeline(discovery_like(), None, cfg)
    assert [n for n, _ in res.stages] == ["discovery", "partition-code", "fall-through-only",
                                         "inline-hot-calls", "patch-point-selection",
                                         "prune-code"]
    assert set(res.timings) == {n for n, _ in res.stages[1:]} | {"verify"}
    assert res.counters["prune-code"]["regions-out"] == 1
    assert res.counters["partition-code"]["components"] == 2
    assert res.counters["inline-hot-calls"]["inlined"] == 1
    [r] = res.regions
    assert r.state.value == "selected" and entries(r) == [0x10]
    assert any(isinstance(k, CloneKey) for k in r.body_nodes())
    assert r.info["loops"].max_trip_count() == 100
    assert res.failures == []
    assert len(list(tmp_path.glob("*.dot"))) >= 6


def test_pipeline_isolates_a_failing_region(monkeypatch):
    from dbr_service.region import fallthrough

    real = fallthrough.compute_fall_through_only

    def flaky(sr, counters=None, **kw):
        if 0x100 in sr.g:
            raise RegionError("boom")
        return real(sr, counters, **kw)

    monkeypatch.setattr(fallthrough, "compute_fall_through_only", flaky)
    res = run_pipeline(discovery_like(), None, RegionConfig(hot_threshold=10, min_region_size=8))
    assert [(f.pass_name, "boom" in f.error) for f in res.failures] == [("fall-through-only", True)]
    # main went on without f: its call could not be inlined, so the call block
    # went, which broke main's loop, so prune dropped it.
    assert res.counters["inline-hot-calls"]["rejected-callee-not-in-region"] == 1
    assert res.regions == [] and res.counters["prune-code"]["kept"] == 0
    with pytest.raises(RegionError):
        run_pipeline(discovery_like(), None, RegionConfig(hot_threshold=10, fail_fast=True))


def test_pipeline_verification_catches_a_broken_pass(monkeypatch):
    from dbr_service.region import patchpoints

    def breaks(sr, counters=None):
        sr.g.remove_edges_from(list(sr.g.out_edges(START)))
        return True

    monkeypatch.setattr(patchpoints, "select_patch_points", breaks)
    res = run_pipeline(discovery_like(), None, RegionConfig(hot_threshold=10))
    assert res.regions == [] and {f.pass_name for f in res.failures} == {"patch-point-selection"}


def test_fallthrough_ip_only_profile_counts_from_sample_density():
    """No edge counts at all (cpu-clock samples): counts from samples per insn,
    pooled over straight-line groups, split over successors by their counts."""
    b = loop_with_chains()
    sr = b.sr
    for u, v, d in sr.g.edges(data=True):
        d["count"] = 0.0
        if v == END:
            d["exits"] = {t: 0.0 for t in d["exits"]}
    # A (2 insns) B (2) C (1): one straight-line group, 50 samples over 5 insns.
    for k, n in {0x100: 30, 0x107: 0, 0x10E: 20, 0x114: 0}.items():
        sr.block(k).samples = n
    c = Counter()
    compute_fall_through_only(sr, c)
    assert c["ip-only-estimates"] == 1
    assert [sr.block(k).count for k in (0x100, 0x107, 0x10E, 0x114)] == [10, 10, 10, 0]
    assert edge_count(sr, 0x10E, 0x100) == 10 and edge_count(sr, 0x10E, 0x114) == 0
    assert edge_count(sr, START, 0x100) == 0      # never sampled on the way in
    [lp] = loop_forest(sr).loops()
    assert lp.trip_count == float("inf")
    sr.verify()


def test_patch_split_of_an_inlined_call_block_keeps_its_inline_decision():
    main, f = caller_callee()
    cb = main.block(0x15)
    cb.insns, cb.size, cb.data = [(0x13, 2), (0x15, 5)], 7, b"\x90" * 7
    main.g.nodes[0x15]["bb"] = cb
    cb.start = 0x13   # the block now starts with a 2-byte insn before the call
    main.g = nx.relabel_nodes(main.g, {0x15: 0x13})
    main.block(0x10).size = 3
    main.block(0x10).insns = [(0x10, 3)]
    main.block(0x10).unpatchable = True
    inline_hot_calls([main, f], hot_threshold=10, inline_budget=1.0)
    assert main.info["inline"]["sites"][0x13]["decision"] == "inlined"
    assert selected(main) == [0x15]
    assert main.info["inline"]["sites"][0x15]["call_insn"] == 0x15
    assert 0x13 not in main.info["inline"]["sites"]
    assert main.g.edges[0x15, CloneKey((0x15,), 0x100)]["kind"] == EdgeKind.CALL


def test_select_regions_runs_discovery_first(monkeypatch):
    from dbr_service.region import discovery, pipeline

    seen = {}

    def fake(samples, mem, *, jumps_from_hot_limit, branch_samples=None, patched=None,
             seed_min=0.0, max_blocks=None):
        seen.update(samples=samples, mem=mem, jfh=jumps_from_hot_limit, bs=branch_samples,
                    seed_min=seed_min, max_blocks=max_blocks)
        return discovery_like()

    monkeypatch.setattr(discovery, "hot_code_discovery", fake)
    res = pipeline.select_regions({0x10: 5.0}, "MEM",
                                  RegionConfig(hot_threshold=10, jumps_from_hot_limit=3,
                                               seed_min_samples=2, max_discovery_blocks=40),
                                  branch_samples={0x1A: {0x10: 9}})
    assert seen == {"samples": {0x10: 5.0}, "mem": "MEM", "jfh": 3, "bs": {0x1A: {0x10: 9}},
                    "seed_min": 2, "max_blocks": 40}
    assert list(res.timings)[0] == "hot-code-discovery" and len(res.regions) == 1


def test_fallthrough_callee_without_branches_is_not_taken_for_an_ip_only_profile():
    """A leaf callee F -> R(ret) has no branch of its own: its entry count (the
    calls to it) still marks the profile as one with branch counts."""
    def leaf(entry_count):
        b = Builder()
        b.block(0x100, (3,), samples=7)
        b.block(0x103, (1,), T.RET, samples=1)
        b.ft(0x100, 0x103)
        b.exit(0x103, 0)
        b.entry(0x100, entry_count)
        return b.sr

    sr = leaf(55)
    compute_fall_through_only(sr)
    assert sr.block(0x100).count == 55 and edge_count(sr, 0x103, END) == 55
    sr = leaf(0)                                       # IP-only: densities instead
    compute_fall_through_only(sr)
    assert sr.block(0x100).count == 4 and sr.block(0x103).count == 4
    sr = leaf(0)                                       # told by the pipeline: not IP-only
    compute_fall_through_only(sr, ip_only=False)
    assert sr.block(0x100).count == 0


def _branch_over_unsampled(samples_at_branch: float, doomed: bool = True) -> SuperRegion:
    """inner() of the throw e2e program: a sampled block (4 insns) whose jcc goes
    either to a one-instruction ``ret`` or to a 6-instruction throw path that calls
    out twice, the second time never to return (``doomed``; else it jumps on to
    other code); neither successor drew a sample (a ret's samples skid onto the
    return address)."""
    b = Builder()
    b.block(0x100, (3, 3, 4, 6), T.JCC, targets=[0x200], ft=0x110, samples=samples_at_branch)
    b.block(0x110, (1,), T.RET)
    b.block(0x200, (4, 4), T.FALLTHROUGH)
    b.block(0x208, (5,), T.CALL, targets=[0x900], ft=0x20D)
    b.block(0x20D, (3, 4), T.FALLTHROUGH)
    if doomed:
        b.block(0x214, (5,), T.CALL, targets=[0x908], ft=None)
    else:
        b.block(0x214, (5,), T.JMP, targets=[0x908])
    b.entry(0x100)
    b.ft(0x100, 0x110)
    b.flow(0x100, 0x200)
    b.exit(0x110, 0)
    b.ft(0x200, 0x208)
    b.call(0x208, 0x900, cont=0x20D)
    b.ft(0x20D, 0x214)
    if doomed:
        b.call(0x214, 0x908)
    else:
        b.exit(0x214, 0x908)
    return b.sr


def test_fallthrough_ip_only_unsampled_successors_share_by_likelihood():
    """Where no successor of a branch was sampled, flow goes where its absence of
    samples is likeliest: the one-instruction ret, not the long throw path (an even
    split made the throw path's calls hot and kept its function from being
    inlined: the throw e2e program selected no region on an AMD EPYC)."""
    sr = _branch_over_unsampled(400, doomed=False)
    compute_fall_through_only(sr)
    assert sr.block(0x100).count == 100
    assert edge_count(sr, 0x100, 0x110) == pytest.approx(100)
    assert sr.block(0x200).count < 1e-6 and sr.block(0x214).count < 1e-6
    sr.verify()
    # hardly any samples: their absence says little, the split stays near even
    sr = _branch_over_unsampled(0.2, doomed=False)
    compute_fall_through_only(sr)
    share = edge_count(sr, 0x100, 0x200) / sr.block(0x100).count
    assert 0.3 < share < 0.5


def test_fallthrough_ip_only_doomed_path_keeps_only_its_own_samples():
    """One stray sample on the throw path (it ends in a call that never returns)
    against an unsampled ret: proportional splitting sent the throw path all of the
    branch's count; it keeps what its samples show, the rest goes to the ret."""
    sr = _branch_over_unsampled(400)
    sr.block(0x20D).samples = 1                       # 1 sample over its 6-insn group
    compute_fall_through_only(sr)
    assert sr.block(0x200).count == pytest.approx(1 / 6)
    assert edge_count(sr, 0x100, 0x110) == pytest.approx(100 - 1 / 6)
    sr.verify()
    # no ret to go to: a branch between two doomed paths splits as before
    sr = _branch_over_unsampled(400)
    sr.g.remove_node(0x110)
    sr.block(0x100).fallthrough = None
    sr.add_edge(0x100, 0x214, EdgeKind.FLOW)
    compute_fall_through_only(sr)
    assert sr.block(0x100).count + 1e-9 >= edge_count(sr, 0x100, 0x214) > 0


def test_doomed_blocks_end_in_calls_that_never_return_and_not_in_loops():
    from dbr_service.region.fallthrough import doomed_blocks
    sr = _branch_over_unsampled(400)
    assert doomed_blocks(sr) == {0x200, 0x208, 0x20D, 0x214}
    sr.add_edge(0x20D, 0x200, EdgeKind.FLOW)          # a loop on the way: not doomed
    assert doomed_blocks(sr) == {0x214}
    sr = _branch_over_unsampled(400)
    sr.add_edge(0x20D, END, EdgeKind.EXIT, target=0x777)    # may leave: not doomed
    assert doomed_blocks(sr) == {0x214}


def test_inline_noreturn_call_in_callee_does_not_block_inlining():
    """A hot call that never returns (hot by a bad estimate, or a program that really
    throws often) exits to original code; its function is still inlined."""
    b = Builder()
    b.block(0x10, (5,), T.CALL, targets=[0x100], ft=0x15, count=100)
    b.block(0x15, (4,), T.JCC, targets=[0x10], ft=0x19, count=100)
    b.block(0x19, (1,), T.RET)
    b.block(0x100, (4,), T.JCC, targets=[0x200], ft=0x104, count=100)
    b.block(0x104, (1,), T.RET, count=50)
    b.block(0x200, (5,), T.CALL, targets=[0x900], ft=None, count=50)
    b.entry(0x10, 1)
    b.call(0x10, 0x100, count=100, cont=0x15)
    b.flow(0x15, 0x10, 99)
    b.ft(0x15, 0x19, 1)
    b.exit(0x19, 0, 1)
    b.ft(0x100, 0x104, 50)
    b.flow(0x100, 0x200, 50)
    b.exit(0x104, 0, 50)
    b.call(0x200, 0x900, count=50)
    sr = b.sr
    c = Counter()
    inline_hot_calls([sr], hot_threshold=10, inline_budget=4.0, counters=c)
    sites = sr.info["inline"]["sites"]
    assert sites[0x10]["decision"] == "inlined", sites
    assert sites[0x200]["reason"] == "never-returns"
    assert c["rejected-callee-has-hot-calls"] == 0


def _caller_loop(samples=(0, 0, 0)) -> Builder:
    """A loop at 0x10 whose body calls 0x100 (not built here): 0x10 (2 insns),
    the call at 0x15, the jcc back at 0x1A, then a ret; ``samples`` of the first
    three blocks."""
    b = Builder()
    b.block(0x10, (3, 2), samples=samples[0])
    b.block(0x15, (5,), T.CALL, targets=[0x100], ft=0x1A, samples=samples[1])
    b.block(0x1A, (3, 2), T.JCC, targets=[0x10], ft=0x1F, samples=samples[2])
    b.block(0x1F, (1,), T.RET)
    b.entry(0x10)
    b.ft(0x10, 0x15)
    b.call(0x15, 0x100, cont=0x1A)
    b.flow(0x1A, 0x10)
    b.ft(0x1A, 0x1F)
    b.exit(0x1F, 0)
    return b


def test_inline_a_callee_whose_unsampled_throw_path_calls_out():
    """The pipeline on a caller loop calling the function above: the call is inlined
    (its throw path is cold, pruned) and the region survives."""
    b = _caller_loop((50, 50, 40))
    callee = _branch_over_unsampled(400)
    for k, block in callee.blocks():
        b.sr.add_block(block)
    for u, v, d in callee.g.edges(data=True):
        if u == START or v == END:
            continue
        b.sr.add_edge(u, v, d["kind"], 0.0)
    b.sr.add_edge(START, 0x100, EdgeKind.ENTRY, 0.0)
    b.exit(0x110, 0)
    b.exit(0x208, 0x900)
    b.exit(0x214, 0x908)
    res = run_pipeline(b.sr, None, RegionConfig(hot_threshold=2))
    assert res.failures == []
    [sr] = res.regions
    assert sr.info["inline"]["sites"][0x15]["decision"] == "inlined"
    assert 0x200 not in sr.g and not any(isinstance(k, CloneKey) and k.start == 0x200
                                         for k in sr.g)


def test_ip_only_call_site_takes_its_callee_entry_count():
    """A loop whose body is a call draws few samples itself (the calls workload on
    an AMD EPYC: 3 of 796), its callee many.  The call site runs as often as the
    callee is entered, so the call is hot, inlined, and the loop kept."""
    from dbr_service.region.fallthrough import call_site_floors

    def profile():
        b = _caller_loop((0, 0, 1))
        b.block(0x100, (4, 4, 4, 4), samples=60)
        b.block(0x110, (1,), T.RET)
        b.entry(0x100)
        b.ft(0x100, 0x110)
        b.exit(0x110, 0)
        return b.sr

    sr = profile()
    compute_fall_through_only(sr)
    assert call_site_floors([sr]) == {sr.id: {0x15: pytest.approx(12)}}   # 60 samples / 5 insns
    res = run_pipeline(profile(), None, RegionConfig(hot_threshold=2))
    assert res.counters["fall-through-only"]["call-site-floors"] == 1
    [kept] = res.regions
    assert kept.info["inline"]["sites"][0x15]["decision"] == "inlined"
    assert any(lp.trip_count >= 2 for lp in loop_forest(kept).loops())
    # two call sites share the callee's count by their own counts
    sr = profile()
    sr.add_block(bb_(0x40, (5,), T.CALL, targets=[0x100], ft=None, samples=3))
    sr.add_edge(START, 0x40, EdgeKind.ENTRY)
    sr.add_edge(0x40, END, EdgeKind.EXIT, target=0x100)
    compute_fall_through_only(sr)
    floors = call_site_floors([sr])[sr.id]
    assert floors[0x15] + floors[0x40] == pytest.approx(12)
    assert floors[0x40] > floors[0x15]


# ---- CUT-WIDE-DISPATCH ---------------------------------------------------------------
def _dispatch_loop(n_targets: int) -> SuperRegion:
    """head -> dispatch (indirect jmp over ``n_targets`` cases) -> case_i -> head: an
    interpreter loop whose only cycle passes through the indirect jump."""
    from dbr_service.region.model import RegionState

    b = Builder("discovered")
    head = b.block(0x100, (5, 3), count=1000, samples=100)
    cases = [0x200 + 0x10 * i for i in range(n_targets)]
    disp = b.block(0x108, (4, 2), T.IJMP, targets=cases, count=1000, samples=100)
    b.entry(head, 1)
    b.ft(head, disp, 1000)
    for c in cases:
        b.block(c, (5, 2), T.JMP, targets=[head], count=1000 / n_targets,
                samples=100 / n_targets)
        b.flow(disp, c, 1000 / n_targets)
        b.flow(c, head, 1000 / n_targets)
    b.exit(disp, 0x900, 0)
    b.sr.state = RegionState.DISCOVERED
    return b.sr


def test_translated_dispatch_keeps_its_loop() -> None:
    """A PC-relative table dispatch (``add rdx, r8; jmp rdx`` with a known table base)
    is translated by code generation, so its edges stay whatever its width; the same
    block without a table base is cut."""
    from dataclasses import replace

    from dbr_service.region.model import MAX_CASCADE_TARGETS

    cfg = RegionConfig(hot_threshold=10, min_region_size=8, min_loop_trip_count=2)
    n = MAX_CASCADE_TARGETS + 8

    def loop(table_base):
        sr = _dispatch_loop(n)
        bb = sr.block(0x108)
        sr.add_block(replace(bb, size=5, insns=[(0x108, 3), (0x10B, 2)],
                             data=bytes.fromhex("4c01c2ffe2"),      # add rdx, r8; jmp rdx
                             table_base=table_base), 0x108)
        return sr

    res = run_pipeline(loop(0x1000), None, cfg)
    assert res.counters["partition-code"]["translated-dispatches"] == 1
    assert "wide-dispatches" not in res.counters["partition-code"]
    assert len(res.regions) == 1 and not res.failures
    assert res.regions[0].info["loops"]
    cut = run_pipeline(loop(None), None, cfg)
    assert cut.counters["partition-code"]["wide-dispatches"] == 1 and cut.regions == []


def test_wide_dispatch_is_cut_and_its_loop_not_selected() -> None:
    from dbr_service.region.model import MAX_CASCADE_TARGETS

    cfg = RegionConfig(hot_threshold=10, min_region_size=8, min_loop_trip_count=2)
    wide = run_pipeline(_dispatch_loop(MAX_CASCADE_TARGETS + 8), None, cfg)
    assert wide.counters["partition-code"]["wide-dispatches"] == 1
    assert wide.counters["partition-code"]["edges-cut"] == MAX_CASCADE_TARGETS + 8
    assert wide.regions == [] and not wide.failures
    # a dispatch code generation turns into a compare cascade keeps its loop
    narrow = run_pipeline(_dispatch_loop(MAX_CASCADE_TARGETS), None, cfg)
    assert "wide-dispatches" not in narrow.counters["partition-code"]
    assert len(narrow.regions) == 1 and not narrow.failures
    assert narrow.regions[0].info["loops"]
