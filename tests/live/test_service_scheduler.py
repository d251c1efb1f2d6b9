"""Scheduler and worker job: capacity from load, hottest first, results from a real
worker process; automatic agent-timer fallback when perf is refused."""

from __future__ import annotations

import os
import queue
import shutil
import tempfile
import threading

import pytest
from service_helpers import agent_path, build_example, kill, spawn_client, symbol_range

from dbr_service.common.procmaps import MapEntry
from dbr_service.common.config import Config, ConfigSources
from dbr_service.common.errors import SamplingError
from dbr_service.daemon.scheduler import Scheduler, auto_workers
from dbr_service.region.worker import ClientJob, JobResult, find_hotspots

MAPS = [MapEntry(0x400000, 0x401000, "r--p", 0, "/bin/prog"),
        MapEntry(0x401000, 0x402000, "r-xp", 0x1000, "/bin/prog"),
        MapEntry(0x7f0000000000, 0x7f0000001000, "r-xp", 0, "/lib/libc.so")]


def test_auto_workers_follows_load():
    assert auto_workers(2, 0.0) == 1          # never more than CPUs - 1 (but at least 1)
    assert auto_workers(8, 2.0) == 6
    assert auto_workers(8, 0.0) == 7
    assert auto_workers(8, 20.0) == 1


def test_find_hotspots_threshold_and_modules():
    counts = {0x401010: 50, 0x401020: 30, 0x7f0000000100: 15, 0x401030: 5}
    hs = find_hotspots(counts, MAPS, threshold=0.1)
    assert [h["ip"] for h in hs] == [0x401010, 0x401020, 0x7f0000000100]
    assert hs[0]["module"] == "/bin/prog" and hs[0]["offset"] == 0x1010
    assert hs[0]["fraction"] == 0.5
    assert hs[2]["module"] == "/lib/libc.so" and hs[2]["offset"] == 0x100
    assert find_hotspots(counts, MAPS, threshold=0.0, top=2)[1]["ip"] == 0x401020
    assert find_hotspots({0x10: 3}, MAPS, threshold=0.0)[0]["module"] == "[unknown]"
    assert find_hotspots({}, MAPS, threshold=0.0) == []


def test_schedule_hottest_first_and_worker_result():
    results: queue.Queue = queue.Queue()
    sched = Scheduler(lambda res, sid: results.put((sid, res)))
    cfg = Config(hot_threshold=0.2).to_dict()
    jobs = [ClientJob(sid, os.getpid(), "/bin/prog", {0x401010: n, 0x401020: 1},
                      {0x401010: n, 0x401020: 1}, MAPS, cfg) for sid, n in
            ((1, 10), (2, 500), (3, 40))]
    try:
        sched.warm(1)
        assert sched.wait_ready(60), "the worker pool did not start"
        assert sched.schedule(jobs, max_workers=1) == [2]        # the hottest only
        assert sched.stats()["deferred_for_load"] == 2
        assert sched.schedule(jobs, max_workers=1) == []          # 2 still running
        sid, res = results.get(timeout=60)
        assert sid == 2 and isinstance(res, JobResult), res
        assert res.worker_pid != os.getpid()                      # in a worker process
        assert [h["ip"] for h in res.hotspots] == [0x401010]
        # Region selection ran (or was reported missing/failing) without raising.
        assert res.region_status
        assert sched.schedule([jobs[0], jobs[2]], max_workers=2) == [3, 1]
        got = {results.get(timeout=60)[0] for _ in range(2)}
        assert got == {1, 3}
    finally:
        sched.shutdown()


