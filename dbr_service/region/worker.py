"""The job a worker process runs for one client, and the worker processes themselves.

The job, :func:`optimize_client`, is the one place the cycle's worker step runs
(docs/architecture.md, "One cycle" 4): hot spots and region selection, from a
picklable :class:`ClientJob` to a :class:`JobResult`.  Code generation and
installation run on the client's session thread (installation/optimize.py, installation/install.py).
The
scheduler (daemon/scheduler.py) decides which jobs run and submits them to a pool whose
workers start with :func:`worker_init`.
"""

from __future__ import annotations

import bisect
import dataclasses
import errno
import importlib
import os
import select
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

from dbr_service.common.procmaps import MapEntry, find_mapping, module_base


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
    #: Fall-through ranges of the snapshot's branch stacks ``{(start, end): count}``:
    #: their not-taken branches join ``branches`` in the worker (sampling/fulltrace.py).
    fallthroughs: dict[tuple[int, int], int] = field(default_factory=dict)
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
    #: A warm job's second choice: the configuration it selects under again when
    #: ``config`` selects no region with a patch site (profiles/warmprep.py).
    fallback_config: dict[str, Any] | None = None
    submitted: float = field(default_factory=time.time)

    def function_entries(self):
        """In the worker: the client's known function entries (.eh_frame FDE starts and
        symbols of its module files, region/functions.py), for entry sites."""
        from dbr_service.common.clientfiles import ProcHandle
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
    #: those it decoded (region/decode.py ModuleDecodeCache).
    decode_cached: int = 0
    decode_new: int = 0
    #: Blocks hot-code discovery made (the job's size).
    blocks: int = 0


def optimize_client(job: ClientJob) -> JobResult:
    """Worker: hot spots → region selection (code generation runs on the session thread).

    A failure in region selection is recorded in the result; it never raises, so one
    client's trouble cannot disturb the pool or the others.
    """
    from dbr_service.common.config import Config

    from dbr_service.region.decode import DECODE_CACHE

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
    def config(d: dict[str, Any]) -> Config:
        return Config(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in d.items()})

    cfg = config(job.config)
    if _IN_WORKER:
        set_thread_nice(cfg.worker_nice)
        set_autogroup_nice(cfg.worker_nice)
    hotspots = find_hotspots(job.samples, job.maps, threshold=cfg.hot_threshold,
                             top=cfg.hotspots_kept)
    regions, status, srs = select_client_regions(job, cfg)
    if job.fallback_config is not None and \
            all(d["transfer_only"] for d in regions or []):
        regions, status, srs = select_client_regions(job, config(job.fallback_config))
        status += " (under the second configuration)"
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


# --------------------------------------------------------------------------- region selection
def region_config(cfg: Any, total_samples: int) -> Any:
    """The pipeline's RegionConfig from the service Config.  ``hot_threshold`` is a
    fraction of the client's samples here and a sample count in the pipeline."""
    from dbr_service.region.pipeline import RegionConfig

    share = cfg.hot_function_threshold
    hot_text = cfg.hot_text
    if hot_text:      # hot text: functions down to the smaller share, at their entries
        share = min(share, cfg.hot_text_min_share) if share > 0 else cfg.hot_text_min_share
    return RegionConfig(jumps_from_hot_limit=cfg.jumps_from_hot_limit,
                        hot_threshold=max(1.0, cfg.hot_threshold * total_samples),
                        min_loop_trip_count=cfg.min_loop_trip_count,
                        function_threshold=(max(1.0, share * total_samples)
                                            if share > 0 else None),
                        min_region_size=cfg.min_region_size, inline=cfg.inline,
                        inline_budget=cfg.inline_budget,
                        transfer_only=cfg.transfer, real_calls=cfg.real_calls,
                        entry_sites=cfg.entry_sites or hot_text, hot_text=hot_text,
                        hot_text_max_bytes=cfg.hot_text_max_bytes)


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
                # hot text wants every function the samples show, not a first loop
                max_discovery_blocks=None if cfg.hot_text else QUICK_MAX_BLOCKS)
        if job.max_blocks is not None:
            rcfg = dataclasses.replace(rcfg, max_discovery_blocks=min(
                job.max_blocks, rcfg.max_discovery_blocks or job.max_blocks))
        functions = job.function_entries()
        mem = job.memory_view()
        branches = job.branches
        if job.fallthroughs:
            from dbr_service.sampling.fulltrace import full_branch_counts
            branches = full_branch_counts(job.branches, job.fallthroughs, mem.read)
        res = pipeline.select_regions(job.cumulative, mem, rcfg,
                                      branch_samples=branches or None,
                                      patched=is_patched if patched else None,
                                      functions=functions)
    except Exception as exc:  # per-client: recorded, the service goes on
        tb = traceback.format_exception_only(type(exc), exc)[-1].strip()
        return None, f"region selection failed: {tb}", None
    regions = [describe_region(sr, functions.name) for sr in res.regions]
    for d, sr in zip(regions, res.regions):
        # the functions whose code the region copies (clones: their callees'), by FDE
        d["function_starts"] = sorted({f for _, bb in sr.blocks()
                                       if (f := functions.function_start(bb.start))
                                       is not None})
    status = f"{len(regions)} region(s) selected"
    if res.failures:
        status += f", {len(res.failures)} dropped by failures ({res.failures[0].error})"
    return regions, status, list(res.regions)


def describe_region(sr: Any, name: Any = None) -> dict[str, Any]:
    """A picklable summary of one super-region (region/model.py SuperRegion); ``name``
    names the functions of its blocks in its graph (FunctionEntries.name)."""
    blocks = list(sr.blocks())
    modules = [bb.module for _, bb in blocks if getattr(bb, "module", None)]
    return {"id": sr.id, "module": modules[0] if modules else "",
            "entries": sorted(int(n) for n, _ in sr.entry_edges() if isinstance(n, int)),
            "transfer_only": sr.transfer_only,
            "blocks": len(blocks), "code_bytes": sum(bb.size for _, bb in blocks),
            "hot_function": bool(sr.info.get("hot_function")),
            "functions": sr.info.get("functions", 0),
            "dot": sr.to_dot(sr.id, name)}


# --------------------------------------------------------------------------- worker processes
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
#: (set in pool workers by worker_init).
_OWN_AUTOGROUP = False


def set_autogroup_nice(nice: int) -> bool:
    """Give the calling process's autogroup niceness ``nice``, if the process has an
    autogroup of its own (a worker after worker_init).

    With autogroups (``/proc/sys/kernel/sched_autogroup_enabled``, the default of most
    distributions), the kernel shares CPU time first between sessions, each weighted
    by its autogroup's niceness, and only then between the threads of a session by
    theirs.  A worker at niceness 19 in the service's session therefore took as much
    of a CPU as a client in a session of its own (a service manager starts each
    program so): a nice-19 CPU hog in a session at autogroup niceness 0 made a
    2-thread program on 2 CPUs take 1.81x its time, 1.17x with its autogroup at 19
    (docs/decisions/0030-selection-workers-own-autogroup.md).
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


def worker_init(service_pid: int) -> None:
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


#: What the forkserver imports once for every worker: this module (the job) and what
#: the job needs.
WORKER_PRELOAD = ["dbr_service.region.worker", "dbr_service.region.pipeline",
                  "dbr_service.region.discovery", "dbr_service.region.memview",
                  "dbr_service.codegen.relocate"]


def warm_up() -> int:
    """Makes the pool start a worker early and import what a job needs (capstone,
    networkx, the pipeline), so the first job does not pay for it."""
    for name in WORKER_PRELOAD:
        importlib.import_module(name)
    return os.getpid()
