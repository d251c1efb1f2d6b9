"""`python -m bench long`: long-running programs (15-60 s each, --quick: 3-5 s) under
native, dbr (host service, default and --aggressive), BOLT and gcc PGO, alternated.

usage: python -m bench long [--quick] [--pairs N] [--server-pairs N]
                            [--only W[,W...]] [--configs C[,C...]] [--setup]
                            [--publish] [--publish-from DIR]

Results go to bench/results/long-<timestamp>/ (results.json, results.md, PNG plots),
rewritten after every run, so a killed run keeps what it had.  --publish copies the
table into docs/performance.md (between its long-table markers) and the plots into
docs/img/."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

from bench.common import code_version, machine_details, results_dir
from bench.long import report, runner, tools
from bench.long.workloads import ON_REQUEST, WORKLOADS, Ctx, Skip

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "performance.md"
BEGIN, END = "<!-- long-table:begin -->", "<!-- long-table:end -->"


def log(msg: str) -> None:
    print(msg, flush=True)


class Out:
    """The results directory, written whole after every change."""

    def __init__(self, directory: Path, data: dict) -> None:
        self.dir = directory
        self.data = data
        self.dir.mkdir(parents=True, exist_ok=True)

    def save(self, plots: bool = False) -> None:
        self.data["updated"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        tmp = self.dir / "results.json.tmp"
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        os.replace(tmp, self.dir / "results.json")
        try:
            md = report.markdown(self.data)
        except Exception as exc:  # noqa: BLE001 - a rendering bug must not lose the data
            md = f"# dbr long benchmark\n\nrendering failed: {exc!r}; see results.json\n"
        tmp = self.dir / "results.md.tmp"
        tmp.write_text(md)
        os.replace(tmp, self.dir / "results.md")
        if plots:
            try:
                self.data["plots"] = [p.name for p in report.plots(self.data, self.dir)]
            except Exception as exc:  # noqa: BLE001
                self.data["plots_error"] = repr(exc)


def publish(directory: Path) -> int:
    """Copy a run's table into docs/performance.md and its plots into docs/img/."""
    data = json.loads((directory / "results.json").read_text())
    plots = report.plots(data, directory)
    img = REPO / "docs" / "img"
    img.mkdir(parents=True, exist_ok=True)
    for p in plots:
        shutil.copy(p, img / p.name)
    text = DOC.read_text()
    if BEGIN not in text or END not in text:
        log(f"publish: {DOC} has no {BEGIN} ... {END} block; plots copied only")
        return 1
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    kind = "quick run (--quick)" if data.get("quick") else f"full run ({data.get('pairs')} pairs)"
    m = data.get("machine") or {}
    code = data.get("code") or {}
    dirty = (f" with {code['uncommitted_files']} uncommitted file(s) under dbr_service/, "
             "dbr_agent/, shared/" if code.get("uncommitted_files") else "")
    block = (f"{BEGIN}\n_{kind}; dbr at commit {code.get('commit', '?')}{dirty};"
             f" {m.get('cores', '?')} cores, {m.get('pmu_note', '')}; load average "
             f"{m.get('loadavg_start', '?')} at the start, {m.get('loadavg_end', '?')} at the "
             "end_\n\n"
             + report.table(data) + "\nThe program's own CPU time (user + sys; redis: per request "
             "served) over native's, median [min–max] over the same pairs:\n\n"
             + report.cpu_table(data) + END)
    DOC.write_text(head + block + tail)
    log(f"publish: table -> {DOC}, plots -> {', '.join(str(img / p.name) for p in plots)}")
    return 0


