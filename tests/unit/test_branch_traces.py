"""Branch-trace edge profiles: the perf side (events, detection, randomised period, ring
records with branch stacks), the profile (chopped stacks, fall-through ranges decoded
into not-taken edges) checked against synthetic programs with a known answer, and a
recorded stream replayed through the service's aggregation.  These hosts have no PMU:
the branch event is detected as missing, and sampling degrades to IP samples."""

from __future__ import annotations

import errno
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

import branchsynth as S
from dbr_service.region.memview import MappedRange, MemoryView
from dbr_service.region.model import END
from dbr_service.region.pipeline import RegionConfig, select_regions
from dbr_service.sampling import perf_abi as A
from dbr_service.sampling.aggregate import SampleAggregator
from dbr_service.sampling.base import Sample
from dbr_service.sampling.branchperf import (
    BRANCH_SAMPLE_TYPES, BranchEvent, BranchStackSource, RandomPeriod, probe_branch_event)
from dbr_service.sampling.detect import detect
from dbr_service.sampling.fulltrace import full_branch_counts, full_trace
from dbr_service.sampling.lbr import CBT_SIZE, lbr_profile
from dbr_service.sampling.recorded import RecordedSource
from dbr_service.session.sources import choose_source

FIXTURE = Path(__file__).parent.parent / "data" / "lbr_synthetic.samples"


def _estimate(prog: S.Program, run: S.Run, cbt_size: int | None = CBT_SIZE):
    agg = SampleAggregator(lbr_cbt_size=cbt_size)
    agg.add([Sample(7, 7, ip, None, st) for ip, st in zip(run.ips, run.stacks)])
    return full_branch_counts(agg.branch_counts(7), agg.fallthrough_counts(7), prog.read)


# ------------------------------------------------------------------------ the perf side
def test_branch_event_by_vendor_and_filter_fallback():
    tried = []

    def refuse_no_flags(attr, pid):
        tried.append((attr.type, attr.config, attr.branch_sample_type, attr.sample_type))
        if attr.branch_sample_type & A.PERF_SAMPLE_BRANCH_NO_FLAGS:
            raise OSError(errno.EINVAL, "old kernel")
        return os.open("/dev/null", os.O_RDONLY)

    event, reason = probe_branch_event("GenuineIntel", refuse_no_flags)
    assert event is not None and "opens" in reason
    assert (event.spec.type, event.spec.config) == (A.PERF_TYPE_RAW, 0x20C4)
    assert event.branch_sample_type == A.PERF_SAMPLE_BRANCH_USER | A.PERF_SAMPLE_BRANCH_ANY
    assert [t[2] for t in tried] == list(BRANCH_SAMPLE_TYPES)
    assert all(t[3] & A.PERF_SAMPLE_BRANCH_STACK for t in tried)
    event, _ = probe_branch_event("AuthenticAMD", lambda a, p: os.open("/dev/null", os.O_RDONLY))
    assert event.spec.config == 0xC4 and event.branch_sample_type == BRANCH_SAMPLE_TYPES[0]

    def no_pmu(attr, pid):
        raise OSError(errno.ENOENT, "no such event")
    event, reason = probe_branch_event("GenuineIntel", no_pmu)
    assert event is None and "not supported" in reason
    assert probe_branch_event("SomeOtherVendor")[0] is None


def test_this_host_degrades_to_ip_sampling():
    rep = detect()
    if rep.capabilities["lbr"].available:
        pytest.skip("this host gives branch stacks: the degraded path is not taken here")
    assert rep.branch_records["available"] is False and rep.branch_records["reason"]
    assert rep.best != "lbr"
    caps = rep.to_json()
    assert choose_source("auto", caps) in ("perf-cpu-clock", "perf-cycles", "agent-timer")
    assert choose_source("perf", caps) != "lbr"
    # where a host offers them, branch stacks win under auto and perf
    offered = dict(caps, best="lbr")
    assert choose_source("auto", offered) == choose_source("perf", offered) == "lbr"
    assert choose_source("agent-timer", offered) == "agent-timer"


def test_random_period_bounds_and_mean():
    rp = RandomPeriod(100_003, rng=random.Random(1))
    draws = [rp.draw() for _ in range(20000)]
    assert min(draws) >= 100_003 - 12_500 and max(draws) <= 100_003 + 12_500
    assert abs(sum(draws) / len(draws) - 100_003) < 300
    assert len(set(draws)) > 10000
    with pytest.raises(Exception):
        RandomPeriod(100, 100)


