"""Call-stack collections the control verb ``flamegraph`` runs for operators.

A collection samples one client's call stacks for a bounded time on a thread of its
own (stackprof.collect), so the control socket keeps answering meanwhile: the first
``flamegraph`` request for a pid starts it and is answered ``sampling`` at once; the
operator's client asks again until the answer is ``done`` with the folded stacks.
A finished collection is kept :data:`KEEP_S` seconds for its answer, then dropped.

Bounds: at most :data:`MAX_JOBS` collections at once (each opens an event and a
512 KiB ring per thread of its client, at most 64 threads), at most
:data:`MAX_SECONDS` seconds each, at most :data:`MAX_LINES` folded lines and
:data:`MAX_BYTES` bytes of them in an answer (the rest is summed into one ``[other]``
line).  Only clients of the service can be
profiled: their uid passed the service's ``allowed_uids`` check when they connected,
and they are read through the session's ``/proc/PID`` handle, which fails once that
process has ended even if its pid is reused.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dbr_service.commands.ctlclient import Code, Fault
from dbr_service.common.errors import SamplingError
from dbr_service.stacks.stackprof import MAX_SECONDS, StackProfile, collect

if TYPE_CHECKING:  # pragma: no cover
    from dbr_service.daemon.service import Service

log = logging.getLogger("dbr.stacks")

MAX_JOBS = 4
KEEP_S = 60.0
MAX_LINES = 20_000
#: Most bytes of folded lines in one answer (a line is up to 128 frames of 200
#: characters).
MAX_BYTES = 8 << 20
TOP_CALLS = 50
DEFAULT_SECONDS = 5.0


@dataclass
class Job:
    pid: int
    seconds: float
    started: float
    exe: str = ""
    thread: threading.Thread | None = None
    done: float | None = None
    result: dict[str, Any] | None = None
    error: str | None = None


_jobs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def _table(service: Service) -> dict[int, Job]:
    with _lock:
        return _jobs.setdefault(service, {})


def bound_lines(lines: list[str], max_lines: int = MAX_LINES,
                max_bytes: int = MAX_BYTES) -> list[str]:
    """The heaviest folded lines within both bounds, sorted, and the samples of the
    others summed into one ``[other]`` line."""
    if len(lines) <= max_lines and sum(len(x) + 1 for x in lines) <= max_bytes:
        return lines
    lines = sorted(lines, key=lambda line: -int(line.rpartition(" ")[2]))
    kept, size, rest = [], 0, 0
    for line in lines:
        if len(kept) < max_lines and size + len(line) + 1 <= max_bytes:
            kept.append(line)
            size += len(line) + 1
        else:
            rest += int(line.rpartition(" ")[2])
    return sorted(kept) + [f"[other] {rest}"]


def _answer(prof: StackProfile, stats: dict[str, Any], job: Job) -> dict[str, Any]:
    lines = bound_lines(prof.folded_lines())
    return {"state": "done", "pid": job.pid, "exe": job.exe, "seconds": job.seconds,
            "samples": prof.samples, "truncated": prof.truncated,
            "methods": dict(prof.methods), "folded": lines,
            "calls": prof.graph.top_calls(TOP_CALLS), "stats": stats}


class _Attributer:
    """Replacement-code address -> original address for one collection: by the
    installer's live regions, and by those seen live earlier in the collection (a
    region removed meanwhile may still have threads, or return addresses, in it)."""

    def __init__(self, session: Any) -> None:
        self.session = session
        self._live: Any = None
        self._seen: dict[int, tuple[int, int, Any]] = {}

    def __call__(self, addr: int) -> int:
        reg = self._region(addr)
        got = None if reg is None else reg.original_of(addr)
        return addr if got is None else got

    def sp_offset(self, addr: int) -> int | None:
        """rsp at ``addr`` less the original's (0 in original code; None: unknown)."""
        reg = self._region(addr)
        return 0 if reg is None else reg.sp_offset_of(addr)

    def _region(self, addr: int) -> Any:
        """The region (live now or seen live earlier) whose code holds ``addr``."""
        inst = getattr(self.session, "installer", None)
        if inst is None:
            return None
        live = inst.live
        if live is not self._live:
            self._live = live
            for lo, hi, reg in live:
                self._seen.setdefault(id(reg), (lo, hi, reg))
        _orig, reg = inst.attribute(addr)
        if reg is not None:
            return reg
        for lo, hi, old in self._seen.values():
            if lo <= addr < hi:
                return old
        return None


def _run(job: Job, session: Any) -> None:
    try:
        att = _Attributer(session)
        prof, stats = collect(session.proc, job.pid, job.seconds, attribute=att,
                              sp_offset=att.sp_offset)
        if "error" in stats:
            job.error = stats["error"]
        else:
            job.result = _answer(prof, stats, job)
    except SamplingError as exc:
        job.error = f"call-stack sampling not available: {exc}"
    except Exception as exc:   # a bug: this collection fails, the service goes on
        log.exception("call-stack collection of pid %d failed", job.pid)
        job.error = f"internal error: {exc!r}"
    finally:
        job.done = time.monotonic()


def flamegraph(service: Service, pid: int, seconds: float | None) -> dict[str, Any]:
    """Start, report or finish the collection of ``pid`` (the verb's handler)."""
    if pid <= 0:
        raise Fault(Code.BAD_ARGS, "pid must be a positive integer")
    secs = DEFAULT_SECONDS if seconds is None else float(seconds)
    if not 0 < secs <= MAX_SECONDS:
        raise Fault(Code.BAD_ARGS, f"seconds must be above 0 and at most {MAX_SECONDS:g}")
    table = _table(service)
    now = time.monotonic()
    with _lock:
        for p in [p for p, j in table.items() if j.done is not None and now - j.done > KEEP_S]:
            del table[p]
        job = table.get(pid)
        if job is not None and job.done is not None:
            del table[pid]
            if job.error is not None:
                raise Fault(Code.NOT_AVAILABLE, f"flamegraph of pid {pid}: {job.error}")
            return job.result or {}
        if job is not None:
            return {"state": "sampling", "pid": pid, "seconds": job.seconds,
                    "remaining_s": round(max(0.0, job.started + job.seconds - now), 3)}
        session = service.find_client(pid)
        if session is None or not session.alive:
            raise Fault(Code.NO_CLIENT, f"no live client with pid {pid}")
        if sum(j.done is None for j in table.values()) >= MAX_JOBS:
            raise Fault(Code.NOT_AVAILABLE, f"{MAX_JOBS} call-stack collections are "
                                            "running; try again when one has ended")
        job = Job(pid, secs, now, str(session.exe or ""))
        job.thread = threading.Thread(target=_run, args=(job, session),
                                      name=f"dbr-stacks-{pid}", daemon=True)
        table[pid] = job
    job.thread.start()
    return {"state": "sampling", "pid": pid, "seconds": secs, "remaining_s": secs}

