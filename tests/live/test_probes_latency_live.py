"""Latency probes on a real program under a real service (dbr_service/session/probes.py,
codegen/probes_latency.py).

tests/agent_progs/latency.c sleeps known times in ``nap``, nests ``rec``, leaves
``leap`` by ``longjmp`` on odd calls, and runs ``nap`` on 8 threads.  Each count is
exact; no sample is shorter than its sleep; the recursion's calls each last at least
their depth's sleeps; calls left by ``longjmp`` are not counted and leave no entry
behind (the slot table does not fill up); threads that end inside do not disturb
later ones; ``del``, detach and the service's stop while 8 threads sleep inside the
function let them return to their callers (the program's sums are right).  A C++
program is refused (its exceptions would unwind into the exit stub, which has no
unwind information)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from harness import compile_c
from service_helpers import ServiceProc, agent_path
from probe_helpers import Prog, paused_prog

from dbr_service.common.tsc import invariant_problem

pytestmark = [
    pytest.mark.skipif(agent_path() is None, reason="the agent cannot be built"),
    pytest.mark.skipif(invariant_problem() is not None,
                       reason=f"latency probes need an invariant TSC: {invariant_problem()}"),
]

MS = 1_000_000


@pytest.fixture(scope="module")
def prog() -> str:
    return str(compile_c(["latency.c"], flags=["-fcf-protection=none"], out_name="latency"))


@pytest.fixture
def quiet(prog):
    """The program under a service told to leave it alone (paused: no regions)."""
    yield from paused_prog(prog)


def _samples(shown: dict) -> list[tuple[int, int]]:
    """Each measured call's bucket as (low ns, high ns), shortest first."""
    return [(lo, hi) for lo, hi, n in shown["buckets"] for _ in range(n)]


def _done(p: Prog, line: str, timeout: float = 60.0) -> int:
    return int(p.run(line, "done", timeout).split()[1])


def test_latency_of_a_sleep(quiet: Prog) -> None:
    """50 calls of a 2 ms sleep: 50 samples, none shorter than 2 ms, and each no
    longer than the program's own measurement around the call (the k-th shortest
    sample's bucket starts at or below the k-th shortest measured time)."""
    p = quiet.probe("add", location="nap", kind="latency")
    assert (p["kind"], p["location"], p["count"], p["misses_no_slot"]) == \
        ("latency", "nap", 0, 0)
    quiet.proc.stdin.write(b"timed 50 2000\n")
    quiet.proc.stdin.flush()
    times = sorted(int(t) for t in quiet.out.expect("times", 60).split()[1:])
    assert int(quiet.out.expect("done", 60).split()[1]) == 50 * 2000
    quiet.out.expect("ready")
    shown = quiet.probe("show", id=p["id"])
    assert shown["count"] == 50
    assert shown["misses_no_slot"] == shown["misses_too_deep"] == 0
    samples = _samples(shown)
    assert len(samples) == len(times) == 50
    for (lo, hi), t in zip(samples, times):
        assert hi > 2 * MS and lo <= t * 1.01, (lo, hi, t)
    assert 50 * 2 * MS <= shown["sum_ns"] <= sum(times) * 1.01
    assert 2 * MS <= shown["mean_ns"] and shown["p50_ns"] > 2 * MS
    assert shown["p99_ns"] >= shown["p90_ns"] >= shown["p50_ns"]


def test_recursion_counts_every_depth(quiet: Prog) -> None:
    r = quiet.probe("add", location="rec", kind="latency")
    n = quiet.probe("add", location="nap", kind="latency")
    assert _done(quiet, "rec 6 1000") == 6 * 1000
    shown = quiet.probe("show", id=r["id"])
    assert shown["count"] == 6 and quiet.probe("show", id=n["id"])["count"] == 6
    # the call at depth d (counted from the innermost) sleeps d times 1 ms
    for d, (_lo, hi) in enumerate(_samples(shown), 1):
        assert hi > d * MS, (d, shown["buckets"])
    assert shown["sum_ns"] >= 21 * MS
    assert _done(quiet, "rec 40 0") == 0          # deeper than a thread's 24 entries
    shown = quiet.probe("show", id=r["id"])
    assert (shown["count"], shown["misses_too_deep"]) == (6 + 24, 16)


