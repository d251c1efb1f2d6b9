"""The monitor of counting regions (docs/decisions/0041-exact-counts.md): a thread
that reads the counters of a session's counting regions, keeps each block's exact
entry count, promotes a block once its count reaches its threshold
(``count_threshold_direct`` entries, ``count_threshold_indirect`` for a block an
indirect jump or call of the region reaches), and hands a region whose counting
phase is over (a block promoted, or ``count_phase_max_s`` passed) to its session,
which replaces it by the region built from the counts.

Counted code runs tens of times slower than the final code, and a hot loop reaches
its threshold well within a millisecond, so the phase should end as soon as that
happens: a region's first read comes ``FIRST_POLL_S`` after its install, and each
next one when the counts so far, at the rate they grew, bring a block to its
threshold (:func:`next_wait`), never sooner than ``FIRST_POLL_S`` nor later than
``count_poll_ms``.

The counters are words of a data buffer that the service reads through its own
mapping: reading them needs no message to the agent, so the monitor runs beside the
session thread, which alone talks to the agent.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dbr_service.codegen.blocks import CountPlan
from dbr_service.region.model import EdgeKind, NodeKey, SuperRegion, TermKind

log = logging.getLogger("dbr.counting")

#: Seconds from a counting region's install to its first read, and the shortest
#: interval between two reads.
FIRST_POLL_S = 0.001


def next_wait(elapsed: float, progress: float, last_wait: float, longest: float) -> float:
    """Seconds to the next read of a counting region whose phase has run ``elapsed``
    seconds, its most advanced block ``progress`` (0 <= progress < 1) of the way to
    its threshold: the time the rest takes at the rate so far; twice ``last_wait``
    while nothing ran; within [FIRST_POLL_S, ``longest``]."""
    if progress <= 0.0 or elapsed <= 0.0:
        want = 2.0 * last_wait
    else:
        want = elapsed * (1.0 - progress) / progress
    return min(longest, max(FIRST_POLL_S, want))


def indirect_targets(sr: SuperRegion) -> set[NodeKey]:
    """Blocks of ``sr`` that an indirect jump or call of ``sr`` reaches."""
    out = set()
    for k, bb in sr.blocks():
        if bb.term in (TermKind.IJMP, TermKind.ICALL):
            for _, v, d in sr.g.out_edges(k, data=True):
                if d.get("kind") in (EdgeKind.FLOW, EdgeKind.CALL):
                    out.add(v)
    return out


@dataclass
class CountingRegion:
    """One counting region as the monitor follows it."""

    rid: str                      # the session's region id
    install_id: int               # the installer's id of the counting region
    sr: SuperRegion               # as selected (counts inferred from samples)
    plan: CountPlan
    sides: dict[NodeKey, int]     # the emitted code's counted sides
    read: Callable[[int], int | None]   # a counter's value; None: its buffer is gone
    started: float = field(default_factory=time.monotonic)
    #: When the monitor reads the counters next, and the interval that led there.
    next_at: float = 0.0
    wait: float = FIRST_POLL_S
    counts: dict[NodeKey, int] = field(default_factory=dict)
    #: Block -> its count at the poll that promoted it.
    promoted: dict[NodeKey, int] = field(default_factory=dict)
    polls: int = 0
    #: Why the phase ended (None: still counting), and when (monotonic).
    done: str | None = None
    done_at: float | None = None
    indirect: set[NodeKey] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.indirect = indirect_targets(self.sr)
        self.next_at = self.started + self.wait

    def value(self, addr: int) -> int:
        """A counter's value, 0 if its buffer is gone."""
        try:
            return self.read(addr) or 0
        except ValueError:        # the buffer was closed while it was read
            return 0


class CountMonitor:
    """Counting regions of one session and the thread that polls them."""

    def __init__(self, direct: int, indirect: int, max_s: float, poll_s: float,
                 on_done: Callable[[CountingRegion], Any]) -> None:
        self.direct, self.indirect, self.max_s, self.poll_s = direct, indirect, max_s, poll_s
        self.on_done = on_done
        self.regions: dict[str, CountingRegion] = {}
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._kick = threading.Event()       # a region added, or stop()
        self._thread: threading.Thread | None = None

    def threshold(self, cr: CountingRegion, k: NodeKey) -> int:
        return self.indirect if k in cr.indirect else self.direct

    def add(self, cr: CountingRegion) -> None:
        with self.lock:
            self.regions[cr.rid] = cr
        self._kick.set()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="dbr-count-monitor",
                                            daemon=True)
            self._thread.start()

    def remove(self, rid: str) -> CountingRegion | None:
        with self.lock:
            return self.regions.pop(rid, None)

    def poll_one(self, cr: CountingRegion, now: float) -> bool:
        """Read ``cr``'s block counters, promote blocks at their thresholds, set its
        next read (``next_at``); whether its phase has just ended."""
        cr.polls += 1
        progress = 0.0
        for k, addr in cr.plan.blocks.items():
            n = cr.counts[k] = cr.value(addr)
            thr = self.threshold(cr, k)
            if k not in cr.promoted and n >= thr:
                cr.promoted[k] = n
            progress = max(progress, n / thr)
        # a region whose phase is over is read at the longest interval until its
        # session takes it away
        cr.next_at = now + self.poll_s
        if cr.done is not None:
            return False
        elapsed = now - cr.started
        if cr.promoted:
            cr.done = "promoted"
        elif elapsed >= self.max_s:
            cr.done = "phase time bound"
        else:
            cr.wait = next_wait(elapsed, progress, cr.wait, self.poll_s)
            cr.next_at = min(now + cr.wait, cr.started + self.max_s)
            return False
        cr.done_at = now
        return True

    def poll(self, now: float | None = None) -> list[CountingRegion]:
        """Poll every region whose read is due at ``now``; those whose phase ended."""
        now = time.monotonic() if now is None else now
        with self.lock:
            regions = [cr for cr in self.regions.values() if cr.next_at <= now]
        return [cr for cr in regions if self.poll_one(cr, now)]

    def due_in(self, now: float) -> float:
        """Seconds until a region's read is due (``poll_s`` with no region)."""
        with self.lock:
            first = min((cr.next_at for cr in self.regions.values()), default=now + self.poll_s)
        return max(0.0, first - now)

    def _run(self) -> None:
        while not self._stop.is_set():
            wait = self.due_in(time.monotonic())
            if wait > 0:
                self._kick.wait(wait)
                self._kick.clear()
                continue                  # a region came or went: due times again
            for cr in self.poll():
                try:
                    self.on_done(cr)
                except Exception:    # the session is gone: nothing to hand it to
                    log.exception("counting region %s: its end could not be handed on",
                                  cr.rid)

    def stop(self) -> None:
        self._stop.set()
        self._kick.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=max(1.0, 5 * self.poll_s))