def test_branch_stack_records_through_a_ring_with_hw_index():
    """Records built with the kernel's layout, written into a ring that wraps, drained
    by PerfRing and parsed with and without hw_idx."""
    stacks = [tuple((0x401000 + 16 * i + k, 0x402000 + k) for k in range(n))
              for i, n in enumerate([16, 3, 0, 32, 16] * 20)]
    pages = 1
    fd = os.memfd_create("ring")
    try:
        os.ftruncate(fd, (1 + pages) * A.PAGE_SIZE)
        ring = A.PerfRing(fd, pages)
        head, got, wrapped = 0, [], False
        for hw in (0, None):
            recs = [S.sample_record(9, 10, 0x401234, i, st, hw) for i, st in enumerate(stacks)]
            pending = []
            for rec in recs + [b""]:
                if not rec or head + len(rec) - ring.tail > ring.data_size:
                    data, overrun = ring.drain()
                    assert not overrun
                    res = A.parse_records(data, S.SAMPLE_TYPE, branch_hw_index=hw is not None)
                    assert res.bad_records == 0
                    got += [s.branch_stack for s in res.samples]
                    assert len(res.samples) == len(pending)
                    pending = []
                if not rec:
                    break
                pos = head % ring.data_size
                first = min(len(rec), ring.data_size - pos)
                wrapped |= first < len(rec)
                ring.mm[ring.data_offset + pos: ring.data_offset + pos + first] = rec[:first]
                ring.mm[ring.data_offset: ring.data_offset + len(rec) - first] = rec[first:]
                head += len(rec)
                ring._head.value = head
                pending.append(rec)
        ring.close()
    finally:
        os.close(fd)
    assert wrapped and got == stacks * 2
    # a stack longer than its record is refused, not read past the end
    bad = bytearray(S.sample_record(9, 10, 1, 2, stacks[0]))
    bad[32:40] = (1000).to_bytes(8, "little")
    assert A.parse_records(bytes(bad), S.SAMPLE_TYPE, True).bad_records == 1


@pytest.fixture
def spinner():
    p = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    yield p
    os.kill(p.pid, signal.SIGKILL)
    p.wait(timeout=10)


def test_randomised_period_rearms_a_live_event(spinner):
    """The software clock stands in for the taken-branch event (no PMU here): the
    source's thread drains each ring every few samples and sets a new period."""
    spec = A.EVENTS["cpu-clock"]
    event = BranchEvent(spec, 0, A.PERF_SAMPLE_IP | A.PERF_SAMPLE_TID | A.PERF_SAMPLE_TIME)
    src = BranchStackSource(event, RandomPeriod(200_000, rng=random.Random(2)),
                            data_pages=2, rearm_samples=4)
    try:
        src.open(spinner.pid)
    except Exception as exc:
        pytest.skip(f"perf refused here: {exc}")
    try:
        src.enable()
        samples = []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and src.stats.extra["rearms"] < 20:
            time.sleep(0.1)
            samples += src.read()
        src.disable()
        samples += src.read()
    finally:
        src.close()
    assert src.stats.extra["rearms"] >= 20 and src.stats.extra["rearm_errors"] == 0
    assert len(samples) >= 4 * 20 and all(s.pid == spinner.pid for s in samples)
    assert src._thread is None and not src.tids


# ------------------------------------------------------------------------ the profile
def test_full_trace_recovers_not_taken_edges():
    prog = S.build()
    a, b, c = prog.by_name["a"], prog.by_name["b"], prog.by_name["c"]
    d, e = prog.by_name["d"], prog.by_name["e"]
    # ran from d's start through d's and e's not-taken jcc to e2's jmp
    end = prog.by_name["e2"].branch
    tr = full_trace({(d.start, end): 5, (a.start, c.branch): 2}, prog.read)
    assert tr.not_taken == {d.branch: {d.end: 5}, e.branch: {e.end: 5}, a.branch: {a.end: 2}}
    assert tr.rejected == 0
    # a range crossing a jmp, one ending mid-instruction, one unreadable: left out
    tr = full_trace({(prog.by_name["e2"].start, prog.by_name["g"].end): 1,
                     (b.start, c.branch + 1): 1, (0x10, 0x20): 1}, prog.read)
    assert tr.not_taken == {} and tr.rejected == 3


def test_edge_counts_match_a_known_answer():
    """Every branch edge, taken or not, within 3 % of its true share (measured: under
    1.2 % on 4100 stacks of 15 branches, period 97 ± 12 taken branches)."""
    prog = S.build()
    run = S.run(prog, 600_000, RandomPeriod(97, rng=random.Random(5)).draw)
    assert len(run.stacks) > 3000
    errs = S.relative_errors(run.truth, _estimate(prog, run), min_share=0.02)
    assert len(errs) == 9                      # the hot edges, 4 of them not taken
    assert max(errs.values()) < 0.03, errs


