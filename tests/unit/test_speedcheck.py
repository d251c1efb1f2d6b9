"""dbr_service/installation/speedcheck.py: the phases of a speed check, its verdicts from made-up
progress readings, and the progress read from a real process."""

from __future__ import annotations

import collections
import subprocess
import sys
import threading
import time
import types

import pytest

from dbr_service.session.cadence import SessionCadence
from dbr_service.session.clients import ClientSession
from dbr_service.session.session_regions import RegionBook, RegionRecord, RegionState
from dbr_service.installation.install import InstallState
from dbr_service.installation.speedcheck import (CHECK_TRIES, MIN_CPU_S, MIN_ENTRIES, MIN_IO_BYTES,
                                                 ORIGINAL,
                                                 REPLACEMENT, Progress, SpeedCheck, read_progress,
                                                 verdict_text)


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


def run_counted_check(rates: dict[str, float], io_rate: float = 1000.0,
                      cpu_s: float = 0.4) -> SpeedCheck:
    """Drive a check of a program with little I/O whose progress points are passed
    rates[K] times per CPU second in phases of kind K."""
    chk = SpeedCheck([1], ["a"], pairs=4)
    io, cpu, n = 0, 10**9, 0
    while (kind := chk.next_kind()) is not None:
        chk.begin(kind, Progress(io, cpu, n), 1.0)
        io += int(io_rate * cpu_s)
        cpu += int(cpu_s * 1e9)
        n += int(rates[kind] * cpu_s)
        chk.end(Progress(io, cpu, n))
    return chk


def test_a_program_with_little_io_is_judged_by_its_progress_points():
    slower = run_counted_check({REPLACEMENT: 90_000.0, ORIGINAL: 100_000.0})
    assert (slower.verdict, slower.measure) == ("slower", "entries"), slower.why
    assert slower.ratio == pytest.approx(0.9, abs=0.001)
    assert slower.summary()["measure"] == "entries"
    same = run_counted_check({REPLACEMENT: 100_000.0, ORIGINAL: 100_000.0})
    assert (same.verdict, same.measure) == ("same", "entries")
    faster = run_counted_check({REPLACEMENT: 125_000.0, ORIGINAL: 100_000.0})
    assert (faster.verdict, faster.measure) == ("faster", "entries")


def test_enough_io_is_measured_by_io_even_with_progress_points():
    chk = run_counted_check({REPLACEMENT: 90_000.0, ORIGINAL: 100_000.0},
                            io_rate=10 * MIN_IO_BYTES)
    assert (chk.verdict, chk.measure) == ("same", "io"), chk.why


def test_too_few_passes_and_too_little_io_are_unmeasurable():
    chk = SpeedCheck([1], ["a"])
    chk.begin(REPLACEMENT, Progress(0, 0, 0), 1.0)
    chk.end(Progress(100, 10**9, MIN_ENTRIES - 1))
    assert chk.verdict == "unmeasurable" and chk.measure is None
    assert f"{MIN_ENTRIES - 1} passes" in chk.why
    # points lost after the check chose them (their trampolines were removed): ends it
    chk = SpeedCheck([1], ["a"])
    chk.begin(REPLACEMENT, Progress(0, 0, 0), 1.0)
    chk.end(Progress(100, 10**9, 10 * MIN_ENTRIES))
    assert chk.measure == "entries" and not chk.done
    chk.begin(chk.next_kind(), Progress(100, 10**9, 10 * MIN_ENTRIES), 2.0)
    chk.end(Progress(200, 2 * 10**9, None))
    assert chk.verdict == "unmeasurable" and "progress points" in chk.why


def test_too_little_io_asks_for_progress_points_once_then_runs_the_first_phase_again():
    chk = SpeedCheck([1], ["a"], may_count=True)
    chk.begin(REPLACEMENT, Progress(0, 0), 1.0)
    chk.end(Progress(100, 10**9))
    assert not chk.done and "bytes of I/O" in chk.wants_points
    assert chk.next_kind() == REPLACEMENT and chk.phases == []
    chk.wants_points = ""
    chk.begin(REPLACEMENT, Progress(100, 10**9, 0), 2.0)
    chk.end(Progress(200, 2 * 10**9, 5 * MIN_ENTRIES))
    assert chk.measure == "entries" and len(chk.phases) == 1
    # counted and still too few: unmeasurable, not asked again
    again = SpeedCheck([1], ["a"], may_count=True)
    again.begin(REPLACEMENT, Progress(0, 0), 1.0)
    again.end(Progress(100, 10**9))
    again.wants_points = ""
    again.begin(REPLACEMENT, Progress(0, 10**9, 0), 2.0)
    again.end(Progress(100, 2 * 10**9, 3))
    assert again.verdict == "unmeasurable" and not again.wants_points
    # too little CPU is not helped by counting
    idle = SpeedCheck([1], ["a"], may_count=True)
    idle.begin(REPLACEMENT, Progress(0, 0), 1.0)
    idle.end(Progress(0, 1000))
    assert idle.verdict == "unmeasurable" and not idle.wants_points


