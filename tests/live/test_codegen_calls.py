"""Real calls in replacement code (``real_calls``): region selection keeps a direct call
that is not inlined when its callee is in the call's own module and is no PLT stub, and
the emitter turns it into ``call rel32`` to the original callee, whose ``ret`` comes
back into the buffer.

Golden bytes of the call (near, and through a far-exit stub), the selection rule on a
fake memory view, and unicorn differential runs of a program assembled at its original
address: hot-code discovery over its sampled trace, the whole region pipeline, emission,
then the replacement code run against the original from the same random states.  End to
end: a program whose hot loop calls a function too large to inline, under ``dbr run``.
"""

from __future__ import annotations

import json
import random
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from codegen_util import CS, linear
from harness import compile_c
from realcall_util import (FAR, LIB, NEAR, NESTED_SRC, ORIG, T, Program, ProgramView, Run,
                           call_block, call_state, loop_with_call, same_run, select_program)
from region_graphs import Builder

from dbr_service.codegen.emit import check_generated, emit_region
from dbr_service.codegen.layout import Layout
from dbr_service.codegen.relocate import call_rel32
from dbr_service.common.errors import CodegenError
from dbr_service.region.inline import real_call_refusal, remove_call_blocks
from dbr_service.region.model import END, BasicBlock, EdgeKind, SuperRegion


# -- golden bytes ---------------------------------------------------------------------------

