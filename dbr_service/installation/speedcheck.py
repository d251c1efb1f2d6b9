"""Speed checks: is a client faster with its new regions than without them?

Sample shares cannot tell: a region can keep every sample and still run slower than
the code it replaces (docs/decisions/0028-speed-checks.md).  A check measures the
program's own progress instead, in alternated phases: the regions patched (as
installed), then suspended (their sites restored, their code kept), and so on,
``pairs`` times each, in the order R O, O R, R O, ... so that a steady drift of the
program's speed falls on both sides alike.  A first phase, with the regions as
installed, is not counted: it tells whether the program can be measured at all, and
it absorbs what the last sampling window and selection job left behind (on xz the
first pair was 10-15 % below the others when it was counted).  Progress is the bytes
the process reads and writes (``rchar`` + ``wchar`` of /proc/PID/io) per second of its CPU time (the
process CPU clock, which counts every thread, ended ones too): for a program that
streams data (a compressor, a server) that is work done per CPU second, immune to
other load on the machine.  A program that does little I/O cannot be measured this
way by I/O.  For it the check counts *progress points* instead
(``dbr_service/installation/progress_points.py``): addresses of original code outside the checked
regions' copies that the program passes equally often per unit of work whichever code
runs, each patched to a counting trampoline for the check's length; progress is then
their passes per CPU second.  A check says which measure it used (``measure``: "io" or
"entries"); one with neither enough I/O nor enough passes ends after the first phase,
which runs the regions as they are.

Verdicts, from the ratio q of replacement over original progress rate in each pair,
through the mean of log q and its 95 % t interval over the pairs (some programs' own
rate varies by 10-15 % from one half second to the next: native xz -1 does, while a
compute loop on the same machine varies by 1 %; the interval makes such a program's
check say "same" instead of a verdict at random):

* ``slower``: the whole interval is below 1 and the ratio (geometric mean) below
  1 - margin.  The service removes the regions and installs no region that copies
  their code again.
* ``faster``: the mirror image.
* ``same``: neither (no difference shown, or one within the margin).  The regions
  stay.
* ``unmeasurable``: a phase did too little I/O (and passed its progress points too
  seldom) or too little CPU, or progress could not be read.  The regions stay, as they
  would without a check.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import dataclass, field

REPLACEMENT = "replacement"
ORIGINAL = "original"

#: A phase must see this much of the program's I/O and CPU time to count.
MIN_IO_BYTES = 256 * 1024
MIN_CPU_S = 0.05
#: Passes of its progress points a phase must see when I/O is too little to count.
MIN_ENTRIES = 1000
IO = "io"
ENTRIES = "entries"
#: Phases the youngest region of a check must have been live for before it starts:
#: regions selected together are checked together.
SETTLE_PHASES = 4

#: A region whose check was abandoned (another region of it was removed meanwhile,
#: or the agent refused a step) while it stayed live is checked again, after the
#: settling time, until this many checks of it were abandoned; then it keeps that
#: verdict, as a region that was never checked would (a lost wake-up or a map that
#: keeps changing must not hold the client's sampling off for good).
CHECK_TRIES = 3

#: Tests only: the progress of replacement phases is counted times this, so that a
#: test can have regions found slower (or faster) on demand.
_TEST_SCALE = float(os.environ.get("DBR_TEST_SPEED_SCALE") or 1.0)

#: Two-sided 95 % quantiles of Student's t by degrees of freedom (a df between two
#: keys takes the lower key's, the wider interval).
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
        9: 2.262, 10: 2.228, 12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042, 60: 2.000,
        120: 1.980}


def t95(df: int) -> float:
    return _T95[max(k for k in _T95 if k <= df)] if df >= 1 else math.inf


def ratio_interval(ratios: list[float]) -> tuple[float, float, float]:
    """Geometric mean of ``ratios`` and its 95 % t interval (from their logs)."""
    logs = [math.log(r) for r in ratios]
    m = statistics.fmean(logs)
    if len(logs) < 2:
        return math.exp(m), 0.0, math.inf
    half = t95(len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(m), math.exp(m - half), math.exp(m + half)


@dataclass(frozen=True)
class Progress:
    """The program's cumulative I/O bytes, CPU time and passes of its progress points
    (None: none counted) at one instant."""

    io_bytes: int
    cpu_ns: int
    entries: int | None = None


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


def verdict_text(verdict: str, ratio: float | None, measure: str | None = None) -> str:
    """A check's verdict as `dbr ctl regions` and `dbr run` show it: "slower x0.912",
    "slower x0.912 by entries" when it counted progress points rather than I/O."""
    return verdict + (f" x{ratio:.3f}" if ratio is not None else "") + \
        (f" by {measure}" if measure == ENTRIES else "")


@dataclass
class PhaseResult:
    kind: str
    io_bytes: int
    cpu_s: float
    entries: int = 0
    measure: str = IO

    @property
    def amount(self) -> int:
        """The work done by the check's measure: bytes of I/O, or progress-point passes."""
        return self.entries if self.measure == ENTRIES else self.io_bytes

    @property
    def rate(self) -> float:
        """Work per CPU second."""
        return self.amount / self.cpu_s if self.cpu_s > 0 else 0.0


