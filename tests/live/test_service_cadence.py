"""Sampling cadence: a client whose snapshots change nothing is sampled less often
(cadence.sampling_interval), and code mapped in (a dlopen) brings it back to the
full rate.  The point is cost: sampling is part of what a deployed host costs a
program that has nothing left to optimize
(docs/decisions/0012-sampling-cadence-quiet-and-young-clients.md)."""

from __future__ import annotations

import signal
import time
from types import SimpleNamespace

import pytest
from harness import compile_c
from service_helpers import ServiceProc, agent_path, kill, spawn_client

from dbr_service.common.config import AGGRESSIVE, Config
from dbr_service.session.cadence import QUIET_BEFORE_BACKOFF, sampling_interval


def _cfg(**kw):
    base = dict(snapshot_interval_s=1.0, snapshot_backoff_max_s=8.0, continuous_sampling=False)
    return SimpleNamespace(**{**base, **kw})


def test_interval_doubles_after_quiet_snapshots_up_to_the_cap():
    cfg = _cfg()
    got = [sampling_interval(cfg, q) for q in range(QUIET_BEFORE_BACKOFF + 5)]
    assert got[:QUIET_BEFORE_BACKOFF] == [1.0] * QUIET_BEFORE_BACKOFF
    assert got[QUIET_BEFORE_BACKOFF:] == [2.0, 4.0, 8.0, 8.0, 8.0]
    assert sampling_interval(cfg, 10**6) == 8.0            # no overflow on long quiet runs


@pytest.mark.parametrize("kw", [dict(snapshot_backoff_max_s=0.5),   # cap below the base
                                dict(snapshot_backoff_max_s=1.0),
                                dict(continuous_sampling=True)])
def test_no_backoff_when_configured_off(kw):
    cfg = _cfg(**kw)
    assert {sampling_interval(cfg, q) for q in range(12)} == {1.0}


def test_defaults_back_off_and_aggressive_does_not():
    d = Config()
    assert d.snapshot_backoff_max_s > d.snapshot_interval_s
    a = Config(**AGGRESSIVE)
    assert sampling_interval(a, 50) == a.snapshot_interval_s


def _client(svc, pid):
    return next((c for c in svc.call("clients") if c["pid"] == pid), None)


@pytest.mark.skipif(agent_path() is None, reason="libdbr_agent.so cannot be built")
def test_quiet_client_is_sampled_less_until_code_is_mapped():
    """A steady hot loop: once its region is live and selection keeps finding the
    same, its snapshots thin out to one per snapshot_backoff_max_s while the
    service's snapshots go on; a dlopen puts it back at the full rate at once."""
    prog = compile_c(["quietdl.c"], flags=["-O2"])
    lib = compile_c(["hotlib.c"], shared=True, out_name="libhot")
    svc = ServiceProc("--aggressive", "snapshot_interval_s=0.1", "snapshot_window_s=0.05",
                      "snapshot_backoff_max_s=0.8").wait_ready()
    client = None
    try:
        client = spawn_client(svc.dir, [str(prog), "60", str(lib)])
        assert client.stdout.readline().strip() == "ready"
        pid = client.pid
        c = svc.wait_for(lambda: (c := _client(svc, pid)) and c["sampling_interval_s"] == 0.8
                         and c, 40.0, "the client backing off to 0.8 s")
        assert c["patches_installed"] >= 1 and c["quiet_snapshots"] >= QUIET_BEFORE_BACKOFF + 2

        # backed off: about one window per 0.8 s while the service snapshots every 0.1 s
        svc_before, mine_before = svc.call("status")["snapshots"], c["snapshots"]
        time.sleep(2.4)
        c = _client(svc, pid)
        svc_n = svc.call("status")["snapshots"] - svc_before
        mine = c["snapshots"] - mine_before
        assert svc_n >= 12, svc_n
        assert 1 <= mine <= 5, (mine, svc_n)
        assert client.poll() is None

        # new code: back to the full rate within a window or two
        client.send_signal(signal.SIGUSR1)
        assert client.stdout.readline().strip() == "opened"
        svc.wait_for(lambda: (c := _client(svc, pid)) and c["quiet_snapshots"] == 0
                     and c["sampling_interval_s"] == 0.1, 5.0, "the full rate after dlopen")
        client.send_signal(signal.SIGTERM)
        client.wait(timeout=10)
    finally:
        kill(client)
        svc.stop()


def test_a_region_inside_code_already_replaced_is_covered():
    """Sampling noise moves a loop's entries by a block from job to job; a region
    whose entries all lie in code an installed region replaces is a variant of it:
    not installed again, and no news for the quiet judgement (service._apply_result).
    Once the installed region is removed, the variant is installable."""
    import threading

    from dbr_service.session.session_regions import RegionBook, RegionRecord, RegionState

    live = RegionRecord("r1", "/lib/liblzma.so", [0x19F7], 11, 203,
                        state=RegionState.INSTALLED, orig_ranges=[(0x19A0, 0x1A30)])
    other = RegionRecord("r2", "/lib/libc.so", [0x5000], 3, 50,
                         state=RegionState.INSTALLED, orig_ranges=[(0x5000, 0x5040)])
    book = RegionBook(threading.RLock())
    book.regions = {"r1": live, "r2": other}

    def covered(module, entries, rid="r9"):
        return book.covered(rid, module, entries)

    assert covered("/lib/liblzma.so", [0x1A17])              # a block further on
    assert covered("/lib/liblzma.so", [0x19A3, 0x1A2F])      # every entry inside
    assert not covered("/lib/liblzma.so", [0x19A3, 0x1A30])  # one entry outside: news
    assert not covered("/lib/liblzma.so", [0x1990])
    assert not covered("/lib/libc.so", [0x1A17])             # another module's range
    assert not covered("/lib/liblzma.so", [])
    # an installed region is not a variant of itself: it stays news as before
    assert not covered("/lib/liblzma.so", [0x19F7], rid="r1")
    live.state = RegionState.REMOVED                         # not effective, say
    assert not covered("/lib/liblzma.so", [0x1A17])


