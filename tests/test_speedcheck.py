"""dbr_service/speedcheck.py: the phases of a speed check, its verdicts from made-up
progress readings, and the progress read from a real process."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from dbr_service.speedcheck import (MIN_CPU_S, MIN_IO_BYTES, ORIGINAL, REPLACEMENT, Progress,
                                    SpeedCheck, read_progress)


def run_check(rates: dict[str, list[float]], pairs: int = 6, cpu_s: float = 0.4,
              margin: float = 0.03) -> SpeedCheck:
    """Drive a check through all its phases; the phase of kind K, the i-th of its kind,
    does rates[K][i] bytes of I/O per CPU second over ``cpu_s`` of CPU."""
    chk = SpeedCheck([1, 2], ["a", "b"], pairs=pairs, phase_s=0.5, margin=margin)
    seen = {REPLACEMENT: 0, ORIGINAL: 0}
    io, cpu, now = 1000, 10**9, 100.0
    while (kind := chk.next_kind()) is not None:
        chk.begin(kind, Progress(io, cpu), now)
        assert chk.next_at == now + 0.5
        rate = rates[kind][seen[kind] % len(rates[kind])]
        seen[kind] += 1
        io += int(rate * cpu_s)
        cpu += int(cpu_s * 1e9)
        now += 0.5
        chk.end(Progress(io, cpu))
    assert chk.done
    return chk


def test_phases_alternate_and_the_first_runs_the_regions_as_installed():
    chk = SpeedCheck([1], ["a"], pairs=4)
    assert chk.order == [REPLACEMENT, REPLACEMENT, ORIGINAL, ORIGINAL, REPLACEMENT,
                         REPLACEMENT, ORIGINAL, ORIGINAL, REPLACEMENT]
    assert chk.next_kind() == REPLACEMENT


def test_a_consistently_slower_region_is_called_slower():
    chk = run_check({REPLACEMENT: [9.0e6, 9.1e6, 8.9e6], ORIGINAL: [10.0e6]})
    assert chk.verdict == "slower", chk.why
    assert chk.ratio == pytest.approx(0.90, abs=0.01)
    assert chk.interval[0] < chk.ratio < chk.interval[1] < 1.0
    assert len(chk.ratios) == 6 and len(chk.phases) == 13
    s = chk.summary()
    assert s["verdict"] == "slower" and s["regions"] == ["a", "b"] and s["phases"] == 13


def test_the_first_phase_is_not_counted():
    """It runs the regions as installed right after the last sampling window: a
    slow first phase (here a fifth of the rate) changes nothing."""
    chk = run_check({REPLACEMENT: [2e6, 10e6, 10e6, 10e6, 10e6, 10e6, 10e6], ORIGINAL: [10e6]})
    assert chk.verdict == "same" and chk.ratios == [1.0] * 6


def test_faster_and_same():
    fast = run_check({REPLACEMENT: [11e6, 11.1e6, 10.9e6], ORIGINAL: [10e6]})
    assert fast.verdict == "faster" and fast.interval[0] > 1.0
    # a consistent 1 % is shown but within the 3 % margin
    small = run_check({REPLACEMENT: [10.1e6, 10.11e6, 10.09e6], ORIGINAL: [10e6]})
    assert small.verdict == "same" and "within 3%" in small.why, small.why


def test_a_noisy_program_shows_no_difference():
    """Pair ratios spread as native xz's half seconds do (0.8-1.35): even a geometric
    mean 8 % below 1 is no verdict when the interval reaches past 1."""
    noisy = run_check({REPLACEMENT: [10e6, 8.0e6, 10.4e6, 7.6e6, 9.2e6, 11.5e6, 8.3e6],
                       ORIGINAL: [10e6]})
    assert noisy.ratio < 0.97 and noisy.interval[0] < 1.0 < noisy.interval[1]
    assert noisy.verdict == "same" and "no difference shown" in noisy.why
    # the same spread around 0.5 is shown
    slow = run_check({REPLACEMENT: [5e6, 4.0e6, 5.2e6, 3.8e6, 4.6e6, 5.75e6, 4.15e6],
                      ORIGINAL: [10e6]})
    assert slow.verdict == "slower" and slow.interval[1] < 1.0


def test_a_program_with_little_io_is_unmeasurable_after_one_phase():
    chk = SpeedCheck([1], ["a"])
    chk.begin(chk.next_kind(), Progress(0, 0), 1.0)
    chk.end(Progress(MIN_IO_BYTES - 1, 10**9))
    assert chk.verdict == "unmeasurable" and "bytes of I/O" in chk.why
    assert chk.next_kind() is None and len(chk.phases) == 0
    idle = SpeedCheck([1], ["a"])
    idle.begin(REPLACEMENT, Progress(0, 0), 1.0)
    idle.end(Progress(10 * MIN_IO_BYTES, int(MIN_CPU_S * 1e9) - 1))
    assert idle.verdict == "unmeasurable"


def test_unreadable_progress_ends_the_check():
    chk = SpeedCheck([1], ["a"])
    chk.begin(REPLACEMENT, None, 1.0)
    assert chk.verdict == "unmeasurable" and chk.next_kind() is None
    chk = SpeedCheck([1], ["a"])
    chk.begin(REPLACEMENT, Progress(0, 0), 1.0)
    chk.end(None)
    assert chk.verdict == "unmeasurable"


def test_read_progress_of_a_process_that_reads_and_writes():
    code = ("import sys,time\n"
            "sys.stdout.write('ready\\n'); sys.stdout.flush(); sys.stdin.readline()\n"
            "t=time.time()\n"
            "while time.time()-t<0.3:\n"
            "    open('/dev/zero','rb').read(1<<16)\n"
            "sys.stdout.write('done\\n'); sys.stdout.flush(); sys.stdin.readline()\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline() == "ready\n"
        a = read_progress(p.pid)
        p.stdin.write("\n")
        p.stdin.flush()
        assert p.stdout.readline() == "done\n"
        b = read_progress(p.pid)
        assert a is not None and b is not None
        assert b.io_bytes - a.io_bytes >= 1 << 16
        assert 0.05e9 < b.cpu_ns - a.cpu_ns < 5e9
    finally:
        p.kill()
        p.wait(timeout=10)
    t = time.monotonic()
    while read_progress(p.pid) is not None and time.monotonic() - t < 5:
        time.sleep(0.01)
    assert read_progress(p.pid) is None


def test_dbr_ctl_regions_shows_each_regions_verdict():
    from dbr_service.cmd_ctl import render

    out = render("regions", {"pid": 7, "status": "2 region(s) selected", "regions": [
        {"id": "r1", "state": "removed", "blocks": 3, "code_bytes": 90, "entries": [0x1000],
         "module": "/bin/x", "info": {"speed_check": {"verdict": "slower", "ratio": 0.9123}}},
        {"id": "r2", "state": "installed", "blocks": 2, "code_bytes": 40, "entries": [0x2000],
         "module": "/bin/x", "info": {"speed_check": {"verdict": "unmeasurable",
                                                      "ratio": None}}},
        {"id": "r3", "state": "selected", "blocks": 2, "code_bytes": 40, "entries": [0x3000],
         "module": "/bin/x", "info": {}}]})
    lines = out.splitlines()
    assert "SPEED" in lines[1]
    assert "slower x0.912" in lines[2] and "unmeasurable" in lines[3]
    assert "x" not in lines[3].split("unmeasurable")[1].split("0x")[0]


def test_the_run_report_on_stderr_names_each_check():
    from dbr_service.report import format_report, run_report

    client = {"pid": 5, "exe": "/bin/x", "samples": 10, "samples_in_replacement": 5,
              "patches_installed": 1, "regions": [], "sampling_source": "perf",
              "region_status": "1 region(s) selected", "hotspots": [],
              "speed_checks": [{"regions": ["r1", "r2"], "verdict": "slower", "ratio": 0.9},
                               {"regions": ["r3"], "verdict": "unmeasurable", "ratio": None}]}
    text = format_report(run_report(["x"], 0, 1.0, [client]))
    assert "speed check of r1, r2: slower x0.900" in text
    assert "speed check of r3: unmeasurable\n" in text + "\n"