@dataclass
class SpeedCheck:
    """One check of a set of regions (their ids in the session's installer)."""

    region_ids: list[int]
    names: list[str]
    pairs: int = 6
    phase_s: float = 0.5
    margin: float = 0.03
    next_at: float = 0.0
    phases: list[PhaseResult] = field(default_factory=list)
    current: str | None = None
    _start: Progress | None = None
    verdict: str | None = None
    why: str = ""
    ratios: list[float] = field(default_factory=list)
    ratio: float | None = None
    interval: tuple[float, float] | None = None
    #: IO or ENTRIES, chosen at the end of the first phase (None until then).
    measure: str | None = None
    #: The progress points counted (original addresses).
    points: list[int] = field(default_factory=list)
    #: The caller can count progress points; once the first phase has shown too little
    #: I/O, ``wants_points`` says so (why it was too little) and the phase runs again.
    may_count: bool = False
    wants_points: str = ""

    @property
    def order(self) -> list[str]:
        """R (not counted), then R O, O R, R O, ...: the regions as installed first."""
        out: list[str] = [REPLACEMENT]
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
        entries = None if at.entries is None or start.entries is None else \
            at.entries - start.entries
        res = PhaseResult(kind, at.io_bytes - start.io_bytes, (at.cpu_ns - start.cpu_ns) / 1e9,
                          entries or 0)
        measure = self.measure or (IO if res.io_bytes >= MIN_IO_BYTES or entries is None
                                   or entries < MIN_ENTRIES else ENTRIES)
        res.measure = measure
        if measure == ENTRIES and entries is None:
            self.stop("unmeasurable", "the progress points could not be read")
            return
        if kind == REPLACEMENT and _TEST_SCALE != 1.0:
            res.io_bytes = int(res.io_bytes * _TEST_SCALE)
            res.entries = int(res.entries * _TEST_SCALE)
        least = MIN_ENTRIES if measure == ENTRIES else MIN_IO_BYTES
        if res.amount < least or res.cpu_s < MIN_CPU_S:
            counted = "" if entries is None else f", {entries} passes of its progress points"
            why = (f"a {self.phase_s:g} s phase saw {res.io_bytes} bytes of I/O{counted} "
                   f"and {res.cpu_s:.3f} s of CPU (at least {MIN_IO_BYTES} bytes or "
                   f"{MIN_ENTRIES} passes, and {MIN_CPU_S:g} s, are needed)")
            if self.may_count and entries is None and res.cpu_s >= MIN_CPU_S:
                # too little I/O: the caller counts progress points, and the first
                # phase runs again with them
                self.may_count, self.wants_points = False, why
                return
            self.stop("unmeasurable", why)
            return
        self.measure = measure
        self.phases.append(res)
        if len(self.phases) == len(self.order):
            self._decide()

    def stop(self, verdict: str, why: str) -> None:
        self.verdict, self.why = verdict, why
        self.current = self._start = None

    def _decide(self) -> None:
        rates = [p.rate for p in self.phases[1:]]   # the first phase is not counted
        kinds = [p.kind for p in self.phases[1:]]
        self.ratios = []
        for i in range(0, len(rates), 2):
            pair = dict(zip(kinds[i:i + 2], rates[i:i + 2]))
            if pair.get(ORIGINAL) and pair.get(REPLACEMENT):
                self.ratios.append(pair[REPLACEMENT] / pair[ORIGINAL])
        if not self.ratios:
            self.stop("unmeasurable", "no pair had progress in both its phases")
            return
        q, lo, hi = ratio_interval(self.ratios)
        self.ratio, self.interval = q, (lo, hi)
        said = (f"x{q:.3f} [{lo:.3f}-{hi:.3f}] of the original code's progress rate "
                f"over {len(self.ratios)} pairs")
        if hi < 1.0 and q < 1.0 - self.margin:
            self.stop("slower", said)
        elif lo > 1.0 and q > 1.0 + self.margin:
            self.stop("faster", said)
        elif lo <= 1.0 <= hi:
            self.stop("same", f"{said}: no difference shown")
        else:
            self.stop("same", f"{said}: within {self.margin:.0%}")

    def summary(self) -> dict:
        return {"regions": list(self.names), "verdict": self.verdict, "why": self.why,
                "measure": self.measure, "points": [hex(p) for p in self.points],
                "ratio": None if self.ratio is None else round(self.ratio, 4),
                "interval": None if self.interval is None else
                [round(x, 4) for x in self.interval],
                "pair_ratios": [round(r, 4) for r in self.ratios],
                "phases": len(self.phases), "phase_s": self.phase_s}
