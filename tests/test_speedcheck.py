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
    assert chk.order == [REPLACEMENT, ORIGINAL, ORIGINAL, REPLACEMENT,
                         REPLACEMENT, ORIGINAL, ORIGINAL, REPLACEMENT]
    assert chk.next_kind() == REPLACEMENT


def test_a_consistently_slower_region_is_called_slower():
    chk = run_check({REPLACEMENT: [9.0e6, 9.1e6, 8.9e6], ORIGINAL: [10.0e6]})
    assert chk.verdict == "slower", chk.why
    assert chk.ratio == pytest.approx(0.90, abs=0.01)
    assert len(chk.ratios) == 6 and len(chk.phases) == 12
    s = chk.summary()
    assert s["verdict"] == "slower" and s["regions"] == ["a", "b"] and s["phases"] == 12


def test_faster_and_same():
    assert run_check({REPLACEMENT: [11e6], ORIGINAL: [10e6]}).verdict == "faster"
    same = run_check({REPLACEMENT: [10.1e6, 9.9e6], ORIGINAL: [10e6]})
    assert same.verdict == "same" and "within 3%" in same.why


def test_one_contrary_pair_is_allowed_two_are_not():
    # pairs: R/O rates (9,10) x5 and (11,10) once: median 0.9, one contrary pair
    one = run_check({REPLACEMENT: [9e6, 9e6, 9e6, 9e6, 9e6, 11e6],
                     ORIGINAL: [10e6]})
    assert one.verdict == "slower"
    two = run_check({REPLACEMENT: [9e6, 11e6, 9e6, 9e6, 11e6, 9e6], ORIGINAL: [10e6]})
    assert sum(r > 1 for r in two.ratios) == 2
    assert two.verdict == "same", two.ratios


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
