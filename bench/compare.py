"""Where dbr stands against the alternatives, per workload.

The configurations of ``bench/configs.py`` (native, dbr, dbr-host, dbr-preload,
thread-only, dbr-sampling, perf, valgrind, pgo), side by side on every workload of
``bench/suite.py``; one run is ``bench/runner.py``'s ``run_once``.

All the configurations of a workload run in alternation (round i starts at config i
mod k, so drift and periodic load hit every config alike) after one warm-up run of
each; we report medians, min/max and IQR, and ratios to native (median over median,
plus the range of per-round paired ratios).  Every run's stdout and output files are
hashed: a configuration whose output differs from native's is a FAILURE (loud, and
the benchmark exits non-zero), never a data point.  Results are written after every
workload, so a crash or an interrupt still leaves the partial JSON and table.

usage: python -m bench.compare [--quick] [--runs N] [--configs a,b] [WORKLOAD...]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from bench import suite
from bench.common import Results
from bench.configs import Config, Native, default_configs, select_configs
from bench.runner import Run, describe_exit, exit_on_sigterm, last_line, run_once
from bench.stats import by_patch, ratio_ci, spread

REPO = Path(__file__).resolve().parents[1]


def log(msg: str) -> None:
    print(msg, flush=True)


def warn(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# Issue 5's target: "no workload slower than native by more than 1 %" with default
# settings.  The default, deployed form is the program under a host service with the
# agent preloaded (dbr-preload); `dbr run` adds its own start-up to every run.
TARGET = {"limit": 1.01, "configs": ["dbr-preload"], "level": 0.95}


# ------------------------------------------------------------------ settings

@dataclass
class Settings:
    quick: bool = False
    runs: int = 5
    warmup: int = 1
    valgrind_runs: int = 2
    timeout_factor: float = 20.0  # a run taking this many times native's is killed
    min_timeout: float = 60.0
    pgo_helps: float = 0.98       # PGO ratio at or below this counts as a gain
    valgrind_budget_s: float = 25.0  # no second valgrind round after this long

    @classmethod
    def for_mode(cls, quick: bool, runs: int | None = None) -> "Settings":
        if quick:
            # no warm-up rounds: the native reference run and each tool's availability
            # smoke run have already warmed the page cache
            return cls(quick=True, runs=runs or 3, warmup=0, valgrind_runs=1)
        return cls(quick=False, runs=runs or 5, warmup=1, valgrind_runs=2)


# ------------------------------------------------------------------ one workload

class Cell:
    """Runs and status of one configuration on one workload."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.runs: list[Run] = []
        self.status = "ok"
        self.message = ""
        self.hung: list[dict] = []   # a timed-out run's threads (session_threads)

    @property
    def live(self) -> bool:
        return self.status == "ok"


def _check_run(cell: Cell, r: Run, ref_code: int, ref_digest: str, wname: str) -> None:
    if r.timed_out:
        cell.status, cell.message = "timeout", f"killed after {r.wall:.1f} s"
        cell.hung = r.hung
        for t in r.hung:   # on stderr too: a hang is a bug to chase, not just a status
            warn(f"   hung: pid {t['pid']} tid {t['tid']} {t['comm']} {t['state']} "
                 f"wchan={t.get('wchan', '?')} syscall={t.get('syscall', '?')}")
    elif r.exit_code != ref_code:
        cell.status = "crashed"
        cell.message = (f"{describe_exit(r.exit_code)} (native: {describe_exit(ref_code)}): "
                        f"{last_line(r.stderr_tail)}")
    elif r.digest != ref_digest:
        cell.status = "FAILURE"
        cell.message = "output differs from native (stdout/output-file hash mismatch)"
    else:
        cell.runs.append(r)
        return
    loud = "!! FAILURE" if cell.status == "FAILURE" else f"!! {cell.status}"
    warn(f"{loud}: {wname} under {cell.cfg.name}: {cell.message}")