def test_defaults_leave_young_clients_alone_and_aggressive_does_not():
    assert Config().min_client_age_s >= 0.5
    assert Config(**AGGRESSIVE).min_client_age_s == 0


@pytest.mark.skipif(agent_path() is None, reason="libdbr_agent.so cannot be built")
def test_a_young_client_is_not_sampled():
    """A client is first sampled once it has run min_client_age_s (a program that
    ends sooner could not gain from replacement code), then as any other; until then
    `dbr ctl clients`/`regions` say why it has no samples.  Its age counts from its
    start: an agent that connects at once (DBR_AGENT_QUIET_MS=0) waits in the service,
    and one that makes its thread when the service would look (the service's hint:
    connects at 1.5 s) is sampled at the next snapshot, not 1.5 s after connecting."""
    prog = compile_c(["cpuloop.c"], flags=["-O2"])
    svc = ServiceProc("snapshot_interval_s=0.1", "snapshot_window_s=0.05",
                      "min_client_age_s=1.5").wait_ready()
    early = planned = None
    try:
        t0 = time.time()
        early = spawn_client(svc.dir, [str(prog), "100000"], env={"DBR_AGENT_QUIET_MS": "0"})
        planned = spawn_client(svc.dir, [str(prog), "100000"])
        c = svc.wait_for(lambda: _client(svc, early.pid), 10.0, "the early client connecting")
        assert c["connected_at"] - t0 < 1.0, c
        seen_young = 0
        while time.time() - t0 < 1.2:
            c = _client(svc, early.pid)
            assert c["samples"] == 0 and c["snapshots"] == 0, c
            assert _client(svc, planned.pid) is None   # no thread yet, no connection
            seen_young += 1
            time.sleep(0.1)
        assert seen_young >= 5          # the service snapshotted meanwhile (every 0.1 s)
        regions = svc.call("regions", {"pid": early.pid})
        assert "younger than min_client_age_s" in regions["status"], regions
        c = svc.wait_for(lambda: (c := _client(svc, early.pid)) and c["samples"] > 0 and c,
                         10.0, "the early client's first samples")
        assert time.time() - t0 >= 1.5
        p = svc.wait_for(lambda: (p := _client(svc, planned.pid)) and p["samples"] > 0 and p,
                         10.0, "the planned client's first samples")
        assert p["connected_at"] - t0 >= 1.4, p
        assert time.time() - p["connected_at"] < 1.0, p   # not another 1.5 s after it
        assert early.poll() is None and planned.poll() is None
    finally:
        kill(early)
        kill(planned)
        svc.stop()


def test_jobs_wait_while_nothing_new_is_hot_and_back_off():
    """Service._job_due: after a client's first jobs, a snapshot whose hot addresses
    were all hot (at half the threshold) at its last job runs no job, nor does one
    inside the backoff gap; a change for the client (a region installed, code mapped)
    ends both; the budget is asked last."""
    import os
    import threading

    from dbr_service.session.cadence import SessionCadence, hot_addresses
    from dbr_service.session.budget import CpuBudget
    from dbr_service.daemon.scheduler import Scheduler
    from dbr_service.region.worker import QUICK_JOBS
    from dbr_service.daemon.service import Service

    cfg = Config()
    sched = Scheduler(lambda res, sid: None)
    svc = SimpleNamespace(config=cfg, scheduler=sched)
    cadence = SessionCadence(activity=3, job_activity=3,
                             job_hot_half=hot_addresses({1: 50, 2: 50}, cfg.hot_threshold / 2),
                             next_job_mono=0.0, jobs_skipped_unchanged=0, jobs_skipped_backoff=0)
    s = SimpleNamespace(session_id=1, pid=os.getpid(), jobs_done=QUICK_JOBS + 1,
                        lock=threading.RLock(), cadence=cadence,
                        cpu_budget=CpuBudget(0.0), session_cpu_s=0.0, control_cpu_s=0.0,
                        connected_mono=0.0)
    now = time.monotonic()
    try:
        assert not Service._job_due(svc, s, {1: 60, 2: 40}, now)        # nothing new
        assert s.cadence.jobs_skipped_unchanged == 1 == sched.stats()["skipped_unchanged"]
        s.cadence.next_job_mono = now + 5
        assert not Service._job_due(svc, s, {1: 50, 9: 50}, now)        # new, backing off
        assert s.cadence.jobs_skipped_backoff == 1 == sched.stats()["skipped_backoff"]
        assert Service._job_due(svc, s, {1: 50, 9: 50}, now + 6)        # the gap is over
        s.cadence.activity = 4                                           # a change
        assert Service._job_due(svc, s, {1: 60, 2: 40}, now)
        s.cadence.activity, s.jobs_done = 3, QUICK_JOBS                  # early jobs: always
        assert Service._job_due(svc, s, {1: 60, 2: 40}, now)
        # over budget: this process's CPU against 1000 s of service CPU
        s.session_cpu_s = 1000.0
        assert not Service._job_due(svc, s, {1: 60, 9: 40}, now)
        assert s.cpu_budget.deferred == 1
    finally:
        sched.shutdown()