@pytest.mark.skipif(agent_path() is None, reason="libdbr_agent.so cannot be built")
def test_agent_timer_fallback_when_perf_refused(monkeypatch):
    from dbr_service.daemon import service as service_mod
    from dbr_service.daemon import snapshots
    from dbr_service.commands.control import ControlServer

    def refused(session, cfg, kind):
        raise SamplingError("perf_event_open: Permission denied (simulated)")

    monkeypatch.setattr(snapshots, "make_perf_source", refused)
    rdir = tempfile.mkdtemp(prefix="dbr-fallback-")
    env = dict(os.environ, DBR_RUNTIME_DIR=rdir)
    svc = service_mod.Service(ConfigSources(aggressive=True, env=env),
                              control_server=ControlServer, embedded=True)
    svc.start()
    assert svc.source_kind.startswith("perf-")
    t = threading.Thread(target=svc.run, daemon=True)
    t.start()
    prog = build_example("hotloop")
    client = spawn_client(rdir, [prog, "20000"])
    try:
        lo, hi = symbol_range(prog, "mix")

        def fell_back():
            s = svc.find_client(client.pid)
            return s is not None and s.source_name == "agent-timer" and s.samples_total >= 30
        deadline = threading.Event()
        for _ in range(200):
            if fell_back():
                break
            deadline.wait(0.1)
        s = svc.find_client(client.pid)
        assert fell_back(), (s and s.source_name, s and s.samples_total, s and list(s.errors))
        top = find_hotspots(dict(s.ip_counts), s.maps, threshold=0.0, top=1)[0]
        assert top["module"] == prog and lo <= top["offset"] < hi
        assert any(e["event"] == "sampling-fallback" for e in svc.events.since(0))
    finally:
        kill(client)
        svc.request_stop("test done")
        t.join(5)
        shutil.rmtree(rdir, ignore_errors=True)
        assert not t.is_alive()


def test_jobs_run_inline_until_the_pool_is_ready():
    """A cold pool takes ~0.5-1 s to start: the first jobs run on a thread of the
    service meanwhile, and the pool is started even if nobody called warm()."""
    results: queue.Queue = queue.Queue()
    sched = Scheduler(lambda res, sid: results.put((sid, res)))
    cfg = Config(hot_threshold=0.2, worker_nice=7).to_dict()
    job = ClientJob(7, os.getpid(), "/bin/prog", {0x401010: 50}, {0x401010: 50}, MAPS, cfg)
    own_nice = os.getpriority(os.PRIO_PROCESS, 0)
    try:
        assert sched.schedule([job], max_workers=1) == [7]
        sid, res = results.get(timeout=60)
        assert sid == 7 and isinstance(res, JobResult)
        assert res.worker_pid == os.getpid() and sched.stats()["inline_jobs"] == 1
        # the inline job left the service's own priority alone (worker_nice is for workers)
        assert os.getpriority(os.PRIO_PROCESS, 0) == own_nice
        assert sched.wait_ready(60)
        assert sched.schedule([job], max_workers=1) == [7]
        sid, res = results.get(timeout=60)
        assert res.worker_pid != os.getpid()
        # the worker ran it at worker_nice (its main thread: the process's niceness)
        assert os.getpriority(os.PRIO_PROCESS, res.worker_pid) == 7
        # in a session of its own, whose autogroup has the same niceness: the kernel
        # weighs sessions against each other by their autogroups' niceness alone
        assert os.getsid(res.worker_pid) == res.worker_pid != os.getsid(0)
        try:
            with open(f"/proc/{res.worker_pid}/autogroup") as f:
                group = f.read()
        except FileNotFoundError:
            group = None   # a kernel without autogroups: nothing to set
        if group is not None:
            assert group.split()[-1] == "7", group
            with open("/proc/self/autogroup") as f:
                own = f.read().split()
            # empty: this process is in the root autogroup (pid 1's session, as under
            # CI), which the worker, leading a session of its own, has left
            assert not own or own[0] != group.split()[0]
    finally:
        sched.shutdown()



