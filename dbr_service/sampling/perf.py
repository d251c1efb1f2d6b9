"""perf_event_open sampling: the software CPU clock everywhere, hardware cycles on a PMU.

One event per client thread (``pid=tid, cpu=-1``), each with its own mmap ring of
``1 + 2^n`` pages, read without blocking from ``data_tail`` to ``data_head``.

Why per-thread events and not ``inherit``: an inherited event only follows threads
*created after* it is attached to the thread that creates them, so the threads a client
already has need one event each anyway; ``inherit`` also follows ``fork()`` into child
processes, which dbr tracks as separate clients with their own sessions; an explicit
event for a thread that an inherited event already covers would count it twice; and with
one fd per thread a thread that exits (ESRCH) costs only its own event.  The price is
that a thread born between two thread scans is not sampled until the service learns of
it (agent THREAD_NEW notice → :meth:`PerfSource.add_thread`, or
:meth:`PerfSource.refresh_threads` which rescans ``/proc/PID/task`` and is cheap enough
to call at the start of every snapshot window).  Rings cannot be shared between threads
(``PERF_EVENT_IOC_SET_OUTPUT`` requires the same task when ``cpu == -1``), hence one
small ring per thread.

The perf_event ABI (structs, syscall, record parsing, the ring and its memory
ordering) is in sampling/perf_abi.py; the names other modules use are re-exported here.
"""

from __future__ import annotations

import errno
import fcntl
import os
import select
import time
from collections import Counter
from dataclasses import dataclass
from typing import Sequence

from dbr_service.common.errors import SamplingError
from dbr_service.common.procfs import started_boottime, status_field
from dbr_service.sampling.base import Sample, SamplingSource
from dbr_service.sampling.perf_abi import (
    EVENTS, PAGE_SIZE, PERF_ATTR_SIZE_VER7, PERF_EVENT_IOC_DISABLE, PERF_EVENT_IOC_ENABLE,
    PERF_RECORD_LOST, PERF_RECORD_SAMPLE, PERF_SAMPLE_BRANCH_ANY, PERF_SAMPLE_BRANCH_HW_INDEX,
    PERF_SAMPLE_BRANCH_STACK, PERF_SAMPLE_BRANCH_USER, PERF_SAMPLE_IP, PERF_SAMPLE_TID,
    PERF_SAMPLE_TIME, PerfEventAttr, PerfEventMmapPage, PerfEventSpec, PerfRing, make_attr,
    parse_records, perf_event_open, read_paranoid)

__all__ = [
    "PerfSource", "SwitchGate", "explain_errno", "list_tids", "probe_event", "sample_ips",
    # re-exported from perf_abi
    "EVENTS", "PAGE_SIZE", "PERF_ATTR_SIZE_VER7", "PERF_EVENT_IOC_DISABLE",
    "PERF_EVENT_IOC_ENABLE", "PERF_RECORD_LOST", "PERF_RECORD_SAMPLE",
    "PERF_SAMPLE_BRANCH_ANY", "PERF_SAMPLE_BRANCH_HW_INDEX", "PERF_SAMPLE_BRANCH_STACK",
    "PERF_SAMPLE_BRANCH_USER", "PERF_SAMPLE_IP", "PERF_SAMPLE_TID", "PERF_SAMPLE_TIME",
    "PerfEventAttr", "PerfEventMmapPage", "PerfEventSpec", "PerfRing", "make_attr",
    "parse_records", "perf_event_open", "read_paranoid",
]


# ---------------------------------------------------------------------------------------
# The source
# ---------------------------------------------------------------------------------------

@dataclass(slots=True)
class _ThreadEvent:
    tid: int
    fd: int
    ring: PerfRing

    def ended(self) -> bool:
        """Whether the thread of this event has ended (the kernel reports POLLHUP on an
        event whose task exited).  A thread the agent started unwrapped sends no
        THREAD_EXIT, and its tid may be a new thread's before the next listing."""
        try:
            p = select.poll()
            p.register(self.fd, select.POLLHUP)
            return any(ev & select.POLLHUP for _, ev in p.poll(0))
        except OSError:
            return True


def list_tids(pid: int) -> list[int]:
    """Current threads of ``pid`` from /proc/PID/task (empty if the process is gone)."""
    try:
        return sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))
    except FileNotFoundError:
        return []
    except OSError as e:
        raise SamplingError(f"cannot list threads of {pid}: {e}") from e


