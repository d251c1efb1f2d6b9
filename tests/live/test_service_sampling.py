"""Sampling through the service with the real agent: the hottest function is the top hot
spot (perf and agent-timer), and every thread is sampled, also threads started late."""

from __future__ import annotations

import pytest
from service_helpers import (ROOT, ServiceProc, agent_path, build_example, kill, spawn_client,
                             symbol_range)

pytestmark = pytest.mark.skipif(agent_path() is None, reason="libdbr_agent.so cannot be built")


def _hotspots_when(svc, pid, pred, timeout=20.0):
    def ready():
        try:
            h = svc.call("hotspots", {"pid": pid, "top": 50})
        except Exception:
            return None
        return h if pred(h) else None
    return svc.wait_for(ready, timeout, f"hot spots of {pid}")


def _top_in_function(svc, pid, binary, func, min_samples=60):
    h = _hotspots_when(svc, pid, lambda h: h["samples"] >= min_samples)
    lo, hi = symbol_range(binary, func)
    mine = [x for x in h["hotspots"] if x["module"] == binary]
    assert mine, h
    top = mine[0]
    assert lo <= top["offset"] < hi, (hex(top["offset"]), hex(lo), hex(hi), h["hotspots"][:5])
    in_func = sum(x["samples"] for x in mine if lo <= x["offset"] < hi)
    assert in_func > 0.5 * h["samples"], (in_func, h["samples"])
    return h


@pytest.mark.parametrize("source, expect", [("perf", "perf-"), ("agent-timer", "agent-timer")])
def test_hottest_function_is_top_hotspot(source, expect):
    svc = ServiceProc("--aggressive", f"sampling_source={source}").wait_ready()
    prog = build_example("hotloop")
    client = None
    try:
        client = spawn_client(svc.dir, [prog, "20000"])
        h = _top_in_function(svc, client.pid, prog, "mix")
        assert h["source"].startswith(expect), h["source"]
        assert svc.call("status")["sampling"]["active"].startswith(expect)
    finally:
        kill(client)
        svc.stop()


@pytest.mark.parametrize("continuous", [False, True], ids=["windows", "continuous"])
def test_every_thread_sampled_including_late_ones(continuous):
    """In windows, a thread started between two is found in /proc at the next one; with
    continuous sampling the source stays open, and a late thread is only known from the
    agent's THREAD_NEW, which the service asks for while a perf source is open."""
    svc = ServiceProc("--aggressive", f"continuous_sampling={str(continuous).lower()}"
                      ).wait_ready()
    prog = build_example("threads", ("-pthread",))
    client = None
    try:
        client = spawn_client(svc.dir, [prog, "4", "3000"])
        tids = []
        for _ in range(4):  # "thread K tid T": the last starts ~1.1 s after attach
            line = client.stdout.readline()
            assert line.startswith("thread"), line
            tids.append(line.split()[3])

        def all_sampled(h):
            return all(h["threads"].get(t, 0) >= 3 for t in tids)
        h = _hotspots_when(svc, client.pid, all_sampled, timeout=10.0)
        assert all_sampled(h), (tids, h["threads"])
        row = next(c for c in svc.call("clients") if c["pid"] == client.pid)
        if continuous:
            assert row["thread_notices"] == "on" and row["thread_notices_received"] >= 3, row
        out, _ = client.communicate(timeout=20)
        assert "threads: done" in out and client.returncode == 0
    finally:
        kill(client)
        svc.stop()


def test_regions_selected_in_workers_and_shown():
    """The worker job runs region selection on the live client; ctl lists the region
    and gives its graph."""
    import subprocess
    import sys

    svc = ServiceProc("--aggressive").wait_ready()
    prog = build_example("hotloop", ("-O2",))
    client = None
    try:
        client = spawn_client(svc.dir, [prog, "20000"])
        regs = svc.wait_for(lambda: (r := svc.call("regions", {"pid": client.pid}))["regions"]
                            and r, 30.0, "a region")
        lo, hi = symbol_range(prog, "mix")
        r = regs["regions"][0]
        assert r["state"] in ("selected", "installed", "removed") and r["blocks"] > 0 \
            and r["code_bytes"] > 0
        assert r["module"] == prog
        base = min(h["ip"] - h["offset"] for h in
                   svc.call("hotspots", {"pid": client.pid})["hotspots"] if h["module"] == prog)
        assert any(lo <= e - base < hi for e in r["entries"]), (r["entries"], base)
        dot = svc.call("region", {"pid": client.pid, "id": r["id"], "format": "dot"})["dot"]
        assert dot.lstrip().startswith("digraph")
        out = subprocess.run([sys.executable, "-m", "dbr_service.commands.cli", "ctl", "region",
                              str(client.pid), r["id"], "--dot", "/dev/null"], env=svc.env,
                             capture_output=True, text=True, timeout=20)
        assert out.returncode == 0, out.stderr
        assert svc.call("status")["scheduler"]["completed"] >= 1
    finally:
        kill(client)
        svc.stop()