def _golden(code: bytes, at: int, expected: list[tuple[str, str]]) -> None:
    got = [(i.bytes.hex(), f"{i.mnemonic} {i.op_str}") for i in CS.disasm(code, at)]
    assert got == expected
    assert sum(len(h) // 2 for h, _ in got) == len(code)


def test_golden_call_rel32() -> None:
    assert call_rel32(0x2000, 0x1000) == bytes.fromhex("e8fbefffff")
    _golden(call_rel32(0x2000, 0x1000), 0x2000, [("e8fbefffff", "call 0x1000")])


def test_golden_real_call_in_a_loop() -> None:
    sr = loop_with_call()
    base = 0x50_0000
    gen = emit_region(sr, base, layout=Layout([0x401000, 0x401005, 0x40100A]))
    _golden(gen.code, base, [
        ("b903000000", "mov ecx, 3"),
        ("e8f610f0ff", "call 0x401100"),         # the original callee
        ("ffc9", "dec ecx"),                     # the return address: the continuation
        ("0f85f3ffffff", "jne 0x500005"),
        ("e9f70ff0ff", "jmp 0x40100e"),
    ])
    assert gen.calls == {base + 5: 0x401005}
    assert gen.returns == {base + 10: 0x40100A}
    assert gen.evictions[base + 10] == 0x40100A and gen.orig_of(base + 10) == 0x40100A
    assert gen.transfers[0x401005] == base + 5 and gen.evictions[base + 5] == 0x401005
    assert gen.transfers[0x40100A] == base + 10
    assert (base + 5, 0x401100) in gen.exits         # the region depends on its callee
    check_generated(gen)


def test_golden_real_call_through_a_far_stub_and_exit_to_the_continuation() -> None:
    sr = loop_with_call(cont_in_region=False)
    base = 0x7F00_0000_0000
    gen = emit_region(sr, base, layout=Layout([0x401000, 0x401005]))
    stub = gen.far_exits[0x401100]
    _golden(gen.code[:gen.data_start], base, [
        ("b903000000", "mov ecx, 3"),
        ("e80b000000", "call 0x7f0000000015"),      # the callee's far stub
        ("e900000000", "jmp 0x7f000000000f"),       # exit to the continuation (far too)
        ("ff250b000000", "jmp qword ptr [rip + 0xb]"),
        ("ff250d000000", "jmp qword ptr [rip + 0xd]"),
    ])
    assert stub == base + 0x15 and gen.far_exits[0x40100A] == base + 0xF
    assert struct.unpack_from("<2Q", gen.code, 0x20) == (0x40100A, 0x401100)
    assert struct.unpack_from("<Q", gen.code, stub + 6 + 0xD - base)[0] == 0x401100
    assert gen.calls == {base + 5: 0x401005} and gen.returns == {base + 10: 0x40100A}
    assert gen.orig_of(base + 10) == 0x40100A          # the jump stands for the continuation
    check_generated(gen)


def test_check_generated_allows_calls_only_where_recorded() -> None:
    gen = emit_region(loop_with_call(), 0x50_0000)
    at = next(iter(gen.calls))
    gen.calls.clear()
    with pytest.raises(CodegenError, match="call in replacement code"):
        check_generated(gen)
    gen = emit_region(loop_with_call(), 0x50_0000)
    gen.exits = [(a, 0x401234 if a == at else t) for a, t in gen.exits]   # another target
    with pytest.raises(CodegenError, match="call in replacement code"):
        check_generated(gen)
    gen = emit_region(loop_with_call(), 0x50_0000)
    gen.calls[at + 1] = 0x401005                       # recorded, but no call there
    with pytest.raises(CodegenError, match="real calls recorded"):
        check_generated(gen)


def test_padding_before_the_continuation_is_an_eviction_point() -> None:
    """The continuation aligned after the call: the return address is padding, which
    still maps (and evicts) to the continuation."""
    sr = loop_with_call()
    gen = emit_region(sr, 0x50_0000, layout=Layout([0x401000, 0x401005, 0x40100A],
                                                   aligned={0x40100A}))
    r = 0x50_0000 + 10
    assert gen.block_addr[0x40100A] == 0x50_0010 and gen.returns == {r: 0x40100A}
    assert gen.evictions[r] == 0x40100A and gen.orig_of(r) == 0x40100A
    assert next(CS.disasm(gen.code[10:], r)).mnemonic == "nop"


# -- which calls are kept -------------------------------------------------------------------

@pytest.mark.parametrize("target,why", [("work", None), ("plt_work", "plt-stub"),
                                        ("lib_work", "other-module")])
def test_refusal_by_callee(target: str, why: str | None) -> None:
    p = Program(target)
    bb = BasicBlock(p.call.address, 5, [(p.call.address, 5)], bytes(p.call.bytes), T.CALL,
                    [p.callee], fallthrough=p.cont, module="prog")
    assert real_call_refusal(bb, p.view) == why
    assert real_call_refusal(bb, None) == "no-memory-view"


def test_refusal_by_call_shape() -> None:
    p = Program("work")
    a = p.call.address

    def blk(**kw) -> BasicBlock:
        d = dict(start=a, size=5, insns=[(a, 5)], data=bytes(p.call.bytes), term=T.CALL,
                 targets=[p.callee], fallthrough=p.cont, module="prog")
        d.update(kw)
        return BasicBlock(**d)

    assert real_call_refusal(blk(term=T.ICALL), p.view) == "indirect"
    assert real_call_refusal(blk(fallthrough=None), p.view) == "never-returns"
    assert real_call_refusal(blk(targets=[]), p.view) == "unknown-target"
    assert real_call_refusal(blk(targets=[p.cont]), p.view) == "reads-return-address"
    assert real_call_refusal(blk(targets=[0x9000_0000]), p.view) == "unknown-module"
    assert real_call_refusal(blk(module="other"), p.view) == "other-module"
    # endbr64; bnd jmp [rip+d] (an IBT PLT) and a thunk jumping into the library
    code = bytearray(p.view.image)
    off = p.work - ORIG
    code[off:off + 11] = bytes.fromhex("f30f1efa f2ff2500000000".replace(" ", ""))
    v = ProgramView(bytes(code), p.lib)
    assert real_call_refusal(blk(), v) == "plt-stub"
    code[off:off + 5] = b"\xe9" + struct.pack("<i", LIB - (p.work + 5))
    v = ProgramView(bytes(code), p.lib)
    assert real_call_refusal(blk(), v) == "other-module"
    v.exclude(p.work, 5)                 # another region's patch there: loop code
    assert real_call_refusal(blk(), v) is None


def test_never_returning_call_is_removed_as_before() -> None:
    """A call without fall-through (discovery knew it never returns) exits to original
    code with real calls too."""
    p = Program("work")

    def sr() -> SuperRegion:
        b = Builder("nr")
        b.block(0x400100, (5,), count=10)
        b.block(0x400105, (5,), T.CALL, targets=[p.work], ft=None, count=10)
        b.entry(0x400100, 10)
        b.ft(0x400100, 0x400105, 10)
        b.exit(0x400105, p.work, 10)
        return b.sr

    off, on = sr(), sr()
    remove_call_blocks(off, set())
    remove_call_blocks(on, set(), real_calls=True, mem=p.view)
    assert 0x400105 not in on.g and on.to_dot("x") == off.to_dot("x")
    assert on.info["inline"]["sites"][0x400105]["real_call"] == "never-returns"
    assert on.info["inline"]["sites"][0x400105]["decision"] == "exit"


# -- the pipeline and unicorn ----------------------------------------------------------------

def test_pipeline_keeps_the_loop_with_its_call() -> None:
    p = Program("work")
    [sr] = select_program(p, real_calls=True)
    c = call_block(sr, p)
    assert c is not None
    site = sr.info["inline"]["sites"][c]
    assert site["decision"] == "call" and site["callee"] == p.work
    assert site["reason"] == "budget" and site["return_address"] == p.cont
    assert sr.g.edges[c, END]["call"] == p.work
    assert sr.g.has_edge(c, p.cont) and sr.g.edges[c, p.cont]["kind"] == EdgeKind.FALLTHROUGH
    # no exit at the call, the continuation is no patch point, the outer loop is whole
    assert all(p.call.address not in ex for _, ex in sr.exit_edges())
    assert all(t not in (p.cont, p.call.address) for t in sr.entry_points())
    outer = max(sr.info["loops"].loops(), key=lambda lp: len(lp.blocks))
    assert c in outer.blocks and p.cont in outer.blocks
    # without real calls the call block goes, and with it the outer loop
    off = select_program(p, real_calls=False)
    assert all(call_block(r, p) is None for r in off)
    assert all(c not in r.g for r in off)
    assert max(len(lp.blocks) for r in off for lp in r.info["loops"].loops()) < len(outer.blocks)


@pytest.mark.parametrize("base", [NEAR, FAR], ids=["near", "far"])
def test_real_call_differential(base: int) -> None:
    """The region with its real call runs as the original from random states; each call
    returns into the buffer, right after the call, mapped to the continuation."""
    p = Program("work")
    [sr] = select_program(p, real_calls=True)
    gen = emit_region(sr, base)
    check_generated(gen)
    assert len(gen.calls) == 1 and set(gen.returns.values()) == {p.cont}
    assert p.main in gen.entries
    if base == FAR:
        assert p.work in gen.far_exits
    rng = random.Random(base)
    for i in range(5):
        n = rng.choice([1, 2, 5, rng.randrange(6, 40)])
        st = call_state(rng, n)
        a = Run(p, None, st, p.main, {p.work})
        b = Run(p, gen, st, gen.entries[p.main], {p.work})
        ctx = f"run {i} n={n}"
        same_run(a, b, ctx)
        assert len(b.seen) == len(a.seen) == n
        assert all(r in gen.returns for _, r in b.seen), ctx        # back into the buffer
        assert all(r == p.cont for _, r in a.seen)
        # control left the buffer only for the callee, then at the loop's exit
        assert b.landings[:-1] == [p.work] * n, ctx
        assert b.landings[-1] in p.boundaries and b.landings[-1] > p.cont, ctx
        # evicted at a return address, the thread finishes in original code as the original
        k = rng.randrange(1, n + 1)
        e = Run(p, gen, st, gen.entries[p.main], {p.work}, evict_at=k)
        assert len(e.evicted) == 1 and gen.evictions[e.evicted[0]] == p.cont
        same_run(a, e, ctx + f" evicted at return {k}")


@pytest.mark.parametrize("target,why", [("plt_work", "plt-stub"),
                                        ("lib_work", "other-module")])
def test_call_not_kept_behaves_as_before(target: str, why: str) -> None:
    """A call real_calls may not keep: the same regions and the same bytes as without
    real calls; the call exits to original code and the run matches the original."""
    p = Program(target)
    on, off = select_program(p, real_calls=True), select_program(p, real_calls=False)
    assert [r.to_dot("x") for r in on] == [r.to_dot("x") for r in off] and on
    for r_on, r_off in zip(on, off):
        assert call_block(r_on, p) is None
        g_on, g_off = emit_region(r_on, NEAR), emit_region(r_off, NEAR)
        assert g_on.code == g_off.code and not g_on.calls
        assert g_on.addr_map == g_off.addr_map and g_on.evictions == g_off.evictions
    sites = [s for r in on for s in r.info["inline"]["sites"].values()]
    assert [s.get("real_call") for s in sites if s["call_insn"] == p.call.address] == [why]
    gen = emit_region(on[0], NEAR)
    rng = random.Random(3)
    for i in range(3):
        st = call_state(rng, rng.randrange(1, 20))
        a = Run(p, None, st, p.main, set())
        image = bytearray(p.image)
        for site, to in gen.entries.items():
            image[site - ORIG:site - ORIG + 5] = b"\xe9" + struct.pack("<i", to - (site + 5))
        b = Run(p, gen, st, p.main, set(), bytes(image))
        same_run(a, b, f"{target} run {i}")
        assert b.buffer_steps > 0 and p.call.address in b.landings


def test_real_call_inside_an_inlined_clone() -> None:
    """``work`` inlined into the loop; its cold call to ``leaf`` stays a real call in the
    clone: ``leaf`` returns into the buffer, the stack above holds the original return
    address the inlined call pushed, and the run matches the original."""
    p = Program("work", NESTED_SRC)
    leaf = next(i.address for i in linear(p.code, p.main) if i.mnemonic == "imul")
    regions = select_program(p, real_calls=True, hot_threshold=8.0, inline_budget=4.0)
    [sr] = [r for r in regions if any(bb.is_clone for _, bb in r.blocks())]
    kept = [(k, s) for k, s in sr.info["inline"]["sites"].items() if s["decision"] == "call"]
    assert [(type(k).__name__, s["callee"]) for k, s in kept] == [("CloneKey", leaf)]
    assert sr.info["inline"]["sites"][p.call.address]["decision"] == "inlined"
    gen = emit_region(sr, NEAR)
    check_generated(gen)
    assert len(gen.calls) == 1
    rng = random.Random(11)
    for i in range(4):
        n = rng.randrange(9, 40)
        st = call_state(rng, n)
        a = Run(p, None, st, p.main, {leaf})
        b = Run(p, gen, st, gen.entries[p.main], {leaf})
        same_run(a, b, f"run {i} n={n}")
        assert len(b.seen) == len(a.seen) == (n + 7) // 8
        assert all(r in gen.returns for _, r in b.seen)
        # above leaf's return address: the one the inlined call pushed, as in the original
        for (slot, _), (oslot, _) in zip(b.seen, a.seen):
            assert slot == oslot
        assert all(gen.evictions[r] == gen.returns[r] for _, r in b.seen)


# -- end to end ------------------------------------------------------------------------------

E2E = Path(__file__).resolve().parent.parent / "e2e_progs"


def _dbr_run(exe: Path, args: list[str], real_calls: bool, report: Path):
    run = subprocess.run([sys.executable, "-m", "dbr_service.commands.cli", "run", "--embedded",
                          "--aggressive", "-o", f"real_calls={str(real_calls).lower()}",
                          "--report", str(report), "--", str(exe), *args],
                         capture_output=True, timeout=300)
    [client] = [c for c in json.loads(report.read_text())["clients"] if c["exe"] == str(exe)]
    foreign = int(re.search(rb"foreign-returns (\d+)", run.stderr).group(1))
    return run, client, foreign


def test_e2e_loop_keeps_its_call(tmp_path) -> None:
    """realcall.c: the loop's callee is too large to inline.  Output as native either way;
    with real_calls the loop's region goes live and the callee sees return addresses
    outside the executable (calls from replacement code), without it never.  The shares
    of samples in replacement code are printed, not asserted (timing)."""
    exe = compile_c([E2E / "realcall.c"], flags=["-O2", "-s"], out_name="realcall-O2")
    args = ["200"]
    native = subprocess.run([str(exe), *args], capture_output=True, timeout=300)
    assert native.returncode == 0 and b"foreign-returns 0" in native.stderr
    shares = {}
    for real in (False, True):
        run, c, foreign = _dbr_run(exe, args, real, tmp_path / f"r-{real}.json")
        assert run.returncode == 0, run.stderr.decode()[-2000:]
        assert run.stdout == native.stdout, "output differs from the native run"
        after, inside = c["samples_after_first_patch"], c["samples_in_replacement"]
        shares[real] = (inside, after, c["regions_went_live"], foreign)
        if real:
            assert c["regions_went_live"] >= 1, (c["region_status"], c["regions"])
            assert foreign > 0, "no call returned into replacement code"
        else:
            assert foreign == 0
    print("real_calls off/on: (samples in replacement, after first patch, regions live, "
          f"calls from replacement code) {shares[False]} / {shares[True]}")
