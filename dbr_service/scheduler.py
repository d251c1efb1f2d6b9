"""Scheduling client work after each snapshot, and the job that runs in a worker process.

The control thread calls :meth:`Scheduler.schedule` with the clients that have fresh
samples.  The scheduler orders them by hotness, decides how many jobs the machine can
take now (``max_workers`` or CPU count minus load), and submits :func:`optimize_client`
to a process pool; results come back through a callback and are applied on the control
thread.  The control thread never waits for a worker.

The job, :func:`optimize_client`, is the one place the cycle's worker step runs
(docs/architecture.md, "One cycle" 4): hot spots and region selection.  Code generation
and installation run on the client's session thread (optimize.py, install.py).
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import errno
import importlib
import importlib.util
import logging
import multiprocessing
import os
import queue
import select
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from dbr_service.procmaps import MapEntry, find_mapping, module_base

log = logging.getLogger("dbr.scheduler")


# --------------------------------------------------------------------------- hot spots
def find_hotspots(ip_counts: dict[int, int], maps: list[MapEntry], *, threshold: float,
                  top: int | None = None) -> list[dict[str, Any]]:
    """Addresses holding at least ``threshold`` of the samples, hottest first.

    Each hot spot names its module and offset (stripped programs have no symbols):
    ``{"ip", "samples", "fraction", "module", "offset", "perms"}``.
    """
    total = sum(ip_counts.values())
    if not total:
        return []
    need = max(1, threshold * total)
    hot = sorted(((ip, n) for ip, n in ip_counts.items() if n >= need),
                 key=lambda t: (-t[1], t[0]))
    if top is not None:
        hot = hot[:top]
    bases: dict[str, int] = {}
    out = []
    for ip, n in hot:
        m = find_mapping(maps, ip)
        module = m.path if m else ""
        if module and module not in bases:
            bases[module] = module_base(maps, module)
        out.append({"ip": ip, "samples": n, "fraction": round(n / total, 4),
                    "module": module or "[unknown]",
                    "offset": ip - bases[module] if module else None,
                    "perms": m.perms if m else ""})
    return out


# --------------------------------------------------------------------------- the job
@dataclass
class ClientJob:
    """Everything a worker needs about one client; picklable."""

    session_id: int
    pid: int
    exe: str
    #: Samples of the last snapshot, per IP.
    samples: dict[int, int]
    #: Samples since the client connected, per IP (steadier for region selection).
    cumulative: dict[int, int]
    #: The client's memory map at snapshot time.
    maps: list[MapEntry]
    #: Configuration as a dict (Config is rebuilt in the worker).
    config: dict[str, Any]
    #: Taken branches seen in the snapshot ``{src: {dst: count}}`` (sources with branch info).
    branches: dict[int, dict[int, int]] = field(default_factory=dict)
    #: Byte ranges of installed patches: discovery stops at them (docs/architecture.md,
    #: "Region selection").
    patched: list[tuple[int, int]] = field(default_factory=list)
    #: Blocks discovery may make (None: no bound), so that the job fits what is left
    #: of the client's CPU budget (CpuBudget.max_blocks).
    max_blocks: int | None = None
    #: A quick job (:func:`quick_job`): selection takes QUICK_REACH, seeds only from
    #: IPs with QUICK_SEED_MIN samples (all of them when there are at most
    #: QUICK_ALL_SEEDS_MAX) and makes at most QUICK_MAX_BLOCKS blocks, so that the
    #: client's first region comes early.
    quick: bool = False
    submitted: float = field(default_factory=time.time)

    def function_entries(self):
        """In the worker: the client's known function entries (.eh_frame FDE starts and
        symbols of its module files, region/functions.py), for entry sites."""
        from dbr_service.clientfiles import ProcHandle
        from dbr_service.codegen.frames import CfiSource
        from dbr_service.region.functions import FunctionEntries

        proc = ProcHandle(self.pid)       # the maps with device and inode: CfiSource
        maps = [(m.lo, m.hi, m.path, m.dev, m.ino) for m in proc.maps() or []
                if m.path.startswith("/")]  # reads only the very files the client maps
        proc.close()
        return FunctionEntries(module_at=CfiSource(lambda: maps).module_at)

    def memory_view(self):
        """In the worker: the live view region selection reads (region/memview.py);
        the job carries only the pid, the worker opens /proc/PID/mem itself."""
        from dbr_service.region.memview import LiveMemoryView

        return LiveMemoryView(self.pid)


@dataclass
class JobResult:
    """What a worker found for one client."""

    session_id: int
    pid: int
    hotspots: list[dict[str, Any]]
    #: Regions selected (dicts, see session_regions.RegionRecord), or None when not run.
    regions: list[dict[str, Any]] | None = None
    #: Why regions are missing: "not available yet", an error text, ...
    region_status: str = ""
    elapsed_s: float = 0.0
    worker_pid: int = 0
    #: The selected super-regions themselves (same order as ``regions``), for codegen
    #: and installation on the service side.
    srs: list[Any] | None = None
    #: CPU seconds the job took (process time in a worker, thread time inline): what
    #: the client's service CPU budget is charged.
    cpu_s: float = 0.0
    #: Instructions discovery took from the worker's per-module decode cache, and
    #: those it decoded (region/discovery.py ModuleDecodeCache).
    decode_cached: int = 0
    decode_new: int = 0
    #: Blocks hot-code discovery made (the job's size).
    blocks: int = 0


def optimize_client(job: ClientJob) -> JobResult:
    """Worker: hot spots → region selection (code generation runs on the session thread).

    A failure in region selection is recorded in the result; it never raises, so one
    client's trouble cannot disturb the pool or the others.
    """
    from dbr_service.config import Config

    from dbr_service.region.discovery import DECODE_CACHE

    t0 = time.monotonic()
    # a worker runs one job at a time: its process's CPU since the end of its last job
    # (this job's unpickling and the last result's pickling included) is this job's;
    # inline, the job shares the service's process, so only its thread's time is
    global _CPU_MARK
    clock = time.process_time if _IN_WORKER else time.thread_time
    c0 = clock()
    start = _CPU_MARK if _IN_WORKER and _CPU_MARK is not None else c0
    cached0, new0 = DECODE_CACHE.counts()
    blocks0 = DECODE_CACHE.blocks
    cfg = Config(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in job.config.items()})
    if _IN_WORKER:
        set_thread_nice(cfg.worker_nice)
        set_autogroup_nice(cfg.worker_nice)
    hotspots = find_hotspots(job.samples, job.maps, threshold=cfg.hot_threshold,
                             top=cfg.hotspots_kept)
    regions, status, srs = select_client_regions(job, cfg)
    cached1, new1 = DECODE_CACHE.counts()
    c1 = clock()
    if _IN_WORKER:
        _CPU_MARK = c1
    return JobResult(job.session_id, job.pid, hotspots, regions, status,
                     time.monotonic() - t0, os.getpid(), srs=srs, cpu_s=c1 - start,
                     decode_cached=cached1 - cached0, decode_new=new1 - new0,
                     blocks=DECODE_CACHE.blocks - blocks0)


#: Discovery reach (conditional jumps from sampled code) of a quick job, at most.
#: Measured on 0.3 s live profiles (selection with --aggressive, reach 6 -> 3): perl
#: 2.0 -> 0.6 s, sqlite3 2.0 -> 0.86 s, python3 0.7 -> 0.34 s, the compressors 0.19-0.26
#: -> 0.03-0.10 s; samples inside the selected regions 267 -> 184 of 592 (perl),
#: 157 -> 145 of 570 (sqlite3), within 3 % on the compressors, equal on the C
#: workloads.  Later jobs use the configured reach and may add regions.
QUICK_REACH = 3

#: Fewest samples an IP needs to seed discovery in a quick job (other jobs: 1).
#: On a flat profile most sampled IPs hold one sample, and each seeds its own search:
#: on the first 0.1 s window (--aggressive, reach 3) selection went from 0.71 s to
#: 0.036 s on sqlite3, 0.24 -> 0.036 s perl, 0.21 -> 0.053 s python3, 0.115 -> 0.019 s
#: bzip2, 0.053 -> 0.010 s gzip, equal on loop-dominated interp; samples inside the
#: selected regions 75 -> 60 of 191 (sqlite3), 20 -> 14 of 193 (python3), 99 -> 81 of
#: 196 (bzip2), 149 -> 132 of 183 (gzip), equal on perl and interp.  Singletons inside
#: the blocks reached from the seeds still count; later jobs seed from every IP.
QUICK_SEED_MIN = 2

#: ... unless the samples are concentrated: with at most this many distinct sampled
#: IPs, every one seeds (a search each costs little, and there are few).  calls' only
#: loop is six instructions around a call and holds ~1 % of the samples, and nothing
#: else leads discovery to it (a ``ret`` has no known target): replaying its first
#: 0.15 s window (300 samples, 29 distinct IPs) of 8-10 perf-recorded runs, the quick
#: settings selected its region in 4 of 8 with 2-sample seeds and in 9 of 10 with
#: every IP seeding.  The flat profiles QUICK_SEED_MIN is for have hundreds.
QUICK_ALL_SEEDS_MAX = 64

#: Blocks a quick job's discovery may make before it stops following jumps.  Even from
#: 2-sample seeds, a window of sqlite3 that reaches its VDBE interpreter's big switch
#: made 1399 blocks and 167 super-regions (0.34 s in the worker, or not done within the
#: 0.7 s run) against 0.03-0.06 s and a few hundred blocks on its other windows.
QUICK_MAX_BLOCKS = 300

#: Jobs of a client that stay quick (QUICK_REACH, QUICK_SEED_MIN, QUICK_MAX_BLOCKS)
#: while it has no region: a first window too flat for the 2-sample seeds (python3: 0
#: regions from 11 seeds in some runs) gets another quick try with the samples since.
QUICK_JOBS = 3


def quick_job(jobs_done: int, has_regions: bool) -> bool:
    """Whether a client's next job is a quick one (ClientJob.quick)."""
    return jobs_done < QUICK_JOBS and not has_regions


