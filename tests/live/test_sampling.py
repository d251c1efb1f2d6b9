"""Sampling sources (perf, agent timer, recorded), host detection, aggregation, LBR edges."""

from __future__ import annotations

import ctypes
import io
import json
import mmap
import fcntl
import os
import struct
import subprocess
import time
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from dbr_service.wire import protocol
from dbr_service.common.errors import SamplingError
from dbr_service.sampling import perf
from dbr_service.sampling.aggregate import SampleAggregator
from dbr_service.sampling.agent_timer import AgentTimerRing, AgentTimerSource, create_ring_memfd
from dbr_service.sampling.base import Sample
from dbr_service.sampling.detect import detect, make_source
from dbr_service.sampling import perf_abi
from dbr_service.sampling.lbr import edges_from_lbr, fallthroughs_from_lbr, lbr_profile
from dbr_service.sampling.recorded import (RecordedSource, parse_brstack, read_samples,
                                           write_samples)

ROOT = Path(__file__).resolve().parents[2]
PROGS = Path(__file__).resolve().parent.parent / "sampling_progs"

needs_perf = pytest.mark.skipif(not perf.PerfSource.available()[0],
                                reason=perf.PerfSource.available()[1])


# ---------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def bins(tmp_path_factory) -> dict[str, Path]:
    """Compile the test programs once per module."""
    d = tmp_path_factory.mktemp("sampling_progs")
    flags = {
        "hotcold": ["-O1", "-g", "-no-pie"],
        "threads": ["-O1", "-g", "-pthread"],
        "ring_producer": ["-O2", "-pthread", f"-I{ROOT / 'shared'}"],
        "switchy": ["-O1", "-pthread"],
    }
    out = {}
    for name, extra in flags.items():
        exe = d / name
        subprocess.run(["gcc", "-std=gnu11", "-Wall", "-Werror", *extra, "-o", str(exe),
                        str(PROGS / f"{name}.c")], check=True)
        out[name] = exe
    return out


@pytest.fixture
def spawn():
    """Start processes; every one is killed (by pid) and reaped at teardown."""
    procs: list[subprocess.Popen] = []

    def start(*args, **kw) -> subprocess.Popen:
        p = subprocess.Popen([str(a) for a in args], **kw)
        procs.append(p)
        return p

    try:
        yield start
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            for f in (p.stdin, p.stdout, p.stderr):
                if f:
                    f.close()


def symbol_ranges(exe: Path) -> dict[str, tuple[int, int]]:
    """Function name -> [start, end) from `nm -S` (non-PIE, so these are run addresses)."""
    out = subprocess.run(["nm", "-S", "--defined-only", str(exe)], check=True,
                         capture_output=True, text=True).stdout
    ranges = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[2] in "tT":
            start, size = int(parts[0], 16), int(parts[1], 16)
            ranges[parts[3]] = (start, start + size)
    return ranges


def sample_for(src: perf.PerfSource, seconds: float, every: float = 0.05) -> list[Sample]:
    got: list[Sample] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(every)
        got += src.read()
    return got


# ---------------------------------------------------------------------------------------
# perf: ABI
# ---------------------------------------------------------------------------------------

def test_perf_event_attr_matches_kernel_header(tmp_path):
    """Sizes, offsets and flag bit positions equal <linux/perf_event.h>'s."""
    attr_fields = [f[0] for f in perf.PerfEventAttr._fields_ if len(f) == 2]
    page_fields = ["data_head", "data_tail", "data_offset", "data_size", "time_zero", "size"]
    lines = ["#include <stdio.h>", "#include <stddef.h>", "#include <string.h>",
             "#include <stdint.h>", "#include <linux/perf_event.h>", "int main(void) {",
             'printf("size attr %zu\\n", sizeof(struct perf_event_attr));',
             'printf("size page %zu\\n", sizeof(struct perf_event_mmap_page));']
    for f in attr_fields:
        lines.append(f'printf("off attr.{f} %zu\\n", offsetof(struct perf_event_attr, {f}));')
    for f in page_fields:
        lines.append(f'printf("off page.{f} %zu\\n", '
                     f'offsetof(struct perf_event_mmap_page, {f}));')
    lines += ["struct perf_event_attr a; memset(&a, 0, sizeof a);",
              "a.disabled = 1; a.exclude_kernel = 1; a.exclude_hv = 1; a.watermark = 1;",
              "a.precise_ip = 2; a.sample_id_all = 1; a.sigtrap = 1; a.inherit_thread = 1;",
              "uint64_t w; memcpy(&w, (char *)&a + 40, 8);",
              'printf("bits flags %llu\\n", (unsigned long long)w);']
    consts = ["PERF_SAMPLE_BRANCH_USER", "PERF_SAMPLE_BRANCH_ANY", "PERF_SAMPLE_BRANCH_NO_FLAGS",
              "PERF_SAMPLE_BRANCH_NO_CYCLES", "PERF_SAMPLE_BRANCH_HW_INDEX",
              "PERF_SAMPLE_BRANCH_STACK", "PERF_EVENT_IOC_PERIOD", "PERF_TYPE_RAW"]
    lines += [f'printf("const {c} %llu\\n", (unsigned long long){c});' for c in consts]
    lines.append("return 0; }")
    src, exe = tmp_path / "p.c", tmp_path / "p"
    src.write_text("\n".join(lines))
    subprocess.run(["gcc", "-o", str(exe), str(src)], check=True)
    out = dict(line.rsplit(" ", 1) for line in subprocess.run(
        [str(exe)], check=True, capture_output=True, text=True).stdout.splitlines())
    assert int(out["size attr"]) >= ctypes.sizeof(perf.PerfEventAttr)
    assert int(out["size attr"]) in (perf.PERF_ATTR_SIZE_VER7, perf.PERF_ATTR_SIZE_VER7 + 8)
    assert int(out["size page"]) == ctypes.sizeof(perf.PerfEventMmapPage)
    for f in attr_fields:
        assert int(out[f"off attr.{f}"]) == getattr(perf.PerfEventAttr, f).offset, f
    for f in page_fields:
        assert int(out[f"off page.{f}"]) == getattr(perf.PerfEventMmapPage, f).offset, f
    a = perf.PerfEventAttr()
    a.disabled = a.exclude_kernel = a.exclude_hv = a.watermark = 1
    a.precise_ip, a.sample_id_all, a.sigtrap, a.inherit_thread = 2, 1, 1, 1
    assert int(out["bits flags"]) == struct.unpack_from("<Q", bytes(a), 40)[0]
    for c in consts:
        assert int(out[f"const {c}"]) == getattr(perf_abi, c), c


