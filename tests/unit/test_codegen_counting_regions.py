"""Counting regions (codegen/blocks.py CountPlan, dbr_service/installation/exact_counts.py), run in
unicorn: a region emitted with a counter at every block entry and on each ``jcc``
block's side leaves registers, flags and memory as the original code does, from
random states (the counters' flags are saved where they may be live), and the
counts derived from its counters equal the block entries and edges the original
run took, counted from its trace."""

from __future__ import annotations

import random
import struct
import zlib

import pytest
from codegen_util import CS, linear
from test_codegen_emit import PLACES, PROGRAMS, SENTINEL, World, _compare, _profile, build

from dbr_service.codegen.counting import COUNTER_LEN, SAVED_COUNTER_LEN
from dbr_service.codegen.emit import check_generated, emit_region
from dbr_service.installation.exact_counts import derive, plan_counters, rebuilt, sample_error
from dbr_service.region.model import CloneKey, TermKind

#: Counters live in the buffer's mapping, this far from its start.
COUNTERS_AT = 0x3000
BUF_SIZE = 0x4000
#: Programs whose runs stay in the copy (so every entry and edge is counted).
WHOLE = [p for p in PROGRAMS if p.inline and p.known_targets == 4 and not p.exclude
         and not p.stop_before_ret]


def _is_counter(insn) -> bool:
    return insn.mnemonic == "lock inc" and "rip" in insn.op_str


def _counting(p, orig: int, delta: int):
    b = build(p, orig, _profile(p, orig))
    base = orig + delta
    nxt = iter(range(base + COUNTERS_AT, base + BUF_SIZE, 8))
    plan = plan_counters(b.sr, lambda: next(nxt))
    gen = emit_region(b.sr, base, counting=plan)
    assert gen.size < COUNTERS_AT
    return b, base, plan, gen


def _trace_profile(b, trace: list[int]):
    """Block entries and block-to-block steps of an original run, from its trace of
    instruction addresses (the region's own blocks, clones by their original start)."""
    starts = {bb.start: k for k, bb in b.sr.blocks()}
    ends = {bb.last_insn[0]: k for k, bb in b.sr.blocks()}
    entries: dict = {}
    steps: dict = {}
    for i, a in enumerate(trace):
        if a in starts:
            entries[a] = entries.get(a, 0) + 1
            if i and trace[i - 1] in ends:
                key = (b.sr.block(ends[trace[i - 1]]).start, a)
                steps[key] = steps.get(key, 0) + 1
    return entries, steps


@pytest.mark.parametrize("orig,delta", PLACES, ids=["low", "high"])
@pytest.mark.parametrize("p", PROGRAMS, ids=[p.name for p in PROGRAMS])
def test_counting_region_is_equivalent(p, orig: int, delta: int) -> None:
    b, base, plan, gen = _counting(p, orig, delta)
    check_generated(gen)
    w = World(b, base, BUF_SIZE)
    rng = random.Random(zlib.crc32(f"count {p.name}@{orig:#x}".encode()))
    for i in range(6):
        st = w.state(rng)
        w.load(None)
        a, _, _ = w.run(st, b.entry)
        w.load(gen, patch=True)
        r, _, landings = w.run(st, b.entry)
        _compare(a, r, f"{p.name} run={i}")
        assert all(x in b.boundaries or x == SENTINEL for x in landings)


def test_flags_saved_only_where_they_may_be_live() -> None:
    """Both forms of increment occur, and every block's copy starts with one."""
    b, base, plan, gen = _counting(PROGRAMS[0], *PLACES[0])
    incs = [i for i in linear(gen.code[:gen.data_start], base) if _is_counter(i)]
    assert len(incs) == len(plan.blocks) + len(gen.counted_sides)
    pushf = [i for i in linear(gen.code[:gen.data_start], base) if i.mnemonic == "pushfq"]
    assert pushf and len(pushf) < len(incs)
    for k, at in gen.block_addr.items():
        first = next(CS.disasm(gen.code[at - base:], at))
        assert _is_counter(first) or first.mnemonic == "lea", (k, first.mnemonic)
    assert SAVED_COUNTER_LEN == COUNTER_LEN + 15


@pytest.mark.parametrize("p", WHOLE, ids=[p.name for p in WHOLE])
def test_exact_counts_equal_the_original_runs(p) -> None:
    orig, delta = PLACES[0]
    b, base, plan, gen = _counting(p, orig, delta)
    w = World(b, base, BUF_SIZE)
    rng = random.Random(zlib.crc32(p.name.encode()))
    want_entries: dict = {}
    want_steps: dict = {}
    w.load(gen, patch=True)
    for _ in range(5):
        st = w.state(rng)
        w.load(None)
        _, trace, _ = w.run(st, b.entry)
        e, s = _trace_profile(b, trace)
        for d, x in ((want_entries, e), (want_steps, s)):
            for k, n in x.items():
                d[k] = d.get(k, 0) + n
        mem = w.m.snapshot([(base + COUNTERS_AT, 0x1000)]).mem[base + COUNTERS_AT]
        w.m.write(base, gen.code)
        img = bytearray(b.image)
        img[b.entry - orig:b.entry - orig + 5] = b"\xe9" + struct.pack(
            "<i", gen.entries[b.entry] - (b.entry + 5))
        w.m.write(orig, bytes(img))
        w.m.write(base + COUNTERS_AT, mem)          # counters accumulate over the runs
        w.run(st, b.entry)
    cmem = w.m.snapshot([(base + COUNTERS_AT, 0x1000)]).mem[base + COUNTERS_AT]
    prof = derive(b.sr, plan, gen.counted_sides,
                  lambda a: struct.unpack_from("<Q", cmem, a - base - COUNTERS_AT)[0])
    got_entries: dict = {}
    for k, n in prof.blocks.items():
        start = k.start if isinstance(k, CloneKey) else k
        got_entries[start] = got_entries.get(start, 0) + n
    assert {a: n for a, n in got_entries.items() if n} == want_entries
    got_steps: dict = {}
    for (u, v), n in prof.edges.items():
        key = (b.sr.block(u).start, b.sr.block(v).start)
        if n:
            got_steps[key] = got_steps.get(key, 0) + n
    # every derived edge is a step the original took as often (exits are not steps)
    assert got_steps == {k: n for k, n in want_steps.items() if k in got_steps}
    assert not prof.inexact or any(bb.term in (TermKind.IJMP, TermKind.ICALL)
                                   for _, bb in b.sr.blocks())
    # the region rebuilt from them is still a region, with the counts on it
    opt = rebuilt(b.sr, prof)
    assert sum(bb.count for _, bb in opt.blocks()) == sum(n for n in prof.blocks.values())
    err = sample_error(b.sr, prof, gen.counted_sides)
    assert err["hot_blocks"] > 0 and err["block_count_error"] >= 0
    emitted = emit_region(opt, base)
    assert not any(_is_counter(i) for i in linear(emitted.code[:emitted.data_start], base))
