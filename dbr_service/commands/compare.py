"""`dbr run --compare N`: did PROG get faster under dbr?  N pairs of runs, native and
under dbr, alternated, and the ratio of their wall times with its interval.

* One native run first, not counted (it warms the page cache and the CPUs' clocks).
* Pair k runs native then dbr for even k, dbr then native for odd k, so a machine
  that slows down or speeds up over the comparison does not favour either side.
* Every run's standard output is hashed (and discarded, as hyperfine does); its
  standard error goes to /dev/null.  A dbr run whose output or exit status differs
  from the first native run's is reported, and `dbr run` then exits 1.
* The ratio is dbr's wall time over native's, per pair; the figure given is their
  median with a distribution-free interval of the median (binomial order statistics,
  at least 95 % where N allows it, else [min, max] with the confidence it has).  An
  interval wholly below 1 says faster, wholly above 1 slower, else "no difference
  resolved" at this N.
* The dbr runs are served by one service, up for the whole comparison (the deployed
  case: a host where dbr runs); the summary says what dbr did in them.
"""

from __future__ import annotations

import hashlib
import math
import os
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

#: Most pairs one comparison runs.
MAX_PAIRS = 1000


@dataclass
class Run:
    """One timed run of PROG."""

    config: str             # "native" or "dbr"
    wall_s: float
    exit_code: int
    out_hash: str
    pid: int
    report: list[dict[str, Any]] = field(default_factory=list)   # dbr runs: client entries
    #: user + sys of PROG and the children it waited for (wait4 rusage)
    cpu_s: float = 0.0


