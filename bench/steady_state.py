"""What a long-running program pays on a deployed host once it has nothing left to
optimize (the target: no workload slower than native by more than 1 %).

Each workload runs for tens of seconds, three ways, alternated round by round (round
i starts at configuration i mod 3, after one unrecorded warm-up round):

* ``native``     the program as is;
* ``host``       ``LD_PRELOAD=libdbr_agent.so`` under a running host service with
                 default settings (quiet clients are sampled less: up to one 0.2 s
                 window per ``snapshot_backoff_max_s`` = 8 s);
* ``host-fixed`` the same with ``snapshot_backoff_max_s=0``: one window every second
                 for the whole run, as before the backoff;
* ``host-sampling`` ``host`` with ``patching=false``: the agent and the sampling
                 without replacement code, so ``host`` minus this is what the installed
                 regions gain or cost;
* ``host-nocheck`` ``host`` with ``speed_check=false`` (only with ``--configs``): the
                 regions stay whatever their effect, so ``host`` against this is what
                 the speed checks (dbr_service/installation/speedcheck.py) save or cost.

Both services run throughout (their start-up is not billed to a client), each on its
own runtime dir; only one program runs at a time.  Every run's stdout is compared
with native's: a difference is a FAILURE, never a data point.  Reported per
configuration: median wall and CPU seconds (user + system of the program, from
wait4), their ratios to native (median over median, and the range of per-round
paired ratios, and the 95 % bootstrap interval of the wall ratio), and what the
service did for the program (windows sampled, samples, its sampling interval at the
end, patches installed).

usage: python -m bench.steady_state [--quick] [--runs N] [--seconds S] [--configs C,...]
                                   [WORKLOAD...]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import dbr_agent
from bench import suite
from bench.common import Results, machine, write_results
from bench.runner import HostService
from bench.stats import paired_ratios, spread, versus

ROOT = Path(__file__).resolve().parents[1]

PERL = r"""
my $n = shift; my %h; my $s = 0;
for my $i (1..$n) { my $k = "k" . ($i % 5000); $h{$k} .= chr(65 + $i % 26);
  $h{$k} = substr($h{$k}, -8) if length($h{$k}) > 16; $s += length($h{$k}); }
print "$s\n";
"""

PYTHON = r"""
import sys
n = int(sys.argv[1]); d = {}; s = 0
for i in range(n):
    k = i % 5000
    v = d.get(k, "") + chr(65 + i % 26)
    if len(v) > 16:
        v = v[-8:]
    d[k] = v; s += len(v)
print(s)
"""

#: name -> (argv builder from a size, size for one second natively on a 2-core Xeon)
#: Host services a run can compare with native: their settings.
SERVICE_CONFIGS: dict[str, tuple[str, ...]] = {
    "host": (), "host-fixed": ("snapshot_backoff_max_s=0",),
    "host-sampling": ("patching=false",), "host-nocheck": ("speed_check=false",)}
DEFAULT_CONFIGS = ("host", "host-fixed", "host-sampling")

WORKLOADS = {
    "perl": (lambda n, d: ["perl", "-e", PERL, str(n)], 7_000_000),
    "python3": (lambda n, d: [sys.executable, "-c", PYTHON, str(n)], 3_100_000),
    "threads": (lambda n, d: [str(d / "threads"), str(n), "1"], 510),
    # xz -1 (one thread) of the suite's generated text, repeated: a real, stripped,
    # memory-bound program whose hot loops dbr patches (liblzma's match finder)
    "xz": (lambda n, d: ["xz", "-T1", "-1", "-c", str(_repeated(d / "text", max(1, n)))], 0.8),
    # tests/e2e_progs/stream.c: a filter that reads 1 MiB of random bytes ROUNDS times,
    # scrambles them in one hot loop and writes them to /dev/null; its I/O per CPU
    # second is steady (1 %), so a speed check can tell its region's effect
    "stream": (lambda n, d: [str(d / "stream"), str(d / "stream.in"), str(max(1, n)),
                             "/dev/null"], 800),
}


def _repeated(src: Path, n: int) -> Path:
    """``n`` copies of ``src`` in one file next to it (made once): the program reads a
    file itself, so the service's view of the run is the program's, not a shell's."""
    out = src.with_name(f"{src.name}-x{n}")
    if not out.exists():
        with open(out, "wb") as f:
            for _ in range(n):
                with open(src, "rb") as s:
                    while chunk := s.read(1 << 22):
                        f.write(chunk)
    return out