# --------------------------------------------------------------------------- CPU budget
def client_cpu_s(pid: int) -> float | None:
    """utime + stime of every thread of process ``pid`` (/proc/PID/stat), seconds."""
    from dbr_service.procfs import stat_fields

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


def region_config(cfg: Any, total_samples: int) -> Any:
    """The pipeline's RegionConfig from the service Config.  ``hot_threshold`` is a
    fraction of the client's samples here and a sample count in the pipeline."""
    from dbr_service.region.pipeline import RegionConfig

    return RegionConfig(jumps_from_hot_limit=cfg.jumps_from_hot_limit,
                        hot_threshold=max(1.0, cfg.hot_threshold * total_samples),
                        min_loop_trip_count=cfg.min_loop_trip_count,
                        function_threshold=(max(1.0, cfg.hot_function_threshold * total_samples)
                                            if cfg.hot_function_threshold > 0 else None),
                        min_region_size=cfg.min_region_size, inline_budget=cfg.inline_budget,
                        transfer_only=cfg.transfer, real_calls=cfg.real_calls,
                        entry_sites=cfg.entry_sites)


def select_client_regions(job: ClientJob, cfg: Any
                          ) -> tuple[list[dict] | None, str, list[Any] | None]:
    """Run region selection; (region summaries, status text, the super-regions)."""
    if not job.cumulative:
        return None, "no samples outside replacement code", None
    patched = sorted(job.patched)

    def is_patched(addr: int) -> bool:
        i = bisect.bisect_right(patched, (addr, 1 << 64)) - 1
        return i >= 0 and patched[i][0] <= addr < patched[i][1]

    try:
        pipeline = importlib.import_module("dbr_service.region.pipeline")
        rcfg = region_config(cfg, sum(job.cumulative.values()))
        if job.quick:
            distinct = sum(1 for n in job.cumulative.values() if n > 0)
            rcfg = dataclasses.replace(
                rcfg, jumps_from_hot_limit=min(rcfg.jumps_from_hot_limit, QUICK_REACH),
                seed_min_samples=0.0 if distinct <= QUICK_ALL_SEEDS_MAX else QUICK_SEED_MIN,
                max_discovery_blocks=QUICK_MAX_BLOCKS)
        if job.max_blocks is not None:
            rcfg = dataclasses.replace(rcfg, max_discovery_blocks=min(
                job.max_blocks, rcfg.max_discovery_blocks or job.max_blocks))
        res = pipeline.select_regions(job.cumulative, job.memory_view(), rcfg,
                                      branch_samples=job.branches or None,
                                      patched=is_patched if patched else None,
                                      functions=job.function_entries())
    except Exception as exc:  # per-client: recorded, the service goes on
        tb = traceback.format_exception_only(type(exc), exc)[-1].strip()
        return None, f"region selection failed: {tb}", None
    regions = [describe_region(sr) for sr in res.regions]
    status = f"{len(regions)} region(s) selected"
    if res.failures:
        status += f", {len(res.failures)} dropped by failures ({res.failures[0].error})"
    return regions, status, list(res.regions)


