"""Statistics of the benchmarks: the spread of a sample, paired ratios to native with
their bootstrap and order-statistic intervals, verdicts against a limit, geometric
means, shares of a reference's gain, and a server's throughput ratio after the first
patch.  Pure functions (no tools, no files), checked by tests/*/test_bench_*.py."""

from __future__ import annotations

import math
import random
import statistics
from typing import Iterable, Sequence

from dbr_service.commands.compare import median_interval as _median_interval

# ------------------------------------------------------------------ one sample

def spread(xs: Sequence[float]) -> dict:
    """Median with its spread: n, min, q1, median, q3, max (IQR = q3 - q1)."""
    xs = sorted(xs)
    if not xs:
        return {"n": 0}
    if len(xs) >= 2:
        q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    else:
        q1 = q3 = xs[0]
    return {"n": len(xs), "min": xs[0], "q1": q1, "median": statistics.median(xs), "q3": q3,
            "max": xs[-1]}


def geomean(xs: Iterable[float | None]) -> float | None:
    xs = [x for x in xs if x is not None and x > 0]
    if not xs:
        return None
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


# ------------------------------------------------------------------ paired rounds

def paired_ratios(cfg: Sequence[float | None], native: Sequence[float | None]) -> list[float]:
    """Per pair, config over native (pairs where either side is missing are left out)."""
    out = []
    for c, n in zip(cfg, native):
        if c is None or n is None or n <= 0 or c <= 0:
            continue
        out.append(c / n)
    return out


def ratio_ci(pairs: Sequence[tuple[float, float]], level: float = 0.95,
             resamples: int = 4000, seed: int = 1) -> tuple[float, float] | None:
    """Bootstrap confidence interval of median(a) / median(b) over paired rounds
    ``(a, b)``: rounds are resampled whole, so what hit both runs of a round (load,
    drift) stays paired.  Percentile method, fixed seed (the same data give the same
    interval).  None with fewer than 5 rounds: too few to say anything."""
    pairs = [(a, b) for a, b in pairs if b > 0]
    if len(pairs) < 5:
        return None
    rng = random.Random(seed)
    n = len(pairs)
    stats = []
    for _ in range(resamples):
        sample = [pairs[rng.randrange(n)] for _ in range(n)]
        mb = statistics.median(b for _, b in sample)
        stats.append(statistics.median(a for a, _ in sample) / mb)
    stats.sort()
    tail = (1.0 - level) / 2
    return stats[int(tail * (resamples - 1))], stats[int((1 - tail) * (resamples - 1))]


def versus(cfg: Sequence[float], native: Sequence[float]) -> dict:
    """A configuration's alternated rounds against native's (same length, round by
    round): ``ratio`` (median over median), ``paired`` (median of the per-round
    ratios) and ``ci95`` (ratio_ci of the rounds, None under 5 of them)."""
    return {"ratio": statistics.median(cfg) / statistics.median(native),
            "paired": statistics.median(paired_ratios(cfg, native)),
            "ci95": ratio_ci(list(zip(cfg, native)))}


def by_patch(pairs: list[tuple[float, float]], patched: list[bool | None]) -> dict:
    """The paired rounds split by whether the dbr run had code installed: for each side,
    its rounds, the ratio of medians and its interval.  With default settings only some
    runs are patched (short runs are born late).  Not the code's own effect: a run gets
    code only if it lasts until the service's first job ends, so runs the machine slowed
    are patched more often (patched rounds can look slower for that reason alone); a
    program under two services, one with ``patching=false`` (bench.service_ab), measures
    the code's own effect."""
    out: dict = {}
    for key, want in (("patched", True), ("unpatched", False)):
        side = [pr for pr, p in zip(pairs, patched) if p is want]
        if not side:
            continue
        nb = statistics.median(b for _, b in side)
        ci = ratio_ci(side)
        out[key] = {"rounds": len(side),
                    "ratio": statistics.median(a for a, _ in side) / nb if nb else None,
                    "ratio_ci95": list(ci) if ci else None}
    return out