def test_verdict_text_names_the_entries_measure():
    assert verdict_text("slower", 0.9, "entries") == "slower x0.900 by entries"
    assert verdict_text("slower", 0.9, "io") == "slower x0.900"
    assert verdict_text("unmeasurable", None, None) == "unmeasurable"


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
    from dbr_service.commands.cmd_ctl import render

    out = render("regions", {"pid": 7, "status": "2 region(s) selected", "regions": [
        {"id": "r1", "state": "removed", "blocks": 3, "code_bytes": 90, "entries": [0x1000],
         "module": "/bin/x", "info": {"speed_check": {"verdict": "slower", "ratio": 0.9123}}},
        {"id": "r2", "state": "installed", "blocks": 2, "code_bytes": 40, "entries": [0x2000],
         "module": "/bin/x", "info": {"speed_check": {"verdict": "unmeasurable",
                                                      "ratio": None}}},
        {"id": "r3", "state": "selected", "blocks": 2, "code_bytes": 40, "entries": [0x3000],
         "module": "/bin/x", "info": {}},
        {"id": "r4", "state": "installed", "blocks": 2, "code_bytes": 40, "entries": [0x4000],
         "module": "/bin/x", "info": {"speed_checks_abandoned": 1}}]})
    lines = out.splitlines()
    assert "SPEED" in lines[1]
    assert "slower x0.912" in lines[2] and "unmeasurable" in lines[3]
    assert "abandoned x1, again" in lines[5] and "abandoned" not in lines[4]
    assert "x" not in lines[3].split("unmeasurable")[1].split("0x")[0]


def test_the_run_report_on_stderr_names_each_check():
    from dbr_service.commands.report import format_report, run_report

    client = {"pid": 5, "exe": "/bin/x", "samples": 10, "samples_in_replacement": 5,
              "patches_installed": 1, "regions": [], "sampling_source": "perf",
              "region_status": "1 region(s) selected", "hotspots": [],
              "speed_checks": [{"regions": ["r1", "r2"], "verdict": "slower", "ratio": 0.9},
                               {"regions": ["r3"], "verdict": "unmeasurable", "ratio": None}]}
    text = format_report(run_report(["x"], 0, 1.0, [client]))
    assert "speed check of r1, r2: slower x0.900" in text
    assert "speed check of r3: unmeasurable\n" in text + "\n"


# ------------------------------------------------------------------ abandoned checks

class _Reg:
    def __init__(self, state):
        self.state, self.evicted, self.sites, self.patched_sites = state, 0, [1], [1]


class _Installer:
    """The installer as _speed_finish sees it: regions by install id, and resume()."""

    evict_enabled = transfer_enabled = True

    def __init__(self):
        self.regions = {1: _Reg(InstallState.INSTALLED), 2: _Reg(InstallState.SUSPENDED)}
        self.resumed: list[int] = []

    def resume(self, iid):
        self.resumed.append(iid)
        self.regions[iid].state = InstallState.INSTALLED

    def pop_cascaded(self):
        return []                       # no region here calls another's copy


def _session(monkeypatch):
    """A ClientSession with two live regions, r1 (installed) and r2 (suspended, as in a
    check's original phase), and nothing behind it but the fields the check uses."""
    s = ClientSession.__new__(ClientSession)
    s.pid, s.lock, s.installer = 1, threading.RLock(), _Installer()
    s.speed_check, s.slow_ranges, s.region_book = None, [], RegionBook(s.lock)
    s.speed_points = s.counter_space = s.install_after_check = None
    s.speed_checks, s.cadence, s.patches_removed = collections.deque(maxlen=16), SessionCadence(), 0
    s.service = types.SimpleNamespace(events=types.SimpleNamespace(publish=lambda *a, **k: None))
    monkeypatch.setattr(s, "_write_perf_map", lambda: None)
    for iid in (1, 2):
        s.region_book.regions[f"r{iid}"] = RegionRecord(
            f"r{iid}", "m", [iid], 1, 16, state=RegionState.INSTALLED, sites=[iid],
            info={"install_id": iid}, installed_mono=10.0)
    return s


def _abandon(s, rids):
    chk = SpeedCheck([int(r[1:]) for r in rids], rids, pairs=2, phase_s=0.5, margin=0.03)
    chk.stop("abandoned", "a region of the check was removed meanwhile")
    s.speed_check = chk
    s._speed_finish()
    return chk