def alternate(cells: list[Cell], prep: suite.Prepared, argv_of: Callable[[Cell], list[str]],
              env: dict[str, str], work: Path, runs: int, warmup: int, timeout: float,
              ref: tuple[int, str], wname: str,
              budget_s: float | None = None) -> list[list[tuple[str, float]]]:
    """Round-robin the live cells, rotating the starting config every round; returns the
    per-round walls (config name, seconds) for paired ratios.  With ``budget_s``, no new
    round starts once that much time has gone (at least one recorded round runs)."""
    rounds: list[list[tuple[str, float]]] = []
    t0 = time.monotonic()
    for i in range(warmup + runs):
        if budget_s is not None and rounds and time.monotonic() - t0 > budget_s:
            break
        live = [c for c in cells if c.live]
        if not live:
            break
        k = i % len(live)
        order = live[k:] + live[:k]
        this: list[tuple[str, float]] = []
        for cell in order:
            if not cell.live:
                continue
            r = run_once(cell.cfg.command(argv_of(cell), prep, work), cell.cfg.environ(env),
                         work / "run", prep.outputs, timeout)
            r.extra = cell.cfg.collect(work, r)
            if i < warmup:  # warm-up: checked, not recorded
                before = len(cell.runs)
                _check_run(cell, r, *ref, wname)
                del cell.runs[before:]
                continue
            _check_run(cell, r, *ref, wname)
            if cell.live:
                r.round = len(rounds)
                this.append((cell.cfg.name, r.wall))
        if i >= warmup:
            rounds.append(this)
    return rounds


def cell_json(cell: Cell, native: Cell | None, rounds: list[list[tuple[str, float]]]) -> dict:
    out: dict[str, Any] = {"status": cell.status, "what": cell.cfg.what}
    if cell.message:
        out["message"] = cell.message
    if cell.hung:
        out["hung_threads"] = cell.hung
    if not cell.runs:
        return out
    walls = [r.wall for r in cell.runs]
    out["runs"] = len(walls)
    out["wall_s"] = spread(walls)
    out["cpu_s"] = spread([r.cpu_s for r in cell.runs])
    out["maxrss_kb"] = max(r.maxrss_kb for r in cell.runs)
    if native is not None and native.runs and cell is not native:
        nw = statistics.median(r.wall for r in native.runs)
        ncpu = statistics.median(r.cpu_s for r in native.runs)
        out["ratio"] = out["wall_s"]["median"] / nw if nw else None
        out["cpu_ratio"] = out["cpu_s"]["median"] / ncpu if ncpu else None
        pairs, patched = [], []
        by_round = {r.round: r for r in cell.runs if r.round >= 0}
        for i, rnd in enumerate(rounds):
            d = dict(rnd)
            if cell.cfg.name in d and native.cfg.name in d and d[native.cfg.name] > 0:
                pairs.append((d[cell.cfg.name], d[native.cfg.name]))
                patched.append(run_patched(by_round.get(i)))
        if pairs:
            out["paired_ratio"] = spread([a / b for a, b in pairs])
            out["paired_walls"] = [[round(a, 6), round(b, 6)] for a, b in pairs]  # raw data
            ci = ratio_ci(pairs)
            if ci is not None:
                out["ratio_ci95"] = list(ci)
            if any(p is not None for p in patched):
                out["paired_patched"] = patched  # per pair: code installed in that run
                out["by_patch"] = by_patch(pairs, patched)
        out["extra_cpu_s"] = out["cpu_s"]["median"] - ncpu
    reports = [r.extra["report"] for r in cell.runs if "report" in r.extra]
    errors = [r.extra["report_error"] for r in cell.runs if "report_error" in r.extra]
    if reports or errors:
        out["dbr"] = dbr_metrics(reports, errors, out)
        pw = out["dbr"].get("prog_wall_s")
        if pw is not None and out.get("ratio"):
            # PROG's own wall time (dbr run's start-up, report and shutdown excluded)
            out["dbr"]["prog_ratio"] = pw / (out["wall_s"]["median"] / out["ratio"])
    return out


