"""Shared benchmark machinery: alternate A/B runs, take medians, report ratios,
record the machine, write results under bench/results/.  The statistics are
``bench/stats.py``."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict:
    """What the numbers were measured on."""
    cpu = ""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    pmu = os.path.exists("/sys/bus/event_source/devices/cpu/events/cycles") or \
        os.path.exists("/sys/bus/event_source/devices/cpu_core")
    return {"cpu": cpu, "cores": os.cpu_count(), "kernel": platform.release(),
            "python": platform.python_version(), "pmu": pmu,
            "load1": os.getloadavg()[0], "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def time_cmd(argv: Sequence[str], env: dict | None = None, stdin: bytes | None = None,
             timeout: float = 600) -> tuple[float, bytes, int]:
    """Wall seconds, stdout and exit code of one run."""
    t0 = time.perf_counter()
    p = subprocess.run(list(argv), env=env, input=stdin, stdout=subprocess.PIPE,
                       stderr=subprocess.DEVNULL, timeout=timeout)
    return time.perf_counter() - t0, p.stdout, p.returncode


def timed(argv: Sequence[str], env: dict | None = None) -> Callable[[], float]:
    """A no-argument runner for ab(): wall seconds of one run; a failing run stops
    the benchmark (its figure would be meaningless)."""
    def run() -> float:
        secs, _, rc = time_cmd(argv, env=env)
        if rc != 0:
            raise SystemExit(f"{list(argv)} exited {rc}")
        return secs
    return run


@dataclass
class ABResult:
    """Medians of alternated runs of A (baseline) and B, and B/A."""

    name: str
    runs: int
    a_median: float
    b_median: float
    ratio: float
    a_all: list[float] = field(default_factory=list)
    b_all: list[float] = field(default_factory=list)
    note: str = ""

    @property
    def delta(self) -> float:
        return self.b_median - self.a_median


def ab(name: str, run_a: Callable[[], float], run_b: Callable[[], float], runs: int,
       warmup: int = 1) -> ABResult:
    """Alternate A and B ``runs`` times each (ABAB..., starting side flipped every
    pair so drift hits both), after ``warmup`` unrecorded runs of each."""
    for _ in range(warmup):
        run_a()
        run_b()
    a, b = [], []
    for i in range(runs):
        order = (run_a, run_b) if i % 2 == 0 else (run_b, run_a)
        for fn in order:
            (a if fn is run_a else b).append(fn())
    am, bm = statistics.median(a), statistics.median(b)
    return ABResult(name, runs, am, bm, bm / am if am else float("nan"), a, b)


def tree_cpu_s(pid: int) -> float | None:
    """user+sys of process ``pid`` and its live descendants so far, with what ``pid``
    reaped of its ended children (a service and its worker processes; psutil).  None
    without psutil or once the process is gone."""
    try:
        import psutil

        root = psutil.Process(pid)
        total = 0.0
        for p in [root, *root.children(recursive=True)]:
            try:
                t = p.cpu_times()
            except psutil.Error:
                continue
            total += t.user + t.system + (t.children_user + t.children_system
                                          if p is root else 0.0)
        return total
    except Exception:  # noqa: BLE001 - no psutil, or the process is gone
        return None


def results_dir() -> Path:
    """Where results go: ``$DBR_BENCH_RESULTS`` if set, else ``bench/results``."""
    return Path(os.environ.get("DBR_BENCH_RESULTS") or RESULTS)


def write_results(stem: str, payload: dict) -> Path:
    """Write ``STEM.json`` into results_dir(), beside bench.compare's results."""
    where = results_dir()
    where.mkdir(parents=True, exist_ok=True)
    path = where / f"{stem}.json"
    path.write_text(json.dumps(payload, indent=2, default=lambda o: asdict(o)))
    return path


# ------------------------------------------------------- command lines, machine, code

