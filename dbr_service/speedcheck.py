"""Speed checks: is a client faster with its new regions than without them?

Sample shares cannot tell: a region can keep every sample and still run slower than
the code it replaces (docs/design-notes.md, "Speed checks").  A check measures the
program's own progress instead, in alternated phases: the regions patched (as
installed), then suspended (their sites restored, their code kept), and so on,
``pairs`` times each, in the order R O, O R, R O, ... so that a steady drift of the
program's speed falls on both sides alike.  Progress is the bytes the process reads
and writes (``rchar`` + ``wchar`` of /proc/PID/io) per second of its CPU time (the
process CPU clock, which counts every thread, ended ones too): for a program that
streams data (a compressor, a server) that is work done per CPU second, immune to
other load on the machine.  A program that does little I/O cannot be measured this
way; its check ends after the first phase, which runs the regions as they are.

Verdicts, from the ratio q of replacement over original progress rate in each pair:

* ``slower``: the median q is below 1 - margin and at most one pair says otherwise.
  The service removes the regions and installs no region at their entries again.
* ``faster``: the median q is above 1 + margin and at most one pair says otherwise.
* ``same``: neither.  The regions stay (they cost nothing measurable).
* ``unmeasurable``: a phase did too little I/O or CPU, or progress could not be
  read.  The regions stay, as they would without a check.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field

REPLACEMENT = "replacement"
ORIGINAL = "original"

#: A phase must see this much of the program's I/O and CPU time to count.
MIN_IO_BYTES = 256 * 1024
MIN_CPU_S = 0.05
#: Phases the youngest region of a check must have been live for before it starts:
#: regions selected together are checked together.
SETTLE_PHASES = 4

#: Tests only: the progress of replacement phases is counted times this, so that a
#: test can have regions found slower (or faster) on demand.
_TEST_SCALE = float(os.environ.get("DBR_TEST_SPEED_SCALE") or 1.0)


@dataclass(frozen=True)
class Progress:
    """The program's cumulative I/O bytes and CPU time at one instant."""

    io_bytes: int
    cpu_ns: int


def cpu_clock_id(pid: int) -> int:
    """The clock id of a process's CPU clock (CPUCLOCK_SCHED, whole process)."""
    return ((~pid) << 3) | 2


def read_progress(pid: int) -> Progress | None:
    """rchar + wchar of /proc/PID/io and the process's CPU time; None if unreadable
    (the process is gone, or /proc/PID/io is not ours to read)."""
    try:
        with open(f"/proc/{pid}/io") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        io = int(fields["rchar"]) + int(fields["wchar"])
        cpu = time.clock_gettime_ns(cpu_clock_id(pid))
    except (OSError, KeyError, ValueError):
        return None
    return Progress(io, cpu)


@dataclass
class PhaseResult:
    kind: str
    io_bytes: int
    cpu_s: float

    @property
    def rate(self) -> float:
        """Bytes of I/O per CPU second."""
        return self.io_bytes / self.cpu_s if self.cpu_s > 0 else 0.0


@dataclass
class SpeedCheck:
    """One check of a set of regions (their ids in the session's installer)."""

    region_ids: list[int]
    names: list[str]
    pairs: int = 6
    phase_s: float = 0.5
    margin: float = 0.03
    started: float = field(default_factory=time.monotonic)
    next_at: float = 0.0
    phases: list[PhaseResult] = field(default_factory=list)
    current: str | None = None
    _start: Progress | None = None
    verdict: str | None = None
    why: str = ""
    ratios: list[float] = field(default_factory=list)
    ratio: float | None = None

    @property
    def order(self) -> list[str]:
        """R O, O R, R O, ...: the first phase runs the regions as installed."""
        out: list[str] = []
        for i in range(self.pairs):
            out += [REPLACEMENT, ORIGINAL] if i % 2 == 0 else [ORIGINAL, REPLACEMENT]
        return out

    @property
    def done(self) -> bool:
        return self.verdict is not None

    def next_kind(self) -> str | None:
        """What the regions must be for the next phase (None: the check is over)."""
        if self.done:
            return None
        order = self.order
        return order[len(self.phases)] if len(self.phases) < len(order) else None

    def begin(self, kind: str, at: Progress | None, now: float) -> None:
        """A phase of ``kind`` starts (the regions were just set to it)."""
        if at is None:
            self.stop("unmeasurable", "the program's progress could not be read")
            return
        self.current, self._start = kind, at
        self.next_at = now + self.phase_s

    def end(self, at: Progress | None) -> None:
        """The running phase ends; the verdict once the last one has."""
        kind, start = self.current, self._start
        self.current = self._start = None
        if kind is None or start is None:
            return
        if at is None:
            self.stop("unmeasurable", "the program's progress could not be read")
            return
        res = PhaseResult(kind, at.io_bytes - start.io_bytes, (at.cpu_ns - start.cpu_ns) / 1e9)
        if kind == REPLACEMENT and _TEST_SCALE != 1.0:
            res.io_bytes = int(res.io_bytes * _TEST_SCALE)
        if res.io_bytes < MIN_IO_BYTES or res.cpu_s < MIN_CPU_S:
            self.stop("unmeasurable",
                      f"a {self.phase_s:g} s phase saw {res.io_bytes} bytes of I/O and "
                      f"{res.cpu_s:.3f} s of CPU (at least {MIN_IO_BYTES} and {MIN_CPU_S:g} "
                      f"are needed)")
            return
        self.phases.append(res)
        if len(self.phases) == len(self.order):
            self._decide()

    def stop(self, verdict: str, why: str) -> None:
        self.verdict, self.why = verdict, why
        self.current = self._start = None

    def _decide(self) -> None:
        rates = [p.rate for p in self.phases]
        kinds = [p.kind for p in self.phases]
        self.ratios = []
        for i in range(0, len(rates), 2):
            pair = dict(zip(kinds[i:i + 2], rates[i:i + 2]))
            if pair.get(ORIGINAL):
                self.ratios.append(pair[REPLACEMENT] / pair[ORIGINAL])
        if not self.ratios:
            self.stop("unmeasurable", "no pair had progress in its original phase")
            return
        q = self.ratio = statistics.median(self.ratios)
        below = sum(1 for r in self.ratios if r < 1.0)
        above = len(self.ratios) - below
        allowed = max(0, len(self.ratios) - 1)
        if q < 1.0 - self.margin and below >= allowed:
            self.stop("slower", f"x{q:.3f} of the original code's progress rate "
                                f"({below} of {len(self.ratios)} pairs slower)")
        elif q > 1.0 + self.margin and above >= allowed:
            self.stop("faster", f"x{q:.3f} of the original code's progress rate "
                                f"({above} of {len(self.ratios)} pairs faster)")
        else:
            self.stop("same", f"x{q:.3f} of the original code's progress rate, within "
                              f"{self.margin:.0%} or not consistent across "
                              f"{len(self.ratios)} pairs")

    def summary(self) -> dict:
        return {"regions": list(self.names), "verdict": self.verdict, "why": self.why,
                "ratio": None if self.ratio is None else round(self.ratio, 4),
                "pair_ratios": [round(r, 4) for r in self.ratios],
                "phases": len(self.phases), "phase_s": self.phase_s}
