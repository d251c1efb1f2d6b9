"""Counting mode end to end (profile=count, docs/decisions/0041-exact-counts.md):
tests/e2e_progs/tripcount.c under `dbr run --embedded --aggressive`.

* With thresholds no block reaches, the counting regions count to the program's end:
  entered only through their patch sites (transfer off, so no thread starts
  mid-round), each loop body's exact count is its trip count times the region's
  entries, exactly; the output is the native run's.
* With the default thresholds the phase ends at a promoted block and the counting
  region is replaced by one built from the counts, without counters; the records
  carry the sample-inferred counts' error.
  The phase ends when the threshold is reached, not at the longest poll interval.
* The monitor promotes blocks at the configured thresholds (direct and indirect),
  reads a region when its counts say the threshold is due, and does not spin on a
  region whose phase is over.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

from harness import compile_c
from region_graphs import sr_with_indirect

from dbr_service.session.counting_monitor import (
    FIRST_POLL_S,
    CountingRegion,
    CountMonitor,
    next_wait,
)
from dbr_service.installation.exact_counts import plan_counters

E2E = Path(__file__).resolve().parent.parent / "e2e_progs"
N1, N2 = 70, 130
SIDE = -(-N2 // 3)               # iterations with j % 3 == 0
#: A longest poll interval far beyond a hot loop's counting phase.
LONG_POLL_MS = 2000


def _run(tmp_path, rounds: int, *opts: str) -> tuple[list[dict], bytes, bytes]:
    exe = compile_c([E2E / "tripcount.c"], flags=["-O1", "-s"], out_name="tripcount-O1")
    args = [str(exe), str(rounds), str(N1), str(N2)]
    native = subprocess.run(args, capture_output=True, timeout=120)
    report = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "dbr_service.commands.cli", "run", "--embedded", "--aggressive",
           "-o", "profile=count", *(x for o in opts for x in ("-o", o)),
           "--report", str(report), "--", *args]
    run = subprocess.run(cmd, capture_output=True, timeout=300)
    assert run.returncode == native.returncode == 0, run.stderr.decode()[-2000:]
    rep = json.loads(report.read_text())
    regions = [r for c in rep["clients"] if c["exe"] == str(exe) for r in c["regions"]]
    return regions, run.stdout, native.stdout


def test_exact_counts_equal_the_trip_counts(tmp_path) -> None:
    regions, out, native = _run(tmp_path, 2_000_000, "transfer=false",
                                "count_threshold_direct=1000000000000",
                                "count_threshold_indirect=1000000000000",
                                "count_phase_max_s=3600")
    assert out == native
    counted = [r["info"]["counting"] for r in regions if "counting" in r["info"]]
    assert counted, regions
    # Which loops get a region depends on where the samples fell; each counted one
    # must hold its loop's trip count exactly (hot functions, which hot_text copies
    # without a loop, have none to hold).
    loops = set()
    for c in [r["info"]["counting"] for r in regions
              if "counting" in r["info"] and not r["info"].get("hot_function")]:
        assert c["phase"] == "ended with the client" and not c["promoted"]
        e, counts = c["entries"], set(c["block_counts"].values())
        assert e > 0
        found = set()
        if N1 * e in counts:
            found.add("n1")
        if {N2 * e, SIDE * e, (N2 - SIDE) * e} <= counts:
            found.add("n2")
        assert found, c          # a counted region holds a known loop's exact counts
        loops |= found
    assert loops, counted


def test_counting_region_replaced_by_the_optimised_one(tmp_path) -> None:
    # The longest poll interval is far beyond the phase: the monitor must read the
    # counters when the threshold is due, not at that interval.
    regions, out, native = _run(tmp_path, 2_000_000, f"count_poll_ms={LONG_POLL_MS}")
    assert out == native
    counted = [r for r in regions if "counting" in r["info"]]
    assert counted, regions
    for r in counted:
        c = r["info"]["counting"]
        assert c["phase"] == "over" and c["why"] == "promoted", c
        assert c["promoted"] and min(c["promoted"].values()) >= 3000
        assert c["replaced"] and c["counters_after"] == 0, c
        assert c["seconds"] < LONG_POLL_MS / 2000, c
        assert c["over_at_s"] > 0 and c["replace_s"] >= 0, c
        assert 0 <= c["ended_after_s"] <= c["seconds"], c
        assert r["state"] == "installed"
        err = c["sample_error"]
        assert err["hot_blocks"] > 0 and err["block_count_error"] >= 0
        assert err["branch_direction_wrong"] is None or 0 <= err["branch_direction_wrong"] <= 1


def test_monitor_promotes_at_the_thresholds() -> None:
    sr = sr_with_indirect()
    addrs = iter(range(0x1000, 0x2000, 8))
    plan = plan_counters(sr, lambda: next(addrs))
    values = {a: 0 for a in plan.blocks.values()}
    done = []
    mon = CountMonitor(direct=30, indirect=50, max_s=60.0, poll_s=0.01, on_done=done.append)
    cr = CountingRegion("r1", 1, sr, plan, {}, values.get, started=0.0)
    assert cr.indirect == {0x200}
    mon.regions["r1"] = cr
    values[plan.blocks[0x100]], values[plan.blocks[0x200]] = 29, 49
    assert mon.poll(now=1.0) == [] and not cr.promoted
    values[plan.blocks[0x100]] = 30              # a direct block at its threshold
    assert mon.poll(now=1.1) == [cr] and cr.promoted == {0x100: 30}
    assert cr.done == "promoted" and cr.done_at == 1.1
    values[plan.blocks[0x200]] = 50              # the indirect target at its own
    assert mon.poll(now=1.2) == [] and cr.promoted == {0x100: 30, 0x200: 50}
    quiet = CountingRegion("r2", 2, sr, plan_counters(sr, lambda: 0x3000), {},
                           lambda a: 0, started=0.0)
    mon.regions = {"r2": quiet}
    assert mon.poll(now=59.0) == [] and mon.poll(now=60.0) == [quiet]
    assert quiet.done == "phase time bound"
    mon.stop()


def test_next_read_when_the_threshold_is_due() -> None:
    assert next_wait(0.0, 0.0, FIRST_POLL_S, 0.05) == 2 * FIRST_POLL_S
    assert next_wait(0.004, 0.0, 0.004, 0.05) == 0.008      # nothing ran: doubles
    assert next_wait(1.0, 0.0, 0.04, 0.05) == 0.05           # up to the longest
    assert abs(next_wait(0.002, 0.5, 0.001, 0.05) - 0.002) < 1e-12   # half way in 2 ms
    assert next_wait(0.002, 0.99, 0.001, 0.05) == FIRST_POLL_S       # never sooner
    assert next_wait(0.002, 0.001, 0.001, 0.05) == 0.05              # never later


def test_monitor_ends_the_phase_when_the_threshold_is_reached() -> None:
    """A loop counting a million entries a second reaches 3,000 in 3 ms: with a
    longest poll interval of 2 s the phase still ends within milliseconds."""
    sr = sr_with_indirect()
    addrs = iter(range(0x1000, 0x2000, 8))
    plan = plan_counters(sr, lambda: next(addrs))
    t0 = time.monotonic()

    def read(addr: int) -> int:
        return int((time.monotonic() - t0) * 1_000_000)
    ended = threading.Event()
    got = []

    def on_done(cr: CountingRegion) -> None:
        got.append((time.monotonic() - t0, cr))
        ended.set()
    mon = CountMonitor(direct=3000, indirect=5000, max_s=60.0,
                       poll_s=LONG_POLL_MS / 1000, on_done=on_done)
    try:
        mon.add(CountingRegion("r1", 1, sr, plan, {}, read, started=t0))
        assert ended.wait(LONG_POLL_MS / 1000 / 2), "the phase ran to the poll interval"
        (when, cr), = got
        assert cr.done == "promoted" and when < LONG_POLL_MS / 1000 / 2
        assert 0x100 in cr.promoted and cr.polls <= 12, cr.polls
    finally:
        mon.stop()


def test_monitor_does_not_spin_on_a_region_whose_phase_is_over() -> None:
    sr = sr_with_indirect()
    plan = plan_counters(sr, iter(range(0x1000, 0x2000, 8)).__next__)
    done = []
    mon = CountMonitor(direct=1, indirect=1, max_s=60.0, poll_s=0.05, on_done=done.append)
    cr = CountingRegion("r1", 1, sr, plan, {}, lambda a: 10)
    try:
        mon.add(cr)                   # promoted at once, never taken away
        time.sleep(0.3)
        assert done == [cr]
        assert cr.polls <= 0.3 / 0.05 + 3, cr.polls
    finally:
        mon.stop()
