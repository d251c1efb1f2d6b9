"""Live taken-branch stacks: Intel LBR, AMD BRS and LbrExtV2 through perf_event, sampled
every N retired taken branches with N drawn afresh around its mean (docs/architecture.md,
"Sampling sources"; sampling/lbr.py turns the stacks into edge counts).

The event counts retired taken branches of the thread in user mode, so the sampling
interval is measured in the unit the edge profile is made of: every taken branch has
the same chance to be among a sample's newest entries, whatever the instruction mix.
The raw events (``PERF_TYPE_RAW``):

* Intel: ``BR_INST_RETIRED.NEAR_TAKEN``, event 0xC4 umask 0x20 (config 0x20c4), on the
  core PMU of every LBR-capable core since Sandy Bridge (arch LBR included);
* AMD and Hygon: "retired taken branch instructions", PMCx0C4 (config 0xc4).  BRS
  (Zen 3) records branch stacks only on this event; LbrExtV2 (Zen 4) takes any event.

Detection opens (never enables) such an event with ``PERF_SAMPLE_BRANCH_STACK`` and
``branch_sample_type`` user + any taken branch, first with ``NO_FLAGS | NO_CYCLES`` (the
kernel then saves less per entry), then without them for kernels that predate them.

Why the period is randomised: a fixed period in lock-step with a loop (the loop runs a
whole number of times per period) samples the same loop phase every time, and with
stacks shorter than a multiple of the loop some of its edges are seen in every stack and
others in none.  Each period is drawn uniformly from ``mean ± spread`` (spread well
below the mean, so that the rate stays steady) and set with ``PERF_EVENT_IOC_PERIOD``,
which also restarts the count.  perf cannot change a period by itself at each sample,
so the kernel wakes the source every ``rearm_samples`` samples (``wakeup_events``)
and a small thread drains that ring and draws the next period: samples in one run
share a period, and every run starts at a phase the program does not choose.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import random
import select
import struct
import threading
from dataclasses import dataclass
from typing import Callable, Sequence

from dbr_service.common.errors import SamplingError
from dbr_service.sampling.base import Sample
from dbr_service.sampling.perf import PerfSource, SwitchGate, explain_errno
from dbr_service.sampling.perf_abi import (
    PAGE_SIZE, PERF_EVENT_IOC_PERIOD, PERF_SAMPLE_BRANCH_ANY, PERF_SAMPLE_BRANCH_NO_CYCLES,
    PERF_SAMPLE_BRANCH_NO_FLAGS, PERF_SAMPLE_BRANCH_STACK, PERF_SAMPLE_BRANCH_USER,
    PERF_SAMPLE_IP, PERF_SAMPLE_TID, PERF_SAMPLE_TIME, PERF_TYPE_RAW, PerfEventAttr,
    PerfEventSpec, make_attr, perf_event_open)

log = logging.getLogger("dbr.service")

#: Taken branches per microsecond of CPU time the mean period assumes (sample_period_us
#: is in microseconds; a core retires roughly 100-500 taken branches a microsecond).
TAKEN_BRANCHES_PER_US = 100
#: The spread of the period is the mean divided by this.
SPREAD_DIVISOR = 8
#: Samples per ring wake-up, each followed by a fresh period.
REARM_SAMPLES = 8
#: Samples the source holds between two reads at most (further ones count as lost).
MAX_PENDING = 1 << 18

#: Raw taken-branch events by /proc/cpuinfo vendor_id.
TAKEN_BRANCH_EVENTS: dict[str, PerfEventSpec] = {
    "GenuineIntel": PerfEventSpec("br_inst_retired.near_taken", PERF_TYPE_RAW, 0x20C4, False),
    "AuthenticAMD": PerfEventSpec("ex_ret_brn_tkn", PERF_TYPE_RAW, 0xC4, False),
    "HygonGenuine": PerfEventSpec("ex_ret_brn_tkn", PERF_TYPE_RAW, 0xC4, False),
}
#: branch_sample_type variants, best first.
BRANCH_SAMPLE_TYPES = (
    PERF_SAMPLE_BRANCH_USER | PERF_SAMPLE_BRANCH_ANY | PERF_SAMPLE_BRANCH_NO_FLAGS
    | PERF_SAMPLE_BRANCH_NO_CYCLES,
    PERF_SAMPLE_BRANCH_USER | PERF_SAMPLE_BRANCH_ANY,
)
SAMPLE_TYPE = PERF_SAMPLE_IP | PERF_SAMPLE_TID | PERF_SAMPLE_TIME | PERF_SAMPLE_BRANCH_STACK

OpenFn = Callable[[PerfEventAttr, int], int]


@dataclass(frozen=True, slots=True)
class BranchEvent:
    """The counter and branch filter a host's branch stacks are sampled with."""

    spec: PerfEventSpec
    branch_sample_type: int
    sample_type: int = SAMPLE_TYPE

    def to_json(self) -> dict:
        return {"event": self.spec.name, "type": self.spec.type, "config": hex(self.spec.config),
                "branch_sample_type": hex(self.branch_sample_type)}