def program_of(ap: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """``-- PROG [ARG ...]`` of an A/B harness's command line (``args.prog``, an
    argparse.REMAINDER), checked with its ``--runs``: at least stats.ratio_ci's floor of 5
    rounds (fewer say nothing).  Usage errors exit 2."""
    prog = args.prog[1:] if args.prog[:1] == ["--"] else args.prog
    if not prog:
        ap.error("no program given (-- PROG [ARG ...])")
    if args.runs < 5:
        ap.error("--runs must be at least 5")
    return prog


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def machine_details() -> dict:
    """machine() plus what a skeptic asks about: load averages, governor, memory,
    perf_event_paranoid, whether perf can use hardware events."""
    m = machine()
    m["loadavg"] = list(os.getloadavg())
    gov = _read("/sys/devices/system/cpu/cpu0/cpufreq/scaling_governor")
    m["cpu_governor"] = gov or "unreadable (no cpufreq in sysfs: VM or fixed frequency)"
    m["cpu_mhz"] = None
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("cpu MHz"):
                m["cpu_mhz"] = float(line.split(":", 1)[1])
                break
    except (OSError, ValueError):
        pass
    m["pmu_note"] = ("hardware PMU events available" if m["pmu"] else
                     "no hardware PMU: perf and dbr sample with the cpu-clock software event")
    m["perf_event_paranoid"] = _read("/proc/sys/kernel/perf_event_paranoid")
    try:
        for line in open("/proc/meminfo"):
            if line.startswith(("MemTotal", "MemAvailable")):
                k, v = line.split(":", 1)
                m[k.lower() + "_kb"] = int(v.split()[0])
    except (OSError, ValueError):
        pass
    m["nprocs_running"] = (_read("/proc/loadavg") or "").split(" ")[3:4]
    return m


def code_version() -> dict:
    """Which dbr was measured: git commit and uncommitted changes under the code dirs."""
    repo = Path(__file__).resolve().parents[1]
    out: dict = {}
    try:
        out["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo,
                                       capture_output=True, text=True,
                                       timeout=10).stdout.strip()
        st = subprocess.run(["git", "status", "--porcelain", "--", "dbr_service", "dbr_agent",
                             "shared"], cwd=repo, capture_output=True, text=True,
                            timeout=10).stdout
        out["uncommitted_files"] = len([ln for ln in st.splitlines() if ln.strip()])
    except (OSError, subprocess.SubprocessError):
        out["commit"] = "unknown"
    return out


class Results:
    """``bench/results/latest.json`` (+ ``latest.md`` and PNG plots), written
    incrementally.  Benchmarks of one ``python -m bench`` session (env
    DBR_BENCH_SESSION) share the file, each in its own section; a new session starts
    a fresh file."""

    def __init__(self, directory: Path, session: str, quick: bool, command: list[str]):
        self.dir = Path(directory)
        self.json_path = self.dir / "latest.json"
        self.md_path = self.dir / "latest.md"
        old = None
        try:
            old = json.loads(self.json_path.read_text())
        except (OSError, ValueError):
            pass
        if old and old.get("session") == session:
            self.data = old
        else:
            self.data = {"schema": "dbr.bench/1", "session": session, "quick": quick,
                         "command": command,
                         "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                         "machine": machine_details(), "benchmarks": {}, "plots": []}
            self.data["machine"]["loadavg_start"] = self.data["machine"]["loadavg"]
            self.data["code"] = code_version()

    @classmethod
    def open(cls, quick: bool, command: list[str] | None = None,
             directory: Path | None = None) -> "Results":
        session = os.environ.get("DBR_BENCH_SESSION") or f"{os.getpid()}-{time.time():.0f}"
        cmd = os.environ.get("DBR_BENCH_COMMAND")
        where = directory or results_dir()
        return cls(where, session, quick,
                   cmd.split() if cmd else list(command or ["python", "-m", "bench"]))

    def update(self, section: str, payload: dict) -> None:
        self.data["benchmarks"][section] = payload
        self.data["machine"]["loadavg_now"] = list(os.getloadavg())
        self.data["updated"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self._write(plots=False)

    def finish(self, plots: bool = True) -> None:
        self.data["machine"]["loadavg_end"] = list(os.getloadavg())
        self.data["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self._write(plots=plots)

    def _write(self, plots: bool) -> None:
        from bench import report

        self.dir.mkdir(parents=True, exist_ok=True)
        if plots:
            try:
                self.data["plots"] = [p.name for p in report.plots(self.data, self.dir)]
            except Exception as exc:  # noqa: BLE001 - a plot problem must not lose the data
                self.data["plots_error"] = repr(exc)
        tmp = self.json_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=lambda o: asdict(o)))
        os.replace(tmp, self.json_path)
        tmp = self.md_path.with_suffix(".md.tmp")
        try:
            tmp.write_text(report.markdown(self.data))
        except Exception as exc:  # noqa: BLE001
            tmp.write_text(f"# dbr benchmarks\n\nrendering failed: {exc!r}; see latest.json\n")
        os.replace(tmp, self.md_path)