class SwitchGate:
    """Which threads of one client are cheap enough to sample with an event of their own.

    A per-thread perf event is taken off its CPU and put back on with its thread: the
    software clock stops and restarts an hrtimer each time, which in a VM reprograms
    the local APIC timer (an exit to the hypervisor).  Measured here (AMD EPYC KVM,
    docs/decisions/0010-switch-heavy-threads-get-no-perf-event.md): about 11 us per
    switch of the thread, so a thread that gives up its CPU 50 000 times a second ran
    1.5x slower while its event was open, and an event on its busy sibling cost
    nothing.  Such a thread also yields few samples here: 36 for its 0.64 s of CPU
    time at a 1 ms period (it runs for microseconds at a time).

    A thread is sampled unless it gave up its CPU more than ``max_rate`` times a
    second (``voluntary_ctxt_switches`` of ``/proc/PID/task/TID/status``): since the
    previous look if that is at least ``min_span_s`` old, else on average since the
    thread started.  Only the switches a thread makes itself (blocking, sleeping)
    count: a busy thread preempted often on a crowded machine pays too, but it is the
    thread whose samples are worth the most (a CPU-bound thread beside churn, 13 000
    preemptions a second, would have been refused).  A thread younger than
    ``min_span_s`` (just announced by THREAD_NEW), or one whose counts cannot be read,
    is sampled.  ``max_rate`` 0 samples every thread.  One gate lives as long as the
    client's session, so the rate of a thread seen in an earlier window is its recent
    one."""

    def __init__(self, pid: int, max_rate: float, min_span_s: float = 0.05) -> None:
        self.pid = pid
        self.max_rate = max_rate
        self.min_span_s = min_span_s
        # tid -> (boottime s, switches then, rate measured up to then or None)
        self._seen: dict[int, tuple[float, int, float | None]] = {}
        #: threads refused, counted once per look (one a window in the default mode)
        self.refused = 0

    def switches(self, tid: int) -> int | None:
        """The thread's voluntary context switches so far (None: not readable)."""
        value = status_field(f"/proc/{self.pid}/task/{tid}/status", "voluntary_ctxt_switches")
        try:
            return int(value) if value is not None else None
        except ValueError:
            return None

    def _started(self, tid: int) -> float | None:
        """The thread's start, in seconds of CLOCK_BOOTTIME."""
        return started_boottime(f"/proc/{self.pid}/task/{tid}/stat")

    @staticmethod
    def _now() -> float:
        return time.clock_gettime(time.CLOCK_BOOTTIME)   # the clock of stat's starttime

    def rate(self, tid: int) -> float | None:
        """Switches a second lately; None when not known (too young, unreadable)."""
        n = self.switches(tid)
        if n is None:
            return None
        now = self._now()
        prev = self._seen.get(tid)
        if prev is not None and n < prev[1]:
            prev = None      # fewer than before: the tid names a new thread
            del self._seen[tid]
        if prev is not None and now - prev[0] >= self.min_span_s:
            r = (n - prev[1]) / (now - prev[0])
            self._seen[tid] = (now, n, r)
            return r
        if prev is not None and prev[2] is not None:
            return prev[2]    # looked at moments ago: that look's rate
        start = self._started(tid)
        r = None if start is None or now - start < self.min_span_s else n / (now - start)
        if prev is None:
            self._seen[tid] = (now, n, r)
        return r

    def allows(self, tid: int) -> bool:
        if self.max_rate <= 0:
            return True
        r = self.rate(tid)
        if r is None or r <= self.max_rate:
            return True
        self.refused += 1
        return False

    def forget(self, live: set[int]) -> None:
        """Drop the history of threads that have ended."""
        for tid in [t for t in self._seen if t not in live]:
            del self._seen[tid]


