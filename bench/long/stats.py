"""Statistics of the long benchmark: paired ratios to native, their median and spread,
a distribution-free interval for the median, geometric means over workloads, and the
server workload's throughput ratio after the first patch.  Pure functions (no tools,
no files), so tests/test_bench_long.py checks them in milliseconds."""

from __future__ import annotations

import math
import statistics
from typing import Iterable, Sequence


def paired_ratios(cfg: Sequence[float | None], native: Sequence[float | None]) -> list[float]:
    """Per pair, config over native (pairs where either side is missing are left out)."""
    out = []
    for c, n in zip(cfg, native):
        if c is None or n is None or n <= 0 or c <= 0:
            continue
        out.append(c / n)
    return out


def _binom_cdf(k: int, n: int) -> float:
    """P(X <= k), X ~ Binomial(n, 1/2)."""
    if k < 0:
        return 0.0
    return sum(math.comb(n, i) for i in range(0, min(k, n) + 1)) / 2 ** n


def median_interval(xs: Sequence[float], level: float = 0.95) -> dict | None:
    """Order-statistic (sign-test) interval for the median: [x_(k), x_(n+1-k)] with
    the largest k whose coverage 1 - 2 P(Binom(n, 1/2) <= k-1) is at least ``level``.
    With too few values for ``level`` (n <= 5 at 95 %) it is the min–max interval and
    its actual coverage, which is then below ``level`` (n=5: 93.8 %).  None for n < 2."""
    xs = sorted(xs)
    n = len(xs)
    if n < 2:
        return None
    best = 1
    for k in range(1, n // 2 + 1):
        if 1 - 2 * _binom_cdf(k - 1, n) >= level:
            best = k
        else:
            break
    cover = 1 - 2 * _binom_cdf(best - 1, n)
    return {"lo": xs[best - 1], "hi": xs[n - best], "coverage": cover,
            "level_met": cover >= level - 1e-12}


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


def geomean(xs: Iterable[float | None]) -> float | None:
    xs = [x for x in xs if x is not None and x > 0]
    if not xs:
        return None
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


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
