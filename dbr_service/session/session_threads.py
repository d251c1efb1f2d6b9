"""A client's threads as its session tracks them, and the programs whose threads
are too short-lived to sample."""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dbr_service.wire import protocol as P
from dbr_service.wire.agentconn import AgentConnection
from dbr_service.common.clientfiles import ProcHandle, ThreadCheck
from dbr_service.common.errors import AgentError, SamplingError
from dbr_service.sampling.perf import SwitchGate

if TYPE_CHECKING:  # pragma: no cover
    from dbr_service.sampling.base import SamplingSource

log = logging.getLogger("dbr.clients")

#: Notices are turned off for the rest of a window once this many announced threads
#: were short-lived (ended before the service could open their event, or within
#: SHORT_LIFE_S of their THREAD_NEW) and they are at least SHORT_THREADS_SHARE of the
#: threads announced in the window (ThreadTracker._quiet_if_short_lived).
SHORT_THREADS_MIN = 32
SHORT_THREADS_SHARE = 0.8
SHORT_LIFE_S = 0.01
#: How many programs whose threads were too short-lived to sample the service
#: remembers (config short_thread_memory_s: for how long), the least recently seen
#: forgotten first (ShortThreadPrograms).
SHORT_THREADS_PROGRAMS = 256
#: With continuous sampling, how often the switch rates of a client's threads are
#: looked at again (ThreadTracker.catch_up_threads).
GATE_LOOK_S = 1.0


