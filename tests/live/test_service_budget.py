"""The service's CPU budget per client, the job cadence, the per-module decode cache,
and the control socket answering while selection runs."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from service_helpers import ServiceProc, agent_path, build_example, kill, spawn_client, symbol_range

from dbr_service.common.config import Config, load_config
from dbr_service.common.errors import ConfigError
from dbr_service.session.cadence import hot_addresses, newly_hot, next_job_gap
from dbr_service.session.budget import CpuBudget, budget_limit, client_cpu_s
from dbr_service.daemon.scheduler import Scheduler
from dbr_service.region.worker import JobResult

needs_agent = pytest.mark.skipif(agent_path() is None, reason="libdbr_agent.so cannot be built")


# --------------------------------------------------------------------------- budget, fake clock
def test_budget_defers_until_the_client_has_run_enough():
    b = CpuBudget(started_mono=0.0, window_s=60.0)
    b.observe(10.0, client_cpu_s=10.0, session_cpu_s=0.1)
    assert b.allows(10.0, 0.05)                  # 0.1 s spent of 0.5 s allowed
    b.charge_job(0.45)                           # no block count: the next job is like it
    b.observe(11.0, client_cpu_s=11.0, session_cpu_s=0.1)
    assert b.service_cpu_s == pytest.approx(0.55)
    assert not b.allows(11.0, 0.05)              # 0.55 + 0.45 > 0.55
    assert b.used(11.0) == pytest.approx(0.05)
    b.observe(21.0, client_cpu_s=21.0, session_cpu_s=0.1)
    assert b.allows(21.0, 0.05)                  # 0.55 + 0.45 <= 1.05
    assert b.allows(11.0, 0.0)                   # 0: no limit


def test_budget_window_slides():
    """What was spent leaves the window after window_s; a client that uses little CPU
    gets a job again only then."""
    b = CpuBudget(started_mono=0.0, window_s=60.0)
    b.observe(5.0, 5.0, 0.0)
    b.charge_job(2.0)                            # a big first job
    for t in range(6, 66):
        b.observe(float(t), 5.0 + 0.1 * (t - 5), 0.0)   # the client now mostly sleeps
        assert not b.allows(float(t), 0.05), t
    b.observe(70.0, 11.5, 0.0)
    # window (10, 70]: the job, charged at 5 s, has left; 6 s of client CPU in it
    assert b.in_window(70.0) == (pytest.approx(6.0), pytest.approx(0.0))
    b.charge_job(0.2, blocks=1000)
    b.observe(71.0, 11.6, 0.0)
    assert b.allows(71.0, 0.05)                  # 0.2 spent, 300 blocks cost 0.06 of 0.33
    assert len(b.points) <= 63                   # old points dropped


def test_max_blocks_fits_what_is_left():
    b = CpuBudget(started_mono=0.0)
    assert b.max_blocks(1.0, 0.05) is None       # cost per block not known yet
    b.charge_job(0.1, blocks=500)                # 0.2 ms a block
    b.observe(40.0, 40.0, 0.0)                   # 2 s allowed, 0.1 spent
    assert b.max_blocks(40.0, 0.05) == int(1.9 / 0.0002)
    assert b.max_blocks(40.0, 0.0) is None
    b.observe(41.0, 40.0, 1.85)                  # nearly spent: the floor
    assert b.max_blocks(41.0, 0.05) == CpuBudget.MIN_JOB_BLOCKS
    assert not b.allows(41.0, 0.05)              # 0.05 s left < 300 blocks * 0.2 ms
    small = CpuBudget(started_mono=0.0)          # a small program: jobs of a few blocks
    small.charge_job(0.01, blocks=5)             # 2 ms a block (the job's fixed cost)
    small.observe(10.0, 1.0, 0.0)                # 0.04 s left: pays for a job like it
    assert small.allows(10.0, 0.05)
    small.observe(11.0, 1.0, 0.045)
    assert not small.allows(11.0, 0.05)


def test_scheduler_admit_counts_and_charges():
    sched = Scheduler(lambda res, sid: None)
    try:
        b = CpuBudget(started_mono=0.0)
        b.observe(1.0, 1.0, 0.2)
        assert not sched.admit(b, 1.0, 0.05)
        assert b.deferred == 1 and sched.stats()["deferred_by_budget"] == 1
        b.observe(10.0, 10.0, 0.2)
        assert sched.admit(b, 10.0, 0.05)
        sched.charge(b, JobResult(1, 1, [], cpu_s=0.3, decode_cached=5, decode_new=7,
                                  blocks=100))
        st = sched.stats()
        assert (st["job_cpu_s"], st["decode_cached"], st["decode_new"]) == (0.3, 5, 7)
        assert b.to_json(10.0)["service_cpu_s"] == pytest.approx(0.5)
        assert b.to_json(10.0)["deferred_by_budget"] == 1
    finally:
        sched.shutdown()


def test_startup_budget_and_presets():
    cfg = load_config(None, [], env={})
    assert cfg.service_cpu_budget == 0.05 and cfg.service_cpu_window_s == 60
    assert budget_limit(cfg, 0.5) == 0.05        # no startup allowance by default
    aggr = load_config(None, [], aggressive=True, env={})
    assert budget_limit(aggr, 2.0) == 0.0        # no limit in its first seconds
    assert budget_limit(aggr, aggr.service_cpu_startup_s + 1) == aggr.service_cpu_budget > 0
    own = load_config(None, ["service_cpu_startup_s=5", "service_cpu_startup_budget=0.5"],
                      env={})
    assert (budget_limit(own, 4.9), budget_limit(own, 5.0)) == (0.5, 0.05)


@pytest.mark.parametrize("kv", ["service_cpu_budget=-0.1", "service_cpu_budget=abc",
                                "service_cpu_window_s=0", "job_backoff_max_s=-1",
                                "service_cpu_startup_s=nan"])
def test_bad_budget_values_are_refused(kv):
    with pytest.raises(ConfigError, match=kv.split("=")[0]):
        load_config(None, [kv], env={})


def test_client_cpu_is_read_from_proc():
    p = subprocess.Popen([sys.executable, "-c", "import time\nt=time.process_time()\n"
                          "while time.process_time() - t < 0.3: pass\ntime.sleep(30)"])
    try:
        deadline = time.monotonic() + 20
        while (client_cpu_s(p.pid) or 0) < 0.3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert 0.3 <= client_cpu_s(p.pid) < 5
    finally:
        kill(p)
    assert client_cpu_s(p.pid) is None           # reaped: gone


# --------------------------------------------------------------------------- job cadence
def test_newly_hot_ignores_noise_at_the_threshold():
    before = hot_addresses({1: 50, 2: 30, 3: 6, 4: 1}, 0.1 / 2)     # 1, 2, 3 (>= 4.35)
    assert before == {1, 2, 3}
    assert not newly_hot({1: 40, 2: 40, 3: 9, 5: 1}, before, 0.1)   # 3 grew: known
    assert newly_hot({1: 40, 2: 30, 7: 20}, before, 0.1)            # 7 is new
    assert not newly_hot({}, before, 0.1)


def test_job_gap_doubles_while_nothing_changes():
    cfg = Config(snapshot_interval_s=1.0, job_backoff_max_s=6.0)
    gaps = [0.0]
    for _ in range(5):
        gaps.append(next_job_gap(cfg, gaps[-1], changed=False))
    assert gaps == [0.0, 1.0, 2.0, 4.0, 6.0, 6.0]
    assert next_job_gap(cfg, 6.0, changed=True) == 0.0


# --------------------------------------------------------------------------- decode cache
def test_second_client_of_a_binary_is_not_decoded_again(monkeypatch):
    """Two processes of one PIE binary (different bases): the second's job takes every
    instruction from the worker's module cache, decodes none, and selects the same
    code; a patched byte in it is still seen as one."""
    from dbr_service.common.procmaps import module_base, read_maps
    from dbr_service.region import decode
    from dbr_service.region.memview import LiveMemoryView
    from dbr_service.region.worker import ClientJob, optimize_client

    monkeypatch.setattr(decode, "DECODE_CACHE", decode.ModuleDecodeCache())
    prog = build_example("hotloop")
    lo, hi = symbol_range(prog, "mix")
    procs = [subprocess.Popen([prog, "30000"], stdout=subprocess.DEVNULL) for _ in range(2)]
    try:
        time.sleep(0.2)
        results, bases = [], []
        for p in procs:
            maps = read_maps(p.pid)
            base = module_base(maps, os.path.realpath(prog))
            bases.append(base)
            samples = {base + a: 20 for a in range(lo, hi, 4)}
            cfg = Config(hot_threshold=0.01).to_dict()
            job = ClientJob(p.pid, p.pid, prog, samples, samples, maps, cfg)
            results.append(optimize_client(job))
        assert bases[0] != bases[1]                          # PIE: another base each
        first, second = results
        assert first.decode_new > 0 and first.decode_cached == 0
        assert second.decode_new == 0 and second.decode_cached > 0
        assert second.cpu_s > 0 and second.blocks > 0
        rel = [sorted((e - b) for r in res.regions or [] for e in r["entries"])
               for res, b in zip(results, bases)]
        assert rel[0] == rel[1] and rel[0], results[0].region_status
        # the cache holds the instruction; the job's patches still win
        view = LiveMemoryView(procs[1].pid)
        at = bases[1] + lo
        dec = decode.Decoder(view, patched=lambda a: a == at)
        assert dec.at(at) == "byte of an installed patch"
        assert not isinstance(decode.Decoder(view, None).at(at), str)
        view.close()
    finally:
        for p in procs:
            kill(p)


def test_code_that_differs_from_its_file_is_not_cached(monkeypatch):
    """Bytes in memory that are not the file's (a patch the job's list of patches
    does not know yet) are decoded for that job only, never entered in the cache."""
    import signal

    from dbr_service.common.procmaps import module_base, read_maps
    from dbr_service.region import decode
    from dbr_service.region.memview import LiveMemoryView

    cache = decode.ModuleDecodeCache()
    monkeypatch.setattr(decode, "DECODE_CACHE", cache)
    prog = build_example("hotloop")
    lo, _ = symbol_range(prog, "mix")
    procs = [subprocess.Popen([prog, "30000"], stdout=subprocess.DEVNULL) for _ in range(2)]
    try:
        time.sleep(0.2)
        os.kill(procs[0].pid, signal.SIGSTOP)
        base0 = module_base(read_maps(procs[0].pid), os.path.realpath(prog))
        with open(f"/proc/{procs[0].pid}/mem", "r+b", buffering=0) as mem:
            mem.seek(base0 + lo)
            mem.write(b"\xcc")                       # an int3 nobody told the job of
        got = decode.Decoder(LiveMemoryView(procs[0].pid), None).at(base0 + lo)
        assert isinstance(got, str) or got.size == 1
        assert not any(lo in m for m in cache.modules.values())
        base1 = module_base(read_maps(procs[1].pid), os.path.realpath(prog))
        hits = cache.hits
        ins = decode.Decoder(LiveMemoryView(procs[1].pid), None).at(base1 + lo)
        assert cache.hits == hits and not isinstance(ins, str) and ins.size > 1
        assert any(lo in m for m in cache.modules.values())   # the file's bytes: entered
    finally:
        for p in procs:
            kill(p)


# --------------------------------------------------------------------------- live
def _row(svc, pid):
    rows = [c for c in svc.call("clients") if c["pid"] == pid]
    return rows[0] if rows else None


@needs_agent
def test_busy_client_over_a_tiny_budget_waits_and_is_reported():
    prog = build_example("hotloop")
    svc = ServiceProc("min_client_age_s=0", "snapshot_interval_s=0.2",
                      "snapshot_window_s=0.1", "service_cpu_budget=0.00001").wait_ready()
    client = None
    try:
        client = spawn_client(svc.dir, [prog, "60000"], env={"DBR_AGENT_QUIET_MS": "0"})
        row = svc.wait_for(lambda: (r := _row(svc, client.pid)) and
                           r["deferred_by_budget"] >= 3 and r, timeout=30,
                           what="jobs deferred by the budget")
        assert row["jobs_done"] == 0 and row["budget"] == 0.00001
        assert row["budget_used"] > row["budget"] and row["client_cpu_s"] > 0
        assert row["service_cpu_s"] > 0
        st = svc.call("status")
        assert st["scheduler"]["deferred_by_budget"] >= 3
        human = subprocess.run([sys.executable, "-m", "dbr_service.commands.cli", "ctl", "clients"],
                               env=svc.env, capture_output=True, text=True, timeout=30)
        assert "deferred)" in human.stdout and "BUDGET USED" in human.stdout, human.stdout
        human = subprocess.run([sys.executable, "-m", "dbr_service.commands.cli", "ctl", "status"],
                               env=svc.env, capture_output=True, text=True, timeout=30)
        assert "service CPU budget: 0.0% of each client" in human.stdout, human.stdout
        rep = svc.call("report", {"pids": [client.pid]})[0]
        assert rep["deferred_by_budget"] >= 3 and rep["service_cpu_s"] > 0
        # the budget was what held the jobs: without it they run
        svc.call("config_set", {"key": "service_cpu_budget", "value": "0"})
        svc.wait_for(lambda: _row(svc, client.pid)["jobs_done"] >= 1, timeout=30,
                     what="a job once the budget is lifted")
    finally:
        kill(client)
        svc.stop()


BUSY_PY = """
import json, re, random
r = random.Random(1)
while True:
    d = {str(i): [r.random() for _ in range(5)] for i in range(200)}
    s = json.dumps(d); json.loads(s)
    re.findall(r"[0-9]+\\.[0-9]{3}", s)
    sorted(s.split(","))