def describe_region(sr: Any) -> dict[str, Any]:
    """A picklable summary of one super-region (region/model.py SuperRegion)."""
    blocks = list(sr.blocks())
    modules = [bb.module for _, bb in blocks if getattr(bb, "module", None)]
    return {"id": sr.id, "module": modules[0] if modules else "",
            "entries": sorted(int(n) for n, _ in sr.entry_edges() if isinstance(n, int)),
            "transfer_only": sr.transfer_only,
            "blocks": len(blocks), "code_bytes": sum(bb.size for _, bb in blocks),
            "dot": sr.to_dot(sr.id)}


# --------------------------------------------------------------------------- scheduler
def auto_workers(cpu_count: int | None = None, load1: float | None = None) -> int:
    """Workers for ``max_workers = 0``: idle CPUs, at least 1, at most CPUs - 1 (but 1)."""
    cpus = cpu_count or os.cpu_count() or 1
    if load1 is None:
        load1 = os.getloadavg()[0]
    idle = int(cpus - load1 + 0.5)
    return max(1, min(max(1, cpus - 1), idle))


#: In a pool worker: its process time at the end of its last job (optimize_client).
_CPU_MARK: float | None = None

#: Set in pool worker processes: only they take ``worker_nice`` (a job run on a thread
#: of the service while the pool is cold keeps the service's priority: a niced thread
#: holding the GIL would hold up the control thread).
_IN_WORKER = False