def test_fixed_period_in_lock_step_biases_random_does_not():
    """A loop of 4 taken branches, period 400 (a multiple): every stack of 15 sees the
    same phase, so one edge is seen 3 times a stack and the others 4."""
    prog = S.build(S.LOCKSTEP)
    fixed = S.run(prog, 200_000, lambda: 400)
    rand = S.run(prog, 200_000, RandomPeriod(400, rng=random.Random(3)).draw)
    e_fixed = S.relative_errors(fixed.truth, _estimate(prog, fixed), 0.02)
    e_rand = S.relative_errors(rand.truth, _estimate(prog, rand), 0.02)
    assert len(e_fixed) == len(e_rand) == 5
    assert max(e_fixed.values()) > 0.10, e_fixed
    assert max(e_rand.values()) < 0.02, e_rand


def test_anchored_chop_counts_taken_and_not_taken_alike():
    """Without the anchor, a stack of 16 gives 16 taken edges but only 15 ranges: the
    not-taken edges come out 1/16 short."""
    prog = S.build(S.LOCKSTEP)
    run = S.run(prog, 200_000, RandomPeriod(400, rng=random.Random(4)).draw)
    nt = (prog.by_name["l0"].branch, prog.by_name["l0"].end)
    for cbt, low, high in ((CBT_SIZE, -0.02, 0.02), (16, -0.09, -0.04)):
        prof = lbr_profile(run.stacks, cbt_size=cbt, anchored=cbt == CBT_SIZE)
        assert prof.stacks == len(run.stacks)
        est = full_branch_counts({s: {d: n} for (s, d), n in prof.edges.items()},
                                 prof.fallthroughs, prog.read)
        total_t, total_e = sum(run.truth.values()), sum(sum(d.values()) for d in est.values())
        rel = (est[nt[0]][nt[1]] / total_e) / (run.truth[nt] / total_t) - 1
        assert low < rel < high, (cbt, rel)
    assert lbr_profile([run.stacks[0][:5]], cbt_size=CBT_SIZE, anchored=True).short == 1


# ------------------------------------------------------------------------ a recorded stream
def test_recorded_stream_replayed_through_the_aggregation():
    """tests/data/lbr_synthetic.samples: 254 stacks of tests/branchsynth.py's PROGRAM
    in dbr.samples/1 (perf-script brstack form), its true edge counts in the header."""
    src = RecordedSource(FIXTURE, batch=50, strict=True)
    assert src.name == "recorded:lbr"
    truth = {(int(a, 16), int(b, 16)): n for a, b, n in src.header["truth"]}
    src.open(99)
    src.enable()
    agg = SampleAggregator()
    agg.start_window()
    while src.remaining:
        agg.add(src.read())
    window = agg.end_window().aggregator
    src.close()
    assert window.samples_of(99) == 254 and window.short_stacks == 0
    est = full_branch_counts(window.branch_counts(99), window.fallthrough_counts(99),
                             S.build().read)
    errs = S.relative_errors(Counter(truth), est, 0.02)
    assert len(errs) == 9 and max(errs.values()) < 0.10, errs
    js = json.loads(json.dumps(window.to_json()))
    assert js["clients"]["99"]["fallthroughs"]



# ------------------------------------------------------------------------ region selection
class _Code(MemoryView):
    """The synthetic program's bytes, read-only and executable, and nothing else."""

    def __init__(self, prog: S.Program) -> None:
        super().__init__()
        self.prog = prog

    def ranges(self):
        return [MappedRange(S.BASE, S.BASE + len(self.prog.code), "r-x", "synthetic")]

    def _read_range(self, rng, addr, n):
        return self.prog.read(addr, n)


def test_selection_counts_come_from_the_branch_profile():
    """Region selection on the synthetic program: with the full branch counts every
    conditional's taken share is its probability (within 0.03); from the IPs alone the
    not-taken side of ``a`` and the loop in ``f1`` are badly off."""
    prog = S.build()
    run = S.run(prog, 200_000, RandomPeriod(97, rng=random.Random(5)).draw)
    branches = _estimate(prog, run)
    cfg = RegionConfig(hot_threshold=1.0, min_loop_trip_count=0, min_region_size=0)

    def taken_shares(branch_samples):
        res = select_regions(dict(Counter(run.ips)), _Code(prog), cfg,
                             branch_samples=branch_samples)
        assert len(res.regions) == 1 and not res.failures
        sr = res.regions[0]
        shares = {}
        for name in ("a", "d", "f1"):
            b = prog.by_name[name]
            node = next(n for n, bb in sr.blocks() if bb.start <= b.branch < bb.start + bb.size)
            out = {v: d["count"] for _, v, d in sr.g.out_edges(node, data=True)}
            taken = sum(c for v, c in out.items()
                        if v != END and sr.block(v).start == prog.by_name[b.target].start)
            shares[name] = taken / max(1e-9, sum(out.values()))
        return shares

    measured = taken_shares(branches)
    for name, share in measured.items():
        assert abs(share - prog.by_name[name].p_taken) < 0.03, measured
    guessed = taken_shares(None)
    assert max(abs(s - prog.by_name[n].p_taken) for n, s in guessed.items()) > 0.2, guessed



