"""perf events for most threads, the agent's timer for those that switch too often.

A per-thread perf software clock costs its thread ~11 us at every switch on a VM, so
:class:`~dbr_service.sampling.perf.SwitchGate` gives no event to a thread that gives
up its CPU more than ``perf_max_switch_rate`` times a second.  Such a thread's hot
code used to be found only if other threads ran it too.  The agent's POSIX CPU-time
timers cost nothing per switch (the kernel checks them at the scheduler tick), so
:class:`GatedTimerSource` asks the agent for a *listed* sampler
(``DBR_SAMPLER_LISTED``) and names exactly the threads the gate refused
(``DBR_MSG_SAMPLER_THREAD``); every other thread keeps its perf event.  Both count
CPU time at the same period, so their samples weigh the same.

What the timer costs instead: a signal a period of the thread's CPU time, and, like
every catching of a signal, a blocking call the signal lands in may return ``EINTR``
where the call is not restarted (docs/agent.md, "Known limits").

Requests to the agent go out only from :meth:`enable` and :meth:`refresh_threads`,
which the session thread calls between requests; :meth:`add_thread` and
:meth:`remove_thread` run while a thread notice is handled, possibly inside another
request's wait, and only change what the next of those sends.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Sequence

from dbr_service.wire import protocol as P
from dbr_service.wire.agentconn import result_name
from dbr_service.common.errors import SamplingError
from dbr_service.sampling.agent_timer import AgentTimerSource
from dbr_service.sampling.base import Sample, SamplingSource
from dbr_service.sampling.perf import PerfSource

#: arm(tid, on) -> the agent's result (protocol.Result)
ArmFn = Callable[[int, bool], int]


class GatedTimerSource(SamplingSource):
    """A :class:`PerfSource` with a switch gate, plus a listed agent-timer sampler for
    the threads the gate refuses.  The timer sampler starts only once a thread needs
    it.  If the agent cannot time threads (its answer, a timeout), the fallback is
    given up for the source's life and ``failed`` says why; perf goes on."""

    def __init__(self, perf: PerfSource, timer: AgentTimerSource, arm: ArmFn) -> None:
        super().__init__()
        if perf.gate is None:
            raise SamplingError("a gated timer source needs a perf source with a switch gate")
        self.perf, self.timer, self._arm = perf, timer, arm
        #: perf's name, with "+agent-timer" once a thread has been timed
        self.name = perf.name
        self.stats = perf.stats
        #: threads whose timer the agent has armed now
        self.timed: set[int] = set()
        self.failed: str | None = None
        self._new_timed: set[int] = set()     # since take_counts
        self._new_samples = 0
        self._failure_told = False

    @property
    def gate(self):
        return self.perf.gate

    @property
    def gated(self) -> set[int]:
        return self.perf.gated

    @classmethod
    def available(cls) -> tuple[bool, str]:
        return PerfSource.available()

    def open(self, pid: int, tids: Sequence[int] | None = None) -> None:
        self.perf.open(pid, tids)
        try:
            self.timer.open(pid)
        except BaseException:
            self.perf.close()
            raise
        self.pid = pid

    def add_thread(self, tid: int) -> bool:
        return self.perf.add_thread(tid)

    def remove_thread(self, tid: int) -> None:
        self.perf.remove_thread(tid)
        # An ended thread's timer never fires again; the agent deletes it when it
        # needs the slot, or at the sampler's stop.
        self.timed.discard(tid)

    def refresh_threads(self) -> tuple[list[int], list[int]]:
        out = self.perf.refresh_threads()
        if self.enabled:
            self._sync()
        return out

    @property
    def tids(self) -> list[int]:
        return self.perf.tids

    def enable(self) -> None:
        self.perf.enable()
        self.enabled = True
        self._sync()

    def _give_up(self, why: str) -> None:
        self.failed = f"timer for threads perf leaves out: {why}"
        self.timed.clear()
        if self.timer.enabled:
            with contextlib.suppress(SamplingError):
                self.timer.disable()

    def _sync(self) -> None:
        """Arm the timers of the threads the gate refuses now, delete those of the
        threads it lets back in."""
        if self.failed is not None:
            return
        want = set(self.perf.gated)
        if want and not self.timer.enabled:
            try:
                self.timer.enable()
            except SamplingError as exc:
                self._give_up(str(exc))
                return
        for tid, on in [(t, False) for t in sorted(self.timed - want)] + \
                       [(t, True) for t in sorted(want - self.timed)]:
            try:
                rc = self._arm(tid, on)
            except Exception as exc:   # AgentError: no answer, session broken
                self._give_up(f"tid {tid}: {exc}")
                return
            if rc == P.Result.OK:
                if on:
                    self.timed.add(tid)
                    self._new_timed.add(tid)
                    self.name = f"{self.perf.name}+agent-timer"
                else:
                    self.timed.discard(tid)
            elif rc == P.Result.E_UNKNOWN:
                self.timed.discard(tid)    # ended meanwhile
            else:
                self._give_up(f"tid {tid}: agent answered {result_name(rc)}")
                return

    def disable(self) -> None:
        try:
            self.perf.disable()
        finally:
            self.enabled = False
            if self.timer.enabled:
                try:
                    self.timer.disable()
                finally:
                    self.timed.clear()

    def read(self) -> list[Sample]:
        out = self.perf.read()
        if self.timer.ring is not None:
            got = self.timer.read()
            self._new_samples += len(got)
            self.stats.samples += len(got)
            out += got
        return out

    def fileno(self) -> list[int]:
        return self.perf.fileno()

    def take_counts(self) -> tuple[set[int], int, str | None]:
        """What happened since the last call: threads timed, samples from their
        timers, and why the fallback was given up (once)."""
        tids, self._new_timed = self._new_timed, set()
        n, self._new_samples = self._new_samples, 0
        failed = self.failed if not self._failure_told else None
        self._failure_told = self.failed is not None
        return tids, n, failed

    def close(self) -> None:
        try:
            self.timer.close()
        finally:
            self.timed.clear()
            self.perf.close()
            self.enabled = False
            self.pid = None