def median_interval(xs: list[float], level: float = 0.95) -> tuple[float, float, float]:
    """``(low, high, confidence)``: the widest-needed order-statistic interval of the
    median of ``xs`` with confidence at least ``level``; with too few values, [min, max]
    and the confidence that has (1 - 2**(1-n))."""
    s = sorted(xs)
    n = len(s)
    if n == 0:
        raise ValueError("no values")
    # P(the median lies in [s[j], s[n-1-j]]) = 1 - 2 P(Bin(n, 1/2) <= j)
    j, best = 0, 1.0 - 2.0 * 0.5 ** n
    for k in range(1, (n + 1) // 2):
        cover = 1.0 - 2.0 * sum(math.comb(n, i) for i in range(k + 1)) / 2.0 ** n
        if cover < level:
            break
        j, best = k, cover
    return s[j], s[n - 1 - j], (best if n > 1 else 0.0)


def verdict(low: float, high: float) -> str:
    if high < 1.0:
        return "faster under dbr"
    if low > 1.0:
        return "slower under dbr"
    return "no difference resolved"


def time_run(prog: list[str], env: Mapping[str, str], config: str) -> Run:
    """Run PROG once: wall time from spawn to exit, exit status, hash of its output."""
    with tempfile.TemporaryFile() as out:
        t0 = time.monotonic()
        try:
            proc = subprocess.Popen(prog, env=dict(env), stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.DEVNULL)
        except OSError as exc:
            raise CompareError(f"cannot run {prog[0]}: {exc}") from exc
        _, status, ru = os.wait4(proc.pid, 0)
        wall = time.monotonic() - t0
        rc = proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        digest = hashlib.sha256()
        for chunk in iter(lambda: out.read(1 << 20), b""):
            digest.update(chunk)
    return Run(config, wall, 128 - rc if rc < 0 else rc, digest.hexdigest(), proc.pid,
               cpu_s=ru.ru_utime + ru.ru_stime)


class CompareError(Exception):
    """PROG cannot be run at all."""


def run_pairs(prog: list[str], pairs: int, native_env: Mapping[str, str],
              dbr_env: Mapping[str, str],
              report_of: Callable[[int], list[dict[str, Any]]],
              progress: Callable[[str], None] = lambda _t: None) -> dict[str, Any]:
    """The comparison's runs and its result (see the module's docstring)."""
    if not 1 <= pairs <= MAX_PAIRS:
        raise ValueError(f"pairs must be 1..{MAX_PAIRS}")
    warm = time_run(prog, native_env, "native")
    progress(f"warm-up native run: {warm.wall_s:.3f} s, exit {warm.exit_code}")
    runs: list[tuple[Run, Run]] = []
    for k in range(pairs):
        order = ("native", "dbr") if k % 2 == 0 else ("dbr", "native")
        got: dict[str, Run] = {}
        for config in order:
            r = time_run(prog, native_env if config == "native" else dbr_env, config)
            if config == "dbr":
                r.report = report_of(r.pid)
            got[config] = r
        runs.append((got["native"], got["dbr"]))
        progress(f"pair {k + 1}/{pairs}: native {got['native'].wall_s:.3f} s, "
                 f"dbr {got['dbr'].wall_s:.3f} s")
    return summarize(warm, runs)


def summarize(warm: Run, runs: list[tuple[Run, Run]]) -> dict[str, Any]:
    ratios = [d.wall_s / n.wall_s for n, d in runs if n.wall_s > 0]
    low, high, conf = median_interval(ratios) if ratios else (math.nan, math.nan, 0.0)
    differ = [{"pair": k + 1, "config": r.config, "exit_code": r.exit_code,
               "output_differs": r.out_hash != warm.out_hash}
              for k, pair in enumerate(runs) for r in pair
              if r.exit_code != warm.exit_code or r.out_hash != warm.out_hash]
    clients = [c for _, d in runs for c in d.report]
    after = sum(c.get("samples_after_first_patch") or 0 for c in clients)
    firsts = [c["time_to_first_patch_s"] for c in clients
              if c.get("time_to_first_patch_s") is not None]
    return {
        "pairs": len(runs),
        "native_s": [round(n.wall_s, 4) for n, _ in runs],
        "dbr_s": [round(d.wall_s, 4) for _, d in runs],
        "ratios": [round(x, 4) for x in ratios],
        "ratio_median": round(statistics.median(ratios), 4) if ratios else None,
        "ratio_interval": [round(low, 4), round(high, 4)] if ratios else None,
        "confidence": round(conf, 4),
        "verdict": verdict(low, high) if ratios else "no runs",
        "exit_code": warm.exit_code,
        "mismatches": differ,
        "dbr_did": {
            "runs_patched": sum(1 for _, d in runs
                                if any(c.get("patches_installed") for c in d.report)),
            "regions_went_live": sum(c.get("regions_went_live") or 0 for c in clients),
            "samples_after_first_patch": after,
            "samples_in_replacement": sum(c.get("samples_in_replacement") or 0
                                          for c in clients),
            "first_patch_s_median": round(statistics.median(firsts), 3) if firsts else None,
            "service_cpu_s": round(sum(c.get("service_cpu_s") or 0.0 for c in clients), 3),
            # the program's own CPU, from wait4: the service's last look at a client
            # that dbr run reaps at once can come before its end
            "client_cpu_s": round(sum(d.cpu_s for _, d in runs), 3),
        },
    }


def format_compare(res: dict[str, Any]) -> str:
    """Three or four lines for stderr."""
    n = res["pairs"]
    if not res["ratios"]:
        return "dbr: compare: no pair was timed"
    nat, dbr = statistics.median(res["native_s"]), statistics.median(res["dbr_s"])
    low, high = res["ratio_interval"]
    lines = [f"dbr: compare, {n} pair(s) alternated: native {nat:.3f} s "
             f"[{min(res['native_s']):.3f}-{max(res['native_s']):.3f}], dbr {dbr:.3f} s "
             f"[{min(res['dbr_s']):.3f}-{max(res['dbr_s']):.3f}] (median [min-max])",
             f"dbr: dbr/native x{res['ratio_median']:.3f} [{low:.3f}-{high:.3f}] "
             f"({res['confidence']:.0%} interval of the median): {res['verdict']}"]
    if res["confidence"] < 0.95:
        lines[-1] += f"; {n} pair(s) give no 95 % interval, 6 or more do"
    did = res["dbr_did"]
    after = did["samples_after_first_patch"]
    share = did["samples_in_replacement"] / after if after else 0.0
    cpu = did["client_cpu_s"]
    svc = f"{did['service_cpu_s'] / cpu:.1%} of its CPU" if cpu else "no CPU measured"
    if did["runs_patched"]:
        lines.append(f"dbr: in the dbr runs: {did['runs_patched']} of {n} patched, "
                     f"{did['regions_went_live']} region(s) went live, first patch after "
                     f"{did['first_patch_s_median']:.2f} s (median), {share:.0%} of the "
                     f"samples since then in replacement code; service {svc}")
    else:
        lines.append(f"dbr: in the dbr runs: nothing was patched (nothing hot enough, or "
                     f"the runs ended first); service {svc}")
    if res["mismatches"]:
        m = res["mismatches"][0]
        what = "its output differs" if m["output_differs"] else f"exit {m['exit_code']}"
        lines.append(f"dbr: {len(res['mismatches'])} run(s) differ from the first native run "
                     f"(exit {res['exit_code']}); the first: pair {m['pair']}, {m['config']}: "
                     f"{what}")
    return "\n".join(lines)
