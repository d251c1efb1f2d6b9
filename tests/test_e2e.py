"""End to end: stripped programs under `dbr run --embedded --aggressive`.

Each program's output must equal its native run's, byte for byte, whatever dbr
did.  Where dbr can optimize the program, at least one region must be installed
and most samples after the first patch must land in replacement code.  Issue 5
asks for 90% on loop-dominated programs; the tests guard 80% because a loaded
2-core machine moves the figure by several points; bench/ reports the measured
share.  Programs dbr cannot patch yet are marked xfail(strict) with the reason,
so the day they work the test says so.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from harness import compile_c

E2E = Path(__file__).resolve().parent / "e2e_progs"


@dataclass
class Case:
    name: str
    src: str
    args: dict[str, list[str]]           # per optimization level
    libs: list[str] = field(default_factory=list)     # shared libraries to build first
    link_lib: bool = False                # link the first lib (PLT calls into it)
    lib_arg: bool = False                 # pass the first lib's path as argv[1]
    loop_share: bool = True               # assert the replacement-code share (at -O2)
    #: Known gap, per optimization level: why dbr installs no region there yet.  The
    #: test still checks correctness in full, then reports the missing region as an
    #: expected failure (visible in every summary) instead of passing.
    patch_gap: dict[str, str] = field(default_factory=dict)
    xfail: dict[str, str] = field(default_factory=dict)


CASES = [
    Case("calls", "calls.c", {"-O2": ["400"], "-O0": ["120"]}),
    Case("threads", "threads.c", {"-O2": ["150", "4"], "-O0": ["40", "4"]}),
    Case("sigjmp", "sigjmp.c", {"-O2": ["8000"], "-O0": ["3000"]}),
    # the 12-way jump-table dispatch is translated (codegen/dispatch.py): the dispatch
    # loop runs in replacement code
    Case("interp", "interp.c", {"-O2": ["50"], "-O0": ["15"]}),
    Case("throw", "throw.cpp", {"-O2": ["150000"], "-O0": ["60000"]}, loop_share=False),
    Case("plt", "plt.c", {"-O2": ["500"], "-O0": ["200"]}, libs=["libplt.c"], link_lib=True),
    Case("workers", "workers.c", {"-O2": ["600"], "-O0": ["200"]}, loop_share=False,
         patch_gap={"-O2": "the hot loop has no instruction of 5 bytes or more and its "
                           "pre-header is rarely sampled (no patch point); what is checked "
                           "is forked children running inherited code correctly"}),
    Case("dlhot", "dlhot.c", {"-O2": ["1000"], "-O0": ["300"]}, libs=["libdlhot.c"],
         lib_arg=True, loop_share=False,
         patch_gap={"-O2": "the library's loop has no 5-byte instruction and runs once per "
                           "dlopen (no patch point); what is checked is dlclose of hot code"}),
]


def _build(case: Case, opt: str) -> tuple[Path, list[str]]:
    libs = [compile_c([E2E / lib], flags=[opt, "-s"], shared=True,
                      out_name=f"{Path(lib).stem}{opt}") for lib in case.libs]
    flags = [opt, "-s"]
    link = []
    if case.link_lib:
        flags += [f"-Wl,-rpath,{libs[0].parent}"]
        link = [libs[0]]
    exe = compile_c([E2E / case.src], flags=flags, out_name=f"{case.name}{opt}",
                    cc="g++" if case.src.endswith(".cpp") else "gcc", link=link)
    args = ([str(libs[0])] if case.lib_arg else []) + case.args[opt]
    return exe, args


PARAMS = [pytest.param(c, opt, id=f"{c.name}{opt}",
                       marks=[pytest.mark.xfail(reason=c.xfail[opt], strict=True)]
                       if opt in c.xfail else [])
          for c in CASES for opt in ("-O2", "-O0")]


@pytest.mark.parametrize("case, opt", PARAMS)
def test_program_under_dbr(case: Case, opt: str, tmp_path):
    exe, args = _build(case, opt)
    native = subprocess.run([str(exe), *args], capture_output=True, timeout=300)
    assert native.returncode == 0, native.stderr
    report = tmp_path / "report.json"
    run = subprocess.run([sys.executable, "-m", "dbr_service.cli", "run", "--embedded",
                          "--aggressive", "--report", str(report), "--", str(exe), *args],
                         capture_output=True, timeout=300)
    assert run.returncode == native.returncode, run.stderr.decode()[-2000:]
    assert run.stdout == native.stdout, "output differs from the native run"
    rep = json.loads(report.read_text())
    mine = [c for c in rep["clients"] if c["exe"] == str(exe)]
    assert mine, rep["clients"]
    installed = sum(c["patches_installed"] for c in mine)
    if not installed and opt in case.patch_gap:
        pytest.xfail(case.patch_gap[opt])
    assert installed >= 1, [(c["region_status"], c["regions"]) for c in mine]
    for c in mine:
        assert c["samples_in_replacement"] <= c["samples_after_first_patch"] <= c["samples"]
    after = sum(c["samples_after_first_patch"] for c in mine)
    inside = sum(c["samples_in_replacement"] for c in mine)
    print(f"{case.name}{opt}: {installed} patches, {inside}/{after} samples after the "
          f"first patch in replacement code")
    # -O0 shares vary run to run (0.6-0.97 seen: which region lands first) and are not
    # asserted; bench/ reports them.
    if case.loop_share and opt == "-O2":
        assert after > 0 and inside / after >= 0.8, (inside, after)