def test_an_abandoned_check_leaves_its_live_regions_to_a_later_one(monkeypatch):
    """A check ends "abandoned" when one of its regions goes meanwhile; the regions
    still live are not judged by it: they are resumed, checked again once the settling
    time has passed since, and only after CHECK_TRIES abandoned checks keep that
    verdict (so a map that keeps changing cannot hold sampling off for good)."""

    s = _session(monkeypatch)
    assert s.speed_candidates(2.0, 20.0) == ["r1", "r2"]
    # r1 goes (a map change, say) while r2 is suspended for an original phase
    s.installer.regions[1].state = InstallState.REMOVED
    s.region_book.regions["r1"].state = RegionState.REMOVED
    _abandon(s, ["r1", "r2"])
    r1, r2 = s.region_book.regions["r1"].info, s.region_book.regions["r2"].info
    assert r1["speed_check"]["verdict"] == "abandoned"     # gone: its last word
    assert "speed_check" not in r2 and r2["speed_checks_abandoned"] == 1
    assert s.installer.resumed == [2]                      # patched again at once
    assert s.speed_checks[-1]["verdict"] == "abandoned"
    t = s.region_book.regions["r2"].recheck_mono
    assert t > 0
    assert s.speed_candidates(2.0, t + 1.0) == []          # settling again
    assert s.speed_candidates(2.0, t + 2.5) == ["r2"]
    for n in range(2, CHECK_TRIES + 1):
        _abandon(s, ["r2"])
        assert r2["speed_checks_abandoned"] == n
    assert r2["speed_check"]["verdict"] == "abandoned"     # the last try's verdict stays
    assert s.speed_candidates(2.0, time.monotonic() + 100) == []
    assert s.region_book.regions["r2"].state is RegionState.INSTALLED


def test_other_verdicts_are_final_at_once(monkeypatch):
    s = _session(monkeypatch)
    chk = SpeedCheck([1, 2], ["r1", "r2"], pairs=2, phase_s=0.5, margin=0.03)
    chk.stop("unmeasurable", "a 0.5 s phase saw 0 bytes of I/O")
    s.speed_check = chk
    s._speed_finish()
    for rid in ("r1", "r2"):
        assert s.region_book.regions[rid].info["speed_check"]["verdict"] == "unmeasurable"
        assert "speed_checks_abandoned" not in s.region_book.regions[rid].info
    assert s.speed_candidates(2.0, time.monotonic() + 100) == []


def test_a_map_change_over_a_counter_buffer_takes_the_counting_code_out(monkeypatch):
    """The program unmaps a data buffer that counting code writes to: before the agent
    lets the call go ahead, the check's counting code is removed and the check ends
    "abandoned"; no counter is handed out there again.  A change elsewhere leaves it."""
    from dbr_service.installation.progress_points import CounterSpace

    s = _session(monkeypatch)
    removed = []
    s.counter_space = CounterSpace(conn=None)
    buf = types.SimpleNamespace(base=0x7000_0000, size=4096, buffer_id=9)
    s.counter_space.buffers, s.counter_space.used = [buf], {9: 8}
    s.speed_points = types.SimpleNamespace(remove=lambda: removed.append(1))
    s.speed_check = SpeedCheck([1], ["r1"], pairs=2)
    s._speed_map_changed(0x6000_0000, 0x6fff_f000)
    assert s.speed_check is not None and not removed and s.counter_space.buffers == [buf]
    s._speed_map_changed(0x7000_0000, 0x7000_1000)
    assert removed == [1] and s.speed_check is None and s.speed_points is None
    assert s.counter_space.buffers == []
    assert s.speed_checks[-1]["verdict"] == "abandoned"
    assert "counter buffer" in s.speed_checks[-1]["why"]


def test_a_selection_made_during_a_check_is_installed_when_it_ends(monkeypatch):
    """A job's result that arrives while a check runs is not installed then (no region
    goes live during a check), nor dropped: it is installed when the check ends."""
    s = _session(monkeypatch)
    s.region_book.operator_hold_all = True       # install_selected stops before any work
    calls = []
    real = ClientSession.install_selected

    def spy(self, srs, ids):
        calls.append((list(srs), list(ids), self.speed_check is None))
        return real(self, srs, ids)

    monkeypatch.setattr(ClientSession, "install_selected", spy)
    s.speed_check = SpeedCheck([1, 2], ["r1", "r2"], pairs=2, phase_s=0.5, margin=0.03)
    assert s.install_selected(["sr9"], ["r9"]) == 0
    assert s.install_after_check == (["sr9"], ["r9"])
    s.speed_check.stop("unmeasurable", "a 0.5 s phase saw 0 bytes of I/O")
    s._speed_finish()
    assert calls[-1] == (["sr9"], ["r9"], True)            # again, once the check ended
    assert s.install_after_check is None