def _sample_record(ip: int, pid: int, tid: int, t: int) -> bytes:
    return struct.pack("<IHHQIIQ", perf.PERF_RECORD_SAMPLE, 0, 32, ip, pid, tid, t)


def test_perf_ring_wraparound_and_lost_records():
    """A synthetic ring whose records straddle the end of the data area parses whole."""
    pages, page = 1, perf.PAGE_SIZE
    fd = os.memfd_create("fake-perf-ring", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, (1 + pages) * page)
        with mmap.mmap(fd, (1 + pages) * page) as mm:
            hdr = perf.PerfEventMmapPage.from_buffer(mm)
            hdr.data_offset, hdr.data_size = page, pages * page
            start = pages * page - 40  # first record: 32 bytes, then one split 8 | 24
            hdr.data_tail = hdr.data_head = start + 10 * pages * page  # many laps already
            del hdr
        ring = perf.PerfRing(fd, pages)
        lap = ring.tail - ring.tail % ring.data_size
        recs = (_sample_record(0x401000, 7, 8, 1) + _sample_record(0x401010, 7, 9, 2)
                + struct.pack("<IHHQQ", perf.PERF_RECORD_LOST, 0, 24, 0, 5)
                + _sample_record(0x401020, 7, 8, 3))
        pos = ring.tail % ring.data_size
        data = bytearray(ring.mm[page: 2 * page])
        for i, b in enumerate(recs):
            data[(pos + i) % ring.data_size] = b
        ring.mm[page: 2 * page] = bytes(data)
        assert ring.drain() == (b"", False)  # nothing published yet
        ctypes.c_uint64.from_buffer(ring.mm, 1024).value = ring.tail + len(recs)
        raw, overrun = ring.drain()
        assert not overrun and raw == recs
        res = perf.parse_records(raw, perf.PERF_SAMPLE_IP | perf.PERF_SAMPLE_TID
                                 | perf.PERF_SAMPLE_TIME)
        assert [(s.ip, s.tid, s.time_ns) for s in res.samples] == [
            (0x401000, 8, 1), (0x401010, 9, 2), (0x401020, 8, 3)]
        assert res.lost == 5 and res.bad_records == 0
        tail_in_page = ctypes.c_uint64.from_buffer_copy(ring.mm[1032:1040]).value
        assert tail_in_page == ring.tail and ring.tail > lap + ring.data_size  # wrapped
        ring.close()
    finally:
        os.close(fd)


def test_parse_branch_stack_record():
    st = perf.PERF_SAMPLE_IP | perf.PERF_SAMPLE_TID | perf.PERF_SAMPLE_BRANCH_STACK
    body = struct.pack("<QIIQ", 0x500, 3, 4, 2) + struct.pack("<QQQQQQ", 0x4f0, 0x500, 0,
                                                               0x420, 0x4e0, 0)
    rec = struct.pack("<IHH", perf.PERF_RECORD_SAMPLE, 0, 8 + len(body)) + body
    res = perf.parse_records(rec + b"\x09\x00\x00\x00\x00\x00\x04\x00", st)
    assert res.samples[0].branch_stack == ((0x4F0, 0x500), (0x420, 0x4E0))
    assert res.bad_records == 1  # the truncated trailing record (size 4 < 8)


# ---------------------------------------------------------------------------------------
# perf: live
# ---------------------------------------------------------------------------------------