def _build(d: Path, names: list[str]) -> None:
    subprocess.run(["gcc", "-O2", "-pthread", "-o", str(d / "threads"),
                    str(ROOT / "tests" / "e2e_progs" / "threads.c")], check=True)
    if "stream" in names:
        subprocess.run(["gcc", "-O2", "-s", "-o", str(d / "stream"),
                        str(ROOT / "tests" / "e2e_progs" / "stream.c")], check=True)
        (d / "stream.in").write_bytes(random.Random(1).randbytes(1 << 20))
    if "xz" in names:
        if not shutil.which("xz"):
            raise SystemExit("steady_state xz: no xz on PATH (apt-get install xz-utils)")
        # 24 MB of the suite's text (cached): about 1.25 s of xz -1 per copy
        src = suite.text_input(suite.Ctx(quick=False, log=lambda m: None), 24_000_000)
        os.symlink(src, d / "text")


def _run(argv: list[str], env: dict[str, str], timeout: float) -> tuple[float, float, str, int]:
    """Wall seconds, CPU seconds (user + sys), stdout digest and pid of one run."""
    with tempfile.TemporaryFile() as out:
        t0 = time.perf_counter()
        p = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.DEVNULL)
        deadline = t0 + timeout
        while True:
            pid, status, ru = os.wait4(p.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() > deadline:
                p.kill()
                os.wait4(p.pid, 0)
                raise SystemExit(f"{argv[0]} took over {timeout:.0f} s: killed")
            time.sleep(0.002)
        wall = time.perf_counter() - t0
        p.returncode = os.waitstatus_to_exitcode(status)
        if p.returncode != 0:
            raise SystemExit(f"{argv[0]} exited {p.returncode}")
        out.seek(0)
        return wall, ru.ru_utime + ru.ru_stime, hashlib.sha256(out.read()).hexdigest(), p.pid


def _client_info(rt: Path, pid: int) -> dict:
    """What the service did for one (ended) client, from `dbr ctl clients --all`."""
    for _ in range(20):
        p = subprocess.run([sys.executable, "-m", "dbr_service.commands.cli", "ctl", "--json",
                            "clients", "--all"], env=dict(os.environ, DBR_RUNTIME_DIR=str(rt)),
                           capture_output=True, text=True, timeout=30)
        try:
            rows = json.loads(p.stdout or "[]")
        except ValueError:
            rows = []
        mine = [c for c in rows if c.get("pid") == pid]
        if mine:
            c = mine[-1]
            return {k: c.get(k) for k in ("snapshots", "samples", "sampling_interval_s",
                                          "quiet_snapshots", "patches_installed",
                                          "regions_went_live", "speed_check")}
        time.sleep(0.1)
    return {"missing": True}


def _paired(xs: list[float], ys: list[float]) -> dict:
    """Median, min and max of the per-round ratios ys / xs."""
    r = paired_ratios(ys, xs)
    return {"median": statistics.median(r), "min": min(r), "max": max(r)} if r else {}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="8 s runs, 3 rounds")
    ap.add_argument("--runs", type=int, help="recorded rounds (default 5; quick 3)")
    ap.add_argument("--seconds", type=float, help="native length of a run (default 20)")
    ap.add_argument("--configs", help="comma-separated, besides native, from: " +
                    ", ".join(SERVICE_CONFIGS) + f" (default {','.join(DEFAULT_CONFIGS)})")
    ap.add_argument("workloads", nargs="*", help="subset of: " + ", ".join(WORKLOADS))
    args = ap.parse_args(argv)
    bad = set(args.workloads) - set(WORKLOADS)
    if bad:
        ap.error(f"unknown workload(s): {', '.join(sorted(bad))}")
    chosen = [c for c in (args.configs or ",".join(DEFAULT_CONFIGS)).split(",") if c]
    bad = set(chosen) - set(SERVICE_CONFIGS)
    if bad or not chosen:
        ap.error(f"unknown config(s): {', '.join(sorted(bad)) or '(none given)'}")
    runs = args.runs or (3 if args.quick else 5)
    secs = args.seconds or (8.0 if args.quick else 20.0)
    names = args.workloads or list(WORKLOADS)
    agent = dbr_agent.agent_path()
    results: dict = {"machine": machine(), "seconds": secs, "runs": runs, "workloads": {}}
    with tempfile.TemporaryDirectory(prefix="dbr-steady-") as td:
        d = Path(td)
        _build(d, names)
        base = dict(os.environ)
        base.pop("LD_PRELOAD", None)
        svcs = {c: HostService(list(SERVICE_CONFIGS[c])) for c in dict.fromkeys(chosen)}
        try:
            for name, svc in svcs.items():
                why = svc.start(base)
                if why is not None:
                    raise SystemExit(f"dbr service ({name}): {why}")
            rts = {k: Path(svc.rt) for k, svc in svcs.items()}
            envs = {"native": base,
                    **{k: dict(base, DBR_RUNTIME_DIR=str(rt), LD_PRELOAD=agent)
                       for k, rt in rts.items()}}
            configs = list(envs)
            for w in names:
                build, per_s = WORKLOADS[w]
                cmd = build(int(per_s * secs), d)
                wall: dict[str, list[float]] = {c: [] for c in configs}
                cpu: dict[str, list[float]] = {c: [] for c in configs}
                info: dict[str, list[dict]] = {c: [] for c in configs if c != "native"}
                ref = None
                for rnd in range(runs + 1):            # round 0: warm-up, not recorded
                    for j in range(len(configs)):
                        c = configs[(rnd + j) % len(configs)]
                        t, u, digest, pid = _run(cmd, envs[c], timeout=20 * secs + 60)
                        if ref is None and c == "native":
                            ref = digest
                        if ref is not None and digest != ref:
                            raise SystemExit(f"FAILURE: {w} under {c}: output differs from "
                                             "native")
                        if c != "native":
                            i = _client_info(rts[c], pid)
                            if rnd:
                                info[c].append(i)
                        if rnd:
                            wall[c].append(t)
                            cpu[c].append(u)
                    if rnd:
                        print(f"  {w} round {rnd}/{runs}: " + ", ".join(
                            f"{c} {wall[c][-1]:.2f}s" for c in configs), flush=True)
                row = {"argv0": cmd[0], "configs": {}}
                for c in configs:
                    vw = versus(wall[c], wall["native"])
                    row["configs"][c] = {
                        "wall_s": spread(wall[c]), "cpu_s": spread(cpu[c]),
                        "wall_ratio": vw["ratio"],
                        "cpu_ratio": statistics.median(cpu[c]) / statistics.median(cpu["native"]),
                        "wall_paired": _paired(wall["native"], wall[c]),
                        "wall_ci95": vw["ci95"],
                        "cpu_paired": _paired(cpu["native"], cpu[c]),
                        "wall_all": wall[c], "cpu_all": cpu[c]}
                    if c in info:
                        row["configs"][c]["service"] = info[c]
                results["workloads"][w] = row
        finally:
            for svc in svcs.values():
                svc.stop()
    md = _markdown(results)
    print(md)
    results["markdown"] = md
    path = write_results("steady_state", results)
    try:
        Results.open(args.quick).update("steady_state", results)
    except Exception as exc:  # noqa: BLE001 - the table above and the JSON stand
        print(f"(latest.json not updated: {exc!r})")
    print(f"written {path}")
    return 0


