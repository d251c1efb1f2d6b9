"""Programs whose runs end too soon to gain: their agents make no thread.

Under a service whose ``min_client_age_s`` is above 0, an agent makes its thread, and
connects, only once its program is that old and running (dbr_agent/agent.c, "born
when the service would look").  A program that always runs a little longer than that
(bench ``churn``: 1.6 s) still pays each run for a second thread, a session, and in
one run of three or four a sampling window, and gains nothing: its run ends before a
region could be selected and installed.  Measured (bench.service_ab, 101 rounds, run
BP): churn's paired median over native was 1.014 under the default service and 1.003
under one that never let the agent be born; the service spent 8.8 ms against 1.7 ms a
run.

So the service remembers, by executable, runs that ended within ``short_run_s`` of
their start with nothing installed.  After SHORT_RUNS of them in a row, it writes
``short_run_s`` in ms to ``agent-quiet-ms.KEY`` beside the agents' hint
(paths.program_quiet_file; KEY names the executable by device, inode and mtime, as
the agent forms it from ``stat("/proc/self/exe")``).  An agent that finds it makes its
thread only at that age: a later run that ends as soon has no thread and no session.
One that lives longer connects then, and its session, long by then, makes the
service forget the program (the file is removed).  So does a run that has a region
installed, and for ``short_run_memory_s`` after it the program is not born late however
short its runs: dbr does something for it (bench ``xz`` and ``stdio``, 1.8-2 s, have a
region installed in about half their runs at the defaults).  Each late birth is
forgotten after ``short_run_memory_s`` as well, so a program whose runs grew longer is
looked at again without waiting for a late birth.

Not counted: a session that ends while its process lives on (an agent that stepped
aside), a fork child of a client of the same executable (a server's short workers
must not delay the server's next start), sessions ended by the service itself, and
any session while ``patching`` is off (sampling is then the point) or the service's
hint is 0 (``--aggressive`` wants every program from its first moments).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dbr_service.common.paths import QUIET_FILE, program_quiet_file, quiet_hint_ms, write_ms_file

log = logging.getLogger("dbr.service")

#: Short runs in a row before a program's agents are born late.
SHORT_RUNS = 3
#: Programs remembered at most (the least recently seen forgotten first).
SHORT_RUN_PROGRAMS = 256


@dataclass
class _Program:
    exe: str
    short: int = 0                 # short runs in a row
    late_since: float | None = None    # monotonic time its file was written
    gained: float | None = None    # when a run of it last had a region installed


class ShortRunPrograms:
    """The service's memory of short-running programs and their files in ``runtime_dir``.
    Called from session threads and the control thread (one lock)."""

    def __init__(self, runtime_dir: Path, run_s: float, memory_s: float,
                 max_programs: int = SHORT_RUN_PROGRAMS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.runtime_dir = runtime_dir
        #: The runtime dir opened and checked by the service (paths.open_safe_dir);
        #: files are written and removed relative to it.  None: nothing is written.
        self.dir_fd: int | None = None
        self.run_s = run_s
        self.memory_s = memory_s
        self.hint_ms = 0               # the service's own hint (paths.quiet_hint_ms)
        self.max_programs = max_programs
        self.clock = clock
        self._progs: collections.OrderedDict[str, _Program] = collections.OrderedDict()
        self._lock = threading.Lock()
        #: Files written (programs born late), in the service's life.
        self.learned = 0
        self._expired_at = float("-inf")

    # -- settings ------------------------------------------------------------------------
    @property
    def active(self) -> bool:
        """Whether a late birth can be later than the service's hint, which is above 0."""
        return self.hint_ms > 0 and self.memory_s > 0 and self.late_ms() > self.hint_ms

    def late_ms(self) -> int:
        """The age, in ms, at which a program born late gets its agent's thread."""
        return quiet_hint_ms(self.run_s)

    def configure(self, run_s: float, memory_s: float, hint_ms: int) -> None:
        """New settings: every program is forgotten if they changed (its file was
        written for the old ones)."""
        with self._lock:
            changed = (run_s, memory_s, hint_ms) != (self.run_s, self.memory_s, self.hint_ms)
            self.run_s, self.memory_s, self.hint_ms = run_s, memory_s, hint_ms
        if changed:
            self.forget_all()

    # -- what sessions tell ------------------------------------------------------------------
    def connected(self, key: str, age_s: float) -> None:
        """A client of program ``key`` connected at ``age_s`` since its start: one older
        than short_run_s lives longer than the program's short runs."""
        if key and age_s >= self.run_s:
            self.forget(key)

    def ended(self, key: str, exe: str, life_s: float, installed: bool) -> None:
        """A client's process ended after ``life_s`` seconds; ``installed``: a region of
        it was installed.  A short run with nothing installed counts, unless a run of
        the program had a region installed within short_run_memory_s; a long run
        forgets the program."""
        if not key:
            return
        if life_s >= self.run_s or not self.active:
            self.forget(key)
            return
        now = self.clock()
        write = unlearn = False
        with self._lock:
            p = self._progs.get(key)
            if p is None:
                p = self._progs[key] = _Program(exe)
            self._progs.move_to_end(key)
            if installed:
                # dbr does something for it, even in short runs: it is not born late
                p.gained, p.short = now, 0
                unlearn, p.late_since = p.late_since is not None, None
            elif p.gained is None or now - p.gained >= self.memory_s:
                p.gained = None
                p.short += 1
                if p.short >= SHORT_RUNS and p.late_since is None:
                    p.late_since = now
                    write = True
            evicted = []
            while len(self._progs) > self.max_programs:
                evicted.append(self._progs.popitem(last=False))
        for k, old in evicted:
            if old.late_since is not None:
                self._remove(k)
        if unlearn:
            self._remove(key)
        if write and not self._write(key, exe):
            with self._lock:
                p.late_since = None

    def forget(self, key: str) -> None:
        with self._lock:
            p = self._progs.pop(key, None)
        if p is not None and p.late_since is not None:
            self._remove(key)
            log.info("%s: runs no longer short; its agents are born at the service's "
                     "hint again", p.exe)

    def forget_all(self) -> None:
        with self._lock:
            progs, self._progs = self._progs, collections.OrderedDict()
        for k, p in progs.items():
            if p.late_since is not None:
                self._remove(k)

    def expire(self) -> None:
        """Forget programs born late for short_run_memory_s (the control loop calls it
        often; it looks at most once a second)."""
        now = self.clock()
        if now - self._expired_at < 1.0:
            return
        self._expired_at = now
        with self._lock:
            old = [k for k, p in self._progs.items()
                   if p.late_since is not None and now - p.late_since >= self.memory_s]
            for k in old:
                del self._progs[k]
        for k in old:
            self._remove(k)

    def status(self) -> list[dict]:
        """For `dbr ctl status`: the programs whose agents are born late, and when each
        is forgotten."""
        now = self.clock()
        with self._lock:
            return [{"exe": p.exe, "key": k, "birth_ms": self.late_ms(),
                     "forgotten_in_s": round(max(0.0, self.memory_s - (now - p.late_since)), 1)}
                    for k, p in self._progs.items() if p.late_since is not None]

    # -- the files ---------------------------------------------------------------------------
    def _write(self, key: str, exe: str) -> bool:
        path = self.runtime_dir / program_quiet_file(key)
        ms = self.late_ms()
        if self.dir_fd is None:
            return False
        try:
            write_ms_file(program_quiet_file(key), ms, dir_fd=self.dir_fd)
        except OSError as exc:
            log.warning("cannot write %s: %s", path, exc)
            return False
        self.learned += 1
        log.info("%s: its last %d runs ended within short_run_s (%g s) with nothing "
                 "installed; its agents are born at %d ms", exe, SHORT_RUNS, self.run_s, ms)
        return True

    def _remove(self, key: str) -> None:
        if self.dir_fd is None:
            return
        with contextlib.suppress(OSError):
            os.unlink(program_quiet_file(key), dir_fd=self.dir_fd)

    def remove_stale(self) -> None:
        """Remove every program file in the runtime dir (a service that held it before
        and did not stop cleanly; and at stop)."""
        prefix = f"{QUIET_FILE}."
        if self.dir_fd is None:
            return
        try:
            names = os.listdir(self.dir_fd)
        except OSError:
            return
        for name in names:
            if name.startswith(prefix):
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=self.dir_fd)