def test_status_says_whether_branch_records_are_used():
    from dbr_service.commands.cmd_ctl import render
    from dbr_service.session.sources import sampling_capabilities

    caps = sampling_capabilities()
    assert "branch_records" in caps and "reason" in caps["branch_records"]
    base = {"version": "x", "pid": 1, "uptime_s": 1.0, "runtime_dir": "/r", "clients": 0,
            "clients_seen": 0, "snapshots": 0, "paused": False, "scheduler": {}, "config": {},
            "sampling": {"configured": "auto", "active": caps["best"], "interval_s": 1,
                         "window_s": 0.2, "period_us": 1000, "capabilities": caps,
                         "branch_records_used": caps["best"] == "lbr"}}
    text = render("status", base)
    line = next(x for x in text.splitlines() if x.startswith("branch records:"))
    if not caps["branch_records"]["available"]:
        assert line.startswith("branch records: no (") and line.endswith("IP samples")
    used = dict(base, sampling=dict(base["sampling"], active="lbr", branch_records_used=True,
                                    capabilities=dict(caps, branch_records={
                                        "available": True, "event": "ex_ret_brn_tkn"})))
    assert "branch records: used (ex_ret_brn_tkn" in render("status", used)


def test_a_client_without_branch_stacks_gets_the_perf_clock(spinner):
    """Asked for lbr on a host (or for a client) that refuses branch stacks, the session's
    source is the perf clock, and the session remembers it."""
    from types import SimpleNamespace

    from dbr_service.common.config import Config
    from dbr_service.sampling import branchperf
    from dbr_service.session.sources import make_perf_source

    if branchperf.host_branch_event() is not None:
        pytest.skip("this host gives branch stacks")
    tracker = SimpleNamespace(window_notices=lambda: None, switch_gate=None,
                              gated_timer_failed=None)
    session = SimpleNamespace(pid=spinner.pid, hello_flags=0, forced_source=None,
                              thread_tracker=tracker)
    try:
        src = make_perf_source(session, Config(), "lbr")
    except Exception as exc:
        pytest.skip(f"perf refused here: {exc}")
    try:
        assert src.name == "perf-cpu-clock" and src.tids
        assert session.forced_source == "perf-cpu-clock"
    finally:
        src.close()


def test_worker_joins_the_fall_through_ranges_before_selection():
    """A job carries the window's taken edges and fall-through ranges; the worker
    decodes the ranges in the client's memory and selection sees both sides."""
    from dataclasses import dataclass

    from dbr_service.common.config import Config
    from dbr_service.region.functions import FunctionEntries
    from dbr_service.region.worker import ClientJob, select_client_regions

    prog = S.build()
    run = S.run(prog, 100_000, RandomPeriod(97, rng=random.Random(6)).draw)
    agg = SampleAggregator()
    agg.add([Sample(7, 7, ip, None, st) for ip, st in zip(run.ips, run.stacks)])

    @dataclass
    class Job(ClientJob):
        def memory_view(self):
            return _Code(prog)

        def function_entries(self):
            return FunctionEntries()

    cfg = Config(hot_threshold=0.001, min_loop_trip_count=0, min_region_size=0)
    ips = dict(Counter(run.ips))

    def selected(fallthroughs):
        job = Job(1, 7, "synthetic", ips, ips, [], cfg.to_dict(),
                  branches=agg.branch_counts(7), fallthroughs=fallthroughs)
        regions, status, srs = select_client_regions(job, cfg)
        assert regions, status
        a = prog.by_name["a"]
        node = next(n for n, bb in srs[0].blocks() if bb.start <= a.branch < bb.start + bb.size)
        return {v: d["count"] for _, v, d in srs[0].g.out_edges(node, data=True)
                if v != END and srs[0].block(v).start == a.end}

    with_ranges = selected(agg.fallthrough_counts(7))
    assert with_ranges and all(c > 0 for c in with_ranges.values())
    assert not any(c > 0 for c in selected({}).values())  # taken edges alone: none not taken
