"""Warm start on short real programs: are second runs patched from their start, how
soon, and what do they cost against native?

For each real program of the suite (gzip, xz, zstd, bzip2, sqlite3, perl, python3):

1. **Training**: the program under a ``dbr service --aggressive`` with a fresh profile
   store, until a run is patched and leaves hot text in the store (at most ``--train``
   runs); its profile and hot text go to the store when it ends.  The training
   service is then stopped (a store has one writer).
2. **Timed rounds**, alternated: native; a host service with default settings on that
   store (warm: the program's agents connect at their start and get the selections
   it made ahead from the stored profile, or a job that selects from it); and one
   with ``warm_start=false`` (cold: what the same run gets without a store).  The
   rounds start once the warm service has made its selections ahead, as one that has
   been up a while has (bounded: AHEAD_WAIT_S; the wait is reported).  Every run's
   output is checked against native's.

The runs are the suite's full inputs (about 1-4 s here).

Reported per program: runs patched, time from the agent's connection to the first
patch (median and range), wall time over native (median of the paired ratios, with
their range), the services' CPU per run, and how many of the warm runs' installed
regions were placed from code kept with their selection rather than emitted.

usage: python -m bench.warm [--pairs N] [--train N] [--only NAME,...] [--logs DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import dbr_agent
from bench.common import machine, write_results
from bench.runner import HostService, run_once
from bench.suite import Ctx, Skip, registry
from dbr_service.commands.cmd_run import collect_report, preload_env
from dbr_service.commands.ctlclient import ControlClient
from dbr_service.profiles.profilestore import ProfileStore

#: Seconds the timed rounds wait at most for the warm service's selections ahead.
AHEAD_WAIT_S = 120.0


def _report(svc: HostService, pid: int) -> dict[str, Any]:
    entries = collect_report(ControlClient(svc.rt), pid)
    return next((e for e in entries if e.get("pid") == pid), {})


def _ttfp(entry: dict[str, Any]) -> float | None:
    return entry.get("time_to_first_patch_s")


def _recorded(svc: HostService, runs: int, timeout: float = 10.0) -> None:
    """Wait (bounded) until the service has stored ``runs`` runs: a run's profile is
    written as its session ends, just after the program exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = ControlClient(svc.rt).result("status").get("warm_start") or {}
        if st.get("runs_recorded", 0) >= runs:
            return
        time.sleep(0.05)


