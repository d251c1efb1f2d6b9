"""Threads kept between sessions: each client session runs on a thread that served an
earlier one, when one is idle, instead of on a thread born for it.

Why not a thread per session: a thread's birth costs the client that has just
connected.  The kernel gives a new thread the load of one that is always runnable, and
that load decays over some 100 ms even while the thread sleeps (per-entity load
tracking).  For that long the CPU the service's new thread sat on looks busy, and the
scheduler places the client's own new threads on the other CPUs, beside its busy ones.
A program that starts 5000 short threads beside one busy thread (0.09 s natively) took
+34 ms with a thread born per session and +7 ms with one reused (medians of 16 runs on
2 CPUs; docs/decisions/0029-session-threads-reused.md).  The agent's own thread has the
same cause and other remedies (it is made only when the service would look, and quiet
at first: docs/decisions/0005-agent-thread-born-when-the-service-would-look.md and
docs/decisions/0006-agent-quiet-while-the-program-starts.md).

A reused thread has slept since its last session, so its load has decayed; the few
milliseconds of a handshake add little.  Threads are born only when every kept thread
is busy: at start (``prestart``) and when more sessions are live at once than ever in
the last ``idle_s`` seconds.  An idle thread beyond ``keep`` ends after ``idle_s``;
one that finds ``max_idle`` threads idle already ends at once.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

log = logging.getLogger("dbr.service")

IDLE_NAME = "dbr-session-idle"


class Job:
    """One function run on a kept thread; ``join`` waits for it like Thread.join."""

    def __init__(self, fn: Callable[[], None], name: str) -> None:
        self.fn = fn
        self.name = name
        self._done = threading.Event()

    def join(self, timeout: float | None = None) -> None:
        self._done.wait(timeout)

    def is_alive(self) -> bool:
        return not self._done.is_set()


class _Kept:
    """A thread that runs the jobs handed to it, one after another."""

    def __init__(self, pool: ReusedThreads) -> None:
        self.pool = pool
        self.jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._main, name=IDLE_NAME, daemon=True)

    def _main(self) -> None:
        me = threading.current_thread()
        while True:
            try:
                job = self.jobs.get(timeout=self.pool.idle_s)
            except queue.Empty:
                if self.pool._retire(self):
                    return
                continue  # handed a job meanwhile, or one of the kept few
            if job is None:
                return
            me.name = job.name
            try:
                job.fn()
            except BaseException:  # the job's own bug: this thread goes on serving
                log.exception("%s failed", job.name)
            finally:
                me.name = IDLE_NAME
                job._done.set()
            if not self.pool._back(self):
                return


class ReusedThreads:
    """Kept threads for jobs that block for a long time (one client session each)."""

    def __init__(self, keep: int = 2, idle_s: float = 300.0, max_idle: int = 64) -> None:
        if keep < 0 or max_idle < max(keep, 1) or idle_s <= 0:
            raise ValueError("ReusedThreads: need 0 <= keep <= max_idle, 1 <= max_idle, "
                             "idle_s > 0")
        self.keep = keep
        self.idle_s = idle_s
        self.max_idle = max_idle
        self._lock = threading.Lock()
        self._idle: list[_Kept] = []   # the longest idle first: its load decayed most
        self._closed = False
        #: Threads born, and jobs that ran on a thread an earlier job had used.
        self.born = 0
        self.reused = 0

    def prestart(self, n: int | None = None) -> None:
        """Give birth to ``n`` (default ``keep``) idle threads now, before any client."""
        for _ in range(self.keep if n is None else n):
            k = self._birth()
            with self._lock:
                if self._closed:
                    k.jobs.put(None)
                    return
                self._idle.append(k)

    def run(self, fn: Callable[[], None], name: str) -> Job:
        """Run ``fn`` on an idle kept thread, or on a new one if none is idle."""
        job = Job(fn, name)
        with self._lock:
            if self._closed:
                raise RuntimeError("ReusedThreads: closed")
            k = self._idle.pop(0) if self._idle else None
            if k is not None:
                self.reused += 1
        if k is None:
            k = self._birth()
        k.jobs.put(job)
        return job

    def idle(self) -> int:
        with self._lock:
            return len(self._idle)

    def stats(self) -> dict[str, int]:
        """For `dbr ctl status`: threads born, jobs run on a kept thread, idle now."""
        with self._lock:
            return {"born": self.born, "reused": self.reused, "idle": len(self._idle)}

    def close(self) -> None:
        """End the idle threads (busy ones end after their job)."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for k in idle:
            k.jobs.put(None)

    # -- the kept threads' side ------------------------------------------------------------
    def _birth(self) -> _Kept:
        k = _Kept(self)
        k.thread.start()
        with self._lock:
            self.born += 1
        return k

    def _back(self, k: _Kept) -> bool:
        """A job ended: True if ``k`` waits for the next one, False if it ends."""
        with self._lock:
            if self._closed or len(self._idle) >= self.max_idle:
                return False
            self._idle.append(k)
            return True

    def _retire(self, k: _Kept) -> bool:
        """``k`` was idle for idle_s: True if it ends now (it is then off the idle list)."""
        with self._lock:
            if k not in self._idle or len(self._idle) <= self.keep:
                return False
            self._idle.remove(k)
            return True
