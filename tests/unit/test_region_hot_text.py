"""Whole-program hot text (``hot_text``): discovery starts at the entries of the
functions holding samples, every function entry original code still reaches is
patched, a function is judged by all its samples, the hottest are kept up to a byte
budget; entry sites are refused where any direct branch of the module may land in
bytes 1..4 (region/branchindex.py).

``tests/region_progs/hottext.c`` calls two functions only through a table of
pointers (no direct call names their entries) and has two functions whose bytes 1..4
a jump elsewhere targets (rel32 and rel8)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from dbr_service.common.config import Config
from dbr_service.commands.report import run_report
from dbr_service.region.analyze import function_entries
from dbr_service.region.branchindex import BranchIndex, BranchIndexError, exec_segments, index_of
from dbr_service.region.memview import ElfMemoryView
from dbr_service.region.pipeline import RegionConfig, select_regions
from dbr_service.region.worker import region_config
from harness import compile_c, symbols

SRC = Path(__file__).resolve().parent.parent / "region_progs" / "hottext.c"


@pytest.fixture(scope="module")
def exe() -> Path:
    return compile_c([SRC], flags=["-O2", "-no-pie", "-fno-pie"], out_name="hottext")


def _insns(exe: Path, lo: int, hi: int) -> list[int]:
    dis = subprocess.run(["objdump", "-d", f"--start-address={lo:#x}",
                          f"--stop-address={hi:#x}", str(exe)],
                         capture_output=True, text=True, check=True).stdout
    # "  401358:\t00 " continues a long instruction's bytes: no mnemonic, no start
    return [int(ln.split(":")[0], 16) for ln in dis.splitlines()
            if ln.startswith("  ") and len(ln.split("\t")) >= 3 and "nop" not in ln]


def test_the_program_runs(exe):
    r = subprocess.run([str(exe), "1000"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and r.stdout.strip().isdigit()


# ---- the branch index ------------------------------------------------------------------
def test_jumps_into_bytes_1_to_4_are_found_rel32_and_rel8(exe):
    syms = symbols(exe)
    ix = index_of(str(exe))
    for name in ("into", "into8"):          # jumper: e9 rel32; jumper8: eb rel8
        lo = syms[name][0]
        assert ix.may_branch_into(lo + 1, lo + 5), name
    for name in ("mixa", "mixb"):           # reached only through the pointer table
        lo = syms[name][0]
        assert not ix.may_branch_into(lo + 1, lo + 5), name


def test_backward_and_forward_short_branches():
    # a segment at 0x1000: eb fe at 0x1000 (to itself), 75 02 at 0x1002 (to 0x1006),
    # then nops; 74 f0 at 0x1090 jumps back to 0x1082
    text = bytearray(b"\x90" * 0x100)
    text[0:2] = b"\xeb\xfe"
    text[2:4] = b"\x75\x02"
    text[0x90:0x92] = b"\x74\xf0"
    ix = BranchIndex.__new__(BranchIndex)
    ix._segs = [(0x1000, bytes(text))]
    ix._targets = []
    assert ix.may_branch_into(0x1005, 0x1009)          # 0x1006, forward
    assert ix.may_branch_into(0x1081, 0x1085)          # 0x1082, backward
    assert not ix.may_branch_into(0x1040, 0x1044)


def test_a_file_that_is_no_elf_a_symlink_or_a_fifo_is_refused(tmp_path, exe):
    junk = tmp_path / "junk"
    junk.write_bytes(b"not an ELF file" * 10)
    with pytest.raises(BranchIndexError, match="not an ELF64"):
        index_of(str(junk))
    link = tmp_path / "link"
    os.symlink(exe, link)
    with pytest.raises(BranchIndexError):
        index_of(str(link))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(BranchIndexError, match="not a regular file"):
        index_of(str(fifo))                 # neither blocks nor reads
    with pytest.raises(BranchIndexError):
        exec_segments(b"\x7fELF" + b"\x02\x01" + b"\x00" * 26 + (1 << 40).to_bytes(8, "little")
                      + b"\x00" * 14 + b"\x38\x00\x05\x00" + b"\x00" * 6)


def test_function_entries_answer_starts_and_branches(exe):
    syms = symbols(exe)
    fe = function_entries(ElfMemoryView(str(exe)))
    lo, hi = syms["mixa"]
    assert fe.function_start(lo + 7) == lo and fe.function_start(hi - 1) == lo
    assert fe.may_branch_into(syms["into"][0] + 1, syms["into"][0] + 5)
    assert not fe.may_branch_into(lo + 1, lo + 5)
    seeds = fe.count_samples({lo + 7: 3, lo + 9: 2, syms["mixb"][0] + 6: 1}, seed_min=2)
    assert seeds == [lo]                                   # mixb's IP is below seed_min
    assert fe.samples == {lo: 5, syms["mixb"][0]: 1}


# ---- selection -------------------------------------------------------------------------
def _profile(exe: Path) -> dict[int, int]:
    """Samples on every instruction of mixa (40 each), mixb (20), into (30) and drive
    (10) but their first ones: a flat profile with no sample at an entry."""
    syms = symbols(exe)
    out = {}
    for name, n in (("mixa", 40), ("mixb", 20), ("into", 30), ("drive", 10)):
        lo, hi = syms[name]
        for a in _insns(exe, lo, hi)[1:]:
            out[a] = n
    return out


def _select(exe: Path, **kw):
    mem = ElfMemoryView(str(exe))
    cfg = RegionConfig(jumps_from_hot_limit=4, hot_threshold=1e9, min_loop_trip_count=16,
                       function_threshold=50.0, min_region_size=5, real_calls=True,
                       entry_sites=True, **kw)
    return select_regions(_profile(exe), mem, cfg, functions=function_entries(mem))


def _hot(res) -> dict[int, int]:
    """Hot functions kept: entry point -> body bytes."""
    return {p: sum(bb.size for _, bb in sr.blocks())
            for sr in res.regions if sr.info.get("hot_function") for p in sr.entry_points()}


def test_functions_called_through_pointers_are_entered_at_their_entries(exe):
    syms = symbols(exe)
    res = _select(exe, hot_text=True)
    hot = _hot(res)
    assert syms["mixa"][0] in hot and syms["mixb"][0] in hot, (hot, res.counters)
    for sr in res.regions:                 # entries counted where they are patched
        if sr.info.get("hot_function"):
            assert sr.info["functions"] == len(set(sr.entry_points()) & set(
                a for a, _ in syms.values()))
    # into's first bytes are a jump target elsewhere: no entry site, so no hot function
    assert syms["into"][0] not in hot
    # without hot text discovery never decodes their entries: no hot function at all
    assert _hot(_select(exe)) == {}


def test_the_byte_budget_keeps_the_hottest(exe):
    syms = symbols(exe)
    full = _select(exe, hot_text=True)
    hot = _hot(full)
    a = syms["mixa"][0]                     # the most samples of all
    assert len(hot) >= 3
    res = _select(exe, hot_text=True, hot_text_max_bytes=hot[a])
    assert list(_hot(res)) == [a], _hot(res)
    assert res.counters["prune-code"]["dropped-over-hot-text-budget"] == len(hot) - 1
    assert _hot(_select(exe, hot_text=True, hot_text_max_bytes=sum(hot.values()))) == hot


def test_region_config_under_hot_text():
    cfg = Config().replace_value("hot_text", "true")
    rc = region_config(cfg, 10_000)
    assert rc.hot_text and rc.entry_sites
    assert rc.function_threshold == pytest.approx(10_000 * Config().hot_text_min_share)
    assert rc.hot_text_max_bytes == Config().hot_text_max_bytes
    off = region_config(Config(), 10_000)
    assert not off.hot_text and not off.entry_sites
    assert off.function_threshold == pytest.approx(10_000 * Config().hot_function_threshold)


def test_report_counts_functions_of_live_regions_once():
    regions = [{"state": "installed", "info": {"install_id": 1, "functions": 2,
                                               "function_starts": [0x10, 0x20, 0x30]}},
               {"state": "installed", "info": {"install_id": 2, "functions": 1,
                                               "function_starts": [0x30, 0x40]}},
               {"state": "selected", "info": {"functions": 5, "function_starts": [0x50]}}]
    client = {"samples": 1, "samples_in_replacement": 0, "patches_installed": 3,
              "regions": regions}
    t = run_report([], 0, 1.0, [client])["totals"]
    assert t["function_entries_went_live"] == 3 and t["functions_copied"] == 4


def test_code_after_a_call_that_leaves_the_copy_is_patched_too(exe):
    """drive calls through the table: the call leaves its copy (the callee is unknown)
    and returns to original code; with hot text that return site is patched as well,
    so the rest of drive runs in the copy."""
    syms = symbols(exe)
    lo, hi = syms["drive"]
    call = next(a for a, n in _calls(exe, lo, hi))
    hot = _hot(_select(exe, hot_text=True))
    assert lo in hot
    after = [p for p in hot if call < p < hi]
    assert after, ([hex(p) for p in hot], hex(call))
    # without hot text neither drive's entry nor the code after its call is a region
    assert not [p for p in _hot(_select(exe)) if lo <= p < hi]


def _calls(exe: Path, lo: int, hi: int) -> list[tuple[int, str]]:
    dis = subprocess.run(["objdump", "-d", f"--start-address={lo:#x}",
                          f"--stop-address={hi:#x}", str(exe)],
                         capture_output=True, text=True, check=True).stdout
    return [(int(ln.split(":")[0], 16), ln.split("\t")[2]) for ln in dis.splitlines()
            if ln.startswith("  ") and len(ln.split("\t")) >= 3 and "call" in ln.split("\t")[2]]


def test_analyze_with_hot_text_patches_a_pointer_called_function_at_its_entry(exe, tmp_path):
    """`dbr analyze -o hot_text=true` selects as the service does: samples on every
    instruction of mixa but its first make one region entered at mixa's first byte
    (an entry site: its first instruction is shorter than 5 bytes), though no direct
    call names it and a sampled IP lies inside its first 5 bytes."""
    import sys

    lo, hi = symbols(exe)["mixa"]
    insns = _insns(exe, lo, hi)
    assert insns[1] - lo < 5, "mixa's first instruction is shorter than 5 bytes"
    samples = tmp_path / "s.txt"
    samples.write_text("".join(f"{a:#x} 40\n" for a in insns[1:]))
    cmd = [sys.executable, "-m", "dbr_service.commands.cli", "analyze", str(exe),
           "--samples", str(samples), "-o", "function_threshold=10", "-o",
           "hot_threshold=1e9"]
    on = subprocess.run(cmd + ["-o", "hot_text=true"], capture_output=True, text=True,
                        timeout=120)
    assert on.returncode == 0, on.stderr
    assert f"entries [{lo:#x} (mixa)]" in on.stdout, on.stdout
    off = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert off.returncode == 0, off.stderr
    assert f"{lo:#x} (mixa)]" not in off.stdout, off.stdout