class ShortThreadPrograms:
    """Programs seen starting threads too short-lived to sample (a window whose notices
    were turned off early, ThreadTracker._quiet_if_short_lived), by (exe, build id).

    Each such window cost the program a system call per thread started and the service
    a wake-up per notice (churn: 280-1350 notices, 6-40 ms of the service's CPU, most of
    a window's cost), and taught nothing: the threads end before an event can be
    opened.  A program seen doing it is not asked for notices again for
    ``keep_s`` (config short_thread_memory_s; 0 remembers nothing); a long-lived
    thread it starts meanwhile is found in /proc/PID/task when the next window
    opens, as after a quiet.  Shared by the session threads."""

    def __init__(self, keep_s: float, max_programs: int = SHORT_THREADS_PROGRAMS) -> None:
        self.keep_s, self.max_programs = keep_s, max_programs
        self._seen: collections.OrderedDict[tuple[str, str], float] = collections.OrderedDict()
        self._lock = threading.Lock()

    def note(self, exe: str, build_id: str, now: float | None = None) -> None:
        if not exe or self.keep_s <= 0:
            return
        now = time.monotonic() if now is None else now
        with self._lock:
            self._seen[(exe, build_id)] = now
            self._seen.move_to_end((exe, build_id))
            while len(self._seen) > self.max_programs:
                self._seen.popitem(last=False)

    def known(self, exe: str, build_id: str, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        with self._lock:
            at = self._seen.get((exe, build_id))
            if at is None:
                return False
            if now - at > self.keep_s or self.keep_s <= 0:
                del self._seen[(exe, build_id)]
                return False
            return True


class ThreadTracker:
    """A session's tracking of its client's threads: from /proc/PID/task and
    THREAD_NEW/THREAD_EXIT notices, the notices turned on and off around perf windows,
    and the threads the agent's timer samples.

    Runs on the session thread; other threads read single fields without a lock, and
    compound updates hold the session's ``lock``.  ``source`` gives the session's
    sampling source now (None between windows); ``queue_command`` runs a function as the
    session thread's next command."""

    def __init__(self, pid: int, proc: ProcHandle, conn: AgentConnection,
                 lock: threading.RLock, errors: collections.deque[str],
                 programs: ShortThreadPrograms, max_switch_rate: float,
                 source: Callable[[], SamplingSource | None],
                 queue_command: Callable[[Callable[[], Any]], None]) -> None:
        self.pid, self.proc, self.conn, self.lock, self.errors = pid, proc, conn, lock, errors
        self.programs = programs
        self._source, self._queue_command = source, queue_command
        #: The program (exe, build id) and the agent's HELLO flags (set by hello()).
        self.exe = self.build_id = ""
        self.hello_flags = 0
        #: Thread ids (from /proc/PID/task and THREAD_NEW/THREAD_EXIT notices).
        self.threads: set[int] = set()
        #: THREAD_NEW tids that are not threads of this process: refused (nothing done
        #: for them), counted here.
        self.foreign_tids = 0
        #: The agent sends thread notices now (HELLO_QUIET_THREADS agents: only while
        #: asked, see thread_notices()); older agents send them always.
        self.thread_notices_on = False
        self.thread_notices_received = 0
        #: Since the notices were last turned on: threads announced, those of them that
        #: were short-lived, and when each of the others was announced (monotonic s).
        self._announced = self._short_lived = 0
        self._announced_at: dict[int, float] = {}
        #: Counts the times the notices were turned on; a quiet for short-lived threads
        #: is posted at most once per count (the one it was posted in).
        self._notices_gen = 0
        self._quiet_gen = -1
        #: Windows whose notices were turned off early for short-lived threads.
        self.short_thread_windows = 0
        #: THREAD_NEW notices that arrived after the quiet was asked for (no event
        #: opened for them).
        self.notices_after_quiet = 0
        #: perf windows opened without asking for notices (a program known to start
        #: threads too short-lived to sample: ShortThreadPrograms).
        self.windows_without_notices = 0
        #: Which threads a per-thread perf event may follow (perf_max_switch_rate);
        #: kept for the session so a thread's rate is measured from window to window.
        self.switch_gate = SwitchGate(pid, max_switch_rate)
        #: Threads the gate refused that the agent's timer sampled instead
        #: (sampling/gated.py), the samples those timers gave, and why that fallback
        #: was given up for the session, if it was.
        self.timer_sampled_tids: set[int] = set()
        self.gated_timer_samples = 0
        self.gated_timer_failed: str | None = None
        self._gate_look = 0.0   # monotonic s of catch_up_threads' last look

    def hello(self, exe: str, build_id: str, flags: int) -> None:
        """The handshake's outcome: the program, and whether the agent sends notices
        only while asked (HELLO_QUIET_THREADS)."""
        self.exe, self.build_id, self.hello_flags = exe, build_id, flags
        self.thread_notices_on = not flags & P.HELLO_QUIET_THREADS

    def notice(self, t: P.MsgType, tid: int) -> None:
        # A tid the service acts on (an event opened, a timer armed) must be one of
        # this process's threads; one that has ended counts as short-lived, as an event
        # that could not be opened did.
        check = self.proc.thread_check(tid) if t is P.MsgType.THREAD_NEW else ThreadCheck.OWN
        with self.lock:
            self.thread_notices_received += 1
            if check == ThreadCheck.FOREIGN:
                self.foreign_tids += 1
                log.debug("pid %d: THREAD_NEW of tid %d, not a thread of it: refused",
                          self.pid, tid)
                return
            if t is P.MsgType.THREAD_NEW:
                if check == ThreadCheck.OWN:
                    self.threads.add(tid)
                src = self._source()
                if self._quiet_gen == self._notices_gen:
                    # Quiet already asked for in this window: the notices still
                    # arriving were sent before the agent had it (churn: hundreds,
                    # ~20 us of the service's CPU each with an event opened and
                    # closed).  A long-lived one is found in /proc/PID/task later.
                    self.notices_after_quiet += 1
                elif src is not None:
                    self._announced += 1
                    try:
                        if check == ThreadCheck.OWN and src.add_thread(tid):
                            self._announced_at[tid] = time.monotonic()
                        else:
                            self._short_lived += 1   # ended already
                            self._quiet_if_short_lived()
                    except SamplingError as exc:
                        self.errors.append(str(exc))
            else:
                self.threads.discard(tid)
                at = self._announced_at.pop(tid, None)
                if at is not None and time.monotonic() - at < SHORT_LIFE_S:
                    self._short_lived += 1
                    self._quiet_if_short_lived()
                src = self._source()
                if src is not None:
                    src.remove_thread(tid)

    def _quiet_if_short_lived(self) -> None:
        """Most announced threads ended before their event could be opened, or soon
        after: they live too briefly to take a sample (one per sample_period_us of CPU
        time), and their notices and events only cost the program and the service.
        Quiet for the rest of the window; longer threads are found in /proc/PID/task
        when the next one opens."""
        short = self._short_lived
        if (short < SHORT_THREADS_MIN or short < SHORT_THREADS_SHARE * self._announced
                or not self.thread_notices_on or self._quiet_gen == self._notices_gen):
            return
        self._quiet_gen = self._notices_gen
        self.short_thread_windows += 1
        self.programs.note(self.exe, self.build_id)
        # Not from here: this may run inside another request's wait (its reply could
        # be taken for ours); the session thread's next command asks.
        gen = self._notices_gen

        def quiet() -> None:
            if gen == self._notices_gen:  # not a later window's notices
                self.thread_notices(False)
        self._queue_command(quiet)

    def window_notices(self) -> None:
        """Session thread, a perf window opening (or a continuous one looking again):
        ask for THREAD_NEW/THREAD_EXIT, unless the program (this one, or an earlier run
        of the same executable) proved its threads too short-lived to sample
        (ShortThreadPrograms); that window is counted instead."""
        if self.programs.known(self.exe, self.build_id):
            self.windows_without_notices += 1
        else:
            self.thread_notices(True)

    def thread_notices(self, on: bool) -> None:
        """Session thread: ask the agent for THREAD_NEW/THREAD_EXIT (on) or for quiet.

        Only a source with one event per thread (perf) needs them, and only while it is
        open: each notice costs the program a system call and the service a wake-up, and
        a program that starts threads by the thousand would pay for them all the time
        (4x the native time for 5000 threads,
        docs/decisions/0009-thread-notices-on-request.md).  They are turned on
        before the source lists /proc/PID/task, so no thread falls between the two.  A
        refusal or a timeout is kept in ``errors``: threads started during the window are
        then sampled from the next one."""
        if on == self.thread_notices_on or not self.hello_flags & P.HELLO_QUIET_THREADS:
            return
        try:
            rc = self.conn.notices(P.NOTICE_THREADS if on else 0, timeout=1.0)
        except AgentError as exc:
            self.errors.append(f"thread notices {'on' if on else 'off'}: {exc}")
            return
        if rc == P.Result.OK:
            self.thread_notices_on = on
            if on:
                self._announced = self._short_lived = 0
                self._announced_at.clear()
                self._notices_gen += 1
        else:
            self.errors.append(f"thread notices {'on' if on else 'off'}: agent answered {rc}")

    def _task_tids(self) -> set[int] | None:
        """The client's threads in /proc/PID/task; None if unreadable."""
        return self.proc.tids()

    def refresh(self) -> None:
        tids = self._task_tids()
        if tids is not None:
            with self.lock:
                self.threads = tids

    def count(self, alive: bool) -> int:
        """Threads of the client now (the notices only arrive during perf windows); of
        an ended session (not ``alive``), those it had last (its pid may be another
        process's now)."""
        tids = self._task_tids() if alive else None
        return len(self.threads) if tids is None else len(tids)

    def catch_up_threads(self) -> None:
        """Session thread, continuous sampling (the source stays open), each snapshot:
        after a quiet for short-lived threads, notices on again (not for a program
        known to start such threads: ShortThreadPrograms), then open events for
        the threads /proc/PID/task lists now and drop those of ended ones.  With a
        switch gate, also once a second (GATE_LOOK_S) while the notices are on: a
        sampled thread that now switches too often loses its event, a gated one that
        calmed down gets one (a look reads each thread's status: not at every
        snapshot of a client with a thousand threads)."""
        with self.lock:
            src = self._source()
            if src is None or not hasattr(src, "refresh_threads"):
                return
            now = time.monotonic()
            if self.thread_notices_on and (getattr(src, "gate", None) is None
                                           or now - self._gate_look < GATE_LOOK_S):
                return
            self._gate_look = now
            self.window_notices()
            try:
                src.refresh_threads()
            except SamplingError as exc:
                self.errors.append(str(exc))

    def count_gated_timer(self, src: SamplingSource) -> None:
        """Add what a gated timer source (sampling/gated.py) did since the last look;
        a fallback it gave up is not tried again in this session."""
        take = getattr(src, "take_counts", None)
        if take is None:
            return
        tids, n, failed = take()
        if len(self.timer_sampled_tids) > 1024:      # ended threads' tids go first
            self.timer_sampled_tids &= self.threads
        self.timer_sampled_tids |= tids
        self.gated_timer_samples += n
        if failed is not None:
            self.gated_timer_failed = failed
            self.errors.append(failed)
            log.warning("pid %d: %s; such threads stay unsampled", self.pid, failed)
