"""A client's service CPU budget: the service's CPU spent on a client against the
client's own, over a sliding window (docs/operators.md).  The snapshot cycle observes
both and asks the scheduler to admit a client's job; a finished job is charged to
its client."""

from __future__ import annotations

import collections
import os
from typing import Any

from dbr_service.region.worker import QUICK_MAX_BLOCKS


def client_cpu_s(pid: int) -> float | None:
    """utime + stime of every thread of process ``pid`` (/proc/PID/stat), seconds."""
    from dbr_service.common.procfs import stat_fields

    rest = stat_fields(f"/proc/{pid}/stat")
    try:
        return (int(rest[14 - 3]) + int(rest[15 - 3])) / os.sysconf("SC_CLK_TCK")
    except (TypeError, IndexError, ValueError, OSError):
        return None


def budget_limit(cfg: Any, age_s: float) -> float:
    """The fraction of a client's CPU the service may spend on it at ``age_s`` seconds
    after its connection (0: no limit)."""
    if age_s < cfg.service_cpu_startup_s:
        return cfg.service_cpu_startup_budget
    return cfg.service_cpu_budget


class CpuBudget:
    """One client's service CPU against its own CPU, over a sliding window.

    Service CPU is the CPU of the client's region jobs (:attr:`JobResult.cpu_s`, charged
    by :meth:`charge_job`) plus that of its session thread (sampling windows, agent
    messages, installation) and of the control thread on its windows (fed to
    :meth:`observe` as a running total).  The client's
    CPU is its utime + stime (client_cpu_s).  :meth:`observe` records both totals at a
    time; the window's figures are the totals now less those at the last point at or
    before ``now - window_s`` (the process's start, with nothing spent, at first).
    A job may start only if what is left of the window pays for a small job at the
    client's cost per block (:meth:`allows`), and it may make only as many blocks as
    what is left pays for (:meth:`max_blocks`), so a client's spending stays near the
    limit over any window.
    """

    #: Fewest blocks a budgeted job is given (a smaller one would select little):
    #: a job starts only when what is left of the budget pays for this many.
    MIN_JOB_BLOCKS = QUICK_MAX_BLOCKS

    def __init__(self, started_mono: float, window_s: float = 60.0) -> None:
        self.window_s = window_s
        #: (monotonic s, client CPU s, service CPU s), totals, oldest first.
        self.points: collections.deque[tuple[float, float, float]] = collections.deque(
            [(started_mono, 0.0, 0.0)])
        self.client_cpu_s = 0.0
        self.session_cpu_s = 0.0
        self.job_cpu_s = 0.0
        self.last_job_cpu_s = 0.0
        self.jobs_charged = 0
        #: Jobs not started because the client was over its budget.
        self.deferred = 0
        self.limit = 0.0
        #: CPU seconds per discovered block of the client's last job (None: unknown).
        self.cost_per_block: float | None = None

    @property
    def service_cpu_s(self) -> float:
        return self.job_cpu_s + self.session_cpu_s

    def charge_job(self, cpu_s: float, blocks: int = 0) -> None:
        self.job_cpu_s += max(0.0, cpu_s)
        self.last_job_cpu_s = max(0.0, cpu_s)
        self.jobs_charged += 1
        if blocks > 0:
            self.cost_per_block = max(0.0, cpu_s) / blocks

    def observe(self, now: float, client_cpu_s: float | None,
                session_cpu_s: float | None = None) -> None:
        """Record the totals at ``now`` (None: unknown, the last figure stays)."""
        if client_cpu_s is not None:
            self.client_cpu_s = max(self.client_cpu_s, client_cpu_s)
        if session_cpu_s is not None:
            self.session_cpu_s = max(self.session_cpu_s, session_cpu_s)
        self.points.append((now, self.client_cpu_s, self.service_cpu_s))
        # keep one point at or before the window's start
        while len(self.points) > 2 and self.points[1][0] <= now - self.window_s:
            self.points.popleft()

    def in_window(self, now: float) -> tuple[float, float]:
        """(client CPU, service CPU) in the window ending at ``now``."""
        start = self.points[0]
        for p in self.points:
            if p[0] > now - self.window_s:
                break
            start = p
        return (max(0.0, self.client_cpu_s - start[1]),
                max(0.0, self.service_cpu_s - start[2]))

    def used(self, now: float) -> float | None:
        """Service CPU over client CPU in the window (None before the client used any)."""
        client, service = self.in_window(now)
        return service / client if client > 0 else None

    def allowance(self, now: float, limit: float) -> float:
        """CPU seconds left in the window under ``limit``."""
        client, service = self.in_window(now)
        return limit * client - service

    def allows(self, now: float, limit: float) -> bool:
        """Whether a job may start now under ``limit`` (0: always): what is left pays
        for a job like the client's last, or for MIN_JOB_BLOCKS blocks at its cost per
        block if that is less (the job is then cut to fit: :meth:`max_blocks`)."""
        self.limit = limit
        if limit <= 0:
            return True
        need = self.last_job_cpu_s
        if self.cost_per_block is not None:
            need = min(need, self.cost_per_block * self.MIN_JOB_BLOCKS)
        return self.allowance(now, limit) >= need

    def max_blocks(self, now: float, limit: float) -> int | None:
        """Blocks a job starting now may make so that its CPU fits what is left (at the
        client's last cost per block; None: no bound).  A job's cost grows with what
        discovery reaches: cc1's first full job made ~10 000 blocks in 5.9 s of CPU."""
        if limit <= 0 or not self.cost_per_block:
            return None
        left = self.allowance(now, limit)
        return max(self.MIN_JOB_BLOCKS, int(left / self.cost_per_block))

    def to_json(self, now: float) -> dict[str, Any]:
        used = self.used(now)
        return {"service_cpu_s": round(self.service_cpu_s, 3),
                "service_job_cpu_s": round(self.job_cpu_s, 3),
                "service_thread_cpu_s": round(self.session_cpu_s, 3),
                "client_cpu_s": round(self.client_cpu_s, 3),
                "budget": self.limit,
                "budget_used": None if used is None else round(used, 4),
                "deferred_by_budget": self.deferred}
