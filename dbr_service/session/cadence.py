"""How often a client is sampled and gets a region job: the rules (sampling backoff,
job gaps, what counts as news) and the bookkeeping behind them.

The snapshot cycle (daemon/snapshots.py) and job results (daemon/results.py) read and write a
session's :class:`SessionCadence` on the control thread, the session thread bumps
``activity``; both under the session's lock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class SessionCadence:
    """One client's sampling and job cadence."""

    #: Sampling cadence (daemon/snapshots.py, sampling_interval): ``activity`` counts
    #: what changes the client for selection (regions installed or removed, threads
    #: moved in, code mapped or unmapped); snapshots in a row that changed nothing make
    #: it quiet, and a quiet client is sampled less.
    activity: int = 0
    activity_judged: int = 0
    quiet_snapshots: int = 0
    last_selected: frozenset[str] = frozenset()
    #: Job cadence (daemon/snapshots.py _job_due): the addresses hot at half the threshold in
    #: the last job's input, ``activity`` then, and when the next job may run.
    job_hot_half: frozenset[int] = frozenset()
    job_activity: int = -1
    job_gap_s: float = 0.0
    next_job_mono: float = 0.0
    jobs_skipped_unchanged: int = 0
    jobs_skipped_backoff: int = 0
    #: When its last window began, and the interval it is sampled at now.
    last_window_mono: float = 0.0
    next_window_mono: float = 0.0
    sampling_interval_s: float = 0.0


# --------------------------------------------------------------------------- rules
#: Snapshots in a row that changed nothing before a client's sampling backs off.  The
#: first snapshots after an installation keep the full rate, so its evaluation (grace,
#: cold and not-effective verdicts) sees as many windows as before; so do a client's
#: first QUICK_JOBS + 1 jobs (region/worker.py, daemon/results.py: a quick job that finds nothing is
#: no sign that
#: nothing is left to find).
QUIET_BEFORE_BACKOFF = 3


def sampling_interval(cfg: Any, quiet: int) -> float:
    """Seconds from one of a client's sampling windows to its next, after ``quiet``
    snapshots in a row that changed nothing for it (no new region selected, none
    installed or removed, no code mapped or unmapped).  Doubles from
    ``snapshot_interval_s`` up to ``snapshot_backoff_max_s``: a program with nothing
    left to do pays for sampling an eighth as often at the defaults (1 s -> 8 s)."""
    base = cfg.snapshot_interval_s
    cap = max(base, cfg.snapshot_backoff_max_s)
    if cfg.continuous_sampling or quiet < QUIET_BEFORE_BACKOFF:
        return base
    return min(cap, base * 2.0 ** min(32, quiet - QUIET_BEFORE_BACKOFF + 1))


def hot_addresses(counts: dict[int, int], threshold: float) -> frozenset[int]:
    """The addresses holding at least ``threshold`` of ``counts``' samples."""
    total = sum(counts.values())
    if not total:
        return frozenset()
    need = max(1.0, threshold * total)
    return frozenset(ip for ip, n in counts.items() if n >= need)


def newly_hot(counts: dict[int, int], before: frozenset[int], threshold: float) -> bool:
    """Whether an address is hot (``threshold``) in ``counts`` that was not even half as
    hot in the last job's input (``before``: hot_addresses at threshold / 2).  Selection
    grows regions from hot code: when nothing new is hot, a job would select what the
    last one did.  The half-threshold margin keeps sampling noise at the edge (7 or 8
    samples of 800) from counting as news."""
    return not hot_addresses(counts, threshold) <= before


def next_job_gap(cfg: Any, gap_s: float, changed: bool) -> float:
    """Seconds from a client's job to its next one: 0 after a job that changed something,
    else doubling from ``snapshot_interval_s`` up to ``job_backoff_max_s``."""
    if changed:
        return 0.0
    return min(cfg.job_backoff_max_s, max(cfg.snapshot_interval_s, 2.0 * gap_s))
