"""Aggregation of samples by (client, IP): hot IPs, per-thread counts, branch counts.

The control thread feeds every sample of a snapshot window in here (docs/architecture.md,
"One cycle" 2); region selection reads the hot IPs and, where the source has them, the
branch counts.  Samples that land in replacement code are mapped back to original
addresses by the ``attribute`` hook the code generator provides, so later passes see one
program.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Callable, Iterable

from dbr_service.sampling.base import Sample
from dbr_service.sampling.lbr import CBT_SIZE, lbr_profile

#: ``attribute(pid, ip) -> ip``: maps a replacement-code address to its original one
#: (identity for every other address).
AttributeFn = Callable[[int, int], int]


@dataclass(frozen=True, slots=True)
class HotIp:
    """One entry of a top-N list."""

    pid: int
    ip: int
    count: int
    #: count / samples of that client.
    share: float


class SampleAggregator:
    """Counts samples by (pid, ip) and by (pid, tid), and branches by pid."""

    def __init__(self, attribute: AttributeFn | None = None,
                 lbr_cbt_size: int | None = CBT_SIZE):
        """``lbr_cbt_size``: branches per stack, chopped and anchored as sampling/lbr.py
        says; None counts whole stacks (hand-written streams of any depth)."""
        self.attribute = attribute
        self.lbr_cbt_size = lbr_cbt_size
        #: Branch stacks left out: too short for the chop; ranges that ran backwards.
        self.short_stacks = 0
        self.inconsistent_ranges = 0
        #: pid -> ip -> samples.
        self.ips: dict[int, Counter] = defaultdict(Counter)
        #: pid -> tid -> samples.
        self.threads: dict[int, Counter] = defaultdict(Counter)
        #: pid -> branch source -> branch target -> times seen taken.
        self.branches: dict[int, dict[int, Counter]] = defaultdict(lambda: defaultdict(Counter))
        #: pid -> branch source -> times seen not taken (IBS op).
        self.not_taken: dict[int, Counter] = defaultdict(Counter)
        #: pid -> (start, end) fall-through range -> count (from LBR stacks).
        self.fallthroughs: dict[int, Counter] = defaultdict(Counter)
        #: Samples whose address the attribution hook changed.
        self.attributed = 0
        self.total = 0
        self._window: Window | None = None

    # -- input ------------------------------------------------------------------------------

    def _map(self, pid: int, ip: int) -> int:
        if self.attribute is None:
            return ip
        orig = self.attribute(pid, ip)
        return ip if orig is None else orig

    def add(self, samples: Iterable[Sample]) -> int:
        """Count a batch of samples (also into the open window); returns how many."""
        samples = samples if isinstance(samples, list) else list(samples)
        stacks: dict[int, list] = defaultdict(list)
        for s in samples:
            ip = self._map(s.pid, s.ip)
            self.attributed += ip != s.ip
            self.ips[s.pid][ip] += 1
            self.threads[s.pid][s.tid] += 1
            if s.taken is not None:
                self._add_ibs_branch(s.pid, ip, s)
            if s.branch_stack:
                stacks[s.pid].append([(self._map(s.pid, a), self._map(s.pid, b))
                                      for a, b in s.branch_stack])
        for pid, pid_stacks in stacks.items():
            prof = lbr_profile(pid_stacks, newest_first=True, cbt_size=self.lbr_cbt_size,
                               anchored=self.lbr_cbt_size is not None)
            self.short_stacks += prof.short
            self.inconsistent_ranges += prof.inconsistent
            for (src, dst), c in prof.edges.items():
                self.branches[pid][src][dst] += c
            self.fallthroughs[pid].update(prof.fallthroughs)
        self.total += len(samples)
        if self._window is not None:
            self._window.aggregator.add(samples)
        return len(samples)

    def _add_ibs_branch(self, pid: int, ip: int, s: Sample) -> None:
        if s.taken and s.target is not None:
            self.branches[pid][ip][self._map(pid, s.target)] += 1
        elif not s.taken:
            self.not_taken[pid][ip] += 1

    # -- windows ----------------------------------------------------------------------------

    def start_window(self) -> None:
        """Begin a snapshot window: samples added from now on are also counted apart."""
        self._window = Window(time.monotonic(), None,
                              SampleAggregator(self.attribute, self.lbr_cbt_size))

    def end_window(self) -> Window:
        """Close the open window and return it."""
        if self._window is None:
            raise RuntimeError("end_window() without start_window()")
        win, self._window = self._window, None
        win.end = time.monotonic()
        return win

    # -- queries ----------------------------------------------------------------------------

    def samples_of(self, pid: int) -> int:
        return sum(self.ips[pid].values()) if pid in self.ips else 0

    def top(self, n: int = 20, pid: int | None = None) -> list[HotIp]:
        """The ``n`` hottest (pid, ip) pairs, hottest first (ties by address)."""
        pids = [pid] if pid is not None else list(self.ips)
        rows = []
        for p in pids:
            total = self.samples_of(p)
            rows += [HotIp(p, ip, c, c / total) for ip, c in self.ips.get(p, {}).items()]
        rows.sort(key=lambda h: (-h.count, h.pid, h.ip))
        return rows[:n]

    def per_thread(self, pid: int) -> dict[int, int]:
        return dict(self.threads.get(pid, {}))

    def branch_counts(self, pid: int) -> dict[int, dict[int, int]]:
        """``{src: {dst: count}}`` of taken branches seen for ``pid``."""
        return {src: dict(dsts) for src, dsts in self.branches.get(pid, {}).items()}

    def fallthrough_counts(self, pid: int) -> dict[tuple[int, int], int]:
        """``{(start, end): count}`` of fall-through ranges seen for ``pid``."""
        return dict(self.fallthroughs.get(pid, {}))

    def clear(self) -> None:
        for table in (self.ips, self.threads, self.branches, self.not_taken, self.fallthroughs):
            table.clear()
        self.total = self.attributed = self.short_stacks = self.inconsistent_ranges = 0

    def to_json(self, top_n: int = 50) -> dict:
        """Machine-readable summary (addresses as hex strings)."""
        clients = {}
        for pid in sorted(self.ips):
            clients[str(pid)] = {
                "samples": self.samples_of(pid),
                "top": [{"ip": hex(h.ip), "count": h.count, "share": round(h.share, 4)}
                        for h in self.top(top_n, pid)],
                "threads": {str(t): c for t, c in sorted(self.threads[pid].items())},
                "branches": {hex(s): {hex(d): c for d, c in dsts.items()}
                             for s, dsts in self.branches.get(pid, {}).items()},
                "not_taken": {hex(s): c for s, c in self.not_taken.get(pid, {}).items()},
                "fallthroughs": [[hex(a), hex(b), c]
                                 for (a, b), c in self.fallthroughs.get(pid, {}).items()],
            }
        return {"samples": self.total, "attributed": self.attributed, "clients": clients}


@dataclass(slots=True)
class Window:
    """One snapshot window: its time span (monotonic seconds) and its own counts."""

    start: float
    end: float | None
    aggregator: SampleAggregator

    @property
    def duration_s(self) -> float:
        return (self.end if self.end is not None else time.monotonic()) - self.start

    def top(self, n: int = 20, pid: int | None = None) -> list[HotIp]:
        return self.aggregator.top(n, pid)
