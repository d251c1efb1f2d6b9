"""Optimised code built from exact counts against code built from samples, A/B, with
the counting phase's cost apart.

``python -m bench.counting_ab [--pairs N] [--steps S] [--chunk C] [--no-errors]``:
bench/workloads/mislaid_steps.c (examples/mislaid.c's loop, whose good layout depends
on which side of its branch is hot, run in S timed steps of C iterations) runs under
`dbr run --embedded --aggressive` with ``profile=count`` (A) and ``profile=sample``
(B), alternated, then natively, each run's output checked against the native run's.
Printed:

* **steady state**: per run, the median thread CPU time of a step over the steps
  after the region's last replacement (the second half of the steps; a run whose
  counting phase ended later is reported); the ratio A/B per pair, its geometric
  mean, min and max (also of the fastest step's CPU time and the median step's wall
  time), and each side against the native run of its pair.  This is the final
  code's speed alone.  Whether both sides' final code is the same instructions (the
  last code of each region both made, from their ``--jitdump`` files), and each
  side's CPU time beyond as many steady steps (before its final code), count less
  sample.
* **counting phase** (A): how long it lasted (the region record's ``seconds``), how
  many polls the monitor made, the loop's entries counted, how much slower the
  counted loop ran than the final code (its entries per second against the steady
  steps' iterations per second), the work time it lost (its seconds less the time
  the final code takes for those entries), and the replacement's own seconds.
* **whole runs**: wall time of each run, the ratio A/B, the service's CPU.
* **sample error** (unless ``--no-errors``): per end-to-end program run once with
  ``profile=count``, each counted region's sample-inferred count error
  (exact_counts.sample_error) against the exact counts.

Nothing runs off loopback.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import capstone

ROOT = Path(__file__).resolve().parent.parent
E2E = ROOT / "tests" / "e2e_progs"
STEPS = ROOT / "bench" / "workloads" / "mislaid_steps.c"
#: End-to-end programs of the error table: (name, source, gcc flags, arguments).
ERROR_PROGRAMS = (
    ("tripcount -O1", E2E / "tripcount.c", ["-O1"], ["6000000", "70", "130"]),
    ("cpuwork -O2", E2E / "cpuwork.c", ["-O2"], ["3000000"]),
    ("calls -O2", E2E / "calls.c", ["-O2"], ["400"]),
    ("interp -O2", E2E / "interp.c", ["-O2"], ["80"]),
)


@dataclass
class Run:
    """One run under dbr."""

    wall_s: float
    service_cpu_s: float
    step_cpu_ns: list[int]
    step_wall_ns: list[int]
    counting: list[dict] = field(default_factory=list)
    #: Region name -> its last installed code, normalised (:func:`final_code`).
    code: dict[str, tuple] = field(default_factory=dict)

    def steady(self, key: str = "cpu", how=statistics.median) -> float:
        """Median (or ``how``) ns of a step over the second half of the steps."""
        xs = self.step_cpu_ns if key == "cpu" else self.step_wall_ns
        return how(xs[len(xs) // 2:])

    def excess_s(self) -> float:
        """CPU seconds the run's steps took beyond as many steady steps (median): the
        time before the final code went live, counting phase included."""
        return (sum(self.step_cpu_ns) - len(self.step_cpu_ns) * self.steady()) / 1e9

    def steady_from_s(self) -> float:
        """Seconds from the first step's start to the second half's."""
        return sum(self.step_wall_ns[:len(self.step_wall_ns) // 2]) / 1e9


def _build(src: Path, flags: list[str], out: Path) -> Path:
    subprocess.run(["gcc", *flags, "-s", "-o", str(out), str(src)], check=True, timeout=120)
    return out


def _dbr(prog: list[str], profile: str, report: Path, *extra: str
         ) -> tuple[subprocess.CompletedProcess, float, dict]:
    t0 = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "dbr_service.commands.cli", "run", "--embedded",
                          "--aggressive", "--quiet", *extra, "-o", f"profile={profile}",
                          "--report", str(report), "--", *prog], capture_output=True,
                         timeout=900, cwd=ROOT)
    wall = time.monotonic() - t0
    rep = json.loads(report.read_text()) if report.exists() else {}
    return run, wall, rep


_JIT_HEADER = struct.Struct("<IIIIIIQQ")
_JIT_LOAD = struct.Struct("<IIQIIQQQQ")
_MD = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)


_HEX = re.compile(r"0x[0-9a-f]+")


def _rel(v: int, base: int, size: int) -> str:
    """An address in code at ``base`` as its offset there, any other big one as X."""
    return f"@{v - base}" if base <= v < base + size else "X" if v >= 1 << 16 else hex(v)


def final_code(pid: int) -> dict[str, tuple]:
    """The last code the service recorded for each region in ``pid``'s jitdump file
    (dbr_service/installation/jitdump.py), as (mnemonic, operands) with addresses made
    relative to the code's start; the file is removed."""
    path = Path(f"/tmp/jit-{pid}.dump")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return {}
    with os.fdopen(fd, "rb") as f:
        data = f.read(64 << 20)
    path.unlink(missing_ok=True)
    return jit_loads(data)


