"""Shared benchmark machinery: alternate A/B runs, take medians, report ratios,
record the machine, write results under bench/results/."""

from __future__ import annotations

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


def write_results(stem: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{stem}.json"
    path.write_text(json.dumps(payload, indent=2, default=lambda o: asdict(o)))
    return path