def set_thread_nice(nice: int) -> bool:
    """Give the calling thread niceness ``nice`` (Linux: niceness is per thread).
    Raising it back needs CAP_SYS_NICE; without it the thread stays as it is.
    Whether the thread now has that niceness."""
    tid = threading.get_native_id()
    try:
        if os.getpriority(os.PRIO_PROCESS, tid) != nice:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
    except OSError:
        return False
    return True


#: The worker leads a session of its own, so its scheduling autogroup is its own too
#: (set in pool workers by _worker_init).
_OWN_AUTOGROUP = False


def set_autogroup_nice(nice: int) -> bool:
    """Give the calling process's autogroup niceness ``nice``, if the process has an
    autogroup of its own (a worker after _worker_init).

    With autogroups (``/proc/sys/kernel/sched_autogroup_enabled``, the default of most
    distributions), the kernel shares CPU time first between sessions, each weighted
    by its autogroup's niceness, and only then between the threads of a session by
    theirs.  A worker at niceness 19 in the service's session therefore took as much
    of a CPU as a client in a session of its own (a service manager starts each
    program so): a nice-19 CPU hog in a session at autogroup niceness 0 made a
    2-thread program on 2 CPUs take 1.81x its time, 1.17x with its autogroup at 19
    (docs/design-notes.md, "Selection workers in an autogroup of their own").
    Whether the autogroup now has that niceness; False where there is no autogroup
    to set (kernel without it, or not our own)."""
    if not _OWN_AUTOGROUP:
        return False
    for attempt in range(2):
        try:
            with open("/proc/self/autogroup") as f:   # "/autogroup-123 nice 0"
                if int(f.read().split()[-1]) == nice:
                    return True
            with open("/proc/self/autogroup", "w") as f:
                f.write(str(nice))
            return True
        except OSError as exc:
            # Without CAP_SYS_ADMIN the kernel takes one such change per 100 ms,
            # machine-wide (two workers starting together): once more, later.
            if exc.errno != errno.EAGAIN or attempt:
                return False
            time.sleep(0.11)
        except (ValueError, IndexError):
            return False
    return False