@needs_perf
def test_perf_finds_hot_function(bins, spawn):
    """~1 s of cpu-clock samples: the top IP is in hot(), which holds ~80% of them."""
    exe = bins["hotcold"]
    ranges = symbol_ranges(exe)
    p = spawn(exe)
    src = perf.PerfSource("cpu-clock", sample_period_us=1000)
    agg = SampleAggregator()
    src.open(p.pid)
    try:
        src.enable()
        cpu0 = time.process_time()
        samples = sample_for(src, 1.0)
        src.disable()
        samples += src.read()
        consumer_cpu = time.process_time() - cpu0
        time.sleep(0.15)
        assert src.read() == []  # disabled: the still-running program is not sampled
        src.enable()
        assert len(sample_for(src, 0.15)) > 0  # and a new window samples again
    finally:
        src.close()
    agg.add(samples)
    n = agg.samples_of(p.pid)
    assert n >= 200, f"only {n} samples in 1 s"
    assert {s.tid for s in samples} == {p.pid}
    top = agg.top(1, p.pid)[0]
    lo, hi = ranges["hot"]
    assert lo <= top.ip < hi, f"top ip {top.ip:#x} not in hot [{lo:#x},{hi:#x})"
    def share(fn: str) -> float:
        a, b = ranges[fn]
        return sum(c for ip, c in agg.ips[p.pid].items() if a <= ip < b) / n
    hot, cold = share("hot"), share("cold")
    print(f"samples={n} hot={hot:.3f} cold={cold:.3f} lost={src.stats.lost} "
          f"consumer_cpu={consumer_cpu * 1e3:.1f}ms ({consumer_cpu / n * 1e6:.1f}us/sample)")
    assert 0.65 <= hot <= 0.92 and 0.08 <= cold <= 0.35 and hot + cold > 0.97
    # time stamps increase, disable() really stops sampling
    times = [s.time_ns for s in samples]
    assert times == sorted(times)
    src2 = perf.PerfSource("cpu-clock", sample_period_us=1000)
    src2.open(p.pid)
    try:
        time.sleep(0.2)
        assert src2.read() == []  # created disabled
    finally:
        src2.close()