def run_patched(r: Run | None) -> bool | None:
    """Whether dbr installed code in run ``r`` (its report's time to first patch), or
    None when the run has no report (not a dbr config, or the report failed)."""
    if r is None:
        return None
    rep = r.extra.get("report")
    if not isinstance(rep, dict):
        return r.extra.get("patched")  # False where the service had no session for it
    return rep.get("time_to_first_patch_s") is not None


def _med(xs: list) -> float | None:
    xs = [x for x in xs if isinstance(x, (int, float))]
    return statistics.median(xs) if xs else None


def dbr_metrics(reports: list[dict], errors: list[str], cell: dict) -> dict:
    m: dict[str, Any] = {"reports": len(reports)}
    if errors:
        m["report_errors"] = errors[:3]
    if not reports:
        return m
    ttfp = [r["time_to_first_patch_s"] for r in reports]
    m["runs_patched"] = sum(1 for t in ttfp if t is not None)
    m["region_status"] = next((r["region_status"] for r in reversed(reports)
                               if r.get("region_status")), None)
    m["time_to_first_patch_s"] = _med(ttfp)
    for k in ("samples", "share_in_replacement", "share_after_first_patch",
              "patches_installed", "patches_removed", "regions_installed", "code_bytes",
              "code_bytes_installed", "prog_wall_s"):
        m[k] = _med([r.get(k) for r in reports])
    svc_cpu = _med([r.get("service_cpu_s") for r in reports])
    if svc_cpu is not None:
        m["service_cpu_s"] = svc_cpu
        m["service_cpu_source"] = next((r["service_cpu_source"] for r in reports
                                        if r.get("service_cpu_source")), "dbr run report")
    elif "extra_cpu_s" in cell:
        m["service_cpu_s"] = cell["extra_cpu_s"]
        m["service_cpu_source"] = ("rusage: CPU of the `dbr run` process tree (embedded "
                                   "service thread + agent + program) minus native's, medians")
    rss = _med([r.get("service_peak_rss_kb") or r.get("service_max_rss_kb") for r in reports])
    if rss is None and _med([r.get("service_peak_rss_bytes") for r in reports]) is not None:
        rss = _med([r.get("service_peak_rss_bytes") for r in reports]) / 1024
    if rss is not None:
        m["service_peak_rss_kb"], m["service_rss_source"] = rss, "dbr run report"
    elif "maxrss_kb" in cell:
        m["service_peak_rss_kb"] = cell["maxrss_kb"]
        m["service_rss_source"] = ("rusage ru_maxrss of the `dbr run` tree: the largest "
                                   "process, i.e. dbr run + embedded service unless the "
                                   "program is bigger")
    return m


