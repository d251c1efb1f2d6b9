"""End to end: unwinding through replacement code that makes real calls.

tests/e2e_progs/cfithrow.cpp, stripped, under `dbr run --embedded --aggressive -o
real_calls=true`: its hot loop calls (not inlined, same module) a function that now
and then throws, caught in the loop's caller, and now and then writes a backtrace()
to stderr.  Once the loop's region is live the call is made from a copy of the loop's
function, so every throw unwinds through the copy's frame: the output must equal the
native run's.  The backtraces taken from the callee must name the same functions as
natively, in order, except that the copied function's frame is in a code buffer (no
object: "?"; so are other functions' frames where they are copied too, as with
hot_text), and at least one must have gone through it.  Names come from the
unstripped twin of the program (same code).
"""

from __future__ import annotations

import bisect
import json
import subprocess
import sys
from pathlib import Path

from harness import compile_c, symbols

E2E = Path(__file__).resolve().parent.parent / "e2e_progs"
ARGS = ["600"]      # about 1 s natively on a 2-core Xeon; the first patch comes at ~0.3 s


def _namer(exe: Path):
    syms = sorted((lo, hi, name) for name, (lo, hi) in symbols(exe).items() if hi > lo)
    starts = [s[0] for s in syms]

    def name(tok: str) -> str:
        if not tok.startswith("exe+"):
            return tok
        ret = int(tok[4:], 16) - 1       # a return address: the call is before it
        i = bisect.bisect_right(starts, ret) - 1
        return syms[i][2] if i >= 0 and syms[i][0] <= ret < syms[i][1] else tok
    return name


def _traces(stderr: bytes, name) -> list[list[str]]:
    return [[name(t) for t in ln.split()[1:]] for ln in stderr.decode().splitlines()
            if ln.startswith("bt ")]


def test_throw_and_backtrace_through_a_copy_with_real_calls(tmp_path):
    exe = compile_c([E2E / "cfithrow.cpp"], flags=["-O2", "-s"], out_name="cfithrow-O2",
                    cc="g++")
    twin = compile_c([E2E / "cfithrow.cpp"], flags=["-O2"], out_name="cfithrow-O2-full",
                     cc="g++")
    name = _namer(twin)
    native = subprocess.run([str(exe), *ARGS], capture_output=True, timeout=300)
    assert native.returncode == 0, native.stderr
    [want] = {tuple(t) for t in _traces(native.stderr, name)}
    hot = next(i for i, f in enumerate(want) if "3hot" in f)
    assert "4work" in want[hot - 1] and want[hot + 1] == "main", want

    report = tmp_path / "report.json"
    run = subprocess.run([sys.executable, "-m", "dbr_service.commands.cli", "run", "--embedded",
                          "--aggressive", "-o", "real_calls=true", "--report", str(report),
                          "--", str(exe), *ARGS], capture_output=True, timeout=300)
    assert run.returncode == 0, run.stderr.decode()[-2000:]
    assert run.stdout == native.stdout, "output differs from the native run"
    [client] = [c for c in json.loads(report.read_text())["clients"] if c["exe"] == str(exe)]
    live = [r for r in client["regions"] if r["info"].get("real_calls")]
    assert live and all(r["info"].get("frames", 0) >= 1 and "cfi_refused" not in r["info"]
                        for r in live), client["regions"]

    got = _traces(run.stderr, name)
    assert len(got) == len(_traces(native.stderr, name))
    through = 0
    for t in got:
        if tuple(t) == want:
            continue
        # through the copy: the copied function's frame has no object, the rest as
        # native, or in copies of their own too (hot text copies more functions)
        assert len(t) == len(want) and t[hot] == "?", t
        assert all(f == w or f == "?" for f, w in zip(t, want)), t
        through += 1
    assert through >= 1, "no backtrace went through replacement code"
    print(f"cfithrow: {through}/{len(got)} backtraces through the copy; regions {live}")
