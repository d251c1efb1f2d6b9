"""Call-stack samples: the perf record parser, the unwinder on real samples of programs
built with and without frame pointers, replacement code folded to original addresses,
the call graph fed to function ordering."""

from __future__ import annotations

import dataclasses
import struct
import subprocess
from pathlib import Path

import pytest

from harness import compile_c, terminate

from dbr_service.common.clientfiles import ProcHandle
from dbr_service.codegen.cfi import evaluate
from dbr_service.codegen.frames import CfiSource
from dbr_service.common.procmaps import read_maps
from dbr_service.sampling.perf import probe_event
from dbr_service.sampling.perf_abi import EVENTS, PERF_RECORD_SAMPLE
from dbr_service.sampling.stacks import StackSample, StackSampler, parse_stack_records
from dbr_service.stacks.stackprof import CallGraph, Func, StackProfile, collect, parse_folded
from dbr_service.stacks.unwind import Unwinder, cfa_expression

PROG = Path(__file__).resolve().parent.parent / "sampling_progs" / "callpath.c"
PATH_A = ("main", "path_a", "leaf_work")
PATH_B = ("main", "path_b", "vla_frame", "leaf_work")

perf_ok, perf_why = probe_event(EVENTS["cpu-clock"])
needs_perf = pytest.mark.skipif(not perf_ok, reason=f"no perf sampling here: {perf_why}")


def _record(ip, pid, tid, chain, regs, stack, *, size_override=None):
    body = struct.pack("<QIIQ", ip, pid, tid, 123)
    body += struct.pack("<Q", len(chain) + 1) + struct.pack("<Q", (1 << 64) - 512)
    body += b"".join(struct.pack("<Q", a) for a in chain)
    body += struct.pack("<Q", 2) + struct.pack("<QQQ", *regs)
    body += struct.pack("<Q", len(stack)) + stack + struct.pack("<Q", len(stack))
    size = size_override or 8 + len(body)
    return struct.pack("<IHH", PERF_RECORD_SAMPLE, 0, size) + body


def test_parse_record():
    stack = bytes(range(64))
    rec = _record(0x401000, 7, 8, [0x401000, 0x402000], (0x7ff0, 0x7fe0, 0x401000), stack)
    res = parse_stack_records(rec + rec)
    assert res.bad_records == 0 and len(res.samples) == 2
    s = res.samples[0]
    assert (s.pid, s.tid, s.ip, s.bp, s.sp) == (7, 8, 0x401000, 0x7ff0, 0x7fe0)
    assert s.chain == (0x401000, 0x402000)        # the context marker is dropped
    assert s.stack == stack


def test_parse_record_overrun_is_counted():
    rec = _record(1, 1, 1, [1] * 4, (0, 0, 1), b"x" * 64)
    bad = rec[:8] + rec[8:40] + b"\0" * 8          # a call chain longer than its record
    bad = struct.pack("<IHH", PERF_RECORD_SAMPLE, 0, len(bad)) + bad[8:]
    res = parse_stack_records(bad + rec)
    assert res.bad_records == 1 and len(res.samples) == 1


def test_plt_cfa_expression():
    # .plt's rule: rsp + 8 + (((rip & 15) >= 11) << 3)
    expr = bytes([0x77, 0x08, 0x80, 0x00, 0x3F, 0x1A, 0x3B, 0x2A, 0x33, 0x24, 0x22])
    assert cfa_expression(expr, {7: 0x1000, 16: 0x4010}) == 0x1008
    assert cfa_expression(expr, {7: 0x1000, 16: 0x401B}) == 0x1010
    assert cfa_expression(expr, {7: 0x1000}) is None             # rip unknown
    assert cfa_expression(b"\x96", {7: 0x1000}) is None          # DW_OP_nop: unknown here


