"""CPython's own regression tests pass under `dbr run --embedded --aggressive -o
real_calls=true`: the interpreter's hot code (eval loop, object and unicode
operations) runs in regions whose copies call the interpreter's functions for real,
and every exception, traceback and C-level unwind the tests provoke must come out as
natively.

Needs an interpreter with the `test` package (Debian's python3 has none without
libpython3-testsuite); the first of this venv's base interpreter, `python3` on PATH
and pyenv's versions that has one is used, else the test skips saying so.  The same
tests are run natively first: a failure there is the machine's, and skips.  Long
(`make test-long`): about 12 s natively, a few times that under dbr.  Run again with
`-o hot_text=true` (every function holding 0.05 % of the samples copied).
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import time

import pytest

TESTS = ["test_json", "test_re", "test_long", "test_unicode", "test_math", "test_struct",
         "test_dict", "test_list", "test_set", "test_exceptions", "test_traceback"]


def _candidates() -> list[str]:
    found = [getattr(sys, "_base_executable", None), shutil.which("python3")]
    found += sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/*/bin/python3")),
                    reverse=True)
    found += ["/usr/bin/python3", "/usr/local/bin/python3"]
    out = []
    for p in found:
        if p and os.path.isfile(p) and os.path.realpath(p) not in map(os.path.realpath, out):
            out.append(p)
    return out


def _interpreter() -> str | None:
    """The first candidate whose `test` package holds regrtest and these tests."""
    mods = ", ".join(["test.libregrtest"] + [f"test.{t}" for t in TESTS])
    for py in _candidates():
        try:
            r = subprocess.run([py, "-c", f"import {mods}"], capture_output=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if r.returncode == 0:
            return py
    return None


@pytest.mark.long
@pytest.mark.parametrize("hot_text", [False, True], ids=["default", "hot_text"])
def test_cpython_regrtest_under_dbr_with_real_calls(hot_text, tmp_path):
    py = _interpreter()
    if py is None:
        pytest.skip("no interpreter on this machine has CPython's `test` package with "
                    f"{', '.join(TESTS)} (tried {', '.join(_candidates())})")
    argv = [py, "-m", "test", *TESTS]
    t0 = time.monotonic()
    native = subprocess.run(argv, capture_output=True, timeout=1800, cwd=tmp_path)
    native_s = time.monotonic() - t0
    if native.returncode != 0:
        pytest.skip(f"{py}: the tests fail natively: {native.stdout.decode()[-1500:]}")

    report = tmp_path / "report.json"
    t0 = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "dbr_service.commands.cli", "run", "--embedded",
                          "--aggressive", "-o", "real_calls=true",
                          *(["-o", "hot_text=true"] if hot_text else []), "--report", str(report),
                          "--", *argv], capture_output=True, timeout=3600, cwd=tmp_path)
    dbr_s = time.monotonic() - t0
    out = run.stdout.decode(errors="replace")
    assert run.returncode == 0, out[-3000:] + run.stderr.decode(errors="replace")[-3000:]
    assert "Tests result: SUCCESS" in out and f"All {len(TESTS)} tests OK." in out, out[-3000:]

    rep = json.loads(report.read_text())
    live = [r for c in rep["clients"] for r in c["regions"] if "install_id" in r["info"]]
    calling = [r for r in live if r["info"].get("real_calls")]
    refused = [r for r in live if "cfi_refused" in r["info"]]
    assert all(r["info"].get("frames", 0) >= 1 for r in calling), calling
    print(f"{py}: {len(TESTS)} test files pass under dbr in {dbr_s:.1f} s (natively "
          f"{native_s:.1f} s); {len(rep['clients'])} clients, "
          f"{rep['totals']['patches_installed']} patches, {len(live)} regions went live, "
          f"{len(calling)} with real calls "
          f"({sum(r['info']['real_calls'] for r in calling)} calls), "
          f"{len(refused)} gave them up; {rep['totals']['function_entries_went_live']} hot "
          f"functions' entries, {rep['totals']['functions_copied']} functions copied")
