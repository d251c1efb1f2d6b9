"""End to end: stripped programs under `dbr run --embedded --aggressive`.

Each program's output must equal its native run's, byte for byte, whatever dbr
did.  Where dbr can optimize the program, at least one region must be installed
and, for the loop-dominated ones at -O2, at least 90% of the samples after the
first patch must land in replacement code (measured 99-100% on this
2-core machine).  A region goes live by a patch or, where no patch point runs
again (a loop run once per call), by the agent moving the thread in (TRANSFER).
Programs dbr cannot optimize would be marked xfail(strict) with the reason, so
the day they work the test says so.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from dbr_service.common.config import load_config
from harness import compile_c

E2E = Path(__file__).resolve().parent.parent / "e2e_progs"


@dataclass
class Case:
    name: str
    src: str
    args: dict[str, list[str]]           # per optimization level
    libs: list[str] = field(default_factory=list)     # shared libraries to build first
    link_lib: bool = False                # link the first lib (PLT calls into it)
    lib_arg: bool = False                 # pass the first lib's path as argv[1]
    loop_share: bool = True               # assert the replacement-code share (at -O2)
    xfail: dict[str, str] = field(default_factory=dict)


# Sizes: every run takes 0.5-1.3 s natively on a 2-core Xeon, well past the first
# patch (about 0.2 s); the -O0 sizes once ran 0.2-0.4 s there, too close to it.
CASES = [
    Case("calls", "calls.c", {"-O2": ["400"], "-O0": ["300"]}),
    Case("threads", "threads.c", {"-O2": ["150", "4"], "-O0": ["150", "4"]}),
    # main() ends with pthread_exit: the workers outlive it (about 1 s at both levels;
    # at -O0 40 ran 0.08 s, over before any selection), then the process ends
    Case("mainexit", "mainexit.c", {"-O2": ["500", "2"], "-O0": ["500", "2"]}),
    Case("sigjmp", "sigjmp.c", {"-O2": ["8000"], "-O0": ["6000"]}),
    # the 12-way jump-table dispatch is translated (codegen/dispatch.py): the dispatch
    # loop runs in replacement code
    Case("interp", "interp.c", {"-O2": ["50"], "-O0": ["40"]}),
    # -O0 at 60000 ran 0.47 s on the AMD EPYC, below the floor above, and a CI run
    # there ended before any job had selected a region (now 0.78 s); plt -O0 at 200
    # ran 0.41 s there (now 0.64 s)
    Case("throw", "throw.cpp", {"-O2": ["150000"], "-O0": ["100000"]}, loop_share=False),
    Case("plt", "plt.c", {"-O2": ["500"], "-O0": ["300"]}, libs=["libplt.c"], link_lib=True),
    # at -O2 the hot loops of these two have no instruction of 5 bytes or more and run
    # once per call (a worker's only call, once per dlopen): no patch point ever runs
    # again, so their regions are transfer-only (threads moved in by the agent)
    Case("workers", "workers.c", {"-O2": ["600"], "-O0": ["500"]}, loop_share=False),
    Case("dlhot", "dlhot.c", {"-O2": ["1000"], "-O0": ["600"]}, libs=["libdlhot.c"],
         lib_arg=True, loop_share=False),
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


PARAMS = [pytest.param(c, opt, False, id=f"{c.name}{opt}",
                       marks=[pytest.mark.xfail(reason=c.xfail[opt], strict=True)]
                       if opt in c.xfail else [])
          for c in CASES for opt in ("-O2", "-O0")]

#: The cases run again with `-o hot_text=true` (every function holding 0.05 % of the
#: samples copied and entered at its entry): calls from copies, longjmp, C++ throws,
#: PLT calls into a library and a translated jump table.  The whole file runs so with
#: DBR_HOT_TEXT=true in the environment (the service reads it).  longjmp and PLT calls
#: run so under `make test-long` only (the suite's time budget).
HOT_TEXT_CASES = ("calls", "sigjmp", "throw", "plt", "interp")
HOT_TEXT_LONG = ("sigjmp", "plt")
PARAMS += [pytest.param(c, "-O2", True, id=f"{c.name}-O2-hot_text",
                        marks=[pytest.mark.long] if c.name in HOT_TEXT_LONG else [])
           for c in CASES if c.name in HOT_TEXT_CASES]


def _story(clients: list[dict]) -> list[dict]:
    """What a failed share assertion needs to be read: per client, when things happened,
    each region's fate and any speed checks (the share once came out 83 % in CI)."""
    return [{"timeline": c.get("timeline"), "speed_checks": c.get("speed_checks"),
             "regions": [(r["id"], r["state"], r["blocks"], r["info"].get("removed_why"))
                         for r in c.get("regions", [])]} for c in clients]


@pytest.mark.parametrize("case, opt, hot_text", PARAMS)
def test_program_under_dbr(case: Case, opt: str, hot_text: bool, tmp_path):
    exe, args = _build(case, opt)
    native = subprocess.run([str(exe), *args], capture_output=True, timeout=300)
    assert native.returncode == 0, native.stderr
    report = tmp_path / "report.json"
    run = subprocess.run([sys.executable, "-m", "dbr_service.commands.cli", "run", "--embedded",
                          "--aggressive", *(["-o", "hot_text=true"] if hot_text else []),
                          "--report", str(report), "--", str(exe), *args],
                         capture_output=True, timeout=300)
    assert run.returncode == native.returncode, run.stderr.decode()[-2000:]
    assert run.stdout == native.stdout, "output differs from the native run"
    rep = json.loads(report.read_text())
    mine = [c for c in rep["clients"] if c["exe"] == str(exe)]
    assert mine, rep["clients"]
    installed = sum(c["patches_installed"] for c in mine)
    moved = sum(c["threads_transferred"] for c in mine)
    assert sum(c["regions_went_live"] for c in mine) >= 1, \
        [(c["region_status"], c["regions"]) for c in mine]
    for c in mine:
        assert c["samples_in_replacement"] <= c["samples_after_first_patch"] <= c["samples"]
    after = sum(c["samples_after_first_patch"] for c in mine)
    inside = sum(c["samples_in_replacement"] for c in mine)
    print(f"{case.name}{opt}{' hot_text' if hot_text else ''}: {installed} patches, {moved} "
          f"threads moved in, {inside}/{after} samples after the first patch in replacement "
          f"code, {rep['totals']['functions_copied']} functions copied")
    # -O0 shares vary run to run (0.6-0.97 seen: which region lands first) and are not
    # asserted; bench/ reports them.  Nor with hot text, whose first job (no block bound)
    # lands later: 0.13-1.0 seen on threads, most above 0.9 (DBR_HOT_TEXT=true in the
    # environment turns it on as the service reads it: load_config).
    if case.loop_share and opt == "-O2" and not hot_text and not load_config().hot_text:
        assert after > 0 and inside / after >= 0.9, (inside, after, _story(mine))