"""


@needs_agent
def test_status_answers_while_selection_runs():
    """The control socket answers within 100 ms while a client's selection job runs
    (workers are processes; the control thread never waits for them).  A slow answer
    is retried (at most 5 times) only while the machine is loaded beyond its CPUs."""
    svc = ServiceProc("min_client_age_s=0", "snapshot_interval_s=0.3", "snapshot_window_s=0.2",
                      "service_cpu_budget=0", "jumps_from_hot_limit=64", "hot_threshold=0.001",
                      "job_backoff_max_s=0", "max_workers=1").wait_ready()
    client = None
    try:
        client = spawn_client(svc.dir, [sys.executable, "-c", BUSY_PY],
                              env={"DBR_AGENT_QUIET_MS": "0"})
        seen, retries = [], 0
        deadline = time.monotonic() + 90
        while len(seen) < 5 and time.monotonic() < deadline:
            t0 = time.monotonic()
            st = svc.call("status")
            took = time.monotonic() - t0
            sch = st["scheduler"]
            if sch["running"] >= 1 and sch["submitted"] >= 1 and sch["pool_ready"]:
                if took >= 0.1 and os.getloadavg()[0] > (os.cpu_count() or 1) and retries < 5:
                    retries += 1
                    continue
                seen.append(took)
            time.sleep(0.05)
        assert len(seen) == 5, f"no selection job was seen running ({svc.call('status')})"
        assert max(seen) < 0.1, seen
    finally:
        kill(client)
        svc.stop()