def test_longjmp_out_of_the_function(quiet: Prog) -> None:
    p = quiet.probe("add", location="leap", kind="latency")
    want = sum(i for i in range(1000) if i % 2 == 0) + 1000 * 500
    assert _done(quiet, "leap 1000") == want
    shown = quiet.probe("show", id=p["id"])
    assert shown["count"] == 500                  # the calls that returned
    assert _done(quiet, "leap 1000") == want      # abandoned entries were dropped
    shown = quiet.probe("show", id=p["id"])
    assert (shown["count"], shown["misses_no_slot"], shown["misses_too_deep"]) == (1000, 0, 0)


def test_eight_threads(quiet: Prog) -> None:
    p = quiet.probe("add", location="nap", kind="latency")
    assert _done(quiet, "threads 8 25 1000") == 8 * 25 * 1000
    shown = quiet.probe("show", id=p["id"])
    assert (shown["count"], shown["misses_no_slot"], shown["misses_too_deep"]) == (200, 0, 0)
    assert all(hi > MS for _lo, hi in _samples(shown))
    # many short calls at once: every thread claims and gives back a slot per call
    assert _done(quiet, "threads 8 20000 0") == 0
    shown = quiet.probe("show", id=p["id"])
    assert (shown["count"], shown["misses_no_slot"], shown["misses_too_deep"]) == \
        (200 + 8 * 20000, 0, 0)


def test_threads_that_exit_inside_the_function(quiet: Prog) -> None:
    """Threads end inside leave (pthread_exit unwinds its frame, meets the exit stub
    and ends the thread there).  Their entries stay in their slots; threads made
    after them (glibc reuses their stacks and thread blocks) are measured exactly."""
    p = quiet.probe("add", location="leave", kind="latency")
    per = sum(range(9))                        # leave(0..8) return; leave(9) exits
    for rounds in (1, 2, 3):
        assert _done(quiet, "exiters 4 10") == 4 * per
        shown = quiet.probe("show", id=p["id"])
        assert (shown["count"], shown["misses_no_slot"], shown["misses_too_deep"]) == \
            (rounds * 4 * 9, 0, 0)
    assert _done(quiet, "rec 2 0") == 0        # the program goes on


def test_del_while_threads_are_inside(quiet: Prog) -> None:
    """8 threads sleep 6 s inside nap when the probe goes: its code (the exit stub
    their return addresses point to) stays while censuses find it on their stacks,
    and is freed once they returned; the program's sums are right.  Censuses run in
    the client's sampling cycle, so the client is resumed after the ``del``."""
    p = quiet.probe("add", location="nap", kind="latency")
    lo, hi = p["code"]
    quiet.run("bg 8 1 6000000", "started")
    gone = quiet.probe("del", id=p["id"])         # every thread sleeps inside nap
    assert gone["state"] == "removed: deleted" and gone["retained"] is not None
    quiet.svc.call("resume", {"pid": quiet.pid})

    def held() -> dict | None:
        shown = [x for x in quiet.probe("list")["probes"] if x["id"] == p["id"]]
        return shown[0]["retained"] if shown else None
    seen = quiet.svc.wait_for(lambda: (held() or {}).get("stack_refs", 0) >= 8, 5.0,
                              "a census finding the exit stub on 8 threads' stacks")
    assert seen
    # other probes placed meanwhile do not get its space
    for _ in range(3):
        c = quiet.probe("add", location="rec", kind="count")
        assert c["code"][1] <= lo or hi <= c["code"][0], (c["code"], lo, hi)
        quiet.probe("del", id=c["id"])
    assert held() is not None
    listed = subprocess.run([sys.executable, "-m", "dbr_service.commands.cli", "ctl",
                             "--timeout", "40", "probe", "list", str(quiet.pid)],
                            capture_output=True, text=True, timeout=60,
                            env=dict(os.environ, DBR_RUNTIME_DIR=quiet.svc.dir)).stdout
    assert "removed: deleted (exit stub retained: " in listed, listed
    assert _done(quiet, "join") == 8 * 6000000
    quiet.svc.wait_for(lambda: held() is None, 20, "the exit stub's code freed")
    assert _done(quiet, "nap 3 1000") == 3000