def cpu_vendor(cpuinfo: str = "/proc/cpuinfo") -> str:
    """``vendor_id`` of the first CPU ("" when unreadable)."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def probe_branch_event(vendor: str | None = None, open_fn: OpenFn = perf_event_open
                       ) -> tuple[BranchEvent | None, str]:
    """The branch event this host samples with, or None, and a one-line reason."""
    vendor = cpu_vendor() if vendor is None else vendor
    spec = TAKEN_BRANCH_EVENTS.get(vendor)
    if spec is None:
        return None, f"no taken-branch event known for CPU vendor {vendor or 'unknown'!r}"
    first_err = None
    for bst in BRANCH_SAMPLE_TYPES:
        attr = make_attr(spec, 1, PAGE_SIZE, SAMPLE_TYPE, bst)
        attr.sample_period = 100_003
        try:
            fd = open_fn(attr, 0)
        except OSError as e:
            first_err = first_err if first_err is not None else e.errno
            if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                break      # no PMU, no permission: another filter will not help
            continue
        os.close(fd)
        return (BranchEvent(spec, bst),
                f"perf {spec.name} ({spec.config:#x}) with user branch stacks opens")
    return None, f"perf {spec.name} with branch stacks: {explain_errno(first_err)}"


_HOST_EVENT: list[BranchEvent | None] = []


def host_branch_event() -> BranchEvent | None:
    """This host's branch event, probed once per process."""
    if not _HOST_EVENT:
        _HOST_EVENT.append(probe_branch_event()[0])
    return _HOST_EVENT[0]


class RandomPeriod:
    """Sampling periods drawn uniformly from ``mean ± spread`` (spread < mean)."""

    def __init__(self, mean: int, spread: int | None = None,
                 rng: random.Random | None = None) -> None:
        spread = mean // SPREAD_DIVISOR if spread is None else spread
        if mean < 1 or not 0 <= spread < mean:
            raise SamplingError(f"period {mean} ± {spread}: need 0 <= spread < mean")
        self.mean, self.spread = mean, spread
        self.rng = rng or random.Random()

    def draw(self) -> int:
        return self.rng.randint(self.mean - self.spread, self.mean + self.spread)