def run_workload(w: suite.Workload, configs: list[Config], ctx: suite.Ctx, st: Settings,
                 env: dict[str, str], work: Path) -> dict:
    row: dict[str, Any] = {"name": w.name, "kind": w.kind, "what": w.what, "configs": {}}
    t_start = time.monotonic()
    try:
        prep = w.prepare(ctx)
    except suite.Skip as exc:
        warn(f"-- skipped {w.name}: {exc}")
        row.update(status="skipped", message=str(exc))
        return row
    except Exception as exc:  # noqa: BLE001 - a broken preparation is that workload's crash
        warn(f"!! {w.name}: preparation crashed: {exc!r}")
        row.update(status="crashed", message=f"preparation failed: {exc!r}",
                   traceback=traceback.format_exc()[-2000:])
        return row
    row["argv"] = prep.argv
    wenv = prep.environ(env)
    # Reference run (also the native warm-up): its exit code and output hash are
    # what every configuration must reproduce.
    ref = run_once(prep.argv, wenv, work / "run", prep.outputs, timeout=max(600, st.min_timeout))
    if ref.timed_out or ref.exit_code != 0:
        why = "timed out" if ref.timed_out else describe_exit(ref.exit_code)
        warn(f"!! {w.name}: native run crashed: {why}: {last_line(ref.stderr_tail)}")
        row.update(status="crashed", message=f"native run {why}: {last_line(ref.stderr_tail)}")
        return row
    row["native_reference_wall_s"] = ref.wall
    timeout = max(st.min_timeout, st.timeout_factor * ref.wall)
    cells: dict[str, Cell] = {}
    for cfg in configs:
        cell = Cell(cfg)
        if cfg.reason:
            cell.status, cell.message = "unavailable", cfg.reason
        elif (why := cfg.applies(w, prep)):
            cell.status, cell.message = "n/a", why
        cells[cfg.name] = cell
    native = cells.get("native")
    main = [c for c in cells.values() if c.live and not c.cfg.separate]
    rounds = alternate(main, prep, lambda c: prep.argv, wenv, work, st.runs, st.warmup,
                       timeout, (ref.exit_code, ref.digest), w.name)
    for cell in main:
        row["configs"][cell.cfg.name] = cell_json(cell, native, rounds)
    # Separately paired configurations (valgrind): native vs it, few runs; in quick
    # mode on the small input.
    for cell in [c for c in cells.values() if c.cfg.separate]:
        if not cell.live:
            row["configs"][cell.cfg.name] = cell_json(cell, None, [])
            continue
        argv = prep.small_argv if (st.quick and prep.small_argv) else prep.argv
        sref = ref if argv is prep.argv else run_once(argv, wenv, work / "run", prep.outputs,
                                                      timeout=600)
        pair_native = Cell(Native())
        pair_native.cfg.name = "native-pair"
        vt = max(st.min_timeout * 5, 100 * sref.wall)
        prounds = alternate([pair_native, cell], prep,
                            lambda c: argv, wenv, work, st.valgrind_runs, 0, vt,
                            (sref.exit_code, sref.digest), w.name,
                            budget_s=st.valgrind_budget_s)
        cj = cell_json(cell, pair_native, prounds)
        cj["input"] = "small" if argv is not prep.argv else "same as the others"
        cj["native_pair_wall_s"] = spread([r.wall for r in pair_native.runs]) \
            if pair_native.runs else None
        row["configs"][cell.cfg.name] = cj
    for name, cell in cells.items():
        if name not in row["configs"]:
            row["configs"][name] = cell_json(cell, None, [])
    row["pgo_share"] = pgo_share(row["configs"], st)
    bad = [n for n, c in row["configs"].items() if c["status"] in ("FAILURE", "crashed",
                                                                     "timeout")]
    if any(row["configs"][n]["status"] == "FAILURE" for n in bad):
        row["status"] = "FAILURE"
    elif bad:
        row["status"] = "crashed"
    else:
        row["status"] = "ok"
    if bad:
        row["message"] = "; ".join(f"{n}: {row['configs'][n]['status']}: "
                                   f"{row['configs'][n].get('message', '')}" for n in bad)
    row["seconds"] = time.monotonic() - t_start
    return row


def pgo_share(cfgs: dict, st: Settings) -> dict:
    """(native − dbr)/(native − pgo), when PGO gains beyond ``st.pgo_helps``."""
    pgo, dbr = cfgs.get("pgo", {}), cfgs.get("dbr", {})
    if pgo.get("status") != "ok" or "ratio" not in pgo:
        return {"value": None, "why": "no PGO build" if pgo.get("status") in (None, "n/a")
                else f"PGO {pgo.get('status')}"}
    if pgo["ratio"] > st.pgo_helps:
        return {"value": None, "why": f"PGO gain below {100 * (1 - st.pgo_helps):.0f} % "
                                      f"(pgo/native {pgo['ratio']:.3f})"}
    q3 = (pgo.get("paired_ratio") or {}).get("q3")
    if q3 is not None and q3 >= 1.0:
        return {"value": None, "why": f"PGO gain not consistent (pgo/native {pgo['ratio']:.3f}, "
                                      f"paired-ratio q3 {q3:.3f} ≥ 1)"}
    if dbr.get("status") != "ok" or "ratio" not in dbr:
        return {"value": None, "why": f"dbr {dbr.get('status', 'not run')}"}
    # ratios are over the same native median, so (1 − r_dbr)/(1 − r_pgo)
    return {"value": (1 - dbr["ratio"]) / (1 - pgo["ratio"]), "why": ""}