def _terminate(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench long", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="3-5 s inputs, 15 s server load")
    ap.add_argument("--pairs", type=int, default=None,
                    help="alternated rounds per workload (default 5; --quick 3)")
    ap.add_argument("--server-pairs", type=int, default=None,
                    help="rounds of the server workload (default 2; --quick 1)")
    ap.add_argument("--only", default="", help="workloads: " + ",".join(WORKLOADS) +
                    " (" + ",".join(sorted(ON_REQUEST)) + " only when named)")
    ap.add_argument("--configs", default=",".join(runner.DEFAULT_CONFIGS),
                    help="configurations (native always runs): " + ",".join(runner.CONFIGS))
    ap.add_argument("--setup", action="store_true",
                    help="install what it needs (apt packages, the lupa sdist) and exit")
    ap.add_argument("--publish", action="store_true",
                    help="after the run, copy its table and plots into docs/")
    ap.add_argument("--publish-from", metavar="DIR", help="publish an earlier run and exit")
    ap.add_argument("--out", metavar="DIR", help="results directory (default "
                    "bench/results/long-<timestamp>)")
    ap.add_argument("--seed", type=int, default=1, help="seed of the per-pair orders")
    args = ap.parse_args(argv)
    if args.setup:
        return tools.setup(log)
    if args.publish_from:
        return publish(Path(args.publish_from))
    only = [w for w in args.only.split(",") if w]
    bad = set(only) - set(WORKLOADS)
    if bad:
        ap.error(f"unknown workload(s): {', '.join(sorted(bad))}")
    cfgs = [c for c in args.configs.split(",") if c]
    bad = set(cfgs) - set(runner.CONFIGS)
    if bad:
        ap.error(f"unknown configuration(s): {', '.join(sorted(bad))}")
    cfgs = ["native"] + [c for c in runner.CONFIGS if c in cfgs and c != "native"]
    pairs = args.pairs or (3 if args.quick else 5)
    server_pairs = args.server_pairs or (1 if args.quick else 2)
    if pairs < 1 or server_pairs < 1:
        ap.error("--pairs and --server-pairs must be at least 1")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out_dir = Path(args.out) if args.out else results_dir() / f"long-{stamp}"
    cmd = "python -m bench long " + " ".join(argv if argv is not None else sys.argv[1:])
    data = {"schema": "dbr.bench.long/1", "quick": args.quick, "pairs": pairs,
            "server_pairs": server_pairs, "command": cmd.strip(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "machine": machine_details(), "code": code_version(), "configs": cfgs,
            "config_what": {c: runner.CONFIG_WHAT[c] for c in cfgs}, "workloads": {}}
    data["machine"]["loadavg_start"] = [round(x, 2) for x in os.getloadavg()]
    out = Out(out_dir, data)
    signal.signal(signal.SIGTERM, _terminate)
    log(f"== long: results in {out_dir} ({'quick' if args.quick else 'full'}, {pairs} pairs, "
        f"server {server_pairs})")
    t_start = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="dbr-long-"))
    ctx = Ctx(quick=args.quick, work=work, log=log)
    native_rt = work / "native-rt"
    native_rt.mkdir()
    env = runner.base_env(native_rt)
    services: dict[str, runner.Service | str] = {}
    rc = 0
    try:
        for c, flags in runner.DBR_CONFIGS.items():
            if c in cfgs:
                svc = runner.Service(c, flags, out_dir)
                why = svc.start(env)
                services[c] = why or svc
                if why:
                    log(f"   {c}: {why}")
        out.save()
        for name, prepare in WORKLOADS.items():
            if (only and name not in only) or (not only and name in ON_REQUEST):
                continue
            entry: dict = {"status": "preparing"}
            data["workloads"][name] = entry
            log(f"== {name}")
            try:
                prep = prepare(ctx)
            except Skip as exc:
                entry.update(status="skipped", reason=str(exc))
                log(f"   {exc}")
                out.save()
                continue
            n = server_pairs if prep.kind == "server" else pairs
            try:
                runner.run_workload(name, prep, ctx, cfgs, n, services, env, entry,
                                    out.save, args.seed, log)
            except KeyboardInterrupt:
                raise
            except Exception as exc:  # noqa: BLE001 - one broken workload, the rest still run
                entry["status"] = "error"
                entry["reason"] = f"harness error: {exc!r}"
                entry["traceback"] = traceback.format_exc()[-2000:]
                log(f"!! {name}: {exc!r}")
                rc = 1
            out.save(plots=True)
    except KeyboardInterrupt as exc:
        data["interrupted"] = str(exc) or "interrupted"
        log(f"!! interrupted: results so far in {out_dir}")
        rc = 130
    finally:
        for svc in services.values():
            if isinstance(svc, runner.Service):
                svc.stop()
        data["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        data["elapsed_s"] = round(time.monotonic() - t_start, 1)
        data["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
        data["summary"] = report.summarize(data)
        out.save(plots=True)
        out.save()
        shutil.rmtree(work, ignore_errors=True)
    log(report.table(data))
    log(f"== long: {data['elapsed_s'] / 60:.1f} min; results in {out_dir}")
    if args.publish and rc in (0, 1):
        publish(out_dir)
    return rc


if __name__ == "__main__":
    sys.exit(main())