def _verdicts(sv: list[dict]) -> str:
    """How often each verdict was a run's last speed check: "same 5, slower 2"."""
    n: dict[str, int] = {}
    for s in sv:
        if s.get("speed_check"):
            n[s["speed_check"]] = n.get(s["speed_check"], 0) + 1
    return ", ".join(f"{k} {v}" for k, v in sorted(n.items())) or "–"


def _markdown(res: dict) -> str:
    out = [f"# steady state: {res['seconds']:.0f} s runs, {res['runs']} alternated rounds "
           f"(medians; paired ratio range in brackets)", "",
           "| workload | config | wall s | wall ratio | 95 % interval | CPU ratio "
           "| windows sampled | samples | interval at end s | patches | last speed check |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for w, row in res["workloads"].items():
        for c, v in row["configs"].items():
            sv = v.get("service") or []

            def med(k):
                xs = [s[k] for s in sv if isinstance(s.get(k), (int, float))]
                return f"{statistics.median(xs):g}" if xs else "–"
            wp, cp = v["wall_paired"], v["cpu_paired"]
            ci = v.get("wall_ci95")
            ci_s = f"{ci[0]:.3f}–{ci[1]:.3f}" if ci and c != "native" else "–"
            out.append(
                f"| {w} | {c} | {v['wall_s']['median']:.2f} | {v['wall_ratio']:.3f} "
                f"[{wp.get('min', 0):.3f}-{wp.get('max', 0):.3f}] | {ci_s} | {v['cpu_ratio']:.3f} "
                f"[{cp.get('min', 0):.3f}-{cp.get('max', 0):.3f}] | {med('snapshots')} | "
                f"{med('samples')} | {med('sampling_interval_s')} | {med('patches_installed')} | "
                f"{_verdicts(sv)} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.exit(main())