def _worker_init(service_pid: int) -> None:
    """Worker start-up: a session (so an autogroup) of its own, whose niceness the jobs
    set (set_autogroup_nice); exit as soon as the service is gone, even after a SIGKILL
    (pool workers otherwise wait on their queue forever, holding the forkserver)."""
    global _IN_WORKER, _OWN_AUTOGROUP
    _IN_WORKER = True
    try:
        os.setsid()
        _OWN_AUTOGROUP = True
    except OSError:
        pass   # already a session or process group leader: keeps the service's group

    def watch() -> None:
        try:
            fd = os.pidfd_open(service_pid)
        except OSError:
            os._exit(0)  # already gone
        p = select.poll()
        p.register(fd, select.POLLIN)
        p.poll()  # readable once the process has exited
        os._exit(0)

    threading.Thread(target=watch, name="dbr-worker-watch", daemon=True).start()


WORKER_PRELOAD = ["dbr_service.scheduler", "dbr_service.region.pipeline",
                  "dbr_service.region.discovery", "dbr_service.region.memview",
                  "dbr_service.codegen.relocate"]


def warm_up() -> int:
    """Makes the pool start a worker early and import what a job needs (capstone,
    networkx, the pipeline), so the first job does not pay for it."""
    for name in WORKER_PRELOAD:
        importlib.import_module(name)
    return os.getpid()