class PerfSource(SamplingSource):
    """perf_event sampling of every thread of one client, one event + ring per thread.

    With a :class:`SwitchGate`, threads that switch CPU too often get no event (they
    are counted in ``stats.extra["switch_gated"]`` and listed in ``gated``)."""

    name = "perf-cpu-clock"

    def __init__(self, event: str = "cpu-clock", sample_period_us: int = 1000,
                 data_pages: int = 8, branch_stack: bool = False,
                 precise_ip: int | None = None, gate: SwitchGate | None = None) -> None:
        super().__init__()
        if event not in EVENTS:
            raise SamplingError(f"unknown perf event {event!r} (known: {', '.join(EVENTS)})")
        if sample_period_us <= 0:
            raise SamplingError(f"sample_period_us must be positive: {sample_period_us}")
        if data_pages < 1 or data_pages & (data_pages - 1):
            raise SamplingError(f"data_pages must be a power of two: {data_pages}")
        self.spec = EVENTS[event]
        self.name = f"perf-{event}"
        self.sample_period_us = sample_period_us
        self.data_pages = data_pages
        self.sample_type = PERF_SAMPLE_IP | PERF_SAMPLE_TID | PERF_SAMPLE_TIME
        self.branch_sample_type = 0
        if branch_stack:
            self.sample_type |= PERF_SAMPLE_BRANCH_STACK
            self.branch_sample_type = PERF_SAMPLE_BRANCH_USER | PERF_SAMPLE_BRANCH_ANY
        self.precise_ip = precise_ip
        self._threads: dict[int, _ThreadEvent] = {}
        self._pending: list[Sample] = []
        self.gate = gate
        #: threads the gate refused an event (alive when last looked at)
        self.gated: set[int] = set()
        self.stats.extra.update(throttles=0, bad_records=0, overruns=0, switch_gated=0)

    # -- availability -------------------------------------------------------------------

    @classmethod
    def available(cls, event: str = "cpu-clock") -> tuple[bool, str]:
        """Try to open a sampling event of this kind on the calling thread."""
        return probe_event(EVENTS[event])

    # -- threads --------------------------------------------------------------------------

    def open(self, pid: int, tids: Sequence[int] | None = None) -> None:
        if self.pid is not None:
            raise SamplingError(f"{self.name}: already open on pid {self.pid}")
        if not os.path.isdir(f"/proc/{pid}"):
            raise SamplingError(f"{self.name}: no process {pid}")
        self.pid = pid
        listed = list_tids(pid) if tids is None else list(tids)
        if self.gate is not None and tids is None:
            # one source per window by default, never refreshed: the gate's history
            # of threads that have ended goes here, or it would grow all session
            self.gate.forget(set(listed))
        try:
            for tid in listed:
                self.add_thread(tid)
        except BaseException:
            self.close()
            raise
        if not self._threads and not self.gated:
            self.close()
            raise SamplingError(f"{self.name}: process {pid} has no live thread to sample")

    def add_thread(self, tid: int) -> bool:
        """Open an event for ``tid``; False (not an error) if the thread is already gone.
        True without an event when the gate refuses the thread (it switches too often)."""
        self._require_open()
        ev = self._threads.get(tid)
        if ev is not None:
            if not ev.ended():
                return True
            self.remove_thread(tid)   # an ended thread's: the tid is a new thread's now
        if self.gate is not None and not self.gate.allows(tid):
            self.gated.add(tid)
            self.stats.extra["switch_gated"] += 1
            return True
        self.gated.discard(tid)
        attr = self._attr()
        try:
            fd = perf_event_open(attr, tid)
        except OSError as e:
            if e.errno == errno.ESRCH:
                self.stats.threads_gone += 1
                return False
            raise SamplingError(self._explain(e, tid)) from e
        try:
            ring = PerfRing(fd, self.data_pages)
            if self.enabled:
                fcntl.ioctl(fd, PERF_EVENT_IOC_ENABLE, 0)
        except (OSError, ValueError) as e:
            os.close(fd)
            raise SamplingError(f"{self.name}: mmap/enable of tid {tid} failed: {e}") from e
        self._threads[tid] = _ThreadEvent(tid, fd, ring)
        self.stats.threads = len(self._threads)
        return True

    def _attr(self) -> PerfEventAttr:
        """The attr of one thread's event (sampling/branchperf.py sets its own period)."""
        return make_attr(self.spec, self.sample_period_us, self.data_pages * PAGE_SIZE,
                         self.sample_type, self.branch_sample_type, self.precise_ip)

    def remove_thread(self, tid: int) -> None:
        """Drain then close the event of ``tid`` (its last samples are kept for read())."""
        ev = self._threads.pop(tid, None)
        if ev is None:
            return
        self._drain_one(ev, self._pending)
        ev.ring.close()
        os.close(ev.fd)
        self.stats.threads = len(self._threads)

    def refresh_threads(self) -> tuple[list[int], list[int]]:
        """Rescan /proc/PID/task: open new threads, retire exited ones; (added, removed).
        With a gate, sampled threads that now switch too often lose their event and
        gated ones that have calmed down get one (neither is in the lists)."""
        pid = self._require_open()
        current = set(list_tids(pid))
        self.gated &= current
        was_gated = sorted(self.gated)
        if self.gate is not None:
            self.gate.forget(current)
        for tid in sorted(self._threads.keys() & current):
            if self._threads[tid].ended():   # its tid reused, no THREAD_EXIT between:
                self.remove_thread(tid)      # the new thread is added below
            elif self.gate is not None and not self.gate.allows(tid):
                self.remove_thread(tid)
                self.gated.add(tid)
                self.stats.extra["switch_gated"] += 1
        for tid in was_gated:
            self.gated.discard(tid)
            self.add_thread(tid)   # back in the gated set if still too busy
        added = [t for t in sorted(current - self._threads.keys() - self.gated)
                 if self.add_thread(t) and t in self._threads]
        removed = sorted(self._threads.keys() - current)
        for tid in removed:
            self.remove_thread(tid)
        self.stats.threads_gone += len(removed)
        return added, removed

    @property
    def tids(self) -> list[int]:
        return sorted(self._threads)

    # -- control ----------------------------------------------------------------------------

    def _ioctl_all(self, request: int) -> None:
        for ev in list(self._threads.values()):
            try:
                fcntl.ioctl(ev.fd, request, 0)
            except OSError:
                self.stats.errors += 1

    def enable(self) -> None:
        self._require_open()
        self._ioctl_all(PERF_EVENT_IOC_ENABLE)
        self.enabled = True

    def disable(self) -> None:
        self._require_open()
        self._ioctl_all(PERF_EVENT_IOC_DISABLE)
        self.enabled = False

    # -- reading ----------------------------------------------------------------------------

    def _drain_one(self, ev: _ThreadEvent, out: list[Sample]) -> None:
        data, overrun = ev.ring.drain()
        if overrun:
            self.stats.extra["overruns"] += 1
            self.stats.errors += 1
        if not data:
            return
        res = parse_records(data, self.sample_type,
                            bool(self.branch_sample_type & PERF_SAMPLE_BRANCH_HW_INDEX))
        out.extend(res.samples)
        self.stats.lost += res.lost
        self.stats.extra["throttles"] += res.throttles
        if res.bad_records:
            self.stats.extra["bad_records"] += res.bad_records
            self.stats.errors += res.bad_records

    def read(self) -> list[Sample]:
        out, self._pending = self._pending, []
        for ev in self._threads.values():
            self._drain_one(ev, out)
        self.stats.samples += len(out)
        return out

    def fileno(self) -> list[int]:
        return [ev.fd for ev in self._threads.values()]

    def close(self) -> None:
        for ev in self._threads.values():
            ev.ring.close()
            os.close(ev.fd)
        self._threads.clear()
        self._pending.clear()
        self.gated.clear()
        self.stats.threads = 0
        self.enabled = False
        self.pid = None

    # -- messages ---------------------------------------------------------------------------

    def _explain(self, e: OSError, tid: int) -> str:
        return f"{self.name}: perf_event_open(tid={tid}) refused: {explain_errno(e.errno)}"


