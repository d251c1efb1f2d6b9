"""How often a client is sampled and gets a region job: the bookkeeping behind it.

The snapshot cycle (snapshots.py) and job results (results.py) read and write it on the
control thread, the session thread bumps ``activity``; both under the session's lock.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SessionCadence:
    """One client's sampling and job cadence."""

    #: Sampling cadence (snapshots.py, scheduler.sampling_interval): ``activity`` counts
    #: what changes the client for selection (regions installed or removed, threads
    #: moved in, code mapped or unmapped); snapshots in a row that changed nothing make
    #: it quiet, and a quiet client is sampled less.
    activity: int = 0
    activity_judged: int = 0
    quiet_snapshots: int = 0
    last_selected: frozenset[str] = frozenset()
    #: Job cadence (snapshots.py _job_due): the addresses hot at half the threshold in
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