class Scheduler:
    """Orders clients by hotness and runs :func:`optimize_client` in worker processes.

    :meth:`schedule` (control thread) only decides; a submitter thread creates the pool
    and submits, because starting worker processes can take a while and the control
    thread must never wait for it.
    """

    def __init__(self, on_result: Callable[[JobResult | BaseException, int], None]) -> None:
        self.on_result = on_result
        self._pool: ProcessPoolExecutor | None = None
        self._pool_size = 0
        self.running: dict[int, Future | None] = {}  # session id -> job (None: queued)
        self.submitted = 0
        self.completed = 0
        self.failed = 0
        self.skipped_load = 0
        self.deferred_by_budget = 0
        #: Jobs not run because nothing new was hot, or while backing off (snapshots.py).
        self.skipped_unchanged = 0
        self.skipped_backoff = 0
        self.job_cpu_s = 0.0
        self.decode_cached = 0
        self.decode_new = 0
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[ClientJob | None, int]] = queue.Queue()
        self._closed = False
        #: Set once a pool worker has answered: until then jobs run on a thread of this
        #: process (a cold pool costs ~0.5-1 s; the first job should not wait for it).
        self._pool_ready = threading.Event()
        self._stop_warm = threading.Event()
        self._warm_lock = threading.Lock()
        self._pool_lock = threading.Lock()
        self._warming = False
        self._inline_free = threading.Semaphore(1)
        self.inline_jobs = 0
        self._thread = threading.Thread(target=self._submitter, name="dbr-scheduler",
                                        daemon=True)
        self._thread.start()

    def capacity(self, max_workers: int) -> int:
        """How many jobs may run at once now."""
        if max_workers > 0:
            return max_workers
        try:
            import psutil

            load1 = psutil.getloadavg()[0]
            cpus = psutil.cpu_count() or 1
        except Exception:
            load1, cpus = os.getloadavg()[0], os.cpu_count() or 1
        return auto_workers(cpus, load1)

    def warm(self, max_workers: int, delay_s: float = 0.0) -> None:
        """Start the pool and one worker in the background (first jobs come sooner), and
        import what jobs need in this process too, for jobs run before the pool is up.

        ``delay_s``: start the pool only after this long (`dbr run`'s embedded service:
        a program that ends sooner never pays for starting worker processes; jobs run
        inline until the pool is up anyway)."""
        self._start_warm(self._pool_limit(max_workers), delay_s)
        threading.Thread(target=warm_up, name="dbr-warm-imports", daemon=True).start()

    def _start_warm(self, limit: int, delay_s: float = 0.0) -> None:
        self._warming = True

        def later() -> None:
            if delay_s > 0 and self._stop_warm.wait(delay_s):
                return  # shut down first
            with self._warm_lock:
                if not self._closed:
                    self._warm_pool(limit)

        threading.Thread(target=later, name="dbr-warm-pool", daemon=True).start()

    def wait_ready(self, timeout: float) -> bool:
        """Wait (bounded) until a pool worker has answered; True if it has."""
        return self._pool_ready.wait(timeout)

    def _warm_pool(self, limit: int) -> None:
        """Start the pool (submitting the first job starts the forkserver and a worker,
        synchronously: never on the submitter thread, jobs would queue behind it)."""
        try:
            pool = self._ensure_pool(limit)
            pool.submit(warm_up).add_done_callback(lambda f: self._pool_ready.set())
        except Exception as exc:  # no pool: jobs keep running inline
            self._warming = False   # nothing to wait for at shutdown
            log.warning("worker pool did not start: %s", exc)

    @staticmethod
    def _pool_limit(max_workers: int) -> int:
        return max_workers if max_workers > 0 else max(1, (os.cpu_count() or 1) - 1)

    def admit(self, budget: CpuBudget, now: float, limit: float) -> bool:
        """Whether a client's next job fits its CPU budget (its figures observed just
        before); a job that does not is counted as deferred, on the client and here."""
        if budget.allows(now, limit):
            return True
        budget.deferred += 1
        self.deferred_by_budget += 1
        return False

    def charge(self, budget: CpuBudget, res: JobResult) -> None:
        """A finished job's CPU, on its client's budget and in the totals."""
        budget.charge_job(res.cpu_s, res.blocks)
        self.job_cpu_s += res.cpu_s
        self.decode_cached += res.decode_cached
        self.decode_new += res.decode_new

    def schedule(self, jobs: list[ClientJob], max_workers: int) -> list[int]:
        """Queue the hottest jobs that fit now; returns the session ids queued."""
        cap = self.capacity(max_workers)
        with self._lock:
            free = cap - len(self.running)
            order = sorted((j for j in jobs if j.session_id not in self.running),
                           key=lambda j: -sum(j.samples.values()))
            chosen = order[:max(0, free)]
            self.skipped_load += len(order) - len(chosen)
            for job in chosen:
                self.running[job.session_id] = None
        for job in chosen:
            self._queue.put((job, self._pool_limit(max_workers)))
        return [j.session_id for j in chosen]

    def _submitter(self) -> None:
        while True:
            job, limit = self._queue.get()
            if self._closed:
                return
            try:
                if job is None:
                    continue
                if not self._pool_ready.is_set():
                    if not self._warming:   # nobody called warm(): start the pool now
                        self._start_warm(limit)
                    if self._inline_free.acquire(blocking=False):  # one at a time: the
                        threading.Thread(target=self._run_inline, args=(job,),  # GIL is
                                         daemon=True,           # the control thread's too
                                         name=f"dbr-job-{job.session_id}").start()
                        continue
                pool = self._ensure_pool(limit)
                fut = pool.submit(optimize_client, job)
            except Exception as exc:  # pool broken or shut down: report, go on
                if job is not None:
                    with self._lock:
                        self.running.pop(job.session_id, None)
                    self.failed += 1
                    self.on_result(exc, job.session_id)
                continue
            with self._lock:
                self.running[job.session_id] = fut
                self.submitted += 1
            fut.add_done_callback(lambda f, sid=job.session_id: self._done(sid, f))

    def _run_inline(self, job: ClientJob) -> None:
        """A job on a thread of the service (only while the pool is still starting)."""
        with self._lock:
            self.running[job.session_id] = None
            self.inline_jobs += 1
        try:
            res: JobResult | BaseException = optimize_client(job)
        except Exception as exc:  # optimize_client records its own failures; a bug here
            res = exc
        finally:
            self._inline_free.release()
        with self._lock:
            self.running.pop(job.session_id, None)
            if isinstance(res, BaseException):
                self.failed += 1
            else:
                self.completed += 1
        self.on_result(res, job.session_id)

    def _done(self, session_id: int, fut: Future) -> None:
        with self._lock:
            self.running.pop(session_id, None)
        if fut.cancelled():
            return
        exc = fut.exception()
        if exc is None:
            self.completed += 1
            self.on_result(fut.result(), session_id)
        else:
            self.failed += 1
            self.on_result(exc, session_id)

    def _ensure_pool(self, size: int) -> ProcessPoolExecutor:
        with self._pool_lock:
            return self._ensure_pool_locked(size)

    def _ensure_pool_locked(self, size: int) -> ProcessPoolExecutor:
        if self._pool is None or size != self._pool_size:
            old = self._pool
            # forkserver: workers never inherit the service's threads, sockets or zmq.
            ctx = multiprocessing.get_context("forkserver")
            # The forkserver imports what jobs need once; every worker forks from it
            # with those modules loaded (the first job no longer pays ~0.5 s of imports).
            ctx.set_forkserver_preload(WORKER_PRELOAD)
            self._pool = ProcessPoolExecutor(max_workers=size, mp_context=ctx,
                                             initializer=_worker_init,
                                             initargs=(os.getpid(),))
            self._pool_size = size
            if old is not None:
                old.shutdown(wait=False)
        return self._pool

    def stats(self) -> dict[str, Any]:
        return {"pool_size": self._pool_size, "running": len(self.running),
                "submitted": self.submitted, "completed": self.completed,
                "failed": self.failed, "deferred_for_load": self.skipped_load,
                "deferred_by_budget": self.deferred_by_budget,
                "skipped_unchanged": self.skipped_unchanged,
                "skipped_backoff": self.skipped_backoff,
                "job_cpu_s": round(self.job_cpu_s, 3),
                "decode_cached": self.decode_cached, "decode_new": self.decode_new,
                "inline_jobs": self.inline_jobs, "pool_ready": self._pool_ready.is_set()}

    def shutdown(self, timeout: float = 1.0) -> None:
        """Cancel queued jobs and stop workers without waiting for running ones
        (bounded by ``timeout`` seconds in all)."""
        deadline = time.monotonic() + timeout
        self._stop_warm.set()
        # Not while the pool is being created (bounded: a pool still starting after the
        # timeout is left to its workers' watch on this process).
        locked = self._warm_lock.acquire(timeout=timeout / 2)
        self._closed = True
        if locked:
            self._warm_lock.release()
        self._queue.put((None, 0))
        self._thread.join(timeout / 2)
        if self._pool is not None and self._warming:
            # A worker still starting unpickles the pool's semaphores from its parent:
            # shutting the pool down under it makes it die with a traceback on our
            # stderr.  Give it (bounded) time to come up.
            self._pool_ready.wait(max(0.0, deadline - time.monotonic()))
        pool, self._pool = self._pool, None
        if pool is None:
            return
        procs = list((getattr(pool, "_processes", None) or {}).values())
        pool.shutdown(wait=False, cancel_futures=True)
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