# ------------------------------------------------------------------ the suite

def base_env(runtime_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    env["DBR_RUNTIME_DIR"] = str(runtime_dir)  # private: no host service, nothing shared
    env.setdefault("LC_ALL", "C")
    return env


def run_suite(workloads: list[suite.Workload], configs: list[Config], ctx: suite.Ctx,
              st: Settings, results: Results) -> int:
    """Run everything, writing results after each workload; 0 when every row is ok or
    skipped, 1 when a workload crashed or some configuration's output differed."""
    with tempfile.TemporaryDirectory(prefix="dbr-bench-") as tmpd:
        tmp = Path(tmpd)
        rt = tmp / "rt"
        rt.mkdir()
        env = base_env(rt)
        if ctx.path is not None:
            env["PATH"] = ctx.path
        section: dict[str, Any] = {"settings": st.__dict__, "target": TARGET,
                                   "configs": {}, "workloads": [],
                                   "status": "running"}
        for cfg in configs:
            t0 = time.monotonic()
            try:
                cfg.reason = cfg.check(ctx, env, tmp)
            except Exception as exc:  # noqa: BLE001
                cfg.reason = f"unavailable: check failed: {exc!r}"
            section["configs"][cfg.name] = {"what": cfg.what, "available": cfg.reason is None,
                                            "reason": cfg.reason or "",
                                            "check_s": time.monotonic() - t0}
            log(f"   config {cfg.name:14s} {cfg.reason or 'available'}")
        results.update("compare", section)
        rc = 0
        for w in workloads:
            log(f"-- {w.name}: {w.what}")
            work = tmp / "w" / w.name
            work.mkdir(parents=True)
            try:
                row = run_workload(w, configs, ctx, st, env, work)
            except Exception as exc:  # noqa: BLE001 - keep going, record it
                warn(f"!! {w.name}: benchmark machinery crashed: {exc!r}")
                row = {"name": w.name, "kind": w.kind, "what": w.what, "status": "crashed",
                       "message": f"runner error: {exc!r}",
                       "traceback": traceback.format_exc()[-2000:], "configs": {}}
            shutil.rmtree(work, ignore_errors=True)
            if row["status"] in ("crashed", "FAILURE"):
                rc = 1
            section["workloads"].append(row)
            log("   " + one_line(row))
            results.update("compare", section)
        section["status"] = "complete"
        results.update("compare", section)
    return rc


def one_line(row: dict) -> str:
    if row["status"] == "skipped":
        return f"skipped: {row.get('message', '')}"
    parts = [row["status"]]
    for name, c in row.get("configs", {}).items():
        if "ratio" in c:
            pr = c.get("paired_ratio", {})
            parts.append(f"{name} {c['ratio']:.3f} [{pr.get('min', 0):.3f}-{pr.get('max', 0):.3f}]")
        elif name != "native":
            parts.append(f"{name} {c['status']}")
    return "  ".join(parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.compare", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller inputs, fewer runs")
    ap.add_argument("--runs", type=int, help="recorded runs per config (default 5, quick 3)")
    ap.add_argument("--configs", help="comma list (native always included) of: "
                    + ", ".join(c.name for c in default_configs()))
    ap.add_argument("workloads", nargs="*", help="subset of the workloads")
    args = ap.parse_args(argv)
    exit_on_sigterm()
    ws = suite.registry()
    if args.workloads:
        unknown = set(args.workloads) - {w.name for w in ws}
        if unknown:
            ap.error(f"unknown workload(s) {sorted(unknown)}; known: {[w.name for w in ws]}")
        ws = [w for w in ws if w.name in args.workloads]
    st = Settings.for_mode(args.quick, args.runs)
    given = argv if argv is not None else sys.argv[1:]
    results = Results.open(quick=args.quick, command=["python", "-m", "bench.compare", *given])
    rc = 1
    try:
        rc = run_suite(ws, select_configs(args.configs), suite.Ctx(quick=args.quick), st,
                       results)
    finally:
        results.finish()
        log(f"written {results.json_path}, {results.md_path}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