def jit_loads(data: bytes) -> dict[str, tuple]:
    """Region name -> its last code in a jitdump file's ``data``, normalised."""
    out: dict[str, tuple] = {}
    off = _JIT_HEADER.size
    while off + _JIT_LOAD.size <= len(data):
        rid, size = struct.unpack_from("<II", data, off)
        if size < 8:
            break
        if rid == 0:
            *_, addr, csize, _ = _JIT_LOAD.unpack_from(data, off)
            body = data[off + _JIT_LOAD.size: off + size]
            name, _, rest = body.partition(b"\0")
            out[name.decode(errors="replace")] = tuple(
                (i.mnemonic, _HEX.sub(lambda m, a=addr, n=csize: _rel(int(m[0], 16), a, n),
                                      i.op_str), i.size)
                for i in _MD.disasm(rest[:csize], addr))
        off += size
    return out


def _counted(rep: dict, exe: Path) -> list[dict]:
    return [dict(r["info"]["counting"], region=r["id"], blocks=r["blocks"])
            for c in rep.get("clients", []) if c.get("exe") == str(exe)
            for r in c.get("regions", []) if "counting" in r.get("info", {})]


def _run(exe: Path, args: list[str], profile: str, tmp: Path, want: bytes) -> Run:
    """A run with ``profile``, or natively (``native``)."""
    report = tmp / f"report-{profile}.json"
    report.unlink(missing_ok=True)
    if profile == "native":
        t0 = time.monotonic()
        run = subprocess.run([str(exe), *args], capture_output=True, timeout=900)
        wall, rep = time.monotonic() - t0, {"clients": []}
    else:
        run, wall, rep = _dbr([str(exe), *args], profile, report, "--jitdump")
    if run.returncode != 0 or run.stdout != want:
        raise SystemExit(f"profile={profile}: exit {run.returncode}, output differs: "
                         f"{run.stderr.decode(errors='replace')[-500:]}")
    cpu, wns = [], []
    for line in run.stderr.decode(errors="replace").splitlines():
        f = line.split()
        if len(f) == 4 and f[0] == "step":
            wns.append(int(f[2]))
            cpu.append(int(f[3]))
    if len(cpu) != int(args[0]):
        raise SystemExit(f"profile={profile}: {len(cpu)} step lines, not {args[0]}")
    code = {}
    for c in rep["clients"]:
        code.update(final_code(c["pid"]))
    return Run(wall, sum(c.get("service_cpu_s", 0.0) for c in rep["clients"]), cpu, wns,
               _counted(rep, exe), code)