@pytest.fixture(scope="module", params=["-fomit-frame-pointer", "-fno-omit-frame-pointer"])
def callpath(request):
    exe = compile_c([PROG], flags=[request.param], out_name=f"callpath{request.param}")
    proc = subprocess.Popen([str(exe)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        yield request.param, proc.pid
    finally:
        terminate(proc.pid)
        proc.wait(5)


def _share(folded, path):
    """Share of samples whose stack contains ``path`` as consecutive frames ending at
    the innermost one."""
    n = sum(c for s, c in folded.items() if s[-len(path):] == path)
    return n / max(1, sum(folded.values()))


@needs_perf
def test_known_call_paths_appear(callpath):
    flags, pid = callpath
    prof, stats = collect(ProcHandle(pid), pid, 1.0)
    assert prof.samples >= 50, stats
    folded = parse_folded(prof.folded_lines())
    a, b = _share(folded, PATH_A), _share(folded, PATH_B)
    # the loop spends nearly all its time in leaf_work, half from each path
    assert a > 0.25 and b > 0.25 and a + b > 0.85, (flags, prof.folded_lines())
    assert prof.truncated <= 0.05 * prof.samples, prof.folded_lines()
    # complete stacks start at _start (the outermost frame)
    assert all(s[0] == "_start" for s in folded if "leaf_work" in s)


def _sampled(pid: int, rounds: int, enough: int | None = None) -> list[StackSample]:
    """Call-stack samples of ``pid`` over ``rounds`` pauses of 20 ms (fewer once
    ``enough`` are in)."""
    sampler = StackSampler(pid)
    samples: list[StackSample] = []
    try:
        sampler.add([pid])
        for _ in range(rounds):
            subprocess.run(["sleep", "0.02"])
            samples += sampler.read()
            if enough is not None and len(samples) > enough:
                break
    finally:
        sampler.close()
    return samples


@needs_perf
def test_cfi_preferred_over_frame_pointers(callpath):
    """With frame pointers the kernel's chain and the CFI walk agree; without them the
    chain loses the callers that the CFI walk finds."""
    flags, pid = callpath
    maps = read_maps(pid)
    cfi = CfiSource(lambda: [(m.lo, m.hi, m.path, m.dev, m.ino) for m in maps])
    unwinder = Unwinder(cfi.module_at)
    samples = _sampled(pid, 40)
    assert len(samples) >= 50
    agree = 0
    for s in samples:
        u = unwinder.unwind(s)
        kernel = tuple(s.chain[:1]) + tuple(a - 1 for a in s.chain[1:])
        # the innermost three frames (the IP, its caller, theirs) found by both
        agree += len(kernel) >= 3 and kernel[:3] == u.frames[:3]
    share = agree / len(samples)
    if flags == "-fno-omit-frame-pointer":
        assert share > 0.9, share
    else:
        assert share < 0.2, share
    mod = cfi.module_at(samples[0].ip)
    assert unwinder.keeps_frame_pointers(mod) == (flags == "-fno-omit-frame-pointer")


@needs_perf
def test_replacement_code_folds_to_original(callpath):
    """A sample whose IP and return addresses are in (fake) replacement code unwinds
    to the same original frames as the sample itself."""
    _flags, pid = callpath
    maps = read_maps(pid)
    cfi = CfiSource(lambda: [(m.lo, m.hi, m.path, m.dev, m.ino) for m in maps])
    plain = Unwinder(cfi.module_at)
    samples = _sampled(pid, 50, enough=20)
    exe = next(m for m in maps if m.path.endswith(f"callpath{_flags}") or "callpath" in m.path)
    lo, hi = exe.lo, max(m.hi for m in maps if m.path == exe.path)
    delta = 1 << 40                                  # the "code buffer" is lo+delta...

    def attribute(a: int) -> int:
        return a - delta if lo + delta <= a < hi + delta else a

    moved = Unwinder(cfi.module_at, attribute)
    checked = 0
    for s in samples:
        want = plain.unwind(s)
        if want.truncated or not lo <= s.ip < hi:
            continue
        stack = bytearray(s.stack)
        for off in range(0, len(stack) - 7, 8):      # return addresses into the program
            (w,) = struct.unpack_from("<Q", stack, off)
            if lo <= w < hi:
                struct.pack_into("<Q", stack, off, w + delta)
        fake = dataclasses.replace(s, ip=s.ip + delta, stack=bytes(stack), chain=())
        assert moved.unwind(fake).frames == want.frames
        checked += 1
    assert checked >= 5


@needs_perf
def test_a_sample_inside_a_dispatch_unwinds_with_rsp_set_back(callpath):
    """A sampled IP inside a translation that stepped over the red zone and saved two
    registers (rsp 0x90 below the original's): with ``sp_offset`` it unwinds to the
    original sample's frames; applying the original row to the moved rsp would read
    the saved registers as the return address."""
    flags, pid = callpath
    maps = read_maps(pid)
    cfi = CfiSource(lambda: [(m.lo, m.hi, m.path, m.dev, m.ino) for m in maps])
    plain = Unwinder(cfi.module_at)
    samples = _sampled(pid, 50, enough=20)
    exe = next(m for m in maps if "callpath" in m.path)
    lo, hi = exe.lo, max(m.hi for m in maps if m.path == exe.path)
    delta = 1 << 40

    def attribute(a: int) -> int:
        return a - delta if lo + delta <= a < hi + delta else a

    def sp_offset(a: int) -> int | None:
        return -0x90 if lo + delta <= a < hi + delta else 0

    moved = Unwinder(cfi.module_at, attribute, sp_offset=sp_offset)
    blind = Unwinder(cfi.module_at, attribute)
    checked = by_rsp = wrong = 0
    for s in samples:
        want = plain.unwind(s)
        if want.truncated or not lo <= s.ip < hi:
            continue
        saved = struct.pack("<2Q", 0x1c00000040, hi - 1) + bytes(0x80)   # rax, rcx, red zone
        fake = dataclasses.replace(s, ip=s.ip + delta, sp=s.sp - 0x90, stack=saved + s.stack,
                                   chain=())
        assert moved.unwind(fake).frames == want.frames
        # where the IP's CFA is rsp's (rbp's with frame pointers: rsp is not read there),
        # the row applied to the moved rsp reads a saved register as the return address
        # (or, in a frame over 0x90 bytes, a stale slot of its own: rarely the right one)
        mod = cfi.module_at(s.ip)
        row = evaluate(mod.eh.find(s.ip - mod.bias)).row_at(s.ip - mod.bias)
        if row.cfa.expr is None and row.cfa.reg == 7:
            by_rsp += 1
            wrong += blind.unwind(fake).frames != want.frames
        checked += 1
    assert checked >= 5
    assert wrong >= 0.8 * by_rsp, (wrong, by_rsp)
    if flags != "-fno-omit-frame-pointer":
        assert by_rsp >= checked // 2, (by_rsp, checked)


def test_call_graph_counts_and_order():
    f = {n: Func("/bin/x", i * 0x100, 0x40, n)
         for i, n in enumerate(["main", "a", "b", "leaf", "cold"])}
    g = CallGraph()
    for _ in range(30):
        g.add([f["leaf"], f["a"], f["main"]])
    for _ in range(10):
        g.add([f["leaf"], f["b"], f["main"]])
    g.add([f["leaf"], f["leaf"], f["a"], f["main"]])        # recursion counts no call
    key = {n: (x.module, x.start) for n, x in f.items()}
    assert g.calls[(key["a"], key["leaf"])] == 31
    assert g.calls[(key["b"], key["leaf"])] == 10
    assert (key["leaf"], key["leaf"]) not in g.calls
    assert g.samples[key["leaf"]] == 41
    order = [g.funcs[k].name for k in g.order().order]
    # C3: leaf follows its most frequent caller a
    assert order.index("leaf") == order.index("a") + 1
    assert g.top_calls(1) == [{"caller": "a", "callee": "leaf", "count": 31}]


def test_profile_folds_and_bounds():
    prof = StackProfile()
    main, leaf = Func("/x", 0, 1, "main"), Func("/x", 16, 1, "leaf")
    prof.add([leaf, main], False, "cfi")
    prof.add([leaf, main], False, "cfi")
    prof.add([leaf], True, "cfi")
    assert sorted(prof.folded_lines()) == ["[truncated];leaf 1", "main;leaf 2"]
    assert parse_folded(prof.folded_lines() + ["garbage", "x y"]) == {
        ("main", "leaf"): 2, ("[truncated]", "leaf"): 1}
