"""/proc paths of a client that stay valid after its main thread has ended.

A process whose main thread called ``pthread_exit`` lives on in its other threads,
but its thread-group leader is then a zombie: ``/proc/PID/mem`` cannot be opened
(ESRCH) and ``/proc/PID/maps`` reads empty.  Every live thread shares the address
space, so ``/proc/PID/task/TID/`` of any of them serves instead.
"""

from __future__ import annotations

import os
import time


def stat_fields(stat_path: str) -> list[str] | None:
    """The fields of a ``/proc/.../stat`` file after the command name: field 3 (the
    state letter) first, so field N is at index N - 3.  None if unreadable."""
    try:
        with open(stat_path, "rb") as f:
            text = f.read()
    except OSError:
        return None
    close = text.rfind(b")")         # comm may hold spaces and parentheses
    return text[close + 1:].decode("ascii", "replace").split() if close >= 0 else None


def status_field(status_path: str, key: str) -> str | None:
    """The first word after ``key:`` in a ``/proc/.../status`` file, None if the file is
    unreadable or has no such line."""
    try:
        with open(status_path, "rb") as f:
            text = "\n" + f.read(8192).decode("ascii", "replace")   # the first line too
    except OSError:
        return None
    at = text.find(f"\n{key}:")
    rest = text[at + len(key) + 2:].split(None, 1) if at >= 0 else []
    return rest[0] if rest else None


def thread_state(stat_path: str) -> str | None:
    """The state letter of a ``/proc/.../stat`` file (``R``, ``S``, ``Z``...), None if
    unreadable."""
    rest = stat_fields(stat_path)
    return rest[0] if rest else None


def _starttime(rest: list[str] | None) -> float | None:
    """starttime (field 22, clock ticks) of stat_fields' result, in seconds of
    CLOCK_BOOTTIME; None if missing."""
    try:
        return int(rest[22 - 3]) / os.sysconf("SC_CLK_TCK")
    except (TypeError, IndexError, ValueError, OSError):
        return None


def started_boottime(stat_path: str) -> float | None:
    """When the process or thread of a ``/proc/.../stat`` file started, in seconds of
    CLOCK_BOOTTIME (starttime, field 22, in clock ticks).  None if unreadable."""
    return _starttime(stat_fields(stat_path))


def started_monotonic(pid: int, start: float | None = None) -> float | None:
    """When process ``pid`` started (its fork), on ``time.monotonic``'s clock: its
    starttime (``start``, else read now) taken back from now.  None if unreadable."""
    start = started_boottime(f"/proc/{pid}/stat") if start is None else start
    if start is None:
        return None
    age = time.clock_gettime(time.CLOCK_BOOTTIME) - start
    return time.monotonic() - max(0.0, age)


def process_lives(pid: int, started: float | None) -> bool:
    """Whether process ``pid``, started at ``started`` (started_boottime: a pid taken
    by a new process is not it), still runs: a thread of it other than a zombie."""
    rest = stat_fields(f"/proc/{pid}/stat")   # one read: its start and its state
    if started is None or _starttime(rest) != started:
        return False
    return rest[0] not in ("Z", "X") or proc_dir(pid) != f"/proc/{pid}"


def proc_dir(pid: int) -> str:
    """``/proc/PID``, or ``/proc/PID/task/TID`` of a live thread when the leader has ended.

    When no thread is left (or /proc cannot tell), ``/proc/PID``: its errors are the
    caller's usual ones."""
    base = f"/proc/{pid}"
    if thread_state(f"{base}/stat") not in ("Z", "X"):
        return base
    try:
        tids = sorted(int(t) for t in os.listdir(f"{base}/task") if t.isdigit())
    except OSError:
        return base
    for tid in tids:
        if tid != pid and thread_state(f"{base}/task/{tid}/stat") not in ("Z", "X", None):
            return f"{base}/task/{tid}"
    return base