def _selected_ahead(svc: HostService, timeout: float = AHEAD_WAIT_S) -> float | None:
    """Wait (bounded) until the service has made its selections ahead (a service that
    has been up a while has them): how long the wait took (they started with the
    service, before the cold one was started), None if not within ``timeout``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        st = ControlClient(svc.rt).result("status").get("warm_start") or {}
        if st.get("prepare_pending", 0) == 0:
            return round(time.monotonic() - t0, 2)
        time.sleep(0.1)
    return None


def _hot_text_stored(state: str) -> bool:
    """Whether the store in ``state`` holds hot text (read-only: the training service
    holds it)."""
    store = ProfileStore(state, readonly=True)
    try:
        return any(sm.regions for sm in store.summaries())
    finally:
        store.close()


def _train(prog: Any, train: int, work: Path, agent: str, base: dict[str, str],
           timeout: float) -> tuple[int | None, str]:
    """Runs of ``prog`` under an aggressive service until one is patched and leaves hot
    text in the store (a run whose regions were all taken out again leaves none): how
    many (None: none did), and an error text."""
    svc = HostService(flags=["--aggressive"], prefix="dbr-bench-train-")
    try:
        why = svc.start(base)
        if why is not None:
            return None, f"training service {why}"
        env = prog.environ(preload_env(dict(base, DBR_RUNTIME_DIR=svc.rt), agent))
        for i in range(train):
            r = run_once(prog.argv, env, work / "run", prog.outputs, timeout)
            if r.exit_code != 0:
                return None, f"training run exited {r.exit_code}: {r.stderr_tail}"
            if _ttfp(_report(svc, r.pid)) is not None:
                _recorded(svc, i + 1)
                if _hot_text_stored(base["DBR_STATE_DIR"]):
                    return i + 1, ""
        return None, ""
    finally:
        svc.stop()


def _bench_one(name: str, prog: Any, pairs: int, train: int, work: Path,
               agent: str, base: dict[str, str], timeout: float,
               logs: Path | None = None) -> dict[str, Any]:
    state = Path(tempfile.mkdtemp(prefix="dbr-warm-state-"))
    base = dict(base, DBR_STATE_DIR=str(state))
    warm = HostService(prefix="dbr-bench-warm-",
                       log=logs / f"warm-{name}.log" if logs is not None else None)
    cold = HostService(["warm_start=false"], prefix="dbr-bench-cold-")
    row: dict[str, Any] = {"program": name}
    try:
        trained, err = _train(prog, train, work, agent, base, timeout)
        if err:
            return dict(row, error=err)
        row["training_runs"] = trained or train
        row["trained"] = trained is not None
        for svc in (warm, cold):
            why = svc.start(base)
            if why is not None:
                return dict(row, error=f"service {why}")
        row["selected_ahead_s"] = _selected_ahead(warm)
        env = {n: preload_env(dict(base, DBR_RUNTIME_DIR=s.rt), agent)
               for n, s in (("warm", warm), ("cold", cold))}
        env["native"] = base
        want = None
        walls: dict[str, list[float]] = {"native": [], "warm": [], "cold": []}
        cpu: dict[str, list[float]] = {"warm": [], "cold": []}
        ttfp: dict[str, list[float | None]] = {"warm": [], "cold": []}
        timelines: dict[str, list[Any]] = {"warm": [], "cold": []}
        #: regions installed, and of them placed from kept code (not emitted)
        placed: dict[str, list[int]] = {"warm": [0, 0], "cold": [0, 0]}
        wrong = 0
        names = list(walls)
        svcs = {"warm": warm, "cold": cold}
        for rnd in range(pairs):
            k = rnd % len(names)
            for n in names[k:] + names[:k]:
                svc = svcs.get(n)
                c0 = svc.cpu_s() if svc else None
                r = run_once(prog.argv, prog.environ(env[n]), work / "run", prog.outputs,
                             timeout)
                if r.exit_code != 0 or r.timed_out:
                    return dict(row, error=f"{n} run exited {r.exit_code}: {r.stderr_tail}")
                if n == "native" and want is None:
                    want = r.digest
                walls[n].append(r.wall)
                if svc is not None:
                    entry = _report(svc, r.pid)
                    ttfp[n].append(_ttfp(entry))
                    timelines[n].append(entry.get("timeline"))
                    live = [g for g in entry.get("regions") or [] if g.get("state") == "installed"]
                    placed[n][0] += len(live)
                    placed[n][1] += sum((g.get("info") or {}).get("code_from") == "kept"
                                        for g in live)
                    c1 = svc.cpu_s()
                    if c0 is not None and c1 is not None:
                        cpu[n].append(c1 - c0)
                wrong += want is not None and r.digest != want
        row["native_s"] = statistics.median(walls["native"])
        row["wrong_outputs"] = wrong
        for n in ("warm", "cold"):
            ratios = [a / b for a, b in zip(walls[n], walls["native"])]
            got = [t for t in ttfp[n] if t is not None]
            row[n] = {"ratio": statistics.median(ratios), "ratio_min": min(ratios),
                      "ratio_max": max(ratios), "runs_patched": len(got), "runs": len(ttfp[n]),
                      "first_patch_ms_median": round(statistics.median(got) * 1e3, 1)
                      if got else None,
                      "first_patch_ms_range": [round(min(got) * 1e3, 1),
                                               round(max(got) * 1e3, 1)] if got else None,
                      "service_cpu_ms_per_run": round(statistics.mean(cpu[n]) * 1e3, 1)
                      if cpu[n] else None,
                      "regions_installed": placed[n][0], "regions_placed_kept": placed[n][1],
                      "timelines": timelines[n]}
        return row
    finally:
        warm.stop()
        cold.stop()
        shutil.rmtree(state, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.warm", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=7, help="timed rounds per program (7)")
    ap.add_argument("--train", type=int, default=3,
                    help="training runs at most, until one is patched (3)")
    ap.add_argument("--only", default="", help="comma-separated program names")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds a run may take")
    ap.add_argument("--logs", type=Path, help="directory for the warm services' logs "
                    "(warm-PROGRAM.log): what each run was given, and when")
    args = ap.parse_args(argv)
    if args.pairs < 1 or args.train < 1:
        ap.error("--pairs and --train must be at least 1")
    if args.logs is not None:
        try:
            args.logs.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            ap.error(f"--logs {args.logs}: {exc.strerror}")
    agent = dbr_agent.agent_path()
    if agent is None:
        print("bench.warm: libdbr_agent.so cannot be built", file=sys.stderr)
        return 1
    only = {x for x in args.only.split(",") if x}
    base = dict(os.environ, LC_ALL="C")
    base.pop("LD_PRELOAD", None)
    work = Path(tempfile.mkdtemp(prefix="dbr-bench-warm-"))
    rows = []
    try:
        for w in registry():
            if w.kind != "real" or (only and w.name not in only):
                continue
            try:
                prog = w.prepare(Ctx(quick=False))
            except Skip as exc:
                print(f"{w.name}: skipped: {exc}")
                continue
            row = _bench_one(w.name, prog, args.pairs, args.train, work, agent, base,
                             args.timeout, args.logs)
            rows.append(row)
            if "error" in row:
                print(f"{w.name}: {row['error']}")
                continue
            wm, cd = row["warm"], row["cold"]
            print(f"{w.name:8s} native {row['native_s']:.2f} s | warm x{wm['ratio']:.3f} "
                  f"[{wm['ratio_min']:.3f}-{wm['ratio_max']:.3f}] patched "
                  f"{wm['runs_patched']}/{wm['runs']}, first patch "
                  f"{wm['first_patch_ms_median']} ms {wm['first_patch_ms_range']}, service "
                  f"{wm['service_cpu_ms_per_run']} ms/run | cold x{cd['ratio']:.3f} "
                  f"[{cd['ratio_min']:.3f}-{cd['ratio_max']:.3f}] patched "
                  f"{cd['runs_patched']}/{cd['runs']} | wrong outputs {row['wrong_outputs']}"
                  f" | waited {row['selected_ahead_s']} s for the selections ahead"
                  f" | warm regions placed from kept code {wm['regions_placed_kept']}"
                  f"/{wm['regions_installed']}"
                  f"{'' if row['trained'] else ' | training left no hot text'}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    path = write_results("warm", {"machine": machine(), "pairs": args.pairs,
                                  "train": args.train, "rows": rows})
    print(f"results: {path}")
    return 1 if any("error" in r or r.get("wrong_outputs") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