def _gm(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def _ratio_line(name: str, ratios: list[float]) -> str:
    return (f"{name}: x{_gm(ratios):.3f} (geometric mean of {len(ratios)} pairs; min "
            f"{min(ratios):.3f}, max {max(ratios):.3f}; per pair "
            f"{[round(r, 3) for r in ratios]})")


def _phase(r: Run, chunk: int) -> list[dict]:
    """The counting phases of a count run that ended before the program did, with
    their cost against its steady steps."""
    out = []
    per_ns = chunk / r.steady("wall")          # the final code's iterations per ns
    for c in r.counting:
        if c.get("phase") != "over":
            continue
        n = max(c.get("block_counts", {}).values(), default=0)
        secs = c.get("seconds", 0.0)
        final_s = n / per_ns / 1e9
        out.append({"region": c["region"], "why": c.get("why"), "polls": c.get("polls"),
                    "seconds": secs, "ended_after_s": c.get("ended_after_s"), "entries": n,
                    "slowdown": round(secs / final_s, 1) if final_s > 0 else None,
                    "lost_s": round(secs - final_s, 4),
                    "over_at_s": c.get("over_at_s"), "replace_s": c.get("replace_s"),
                    "late": (c.get("over_at_s") or 0.0) + (c.get("replace_s") or 0.0)
                    > r.steady_from_s()})
    return out


def _steady_lines(rows: dict[str, list[Run]]) -> None:
    a, b, n = rows["count"], rows["sample"], rows["native"]
    for p, rs in rows.items():
        print(f"profile={p}: steady ms/step (CPU, median) "
              f"{[round(r.steady() / 1e6, 3) for r in rs]}; fastest "
              f"{[round(r.steady(how=min) / 1e6, 3) for r in rs]}; wall "
              f"{[round(r.wall_s, 3) for r in rs]} s; service CPU "
              f"{[round(r.service_cpu_s, 3) for r in rs]} s")
    for name, x, y, key, how in (
            ("count/sample, step CPU time (median)", a, b, "cpu", statistics.median),
            ("count/sample, fastest step CPU time", a, b, "cpu", min),
            ("count/sample, step wall time (median)", a, b, "wall", statistics.median),
            ("count/native, step CPU time (median)", a, n, "cpu", statistics.median),
            ("sample/native, step CPU time (median)", b, n, "cpu", statistics.median)):
        print(_ratio_line(f"steady state, {name}",
                          [u.steady(key, how) / v.steady(key, how) for u, v in zip(x, y)]))
    differ = [i for i, (u, v) in enumerate(zip(a, b))
              if not set(u.code) & set(v.code)
              or any(u.code[k] != v.code[k] for k in set(u.code) & set(v.code))]
    print(f"final code: the same instructions from exact and from sampled counts in "
          f"{len(a) - len(differ)} of {len(a)} pairs (the last code of the regions both "
          f"sides made, from the jitdump files)")
    for i in differ:
        for side, r in (("count", a[i]), ("sample", b[i])):
            for name, code in r.code.items():
                print(f"  pair {i} {side} {name}: {len(code)} instructions: "
                      f"{'; '.join(f'{m} {o}' for m, o, _ in code)}")
    for i, (u, v) in enumerate(zip(a, b)):
        if set(u.code) ^ set(v.code):
            print(f"  pair {i}: regions made by one side only: count "
                  f"{sorted(set(u.code) - set(v.code))}, sample "
                  f"{sorted(set(v.code) - set(u.code))}")
    print(f"CPU time beyond the steady state, count - sample: median "
          f"{1e3 * statistics.median(u.excess_s() - v.excess_s() for u, v in zip(a, b)):.1f} "
          f"ms; per pair "
          f"{[round(1e3 * (u.excess_s() - v.excess_s()), 1) for u, v in zip(a, b)]}")
    print(_ratio_line("whole runs, count/sample wall time",
                      [u.wall_s / v.wall_s for u, v in zip(a, b)]))


def ab(pairs: int, steps: int, chunk: int, tmp: Path) -> dict:
    exe = _build(STEPS, ["-O2"], tmp / "mislaid_steps")
    args = [str(steps), str(chunk)]
    want = subprocess.run([str(exe), *args], capture_output=True, check=True,
                          timeout=900).stdout
    rows: dict[str, list[Run]] = {"count": [], "sample": [], "native": []}
    for i in range(pairs):
        for p in (("count", "sample") if i % 2 == 0 else ("sample", "count")) + ("native",):
            rows[p].append(_run(exe, args, p, tmp, want))
    a = rows["count"]
    _steady_lines(rows)
    flat = [ph for r in a for ph in _phase(r, chunk)]
    for ph in flat:
        print(f"counting phase {ph['region']}: {ph['seconds']:.4f} s to its removal "
              f"({ph['ended_after_s']} s to the poll that ended it), {ph['polls']} polls, "
              f"{ph['why']}, {ph['entries']} entries, x{ph['slowdown']} slower than the final "
              f"code, {ph['lost_s'] * 1e3:.1f} ms of work lost; replacement "
              f"{ph['replace_s']} s{' (after the steady steps began)' if ph['late'] else ''}")
    if flat:
        print(f"counting phase: median {statistics.median(p['seconds'] for p in flat):.4f} s, "
              f"median lost {1e3 * statistics.median(p['lost_s'] for p in flat):.1f} ms, "
              f"median replacement {statistics.median(p['replace_s'] or 0 for p in flat):.4f} s")
    left = [(c["region"], c.get("entries"), max(c.get("block_counts", {}).values(), default=0))
            for r in a for c in r.counting if c.get("phase") != "over"]
    for rid, entries, hot in left:
        print(f"counting region {rid} counted to the program's end: {entries} entries, "
              f"hottest block {hot}")
    errs = [c["sample_error"] for r in a for c in r.counting if "sample_error" in c
            and c.get("phase") == "over"]
    return {"mislaid_steps -O2": errs}


def errors(tmp: Path) -> dict[str, list[dict]]:
    """Each error program run once with profile=count: its regions' records."""
    out: dict[str, list[dict]] = {}
    for name, src, flags, args in ERROR_PROGRAMS:
        exe = _build(src, flags, tmp / f"{src.stem}{flags[0]}")
        want = subprocess.run([str(exe), *args], capture_output=True, timeout=900)
        report = tmp / f"errors-{exe.name}.json"
        run, _, rep = _dbr([str(exe), *args], "count", report)
        if run.returncode != want.returncode or run.stdout != want.stdout:
            print(f"{name}: exit {run.returncode}, output differs: "
                  f"{run.stderr.decode(errors='replace')[-300:]}")
            continue
        out[name] = _counted(rep, exe)
    return out


def _fmt(x: float | None) -> str:
    return "–" if x is None else f"{x:.3f}"


def print_errors(per: dict[str, list[dict]], mislaid: list[dict]) -> None:
    print("| program | region | blocks | phase s | block count error | edge count error | "
          "branch directions wrong |")
    print("|---|---|---|---|---|---|---|")
    if mislaid:
        e = [x for x in mislaid if x.get("hot_blocks")]
        print(f"| mislaid_steps -O2 (A/B runs, median of {len(e)}) | r1 | – | – | "
              f"{_fmt(statistics.median(x['block_count_error'] for x in e))} | "
              f"{_fmt(statistics.median(x['edge_count_error'] or 0 for x in e))} | "
              f"{_fmt(statistics.median(x['branch_direction_wrong'] or 0 for x in e))} |")
    for name, recs in per.items():
        for c in recs or [{}]:
            e = c.get("sample_error", {})
            judged = e.get("branches_judged")
            wrong = e.get("branch_direction_wrong")
            print(f"| {name} | {c.get('region', 'none counted')} | {c.get('blocks', '–')} | "
                  f"{c.get('seconds', '–')} | {_fmt(e.get('block_count_error'))} | "
                  f"{_fmt(e.get('edge_count_error'))} | "
                  f"{'–' if wrong is None else f'{wrong:.2f} of {judged}'} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--chunk", type=int, default=25_600_000,
                    help="iterations a step (a multiple of 64)")
    ap.add_argument("--no-errors", action="store_true",
                    help="leave out the per-program sample error table")
    args = ap.parse_args(argv)
    if args.pairs < 1 or args.steps < 2 or args.chunk < 64 or args.chunk % 64:
        ap.error("--pairs >= 1, --steps >= 2, --chunk a positive multiple of 64")
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        mislaid = ab(args.pairs, args.steps, args.chunk, tmp)["mislaid_steps -O2"]
        if not args.no_errors:
            print_errors(errors(tmp), mislaid)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
