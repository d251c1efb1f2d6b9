"""End to end: exceptions, backtraces and siglongjmp through replacement code that makes
real calls (`dbr run --embedded --aggressive -o real_calls=true`), on stripped
programs built at -O0 and -O2, in C++ and C.

tests/e2e_progs/rc_throw.cpp and rc_unwind.c have main -> outer (hot loop) -> middle
(hot loop) -> leaf; leaf and middle are recursive, which keeps the region inliner from
cloning them, so each loop's region calls the next function for real and leaf runs with
two copied frames above it.  Each program first runs unprinted warm-up rounds until it
sees that (or gives up after WARM_S), then the printed rounds.  Shown here:

* rc_throw nested: exceptions thrown in leaf unwind through the copies of middle and
  outer to main's catch; rc_throw inner: caught by a try inside the loop's copy, or
  passed through it to main.  The throws that left a call made from a copy are counted.
* backtrace() and _Unwind_Backtrace, taken in leaf, name the same functions in the
  same order as natively: a frame in a code buffer (no object) is named by the region
  whose code holds it (the report's code_at/code_bytes) after the function of that
  region's entries, which must be the function natively at that place.
* rc_unwind sigjmp: SIGALRM (setitimer) and raise(SIGUSR1) handlers siglongjmp out of
  the copies and their callees; the handlers count where the thread was.

In every case the output equals the native run's.  Names come from the unstripped twin
of each program (same code).
"""

from __future__ import annotations

import bisect
import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from harness import compile_c, symbols

E2E = Path(__file__).resolve().parent.parent / "e2e_progs"
WARM_S = "30"        # the warm-up's bound; it ends as soon as the copies are live (~0.3 s)


@dataclass(frozen=True)
class Case:
    src: str
    mode: str
    rounds: dict[str, str]          # opt -> printed rounds (0.3-0.8 s natively)
    copies: int                     # copied frames a trace must show at least once

    @property
    def cc(self) -> str:
        return "g++" if self.src.endswith(".cpp") else "gcc"


CASES = [
    Case("rc_throw.cpp", "nested", {"-O2": "60", "-O0": "40"}, 2),
    Case("rc_throw.cpp", "inner", {"-O2": "60", "-O0": "40"}, 1),
    Case("rc_unwind.c", "trace", {"-O2": "60", "-O0": "60"}, 2),
    Case("rc_unwind.c", "sigjmp", {"-O2": "60", "-O0": "40"}, 0),
]


def _namer(twin: Path):
    """exe+OFF (a return address) -> the twin's function containing the call."""
    syms = sorted((lo, hi, name) for name, (lo, hi) in symbols(twin).items() if hi > lo)
    starts = [s[0] for s in syms]

    def name_at(off: int) -> str | None:
        i = bisect.bisect_right(starts, off) - 1
        return syms[i][2] if i >= 0 and syms[i][0] <= off < syms[i][1] else None
    return name_at


def _counts(stderr: str, prefix: str) -> dict[str, int]:
    """'thrown 5 from-copy 3 ...' -> {'thrown': 5, 'from-copy': 3, ...}"""
    line = next(ln for ln in stderr.splitlines() if ln.startswith(prefix + " "))
    words = line.split()
    return {k: int(v) for k, v in zip(words[::2], words[1::2])}


def _traces(stderr: str) -> list[tuple[str, list[str]]]:
    return [(ln[:2], ln.split()[1:]) for ln in stderr.splitlines()
            if ln.startswith(("bt ", "ub "))]


def _region_names(client: dict, base: int, name_at) -> list[tuple[int, int, set[str]]]:
    """(lo, hi, functions of its entries) of every region's code in the report."""
    out = []
    for r in client["regions"]:
        at = r["info"].get("code_at")
        if at is None or r["module"] != client["exe"]:
            continue
        lo = at
        out.append((lo, lo + r["code_bytes"], {name_at(e - base) for e in r["entries"]}))
    return out


def _name_frames(trace: list[str], name_at, regions) -> tuple[list[str], int]:
    """Names of a trace's frames, and how many were in a code buffer."""
    names, copies = [], 0
    for tok in trace:
        if tok.startswith("exe+"):
            names.append(name_at(int(tok[4:], 16) - 1) or tok)
        elif tok.startswith("?") and tok != "?0":     # ?0: _Unwind_Backtrace's end
            a = int(tok[1:], 16)
            owners = [fns for lo, hi, fns in regions if lo <= a < hi]
            assert owners, f"frame {tok} is in no region's code: {regions}"
            names.append(owners)        # resolved against the native trace below
            copies += 1
        else:
            names.append(tok)
    return names, copies