@pytest.mark.parametrize("continuous", [False, True], ids=["windows", "continuous"])
def test_short_lived_threads_turn_the_notices_off_and_late_ones_are_still_sampled(continuous):
    """A program starting ~25000 threads a second: most are gone before the service can
    open their perf event, so after SHORT_THREADS_MIN of those it asks the agent for
    quiet for the rest of the window (the notices received stay a small share of the
    threads started).  A long-lived thread started halfway is sampled all the same:
    from /proc/PID/task when the next window opens, or (continuous sampling) when the
    open source is refreshed at the next snapshot."""
    from harness import compile_c
    from dbr_service.session.session_threads import SHORT_THREADS_MIN

    # first without the service's memory of such programs (below), so that every
    # window asks for notices and is quieted
    svc = ServiceProc("--aggressive", f"continuous_sampling={str(continuous).lower()}",
                      "short_thread_memory_s=0").wait_ready()
    prog = str(compile_c([ROOT / "bench" / "workloads" / "churn.c"], flags=["-O2"]))
    try:
        row, started = _churn_with_a_late_thread(svc, prog)
        assert row["short_thread_windows"] >= 1, row
        # the main thread, starting and joining them, leaves its CPU tens of thousands
        # of times a second: no perf event for it (perf_max_switch_rate)
        assert row["threads_switch_gated"] >= 1, row
        # notices the agent sent before it had the quiet still arrive (it starts
        # threads faster than a round trip): no event is opened for them
        assert row["notices_after_quiet"] >= 1, row
        # without the early quiet every thread started in a window brings two notices
        # (windows cover 2/3 of the time here, all of it when continuous): over 1.3 per
        # thread started; with it, a few hundred per window at most
        assert row["short_thread_windows"] * SHORT_THREADS_MIN <= \
            row["thread_notices_received"] < 0.5 * started, (row, started)

        # With the memory (ShortThreadPrograms), a run's first quieted window is its
        # last window with notices, and a later run of the same program asks for
        # none at all; its long-lived thread is still sampled, found in
        # /proc/PID/task when a window opens (or the open source is refreshed).
        svc.call("config_set", {"key": "short_thread_memory_s", "value": 3600})
        for run in ("first", "later"):
            row, _ = _churn_with_a_late_thread(svc, prog)
            assert row["windows_without_notices"] >= 1, (run, row)
            if run == "first":
                assert row["short_thread_windows"] == 1, row
            else:
                assert row["thread_notices_received"] == 0, row
                assert row["short_thread_windows"] == 0, row
    finally:
        svc.stop()


def _churn_with_a_late_thread(svc, prog: str) -> tuple[dict, int]:
    """Run churn 40000 (~3.5 s natively) whose long-lived thread starts halfway, at
    ~0.4 s; once that thread has 5 samples, let it finish.  Its row of `clients`
    (once it has ended) and the threads it started."""
    client = spawn_client(svc.dir, [prog, "40000", "late"])
    try:
        line = client.stdout.readline()
        assert line.startswith("late tid"), line
        late = line.split()[2]
        h = _hotspots_when(svc, client.pid, lambda h: h["threads"].get(late, 0) >= 5,
                           timeout=10.0)
        assert h["threads"].get(late, 0) >= 5, h["threads"]
        out, _ = client.communicate(timeout=30)
        assert client.returncode == 0, out
        started = int(out.split("churn:")[1].split()[0])
        assert started == 40000, out
        return next(c for c in svc.call("clients", {"all": True})
                    if c["pid"] == client.pid), started
    finally:
        kill(client)


def test_programs_with_short_lived_threads_are_remembered():
    """ShortThreadPrograms: by executable and build id, for keep_s after the last
    sighting, at most max_programs (least recently seen first out); an unknown
    executable (empty name) is never remembered."""
    from dbr_service.session.session_threads import ShortThreadPrograms

    m = ShortThreadPrograms(keep_s=10.0, max_programs=2)
    m.note("/bin/churn", "ab", now=100.0)
    assert m.known("/bin/churn", "ab", now=105.0)
    assert not m.known("/bin/churn", "cd", now=105.0)     # another build
    assert not m.known("/bin/other", "ab", now=105.0)
    m.note("/bin/churn", "ab", now=108.0)                 # seen again: kept longer
    assert m.known("/bin/churn", "ab", now=117.0)
    assert not m.known("/bin/churn", "ab", now=118.5)     # forgotten
    assert not m.known("/bin/churn", "ab", now=100.0)     # and gone, not only old
    m.note("a", "1", now=200.0)
    m.note("b", "1", now=201.0)
    m.note("a", "1", now=202.0)                           # a is now the most recent
    m.note("c", "1", now=203.0)                           # b goes
    assert m.known("a", "1", now=204.0) and m.known("c", "1", now=204.0)
    assert not m.known("b", "1", now=204.0)
    m.note("", "", now=205.0)
    assert not m.known("", "", now=205.0)
    m.keep_s = 0.0                                        # short_thread_memory_s=0
    assert not m.known("a", "1", now=204.0)
    m.note("d", "1", now=206.0)
    assert not m.known("d", "1", now=206.0)