def test_service_stop_while_threads_are_inside(prog: str) -> None:
    svc = ServiceProc().wait_ready()
    p = None
    try:
        p = Prog(svc, prog)
        svc.call("pause", {"pid": p.pid})
        p.probe("add", location="nap", kind="latency")
        p.run("bg 8 2 200000", "started")
        svc.stop()                     # probes are removed before BYE; buffers stay
        assert _done(p, "join") == 8 * 2 * 200000
        assert _done(p, "rec 3 1000") == 3000
    finally:
        if p is not None:
            p.close()
        svc.stop()


def test_detach_while_threads_are_inside(quiet: Prog) -> None:
    """`dbr detach` reverts every site and leaves the agent dormant; its buffers stay
    mapped, so threads sleeping inside nap return through the exit stub."""
    quiet.probe("add", location="nap", kind="latency")
    quiet.run("bg 8 2 200000", "started")
    r = quiet.svc.call("detach", {"pid": quiet.pid}, timeout=30.0)
    assert r["session_ended"], r
    assert _done(quiet, "join") == 8 * 2 * 200000
    assert _done(quiet, "rec 3 1000") == 3000


def test_refusals(quiet: Prog) -> None:
    assert "latency probes go at a function's start" in quiet.refused("nap+4", kind="latency")
    assert "--filter applies to args probes only" in quiet.refused(
        "nap", kind="latency", filter="arg0==1")
    assert "_setjmp returns twice" in quiet.refused("_setjmp", kind="latency")
    assert quiet.probe("list")["probes"] == []


@pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler (g++) here")
def test_cxx_program_is_refused() -> None:
    binary = str(compile_c(["latency_cxx.cc"], cc="g++", out_name="latency_cxx"))
    svc = ServiceProc().wait_ready()
    p = None
    try:
        p = Prog(svc, binary)
        svc.call("pause", {"pid": p.pid})
        why = p.refused("_Z5riskyl", kind="latency")
        assert "maps libstdc++" in why and "exit stub" in why, why
        assert p.probe("list")["probes"] == []
        assert _done(p, "go 10") == 5                   # untouched: it still throws
        c = p.probe("add", location="_Z5riskyl", kind="count")   # other kinds are fine
        assert _done(p, "go 10") == 5
        assert p.probe("show", id=c["id"])["count"] == 10
    finally:
        if p is not None:
            p.close()
        svc.stop()


def test_dbr_ctl_probe_show_latency(quiet: Prog) -> None:
    def ctl(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "dbr_service.commands.cli", "ctl", "--timeout",
                               "40", "probe", *argv], capture_output=True, text=True,
                              timeout=60, env=dict(os.environ, DBR_RUNTIME_DIR=quiet.svc.dir))
    pid = str(quiet.pid)
    r = ctl("add", pid, "nap", "--kind", "latency")
    assert r.returncode == 0 and "latency at nap" in r.stdout, r.stdout + r.stderr
    _done(quiet, "nap 10 1000")
    r = ctl("show", pid, "1")
    assert r.returncode == 0, r.stderr
    for word in ("count: 10", "mean", "p50", "p90", "p99", "misses: 0"):
        assert word in r.stdout, r.stdout
    r = ctl("list", pid)
    assert "latency" in r.stdout and " 10 " in r.stdout, r.stdout