@needs_perf
def test_perf_every_thread_including_late_ones(bins, spawn):
    """4 threads at attach, 2 more 0.3 s later found by refresh_threads(): all sampled."""
    p = spawn(bins["threads"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def read_tids(k: int) -> list[int]:
        return [int(p.stdout.readline().split()[1]) for _ in range(k)]

    main_and_first = read_tids(5)
    first = main_and_first[1:]
    src = perf.PerfSource("cpu-clock", sample_period_us=1000)
    src.open(p.pid)
    try:
        assert set(src.tids) == set(main_and_first)
        src.enable()
        samples = sample_for(src, 0.3)
        p.stdin.write("go\n")
        p.stdin.flush()
        late = read_tids(2)
        added, removed = src.refresh_threads()
        assert sorted(added) == sorted(late) and removed == []
        samples += sample_for(src, 0.9)
        per_tid = Counter(s.tid for s in samples)
        print("per-thread samples:", dict(per_tid), "stats:", src.stats)
        for tid in first + late:
            assert per_tid[tid] >= 20, f"thread {tid} got {per_tid[tid]} samples"
        assert src.stats.lost == 0
        # the process exits: draining and rescanning must not raise
        p.kill()
        p.wait(timeout=5)
        src.read()
        added, removed = src.refresh_threads()
        assert added == [] and sorted(removed) == sorted(main_and_first + late)
        assert src.tids == [] and src.read() == []
    finally:
        src.close()


def test_perf_event_of_an_ended_thread_is_not_kept_for_its_tid(bins, spawn, monkeypatch):
    """A thread the agent started unwrapped (a dormant agent's) sends no THREAD_EXIT,
    so its event can still be open when its tid is announced or listed again, a new
    thread's by then.  add_thread and refresh_threads see that the event's thread
    ended (POLLHUP) and drop it instead of keeping the tid as sampled."""
    p = spawn(bins["threads"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    tids = [int(p.stdout.readline().split()[1]) for _ in range(5)]
    src = perf.PerfSource("cpu-clock", sample_period_us=1000)
    try:
        p.stdin.write("go\n")
        p.stdin.flush()
        tids += [int(p.stdout.readline().split()[1]) for _ in range(2)]
        p.stdin.write("brief\n")
        p.stdin.flush()
        brief = int(p.stdout.readline().split()[1])
        src.open(p.pid)
        assert brief in src.tids
        assert p.stdout.readline().strip() == "ended"
        assert brief in src.tids             # nothing told the source
        assert src.add_thread(tids[1]) is True and tids[1] in src.tids   # alive: kept
        # announced again: the ended thread's event is dropped, none opened (gone)
        assert src.add_thread(brief) is False and brief not in src.tids
        # listed again (its tid reused, as the listing would show it): the same
        p.stdin.write("brief\n")
        p.stdin.flush()
        brief2 = int(p.stdout.readline().split()[1])
        src.refresh_threads()
        assert brief2 in src.tids
        assert p.stdout.readline().strip() == "ended"
        real = perf.list_tids
        monkeypatch.setattr(perf, "list_tids", lambda pid: real(pid) + [brief2])
        added, removed = src.refresh_threads()
        assert brief2 not in src.tids and brief2 not in added
        assert set(src.tids) == set(tids)
    finally:
        src.close()


def test_perf_refused_paths(bins, spawn):
    """Refusals are SamplingErrors or (False, reason), never raw OSErrors."""
    with pytest.raises(SamplingError, match="no process"):
        perf.PerfSource().open(2 ** 22 + 12345)
    with pytest.raises(SamplingError):
        perf.PerfSource(sample_period_us=0)
    with pytest.raises(SamplingError):
        perf.PerfSource(data_pages=3)
    ok, reason = perf.PerfSource.available("cycles")
    if not ok:  # this VM: no PMU; the kernel refuses the hardware event
        assert "perf cycles" in reason
        p = spawn(bins["hotcold"])
        src = perf.PerfSource("cycles")
        with pytest.raises(SamplingError, match="refused"):
            src.open(p.pid)
        assert src.pid is None and src.tids == []  # nothing left open
    # a thread that exits between the scan and the open is skipped, not an error
    p = spawn(bins["hotcold"])
    src = perf.PerfSource()
    src.open(p.pid)
    try:
        assert src.add_thread(2 ** 22 + 54321) is False
        assert src.stats.threads_gone == 1
    finally:
        src.close()


def _read_tagged(p, *tags: str) -> dict[str, int]:
    out = {}
    while len(out) < len(tags):
        tag, tid = p.stdout.readline().split()
        assert tag in tags, tag
        out[tag] = int(tid)
    return out


@needs_perf
def test_perf_gate_leaves_threads_that_switch_often_unsampled(bins, spawn):
    """A thread that leaves its CPU ~14 000 times a second gets no event under the
    default gate (2000 a second), its spinning sibling and the sleeping main thread do;
    once it calms down the next refresh gives it one.  Gate 0: every thread."""
    p = spawn(bins["switchy"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    tids = _read_tagged(p, "spin", "switchy")
    time.sleep(0.3)
    ungated = perf.PerfSource(gate=perf.SwitchGate(p.pid, 0))
    ungated.open(p.pid)
    assert set(ungated.tids) == {p.pid, tids["spin"], tids["switchy"]}
    ungated.close()
    gate = perf.SwitchGate(p.pid, 2000)
    src = perf.PerfSource(sample_period_us=1000, gate=gate)
    src.open(p.pid)
    try:
        assert gate.rate(tids["switchy"]) > 5000 and gate.rate(tids["spin"]) < 2000
        assert set(src.tids) == {p.pid, tids["spin"]} and src.gated == {tids["switchy"]}
        assert src.stats.extra["switch_gated"] == 1 and gate.refused >= 1
        src.enable()
        per_tid = Counter(s.tid for s in sample_for(src, 0.3))
        assert per_tid[tids["spin"]] >= 50 and set(per_tid) == {tids["spin"]}, per_tid
        # still switching: the refresh keeps it gated, nothing added or removed
        time.sleep(0.1)
        assert src.refresh_threads() == ([], []) and src.gated == {tids["switchy"]}
        assert src.stats.extra["switch_gated"] == 2   # one look a refresh
        p.stdin.write("calm\n")
        p.stdin.flush()
        time.sleep(0.3)   # the rate since the last look (>= min_span_s) is measured
        assert src.refresh_threads() == ([], [])
        assert tids["switchy"] in src.tids and not src.gated, (src.tids, src.gated)
        per_tid = Counter(s.tid for s in sample_for(src, 0.3))
        assert per_tid[tids["switchy"]] >= 50, per_tid
    finally:
        src.close()
    assert src.gated == set()


class _ListGate(perf.SwitchGate):
    """A gate that refuses the threads in ``block``."""

    def __init__(self, pid: int) -> None:
        super().__init__(pid, 1)
        self.block: set[int] = set()

    def allows(self, tid):
        return tid not in self.block


@needs_perf
def test_perf_refresh_takes_the_event_of_a_thread_that_got_busy(bins, spawn):
    """A sampled thread that starts switching too often loses its event at the next
    refresh (its samples so far are kept for read()), and gets one back later."""
    p = spawn(bins["switchy"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    tids = _read_tagged(p, "spin", "switchy")
    gate = _ListGate(p.pid)
    src = perf.PerfSource(sample_period_us=1000, gate=gate)
    src.open(p.pid)
    try:
        src.enable()
        assert tids["spin"] in src.tids
        time.sleep(0.3)
        gate.block = {tids["spin"]}
        assert src.refresh_threads() == ([], [])
        assert tids["spin"] not in src.tids and src.gated == {tids["spin"]}
        before = Counter(s.tid for s in src.read())
        assert before[tids["spin"]] >= 50, before    # drained when its event closed
        after = Counter(s.tid for s in sample_for(src, 0.2))
        assert after[tids["spin"]] == 0, after
        gate.block = set()
        src.refresh_threads()
        assert tids["spin"] in src.tids and not src.gated
        assert Counter(s.tid for s in sample_for(src, 0.2))[tids["spin"]] >= 30
    finally:
        src.close()


@needs_perf
def test_perf_gate_refusing_every_thread_is_no_error(bins, spawn):
    """A process whose only thread switches too often opens a source with no event
    (no samples, not a refusal that would send the service to the agent timer)."""
    p = spawn(bins["switchy"], "alone", stdin=subprocess.PIPE, stdout=subprocess.PIPE,
              text=True)
    _read_tagged(p, "switchy")
    time.sleep(0.3)
    gate = perf.SwitchGate(p.pid, 2000)
    gone = 2 ** 22 + 4321
    gate._seen[gone] = (0.0, 5, None)          # a thread of an earlier window, ended
    src = perf.PerfSource(gate=gate)
    src.open(p.pid)
    try:
        assert gone not in gate._seen             # forgotten when the window opened
        assert src.tids == [] and src.gated == {p.pid}
        src.enable()
        assert sample_for(src, 0.1) == []
        assert src.refresh_threads() == ([], [])
    finally:
        src.close()


class _ScriptedAgent:
    """The agent's side of a listed timer sampler, scripted: start() hands over a ring
    (whose samples a test writes itself), arm() answers from ``answers`` (tid -> result
    or exception), OK otherwise; every call is recorded."""

    def __init__(self) -> None:
        self.calls: list = []
        self.answers: dict[int, object] = {}
        self.start_error: Exception | None = None
        self.fd = -1

    def start(self, period_us: int, ring_entries: int) -> int:
        self.calls.append(("start", period_us, ring_entries))
        if self.start_error is not None:
            raise self.start_error
        self.fd = create_ring_memfd(ring_entries)
        return os.dup(self.fd)

    def stop(self) -> None:
        self.calls.append(("stop",))

    def arm(self, tid: int, on: bool) -> int:
        self.calls.append((tid, on))
        a = self.answers.get(tid, protocol.Result.OK)
        if isinstance(a, Exception):
            raise a
        return a

    def push(self, *samples: tuple[int, int]) -> None:
        """Publish (pc, tid) samples into the ring as the agent's handler would."""
        with mmap.mmap(self.fd, 0) as mm:
            head = struct.unpack_from("<Q", mm, protocol.RingHeader.head.offset)[0]
            for i, (pc, tid) in enumerate(samples, head):
                struct.pack_into("<QII", mm, 64 + 16 * (i % 64), pc, tid, i + 1)
            struct.pack_into("<Q", mm, protocol.RingHeader.head.offset, head + len(samples))


@needs_perf
def test_gated_threads_get_the_agents_timer_and_failures_leave_perf_going(bins, spawn):
    """sampling/gated.py: the threads the gate refuses are named to a listed agent
    sampler, started only once one needs it; a thread the gate lets back in is
    unnamed; timer samples join perf's.  An agent answer other than OK / E_UNKNOWN,
    or a start it refuses, gives the fallback up (``failed``, told once) while
    perf goes on."""
    from dbr_service.common.errors import AgentError
    from dbr_service.sampling.gated import GatedTimerSource

    p = spawn(bins["switchy"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    tids = _read_tagged(p, "spin", "switchy")

    def make(agent):
        gate = _ListGate(p.pid)
        timer = AgentTimerSource(agent.start, agent.stop, period_us=1000, ring_entries=64)
        return gate, GatedTimerSource(perf.PerfSource(sample_period_us=1000, gate=gate),
                                      timer, agent.arm)

    agent = _ScriptedAgent()
    gate, src = make(agent)
    src.open(p.pid)
    try:
        src.enable()                       # nothing gated: no sampler started
        assert agent.calls == [] and src.name == "perf-cpu-clock"
        gate.block = {tids["switchy"]}
        src.refresh_threads()
        assert agent.calls == [("start", 1000, 64), (tids["switchy"], True)]
        assert src.name == "perf-cpu-clock+agent-timer"
        assert src.timed == {tids["switchy"]} and src.gated == {tids["switchy"]}
        agent.push((0x1234, tids["switchy"]), (0x1238, tids["switchy"]))
        got = Counter((s.tid, s.ip) for s in sample_for(src, 0.2))
        assert got[(tids["switchy"], 0x1234)] == 1 and got[(tids["switchy"], 0x1238)] == 1
        assert sum(n for (t, _), n in got.items() if t == tids["spin"]) >= 30, got
        assert src.take_counts() == ({tids["switchy"]}, 2, None)
        assert src.take_counts() == (set(), 0, None)
        # calmed down: perf takes it back, its timer is deleted, the sampler stays
        gate.block = {tids["spin"]}
        del agent.calls[:]
        src.refresh_threads()
        assert agent.calls == [(tids["switchy"], False), (tids["spin"], True)]
        assert src.timed == {tids["spin"]} and tids["switchy"] in src.tids
        # a thread that ended before it was named is no failure
        gate.block = {tids["spin"], tids["switchy"]}
        agent.answers[tids["switchy"]] = protocol.Result.E_UNKNOWN
        src.refresh_threads()
        assert src.timed == {tids["spin"]} and src.failed is None
        del agent.calls[:]
        src.disable()
        assert agent.calls == [("stop",)] and src.timed == set()
        src.enable()                      # the next window names them again
        assert agent.calls[-2:] == [(tids["spin"], True), (tids["switchy"], True)]
        # a full timer table: given up for good, perf goes on
        agent.answers[tids["switchy"]] = protocol.Result.E_LIMIT
        src.disable()
        src.enable()
        assert src.failed and "E_LIMIT" in src.failed and src.timed == set()
        assert agent.calls[-1] == ("stop",)
        assert src.take_counts()[2] == src.failed and src.take_counts()[2] is None
        del agent.calls[:]
        src.refresh_threads()
        assert agent.calls == []
        src.read()      # what spin's event took before it was gated, kept for read()
        assert Counter(s.tid for s in sample_for(src, 0.2))[tids["spin"]] == 0  # gated
        gate.block = set()
        src.refresh_threads()
        assert Counter(s.tid for s in sample_for(src, 0.2))[tids["spin"]] >= 30
    finally:
        src.close()
    assert src.timed == set() and src.pid is None

    # the agent refuses to start, or stops answering: perf alone
    for failure in (AgentError("sampler refused: E_NOMEM"), None):
        agent = _ScriptedAgent()
        if failure is not None:
            agent.start_error = failure
        else:
            agent.answers[tids["switchy"]] = AgentError("no reply within 1.0 s")
        gate, src = make(agent)
        gate.block = {tids["switchy"]}
        src.open(p.pid)
        try:
            src.enable()
            assert src.failed and src.timed == set(), src.failed
            assert Counter(s.tid for s in sample_for(src, 0.2))[tids["spin"]] >= 30
            src.disable()
        finally:
            src.close()


class _FakeGate(perf.SwitchGate):
    """A gate over made-up counts: {tid: switches}, starts in s, and a clock."""

    def __init__(self, max_rate: float) -> None:
        super().__init__(1, max_rate)
        self.counts: dict[int, int | None] = {}
        self.starts: dict[int, float | None] = {}
        self.clock = 100.0

    def switches(self, tid):
        return self.counts.get(tid)

    def _started(self, tid):
        return self.starts.get(tid)

    def _now(self):
        return self.clock


def test_switch_gate_rates():
    g = _FakeGate(2000)
    g.counts, g.starts = {1: 100_000, 2: 500, 3: 10, 4: None}, {1: 98.0, 2: 99.0, 3: 99.99}
    assert g.rate(1) == pytest.approx(50_000) and not g.allows(1)  # since its start
    assert g.rate(2) == pytest.approx(500) and g.allows(2)
    assert g.rate(3) is None and g.allows(3)   # 10 ms old: not known yet
    assert g.rate(4) is None and g.allows(4)   # counts not readable
    g.clock += 0.01                            # too soon for a rate of its own:
    g.counts[1] = 100_010                      # the last look's holds
    assert g.rate(1) == pytest.approx(50_000)
    g.clock += 0.5                             # calmed down: 100 in 0.5 s
    g.counts[1] = 100_100
    assert g.rate(1) == pytest.approx(200, rel=0.05) and g.allows(1)
    g.clock += 0.5
    g.counts[1] = 110_100                      # busy again: 20 000 a second
    assert not g.allows(1)
    assert g.refused == 2
    g.clock += 0.5
    g.counts[1] = 5                            # the tid now names a new thread
    g.starts[1] = g.clock - 1.0
    assert g.rate(1) == pytest.approx(5)       # its rate since its own start
    g.forget({2, 3})
    assert set(g._seen) == {2, 3}
    assert _FakeGate(0).allows(1)              # 0: no gate


def test_detect_reports_software_clock():
    rep = detect()
    caps = rep.capabilities
    assert set(caps) == {"perf-cpu-clock", "perf-cycles", "ibs-op", "lbr", "agent-timer"}
    assert caps["perf-cpu-clock"].available, caps["perf-cpu-clock"].reason
    assert rep.best in ("perf-cycles", "perf-cpu-clock")
    if not caps["perf-cycles"].available:
        assert rep.best == "perf-cpu-clock"
        assert not caps["lbr"].available
    assert rep.perf_event_paranoid == perf.read_paranoid()
    json.dumps(rep.to_json())
    src = make_source(rep.best, sample_period_us=500)
    assert isinstance(src, perf.PerfSource) and src.name == rep.best
    with pytest.raises(SamplingError):
        make_source("ibs-op")  # offered by some hosts, replayed only
    with pytest.raises(SamplingError):
        make_source("agent-timer")  # needs the session's start/stop
    print(json.dumps(rep.to_json(), indent=1))


# ---------------------------------------------------------------------------------------
# agent timer ring
# ---------------------------------------------------------------------------------------

def _run_producer(spawn, bins, fd: int, nthreads: int, count: int, spin: int = 0):
    return spawn(bins["ring_producer"], fd, nthreads, count, spin, pass_fds=[fd],
                 stdout=subprocess.PIPE, text=True)


def _producer_report(p) -> dict[int, tuple[int, int]]:
    out, _ = p.communicate(timeout=20)
    assert p.returncode == 0, out
    rows = [line.split() for line in out.splitlines()]
    return {int(r[2]): (int(r[3]), int(r[4])) for r in rows}  # tid -> (pushed, dropped)


def _check_order(entries: list[tuple[int, int]]) -> dict[int, list[int]]:
    per: dict[int, list[int]] = defaultdict(list)
    for pc, tid in entries:
        per[tid].append(pc & 0xFFFFFFFF)
    for tid, ks in per.items():
        assert all(a < b for a, b in zip(ks, ks[1:])), f"tid {tid} out of order"
    return per


def test_agent_ring_reads_exactly_what_was_pushed(bins, spawn):
    fd = create_ring_memfd(4096)
    try:
        ring = AgentTimerRing(fd)
        report = _producer_report(_run_producer(spawn, bins, fd, 4, 1000))
        got = ring.read()
        assert len(got) == 4000 and ring.dropped == 0 and ring.read() == []
        per = _check_order(got)
        assert {t: len(v) for t, v in per.items()} == {t: 1000 for t in report}
        assert all(v == list(range(1000)) for v in per.values())
        hdr = protocol.RingHeader.from_buffer_copy(ring.mm[:64])
        assert hdr.head == hdr.tail == 4000
        ring.close()
    finally:
        os.close(fd)


def test_agent_ring_overflow_counts_drops(bins, spawn):
    fd = create_ring_memfd(64)
    try:
        ring = AgentTimerRing(fd)
        report = _producer_report(_run_producer(spawn, bins, fd, 4, 1000))
        dropped = sum(d for _, d in report.values())
        assert dropped == 4000 - 64 and ring.dropped == dropped
        got = ring.read()
        assert len(got) == 64 and ring.new_drops() == dropped
        per = _check_order(got)
        assert {t: len(v) for t, v in per.items()} == {
            t: pushed for t, (pushed, _) in report.items() if pushed}
        # the ring is usable again after the overflow
        report2 = _producer_report(_run_producer(spawn, bins, fd, 2, 30))
        got2 = ring.read()
        assert len(got2) == 60 and ring.new_drops() == 0
        assert all(_check_order(got2)[t] == list(range(30)) for t in report2)
        ring.close()
    finally:
        os.close(fd)


def test_agent_ring_seq_wraps_at_32_bits(bins, spawn):
    """Slot numbers are 64-bit, seq is their low 32 bits: crossing 2**32 must work."""
    fd = create_ring_memfd(64)
    try:
        start = 2 ** 32 - 7
        os.pwrite(fd, struct.pack("<QQ", start, start), protocol.RingHeader.head.offset)
        ring = AgentTimerRing(fd)
        assert ring.tail == start
        report = _producer_report(_run_producer(spawn, bins, fd, 2, 10))
        got = ring.read()
        assert len(got) == 20 and ring.tail == start + 20 and ring.dropped == 0
        assert all(_check_order(got)[t] == list(range(10)) for t in report)
        ring.close()
    finally:
        os.close(fd)


def test_agent_ring_concurrent_consumer(bins, spawn):
    """Consumer racing 4 producers: every entry is read once or counted as dropped."""
    fd = create_ring_memfd(256)
    try:
        ring = AgentTimerRing(fd)
        p = _run_producer(spawn, bins, fd, 4, 5000, spin=20000)
        got = []
        while p.poll() is None:
            got += ring.read()
        got += ring.read()
        report = _producer_report(p)
        per = _check_order(got)
        for tid, (pushed, _) in report.items():
            assert len(per.get(tid, [])) == pushed
        assert len(got) + ring.dropped == 20000 and len(got) > 256
        assert ring.dropped == sum(d for _, d in report.values()) and ring.skipped == 0
        print(f"concurrent: read={len(got)} dropped={ring.dropped}")
        ring.close()
    finally:
        os.close(fd)


def test_agent_ring_rejects_bad_rings():
    unsealed = os.memfd_create("unsealed-ring")
    try:
        os.ftruncate(unsealed, 64 + 16 * 8)
        with pytest.raises(SamplingError, match="not sealed"):   # could shrink under us
            AgentTimerRing(unsealed)
    finally:
        os.close(unsealed)
    fd = os.memfd_create("bad-ring", os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, 64 + 16 * 8)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        with pytest.raises(SamplingError, match="magic"):
            AgentTimerRing(fd)
        hdr = protocol.RingHeader(magic=protocol.RING_MAGIC, version=protocol.PROTO_VERSION,
                                  capacity=12, entry_size=16)
        os.pwrite(fd, bytes(hdr), 0)
        with pytest.raises(SamplingError, match="power of two"):
            AgentTimerRing(fd)
        hdr.capacity = 64
        os.pwrite(fd, bytes(hdr), 0)
        with pytest.raises(SamplingError, match="cannot hold"):
            AgentTimerRing(fd)
    finally:
        os.close(fd)


def test_agent_ring_skips_slot_of_dead_producer():
    fd = create_ring_memfd(8)
    try:
        ring = AgentTimerRing(fd, skip_after_s=0.2)
        with mmap.mmap(fd, 64 + 8 * 16) as mm:
            # slot 0 reserved and never published; slot 1 published
            struct.pack_into("<Q", mm, protocol.RingHeader.head.offset, 2)  # head = 2
            struct.pack_into("<QII", mm, 64 + 16, 0xABC, 77, 2)
            t0 = time.monotonic()
            while time.monotonic() - t0 < 0.1:  # a preempted producer: wait for it
                assert ring.read() == []
            assert ring.skipped == 0
            time.sleep(0.15)
            assert ring.read() == []  # stalled for > 0.2 s: slot 0 is skipped
            assert ring.skipped == 1 and ring.read() == [(0xABC, 77)]
        ring.close()
    finally:
        os.close(fd)


def test_agent_timer_source_through_start_stop(bins, spawn):
    """The source asks its start() for a ring, drains it, and accounts the drops."""
    calls: list = []
    procs: list = []

    def start(period_us: int, ring_entries: int) -> int:
        """The agent's side: the ring fills up (and overflows) before the service maps it."""
        calls.append(("start", period_us, ring_entries))
        fd = create_ring_memfd(ring_entries)
        procs.append(_run_producer(spawn, bins, fd, 3, 500))
        procs[-1].wait(timeout=20)
        return fd

    def stop() -> None:
        calls.append(("stop",))

    src = AgentTimerSource(start, stop, period_us=500, ring_entries=1024)
    src.open(4242)
    try:
        src.enable()
        samples = src.read()
        src.disable()
        samples += src.read()
        assert calls == [("start", 500, 1024), ("stop",)]
        assert len(samples) + src.stats.lost == 1500
        assert src.stats.lost == 1500 - 1024 and len(samples) == 1024
        assert {s.pid for s in samples} == {4242}
        assert src.stats.samples == 1024
    finally:
        src.close()

    def refuse(period_us: int, ring_entries: int) -> int:
        raise RuntimeError("DBR_E_DENIED")

    bad = AgentTimerSource(refuse, stop)
    bad.open(4242)
    with pytest.raises(SamplingError, match="refused"):
        bad.enable()
    bad.close()


# ---------------------------------------------------------------------------------------
# LBR edges, recorded streams, aggregation
# ---------------------------------------------------------------------------------------

def test_lbr_edges_known_answer():
    """Loop at 0x100..0x120 with a call to 0x200: two stacks, newest first."""
    # chronological: 0x120->0x100 (loop back), 0x10c->0x200 (call), 0x210->0x111 (ret),
    #                0x120->0x100 (loop back)
    s1 = [(0x120, 0x100), (0x210, 0x111), (0x10C, 0x200), (0x120, 0x100)]
    s2 = [(0x120, 0x100), (0x10C, 0x200), (0x120, 0x100)]
    edges = edges_from_lbr([s1, s2])
    assert edges == {(0x120, 0x100): 4, (0x10C, 0x200): 2, (0x210, 0x111): 1}
    falls = fallthroughs_from_lbr([s1, s2])
    # from each target to the next source
    assert falls == {(0x100, 0x10C): 2, (0x200, 0x210): 1, (0x111, 0x120): 1}
    # s2's 0x200 -> 0x120 runs from the callee to the caller's loop end without the
    # return: a discontinuity (newer source below older target), not a range
    prof = lbr_profile([s1, s2])
    assert prof.inconsistent == 1 and prof.stacks == 2
    # chopped branch trace: only the newest 2 branches of each stack
    assert edges_from_lbr([s1, s2], cbt_size=2) == {(0x120, 0x100): 2, (0x210, 0x111): 1,
                                                    (0x10C, 0x200): 1}
    assert edges_from_lbr([list(reversed(s1))], newest_first=False) == edges_from_lbr([s1])


def test_recorded_stream_ibs_and_lbr(tmp_path):
    lines = [
        json.dumps({"schema": "dbr.samples/1", "source": "ibs-op"}),
        "# comment",
        json.dumps({"pid": 9, "tid": 10, "ip": "0x401000", "taken": True,
                    "target": "0x400f00", "load_addr": "0x7ff000"}),
        json.dumps({"pid": 9, "tid": 10, "ip": "0x401000", "taken": False}),
        json.dumps({"pid": 9, "tid": 11, "ip": 0x401000, "taken": True, "target": 0x400F00}),
        json.dumps({"pid": 9, "tid": 11, "ip": "0x120",
                    "brstack": "prog 9/11 0x120/0x100/P/-/-/0 0x110/0x118/P/-/-/0"}),
        json.dumps({"pid": 9, "ip": "0x120",
                    "branch_stack": [["0x120", "0x100"], ["0x110", "0x118"]]}),
        "{not json",
        json.dumps({"pid": 9, "tid": 1}),  # no ip
    ]
    path = tmp_path / "ibs.jsonl"
    path.write_text("\n".join(lines) + "\n")
    src = RecordedSource(path, batch=3)
    assert src.name == "recorded:ibs-op" and src.stats.errors == 2
    src.open(555)
    assert src.read() == []  # disabled: nothing comes out
    src.enable()
    agg = SampleAggregator(lbr_cbt_size=None)   # whole 2-entry stacks
    while src.remaining:
        agg.add(src.read())
    src.close()
    assert agg.samples_of(555) == 5 and agg.per_thread(555) == {10: 2, 11: 2, 9: 1}
    br = agg.branch_counts(555)
    assert br[0x401000] == {0x400F00: 2}
    assert br[0x120] == {0x100: 2} and br[0x110] == {0x118: 2}
    assert agg.not_taken[555][0x401000] == 1
    assert agg.fallthroughs[555] == {(0x118, 0x120): 2}
    assert parse_brstack("0x1/0x2/P/-/-/0 junk 0x3/0x4") == ((1, 2), (3, 4))
    with pytest.raises(SamplingError):
        RecordedSource(lines, strict=True)
    # record -> replay round trip
    buf = io.StringIO()
    samples = [Sample(1, 2, 0x10, 5, ((0x20, 0x30),), True, 0x40, 0x50), Sample(1, 3, 0x11)]
    assert write_samples(buf, samples, "lbr") == 2
    header, back, bad = read_samples(buf.getvalue().splitlines())
    assert header["source"] == "lbr" and back == samples and bad == 0


def test_aggregator_windows_top_and_attribution():
    # replacement code at 0x9000.. maps back to 0x1000..
    def attribute(pid: int, ip: int) -> int:
        return ip - 0x8000 if 0x9000 <= ip < 0xA000 else ip

    agg = SampleAggregator(attribute=attribute)
    agg.add([Sample(1, 1, 0x1000)] * 5 + [Sample(1, 2, 0x1004)] * 2 + [Sample(2, 3, 0x50)])
    agg.start_window()
    agg.add(Sample(1, 1, 0x9000) for _ in range(4))  # generator input is fine
    agg.add([Sample(1, 2, 0x1004, taken=True, target=0x9100)])
    win = agg.end_window()
    assert win.aggregator.total == 5 and win.duration_s >= 0
    assert [(h.ip, h.count) for h in win.top(5)] == [(0x1000, 4), (0x1004, 1)]
    top = agg.top(2)
    assert [(h.pid, h.ip, h.count) for h in top] == [(1, 0x1000, 9), (1, 0x1004, 3)]
    assert abs(top[0].share - 9 / 12) < 1e-9
    assert agg.per_thread(1) == {1: 9, 2: 3} and agg.attributed == 4
    assert agg.branch_counts(1) == {0x1004: {0x1100: 1}}
    js = agg.to_json(top_n=1)
    json.dumps(js)
    assert js["clients"]["1"]["top"] == [{"ip": "0x1000", "count": 9, "share": 0.75}]
    with pytest.raises(RuntimeError):
        agg.end_window()