def test_quick_job_takes_the_short_reach(monkeypatch):
    """A quick selection explores at most QUICK_REACH conditional jumps from sampled
    code (its first region comes sooner); others the configured reach; a smaller
    configured reach is never raised.  A quick job also seeds discovery only from IPs
    with QUICK_SEED_MIN samples and makes at most QUICK_MAX_BLOCKS blocks.  On a
    profile of at most QUICK_ALL_SEEDS_MAX distinct IPs every IP seeds (a small loop
    with one sample in the window is found)."""
    import dataclasses

    import dbr_service.region.pipeline as pl
    from dbr_service.region.worker import (QUICK_ALL_SEEDS_MAX, QUICK_MAX_BLOCKS, QUICK_REACH,
                                           QUICK_SEED_MIN, select_client_regions)

    seen = []
    seeds = []

    def fake_select(samples, mem, rcfg, **kw):
        seen.append(rcfg.jumps_from_hot_limit)
        seeds.append((rcfg.seed_min_samples, rcfg.max_discovery_blocks))
        return pl.PipelineResult()

    monkeypatch.setattr(pl, "select_regions", fake_select)
    flat = {0x401000 + 4 * i: 1 + i % 2 for i in range(QUICK_ALL_SEEDS_MAX + 1)}
    job = ClientJob(1, os.getpid(), "/bin/prog", flat, flat, MAPS,
                    Config().to_dict(), quick=True)
    for quick, reach, want in ((True, 6, QUICK_REACH), (False, 6, 6), (True, 2, 2)):
        regions, status, _ = select_client_regions(dataclasses.replace(job, quick=quick),
                                                   Config(jumps_from_hot_limit=reach))
        assert regions == [] and status.startswith("0 region"), status
        assert seen[-1] == want, (quick, reach, seen)
        # ... seeds discovery only from IPs with QUICK_SEED_MIN samples, with a block budget
        assert seeds[-1] == ((QUICK_SEED_MIN, QUICK_MAX_BLOCKS) if quick else (0, None))
    assert QUICK_SEED_MIN > 1
    # a concentrated profile: every IP seeds, the reach and block budget stay quick
    few = dict(list(flat.items())[:QUICK_ALL_SEEDS_MAX])
    select_client_regions(dataclasses.replace(job, samples=few, cumulative=few), Config())
    assert seen[-1] == QUICK_REACH and seeds[-1] == (0, QUICK_MAX_BLOCKS)


def test_quick_jobs_until_a_region_or_three_jobs():
    """Jobs stay quick while the client has no region, at most QUICK_JOBS of them; a
    client with a region, or after QUICK_JOBS jobs, gets the full search."""
    from dbr_service.region.worker import QUICK_JOBS, quick_job

    assert QUICK_JOBS >= 2
    assert [quick_job(n, False) for n in range(QUICK_JOBS + 2)] == \
        [True] * QUICK_JOBS + [False, False]
    assert not any(quick_job(n, True) for n in range(QUICK_JOBS + 2))


def test_set_thread_nice_is_per_thread():
    """Niceness is a thread's own on Linux: a job thread's does not change the
    others' (the service's control thread keeps its priority)."""
    from dbr_service.region.worker import set_thread_nice

    main = os.getpriority(os.PRIO_PROCESS, 0)
    seen = {}

    def job() -> None:
        seen["ok"] = set_thread_nice(min(19, main + 3))
        seen["nice"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    t = threading.Thread(target=job)
    t.start()
    t.join(10)
    assert seen == {"ok": True, "nice": min(19, main + 3)}
    assert os.getpriority(os.PRIO_PROCESS, 0) == main


def test_autogroup_nice_is_tried_again_when_the_kernel_says_later(monkeypatch):
    """Without CAP_SYS_ADMIN the kernel takes one autogroup niceness change per 100 ms
    machine-wide (EAGAIN otherwise): a worker tries once more 0.1 s later.  Only a
    worker with a session of its own sets it; other errors leave it as it is."""
    import errno
    import io

    from dbr_service.region import worker

    state = {"nice": 0, "busy": 1, "writes": 0}

    class Writer(io.StringIO):
        def close(self):
            if not self.closed:
                value = self.getvalue()
                super().close()
                state["writes"] += 1
                if state["busy"]:
                    state["busy"] -= 1
                    raise OSError(errno.EAGAIN, "Resource temporarily unavailable")
                state["nice"] = int(value)

    def fake_open(path, mode="r"):
        assert path == "/proc/self/autogroup"
        return Writer() if "w" in mode else io.StringIO(f"/autogroup-9 nice {state['nice']}\n")

    monkeypatch.setattr(worker, "open", fake_open, raising=False)
    monkeypatch.setattr(worker, "_OWN_AUTOGROUP", False)
    assert worker.set_autogroup_nice(19) is False and state["writes"] == 0
    monkeypatch.setattr(worker, "_OWN_AUTOGROUP", True)
    assert worker.set_autogroup_nice(19) is True
    assert state == {"nice": 19, "busy": 0, "writes": 2}
    assert worker.set_autogroup_nice(19) is True and state["writes"] == 2  # as it is
    state["busy"] = 2                      # refused twice: left for the next job
    assert worker.set_autogroup_nice(5) is False and state["nice"] == 19