def explain_errno(err: int | None) -> str:
    """A one-line reason for a perf_event_open failure."""
    paranoid = read_paranoid()
    reasons = {
        errno.EACCES: f"permission denied (perf_event_paranoid={paranoid}; need "
                      "CAP_PERFMON or a lower setting)",
        errno.EPERM: f"not permitted (perf_event_paranoid={paranoid}, seccomp or LSM)",
        errno.ENOENT: "event not supported by this kernel/CPU (no PMU?)",
        errno.ENODEV: "event not supported by this CPU",
        errno.EOPNOTSUPP: "sampling not supported for this event (no PMU interrupt?)",
        errno.EINVAL: "invalid perf_event_attr for this kernel/CPU",
        errno.ENOSYS: "perf_event_open not available (kernel built without perf)",
        errno.E2BIG: "perf_event_attr size unknown to this kernel",
        errno.EMFILE: "too many open files",
        errno.ESRCH: "no such thread",
    }
    return reasons.get(err, os.strerror(err) if err else "unknown error")


def probe_event(spec: PerfEventSpec, sample_type: int = PERF_SAMPLE_IP | PERF_SAMPLE_TID,
                branch_sample_type: int = 0) -> tuple[bool, str]:
    """Open (never enable) a sampling event on the calling thread to see if it works."""
    attr = make_attr(spec, 1000, PAGE_SIZE, sample_type, branch_sample_type)
    try:
        fd = perf_event_open(attr, 0)
    except OSError as e:
        return False, f"perf {spec.name}: {explain_errno(e.errno)}"
    os.close(fd)
    return True, f"perf {spec.name}: sampling event opens"


def sample_ips(pid: int, seconds: float, sample_period_us: int = 1000,
               poll_s: float = 0.05) -> Counter:
    """Sample every thread of ``pid`` (incl. threads it starts meanwhile) with cpu-clock
    for ``seconds``: how many samples hit each instruction address.  For tools and
    benchmarks that want a profile without a service (the service samples through
    its own loop)."""
    src = PerfSource(sample_period_us=sample_period_us)
    src.open(pid)
    src.enable()
    counts: Counter = Counter()
    try:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            time.sleep(poll_s)
            src.refresh_threads()
            counts.update(s.ip for s in src.read())
        counts.update(s.ip for s in src.read())
    finally:
        src.close()
    return counts