def test_continuous_sampling_looks_at_switch_rates_again_once_a_second():
    """With continuous sampling the source stays open: a thread that gives up its CPU
    ~14 000 times a second gets no perf event (perf_max_switch_rate), its spinning
    sibling does; once it spins too (SIGUSR1), a later look (once a second, GATE_LOOK_S)
    gives it one."""
    import os
    import signal
    import time

    from harness import compile_c

    # (without the agent's timer for gated threads, test below, so that a gated
    # thread takes no sample at all)
    svc = ServiceProc("--aggressive", "continuous_sampling=true",
                      "gated_thread_timer=false").wait_ready()
    prog = str(compile_c([ROOT / "tests" / "sampling_progs" / "switchy.c"],
                         flags=["-O1", "-pthread"]))
    client = None
    try:
        client = spawn_client(svc.dir, [prog])
        tids = dict(client.stdout.readline().split() for _ in range(2))
        assert set(tids) == {"spin", "switchy"}, tids

        def row():
            return next(c for c in svc.call("clients") if c["pid"] == client.pid)
        # (a thread younger than 50 ms has no rate yet: it may have had an event
        # until the next snapshot looked at it)
        h = _hotspots_when(svc, client.pid, lambda h: h["threads"].get(tids["spin"], 0) >= 30
                           and row()["threads_switch_gated"] >= 2, timeout=15.0)
        gated_at = h["threads"].get(tids["switchy"], 0)
        time.sleep(0.6)   # four snapshots at --aggressive: still gated, no new samples
        h = svc.call("hotspots", {"pid": client.pid, "top": 50})
        assert h["threads"].get(tids["switchy"], 0) <= gated_at + 2, (gated_at, h["threads"])
        assert h["threads"][tids["spin"]] >= 100, h["threads"]
        os.kill(client.pid, signal.SIGUSR1)
        h = _hotspots_when(svc, client.pid,
                           lambda h: h["threads"].get(tids["switchy"], 0) >= gated_at + 20,
                           timeout=15.0)
        assert h["threads"][tids["switchy"]] >= gated_at + 20, h["threads"]
        assert client.poll() is None
    finally:
        kill(client)
        svc.stop()


@pytest.mark.parametrize("continuous", [False, True], ids=["windows", "continuous"])
def test_threads_that_switch_too_often_for_perf_get_the_agents_timer(continuous):
    """A thread that gives up its CPU ~12 000 times a second gets no perf event
    (perf_max_switch_rate), so the service names it to the agent's listed timer
    sampler: its samples arrive all the same, counted in the client's row, and its
    spinning sibling keeps its perf event (no timer).  gated_thread_timer=false
    (test above) leaves it unsampled."""
    from harness import compile_c

    svc = ServiceProc("--aggressive", f"continuous_sampling={str(continuous).lower()}"
                      ).wait_ready()
    prog = str(compile_c([ROOT / "tests" / "sampling_progs" / "switchy.c"],
                         flags=["-O1", "-pthread"]))
    client = None
    try:
        client = spawn_client(svc.dir, [prog], env={"SWITCHY_WORK": "20"})
        tids = dict(client.stdout.readline().split() for _ in range(2))
        assert set(tids) == {"spin", "switchy"}, tids

        def row():
            return next((c for c in svc.call("clients") if c["pid"] == client.pid), {})
        # (a thread younger than 50 ms has no rate yet and may get a perf event first:
        # count from when the gate has refused it)
        svc.wait_for(lambda: row().get("threads_switch_gated", 0) >= 1, 15.0, "a gated thread")
        at = svc.call("hotspots", {"pid": client.pid, "top": 50})["threads"].get(
            tids["switchy"], 0)
        h = _hotspots_when(svc, client.pid,
                           lambda h: h["threads"].get(tids["switchy"], 0) >= at + 10,
                           timeout=20.0)
        assert h["threads"][tids["switchy"]] >= at + 10, (at, h["threads"])
        r = svc.wait_for(lambda: (r := row())["gated_timer_samples"] >= 10 and r, 20.0,
                         "samples from the gated thread's timer")
        assert r["threads_timer_sampled"] == 1, r
        assert r["source"] == "perf-cpu-clock+agent-timer", r
        assert not [e for e in r["errors"] if "timer" in e], r["errors"]
        assert client.poll() is None
    finally:
        kill(client)
        svc.stop()