class BranchStackSource(PerfSource):
    """perf sampling of every thread of a client on taken branches, with branch stacks
    and a period re-drawn every ``rearm_samples`` samples (see the module doc).

    ``event`` may be any :class:`BranchEvent`; one without ``PERF_SAMPLE_BRANCH_STACK``
    in its sample type (e.g. the software clock) gives IP samples with the same
    randomised period, which is how the re-arming is tested on hosts without a PMU."""

    name = "lbr"

    def __init__(self, event: BranchEvent, period: RandomPeriod, data_pages: int = 16,
                 rearm_samples: int = REARM_SAMPLES, gate: SwitchGate | None = None) -> None:
        super().__init__("cpu-clock", 1000, data_pages, gate=gate)
        if rearm_samples < 1:
            raise SamplingError(f"rearm_samples must be positive: {rearm_samples}")
        self.spec = event.spec
        self.name = "lbr" if event.sample_type & PERF_SAMPLE_BRANCH_STACK else \
            f"perf-{event.spec.name}-random"
        self.sample_type = event.sample_type
        self.branch_sample_type = event.branch_sample_type
        self.period = period
        self.rearm_samples = rearm_samples
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.stats.extra.update(rearms=0, rearm_errors=0)

    @classmethod
    def available(cls) -> tuple[bool, str]:
        event, reason = probe_branch_event()
        return event is not None, reason

    def _attr(self) -> PerfEventAttr:
        attr = make_attr(self.spec, 1, self.data_pages * PAGE_SIZE, self.sample_type,
                         self.branch_sample_type)
        attr.sample_period = self.period.draw()
        attr.watermark = 0
        attr.wakeup_events = self.rearm_samples
        return attr

    # -- the lock around everything that touches the events ------------------------------
    def open(self, pid: int, tids: Sequence[int] | None = None) -> None:
        with self._lock:
            super().open(pid, tids)
        self._stop.clear()
        self._thread = threading.Thread(target=self._rearm_loop, name=f"dbr-lbr-{pid}",
                                        daemon=True)
        self._thread.start()

    def add_thread(self, tid: int) -> bool:
        with self._lock:
            return super().add_thread(tid)

    def remove_thread(self, tid: int) -> None:
        with self._lock:
            super().remove_thread(tid)

    def refresh_threads(self) -> tuple[list[int], list[int]]:
        with self._lock:
            return super().refresh_threads()

    def enable(self) -> None:
        with self._lock:
            super().enable()

    def disable(self) -> None:
        with self._lock:
            super().disable()

    def read(self) -> list[Sample]:
        with self._lock:
            return super().read()

    def close(self) -> None:
        self._stop.set()
        t, self._thread = self._thread, None
        if t is not None and t is not threading.current_thread():
            t.join(timeout=2.0)
        with self._lock:
            super().close()

    # -- re-arming --------------------------------------------------------------------------
    def _rearm_loop(self) -> None:
        hung: set[int] = set()
        while not self._stop.is_set():
            with self._lock:
                events = {ev.fd: ev for ev in self._threads.values() if ev.fd not in hung}
                hung &= {ev.fd for ev in self._threads.values()}
            if not events or not self.enabled:
                self._stop.wait(0.05)
                continue
            p = select.poll()
            for fd in events:
                p.register(fd, select.POLLIN)
            try:
                ready = p.poll(50)
            except OSError:
                continue
            for fd, mask in ready:
                with self._lock:
                    ev = self._threads.get(events[fd].tid)
                    if ev is None or ev.fd != fd:
                        continue          # removed meanwhile
                    if mask & (select.POLLHUP | select.POLLERR | select.POLLNVAL):
                        hung.add(fd)      # its thread ended: refresh_threads retires it
                    if mask & select.POLLIN:
                        self._rearm(ev)

    def _rearm(self, ev) -> None:
        """Drain one thread's ring and give its event a fresh period (lock held)."""
        before = len(self._pending)
        self._drain_one(ev, self._pending)
        if len(self._pending) > MAX_PENDING:
            self.stats.lost += len(self._pending) - before
            del self._pending[before:]
        try:
            fcntl.ioctl(ev.fd, PERF_EVENT_IOC_PERIOD, struct.pack("<Q", self.period.draw()))
            self.stats.extra["rearms"] += 1
        except OSError:
            self.stats.extra["rearm_errors"] += 1


def make_branch_source(event: BranchEvent, sample_period_us: int, data_pages: int = 16,
                       gate: SwitchGate | None = None) -> BranchStackSource:
    """The live branch-stack source for one client, its mean period from
    ``sample_period_us`` (TAKEN_BRANCHES_PER_US)."""
    mean = max(1000, sample_period_us * TAKEN_BRANCHES_PER_US) | 1   # odd: fewer loop multiples
    return BranchStackSource(event, RandomPeriod(mean), data_pages, gate=gate)