def _matches(named: list, want: tuple[str, ...]) -> bool:
    return len(named) == len(want) and all(
        n == w if isinstance(n, str) else any(w in fns for fns in n)
        for n, w in zip(named, want))


def _build(case: Case, opt: str) -> tuple[Path, Path]:
    tag = f"{Path(case.src).stem}{opt}"
    exe = compile_c([E2E / case.src], flags=[opt, "-s"], out_name=tag, cc=case.cc)
    twin = compile_c([E2E / case.src], flags=[opt], out_name=f"{tag}-full", cc=case.cc)
    return exe, twin


@pytest.mark.parametrize("opt", ["-O2", "-O0"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.src}-{c.mode}")
def test_through_copies_with_real_calls(case: Case, opt: str, tmp_path):
    exe, twin = _build(case, opt)
    name_at = _namer(twin)
    args = [case.mode, case.rounds[opt]]
    native = subprocess.run([str(exe), *args], capture_output=True, timeout=120)
    assert native.returncode == 0, native.stderr[-2000:]
    nerr = native.stderr.decode()

    report = tmp_path / "report.json"
    run = subprocess.run([sys.executable, "-m", "dbr_service.commands.cli", "run", "--embedded",
                          "--aggressive", "-o", "real_calls=true",
                          # every region the program's loops give, not what a CPU budget
                          # lets selection reach: these runs test unwinding through copies
                          "-o", "service_cpu_budget=0", "--report", str(report),
                          "--", str(exe), *args, WARM_S], capture_output=True, timeout=300)
    err = run.stderr.decode(errors="replace")
    assert run.returncode == 0, err[-3000:]
    assert run.stdout == native.stdout, "output differs from the native run"
    assert re.search(r"^warm \d+ rounds, copies yes$", err, re.M), \
        "the copies never called for real: " + err[-2000:]

    [client] = [c for c in json.loads(report.read_text())["clients"] if c["exe"] == str(exe)]
    real = [r for r in client["regions"] if r["info"].get("real_calls")]
    assert len(real) >= max(1, case.copies), client["regions"]
    assert all(r["info"].get("frames", 0) >= 1 and "cfi_refused" not in r["info"]
               for r in real), real

    figures = ""
    if case.src == "rc_throw.cpp":
        want, got = _counts(nerr, "thrown"), _counts(err, "thrown")
        assert got["thrown"] == want["thrown"] > 0, (got, want)
        if case.mode == "nested":
            # thrown in leaf, called from middle's copy, called from outer's copy
            assert got["two-copies"] >= 1, got
        else:
            # Rare caught by the try of the loop's copy; Big passed through it to main
            assert got["caught-inner-from-copy"] >= 1, got
            assert got["from-copy"] - got["caught-inner-from-copy"] >= 1, got
        figures = f"throws {got}"
    if case.mode == "sigjmp":
        got = _counts(err, "alarms")
        assert got["alarms"] == 300 and got["raises"] == 60, got
        assert got["alarm-in-copy"] >= 1, f"no SIGALRM landed in a copy: {got}"
        assert got["raise-under-copy"] >= 1, f"no raise from a callee of a copy: {got}"
        figures = f"signals {got}"

    base = int(re.search(r"^base ([0-9a-f]+)$", err, re.M).group(1), 16)
    regions = _region_names(client, base, name_at)
    natives = {(kind, tuple(name_at(int(t[4:], 16) - 1) or t if t.startswith("exe+") else t
                            for t in tr)) for kind, tr in _traces(nerr)}
    traces = _traces(err)
    assert len(traces) == len(_traces(nerr))
    deepest = 0
    for kind, tr in traces:
        named, copies = _name_frames(tr, name_at, regions)
        assert any(k == kind and _matches(named, w) for k, w in natives), \
            (kind, tr, named, sorted(natives))
        deepest = max(deepest, copies)
    if case.copies:
        assert traces and deepest >= case.copies, \
            f"no trace went through {case.copies} copied frames ({len(traces)} traces)"
    print(f"{case.src} {case.mode} {opt}: {len(real)} regions with real calls; "
          f"{len(traces)} traces, deepest through {deepest} copies; {figures}")
