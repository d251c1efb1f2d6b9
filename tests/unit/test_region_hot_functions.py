"""Hot functions in PRUNE-CODE (region/prune.py): in a flat profile a function patched
at its entry is kept without a hot loop when its blocks hold ``function_threshold``
samples; its cold tails are judged against its own hottest block, not the client's
``hot_threshold``."""

from __future__ import annotations

from collections import Counter

from dbr_service.region.model import END
from dbr_service.region.patchpoints import check_entry_invariant, select_patch_points
from dbr_service.region.prune import prune_code
from region_graphs import T, Builder

F = 0x1000


def loopless(samples=(30.0, 20.0, 0.0), counts=(3.0, 2.0, 0.0)) -> Builder:
    """f at F: push rbp; mov rbp,rsp; sub rsp,16 (an entry site), a hot block ending
    in ret, and a rare block that leaves the function (a cold tail); no loop."""
    b = Builder()
    b.block(F, (1, 3, 4), T.JCC, targets=[F + 0x40], count=counts[0], samples=samples[0])
    b.block(F + 8, (3, 5, 2), T.RET, count=counts[1], samples=samples[1])
    b.block(F + 0x40, (5, 5), T.JMP, targets=[0x9100], count=counts[2], samples=samples[2])
    b.ft(F, F + 8, counts[1])
    b.flow(F, F + 0x40, counts[2])
    b.exit(F + 0x40, 0x9100, counts[2])
    b.exit(F + 8, 0x9000, counts[1])
    b.entry(F, counts[0])
    b.sr.info["function_entries"] = {F}
    return b


def prune(b: Builder, function_threshold, hot_threshold=10.0, c=None):
    assert select_patch_points(b.sr, c)
    check_entry_invariant(b.sr)
    return prune_code(b.sr, hot_threshold=hot_threshold, min_loop_trip_count=4,
                      min_region_size=5, counters=c, function_threshold=function_threshold)


def test_a_hot_function_is_kept_with_its_cold_block_left_as_an_exit():
    c = Counter()
    [kept] = prune(loopless(), function_threshold=40.0, c=c)
    kept.verify()
    assert kept.info["hot_function"] and kept.entry_points() == [F]
    assert sorted(kept.body_nodes()) == [F, F + 8]               # the rare block went
    assert F + 0x40 in kept.g.edges[F, END]["exits"]             # ... as an exit
    assert c["kept-hot-functions"] == 1 and c["dropped-no-hot-loop"] == 0


def test_below_the_function_threshold_or_without_it_loops_rule():
    c = Counter()
    assert prune(loopless(), function_threshold=51.0, hot_threshold=1.0, c=c) == []
    assert prune(loopless(), function_threshold=None, hot_threshold=1.0, c=c) == []
    assert c["dropped-no-hot-loop"] == 2 and c["kept-hot-functions"] == 0


def test_a_function_not_patched_at_a_known_entry_is_not_kept():
    b = loopless()
    b.sr.info["function_entries"] = {F + 0x100}      # F is not known as an entry
    b.sr.block(F + 8).insns = [(F + 8, 5), (F + 13, 5)]  # so a later block is patchable
    b.sr.block(F + 8).size = 10
    b.sr.block(F + 8).data = b"\x90" * 10
    c = Counter()
    parts = prune(b, function_threshold=1.0, c=c)
    assert parts == [] and c["kept-hot-functions"] == 0


def test_a_hot_function_with_a_hot_loop_is_kept_by_its_loop():
    """The loop rule comes first: the part is not marked a hot function."""
    b = Builder()
    b.block(F, (1, 3, 4), T.FALLTHROUGH, count=1, samples=1)
    b.block(F + 8, (3, 2), T.JCC, targets=[F + 8], count=100, samples=300)
    b.block(F + 13, (1,), T.RET, count=1, samples=1)
    b.ft(F, F + 8, 1)
    b.flow(F + 8, F + 8, 99)
    b.ft(F + 8, F + 13, 1)
    b.exit(F + 13, 0x9000, 1)
    b.entry(F, 1)
    b.sr.info["function_entries"] = {F}
    [kept] = prune(b, function_threshold=1.0, hot_threshold=1.0)
    assert "hot_function" not in kept.info and kept.info["loops"].max_trip_count() >= 4


# ---- offline: dbr analyze selects what the service would --------------------------------
FLAT_C = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((noinline)) unsigned step(unsigned h, unsigned c) {
    h ^= c; h *= 16777619u;
    if (h & 1) h += c * 3; else h -= c >> 2;
    return h;
}
int main(int argc, char **argv) {
    unsigned h = 1;
    for (long i = 0; i < atol(argv[1]); i++) h = step(h, (unsigned)i);
    printf("%u\n", h);
    return 0;
}
"""


def test_analyze_keeps_a_hot_function_patched_at_its_entry(tmp_path):
    """`dbr analyze` gives selection the binary's function entries (FDE starts,
    symbols) as the service does: samples spread over a loopless function make a
    region entered at the function's first byte; with a function threshold above the
    function's samples (pipeline key function_threshold, a sample count) none."""
    import subprocess
    import sys

    from harness import compile_c, symbols

    src = tmp_path / "flat.c"
    src.write_text(FLAT_C)
    exe = compile_c([src], flags=["-O2", "-no-pie", "-fno-pie"], out_name="flat-nopie")
    lo, hi = symbols(exe)["step"]
    dis = subprocess.run(["objdump", "-d", f"--start-address={lo:#x}",
                          f"--stop-address={hi:#x}", str(exe)],
                         capture_output=True, text=True, check=True).stdout
    insns = [int(ln.split(":")[0], 16) for ln in dis.splitlines()
             if ln.startswith("  ") and ":" in ln and "nop" not in ln]
    assert lo in insns and len(insns) >= 5, dis
    lines = [f"{a:#x} 40" for a in insns]
    samples = tmp_path / "s.txt"
    samples.write_text("\n".join(lines) + "\n")
    cmd = [sys.executable, "-m", "dbr_service.commands.cli", "analyze", str(exe), "--samples",
           str(samples), "-o", "min_loop_trip_count=16", "-o", "entry_sites=true"]
    on = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert on.returncode == 0, on.stderr
    assert f"entries [{lo:#x} (step)]" in on.stdout, on.stdout
    off = subprocess.run(cmd + ["-o", "function_threshold=1e12"], capture_output=True,
                         text=True, timeout=120)
    assert off.returncode == 0, off.stderr
    assert "0 super-region(s)" in off.stdout, off.stdout