def verdict(ci: tuple[float, float] | None, limit: float) -> str:
    """Whether a ratio is within ``limit`` (e.g. 1.01), from its confidence interval:
    ``met`` (the whole interval at or under), ``missed`` (the whole interval over),
    ``undecided`` (the interval spans the limit: more or quieter rounds needed)."""
    if ci is None:
        return "undecided"
    if ci[1] <= limit:
        return "met"
    if ci[0] > limit:
        return "missed"
    return "undecided"


def median_interval(xs: Sequence[float], level: float = 0.95) -> dict | None:
    """Order-statistic (sign-test) interval for the median, as `dbr run --compare`
    gives it (dbr_service.commands.compare.median_interval): [x_(k), x_(n+1-k)] with the largest
    k whose coverage is at least ``level``; with too few values for ``level`` (n <= 5
    at 95 %) the min–max interval and its actual coverage, then below ``level`` (n=5:
    93.8 %).  None for n < 2."""
    if len(xs) < 2:
        return None
    lo, hi, cover = _median_interval(list(xs), level)
    return {"lo": lo, "hi": hi, "coverage": cover, "level_met": cover >= level - 1e-12}


def summarize(ratios: Sequence[float]) -> dict:
    """Median, min, max and the median's interval of per-pair ratios."""
    if not ratios:
        return {"n": 0}
    out = {"n": len(ratios), "median": statistics.median(ratios), "min": min(ratios),
           "max": max(ratios)}
    ci = median_interval(ratios)
    if ci:
        out["ci"] = ci
    return out


#: Below this gain (1 - ratio) a reference's gain is within run-to-run noise and a share
#: of it means nothing (a 0.5 % gain would turn a 5 % loss into -1000 %).
MIN_REF_GAIN = 0.01


def share_of_gain(dbr_ratio: float | None, ref_ratio: float | None) -> float | None:
    """What part of a reference's gain (BOLT's, PGO's) dbr captures: (1 - dbr) / (1 - ref).
    1.0 = as much as the reference, 0 = none, negative = dbr slower than native.  None
    when either is unknown or the reference gains less than MIN_REF_GAIN."""
    if dbr_ratio is None or ref_ratio is None or 1.0 - ref_ratio < MIN_REF_GAIN:
        return None
    return (1.0 - dbr_ratio) / (1.0 - ref_ratio)


# ------------------------------------------------------------------ servers

def window_mean(slices: Sequence[dict], t0: float, t1: float | None = None) -> float | None:
    """Requests per second over the slices that start at or after ``t0`` (and end by
    ``t1`` when given): total requests over total slice time, or None without any.
    A slice is ``{"start": s, "end": s, "requests": n}`` (seconds from the server's
    start)."""
    req = dur = 0.0
    for s in slices:
        if s["start"] + 1e-9 < t0 or (t1 is not None and s["end"] > t1 + 1e-9):
            continue
        if s.get("requests") is None or s["end"] <= s["start"]:
            continue
        req += s["requests"]
        dur += s["end"] - s["start"]
    return req / dur if dur > 0 else None


def server_pair_ratio(cfg_slices: Sequence[dict], native_slices: Sequence[dict],
                      first_patch_s: float | None) -> dict:
    """Throughput of a configuration over native's in the same window of the run: from
    the configuration's first patch (seconds from its server's start) to the end, or
    the whole run when it installed nothing (``after_patch`` says which).  A native run
    with no slice in that window gives no ratio."""
    end = min((max((s["end"] for s in cfg_slices), default=0.0),
               max((s["end"] for s in native_slices), default=0.0)))
    t0 = first_patch_s if first_patch_s is not None else 0.0
    after = first_patch_s is not None
    note = ""
    if after and (window_mean(cfg_slices, t0, end) is None
                  or window_mean(native_slices, t0, end) is None):
        # patched too late for a whole slice of load after it: the whole run
        t0, after = 0.0, False
        note = f"first patch at {first_patch_s:.1f} s, after the last whole slice"
    c = window_mean(cfg_slices, t0, end)
    n = window_mean(native_slices, t0, end)
    ratio = (c / n) if (c is not None and n) else None
    return {"ratio": ratio, "cfg_rps": c, "native_rps": n, "window_start_s": t0,
            "after_patch": after, "note": note}
