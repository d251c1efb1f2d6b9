"""Unwind information for regions with real calls (codegen/frames.py and
optimize.emit_with_frames).

The region is selected from a real -O2 program (tests/e2e_progs/cfithrow.cpp: a loop
that calls a function too large to inline, kept as a real call) by the region pipeline
over an IP profile of the loop, and emitted near and far (far-exit stubs) from the
code.  Every piece of its code (the address map: each original instruction's
translation, the jumps that leave or continue, padding) must evaluate, in the blob
parsed back as libgcc would, to the row the original function has at the original
instruction; the byte before each return address (where an unwinder looks) too.
A region whose CFI cannot be made is emitted again without its real calls.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from dbr_service.codegen.cfi import CfiError, evaluate, load_eh_frame, parse_eh_frame
from dbr_service.codegen.emit import check_generated, emit_region
from dbr_service.codegen.frames import CfiSource, Module, records_len, region_blobs
from dbr_service.installation.optimize import emit_with_frames
from dbr_service.region.discovery import hot_code_discovery
from dbr_service.region.memview import ElfMemoryView
from dbr_service.region.pipeline import RegionConfig, run_pipeline
from codegen_util import CS
from harness import compile_c, symbols

E2E = Path(__file__).resolve().parent.parent / "e2e_progs"
NEAR, FAR = 0x4000_0000, 0x10_0000_0000
CFG = dict(hot_threshold=2.0, min_loop_trip_count=4, min_region_size=8, inline_budget=0.0,
           inline_min_budget_bytes=0, fail_fast=True)


@pytest.fixture(scope="module")
def prog():
    """The program (unstripped, position-independent: link addresses, bias 0 here) and
    the one region selected from its hot loop."""
    exe = compile_c([E2E / "cfithrow.cpp"], flags=["-O2"], cc="g++", out_name="cfithrow-O2-full")
    syms = symbols(exe)
    lo, hi = next(v for k, v in syms.items() if "3hot" in k)
    view = ElfMemoryView(str(exe))
    insns = list(CS.disasm(view.read(lo, hi - lo), lo))
    back = next(i for i in insns if i.mnemonic.startswith("j") and i.operands[0].type == 2
                and i.operands[0].imm < i.address)
    head = back.operands[0].imm
    samples = {i.address: 1000.0 if head <= i.address <= back.address else 1.0 for i in insns}
    first = hot_code_discovery(samples, view, jumps_from_hot_limit=2)
    [sr] = run_pipeline(first, view, RegionConfig(real_calls=True, **CFG)).regions
    eh = load_eh_frame(str(exe))
    return SimpleNamespace(exe=exe, sr=sr, eh=eh, hot=(lo, hi),
                           module_at=lambda a: Module(str(exe), 0, eh))


def _row(table, addr):
    r = table.row_at(addr)
    assert r is not None, hex(addr)
    return r.state()


@pytest.mark.parametrize("base", [NEAR, FAR], ids=["near", "far"])
def test_blob_rows_are_the_originals_at_every_piece(prog, base):
    gen = emit_region(prog.sr, base)
    check_generated(gen)
    assert gen.calls, "the loop's call was not kept as a real call"
    assert bool(gen.far_exits) == (base == FAR)
    blobs = region_blobs(gen.addr_map, base + gen.size, prog.module_at,
                         skip=gen.far_exits.values())
    assert blobs and all(b.at % 8 == 0 and b.at >= base + gen.size for b in blobs)
    assert all(x.at + len(x.data) <= y.at for x, y in zip(blobs, blobs[1:]))
    tables = []
    for b in blobs:
        # what FRAMES_ADD names: the records, ending with the terminator
        n = records_len(b.data)
        assert b.data[n - 4:n] == b"\0\0\0\0"
        tables += [evaluate(f) for f in parse_eh_frame(b.data[:n], b.at,
                                                        stop_at_terminator=True).fdes]

    def blob_row(addr):
        [t] = [t for t in tables if t.fde.start <= addr < t.fde.end]
        return _row(t, addr)

    far = set(gen.far_exits.values())
    checked = 0
    for lo, hi, orig in gen.addr_map:
        if lo in far:
            assert not any(t.fde.start <= lo < t.fde.end for t in tables)
            continue
        want = _row(evaluate(prog.eh.find(orig)), orig)
        for a in (lo, hi - 1):
            assert blob_row(a) == want, (hex(a), hex(orig))
        checked += 1
    for call, orig_call in gen.calls.items():
        ret = call + 5
        assert blob_row(ret - 1) == _row(evaluate(prog.eh.find(orig_call)), orig_call)
        assert gen.returns[ret] == orig_call + 5
    # data after the code (far-exit slots, return-address slots) has no rows
    assert checked == len(gen.addr_map) - len(far)


def _installer(cfi, frames=True):
    return SimpleNamespace(cfi=cfi, frames_enabled=frames)


def test_emit_with_frames_keeps_real_calls_only_with_cfi(prog):
    good = SimpleNamespace(module_at=prog.module_at)
    gen, blobs, why = emit_with_frames(_installer(good), prog.sr, NEAR)
    assert gen.calls and blobs and why is None

    def nothing(addr):
        raise CfiError(f"{addr:#x} is in no module file")

    for inst, said in ((_installer(SimpleNamespace(module_at=nothing)), "no module file"),
                       (_installer(good, frames=False), "FRAMES_ADD"),
                       (_installer(None), "FRAMES_ADD")):
        gen, blobs, why = emit_with_frames(inst, prog.sr, NEAR)
        assert not gen.calls and not gen.returns and not blobs and said in why
        check_generated(gen)


def test_module_without_an_fde_for_the_code_refuses(prog):
    empty = parse_eh_frame(b"", 0)
    gen = emit_region(prog.sr, NEAR)
    with pytest.raises(CfiError, match="no FDE"):
        region_blobs(gen.addr_map, NEAR + gen.size, lambda a: Module("x", 0, empty))


def test_cfi_source_finds_modules_and_biases(prog, tmp_path):
    """A PIE mapped at 0x5555_0000_0000: bias = its lowest mapping (first PT_LOAD at 0)."""
    import os

    base = 0x5555_0000_0000
    st = os.stat(prog.exe)
    dev = (os.major(st.st_dev), os.minor(st.st_dev))
    maps = [(base, base + 0x1000, str(prog.exe), dev, st.st_ino),
            (base + 0x1000, base + 0x3000, str(prog.exe), dev, st.st_ino),
            (0x7000_0000_0000, 0x7000_0001_0000, "[heap]", (0, 0), 0)]
    src = CfiSource(lambda: maps)
    lo, _ = prog.hot
    m = src.module_at(base + lo)
    assert (m.path, m.bias) == (str(prog.exe), base)
    assert m.eh.find(lo).start == prog.eh.find(lo).start
    with pytest.raises(CfiError, match="no module file"):
        src.module_at(0x7000_0000_0100)
    # another file than the one the client mapped (another mount namespace)
    maps[:2] = [(a, b, p, d, ino + 1) for a, b, p, d, ino in maps[:2]]
    src.refresh()
    with pytest.raises(CfiError, match="not the file the client mapped"):
        src.module_at(base + lo)


def test_dbr_ctl_regions_shows_real_calls_and_cfi_refusals():
    from dbr_service.commands.cmd_ctl import render

    out = render("regions", {"pid": 7, "status": "2 region(s) selected", "regions": [
        {"id": "r1", "state": "installed", "blocks": 3, "code_bytes": 90, "entries": [0x1000],
         "module": "/bin/x", "info": {"real_calls": 2, "frames": 1}},
        {"id": "r2", "state": "installed", "blocks": 2, "code_bytes": 40, "entries": [0x2000],
         "module": "/bin/x", "info": {"real_calls": 0, "cfi_refused": "no FDE covers 0x2000"}}]})
    lines = out.splitlines()
    assert "1 region(s) without their real calls (no CFI)" in lines[0]
    assert "CALLS" in lines[1] and " 2 " in lines[2] and "0 (no CFI)" in lines[3]
