"""What sampling costs.

* client overhead: a CPU-bound program natively vs. under a host `dbr service` with
  default settings and patching off (sampling only), A/B alternated, median ratio;
  target <= 1.01.  The service runs throughout, as on a real host, so its start-up
  is not billed to the client.
* service CPU per sampled busy thread: service CPU seconds (psutil, service process
  and its workers) / (busy client threads x seconds), default settings.
* time to hot spots: from a client's connection to its first finished worker job
  (hot spots known), from the report timeline of `dbr run`, default settings.

usage: python -m bench.sampling_overhead [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

import dbr_agent
from bench.common import ab, machine, timed, write_results

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "tests" / "e2e_progs" / "threads.c"


def start_service(rt: str, extra: list[str]) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-m", "dbr_service.commands.cli", "service", *extra],
                         env=dict(os.environ, DBR_RUNTIME_DIR=rt),
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while not os.path.exists(os.path.join(rt, "control.sock")):
        if time.monotonic() > deadline or p.poll() is not None:
            p.kill()
            raise SystemExit("dbr service did not start")
        time.sleep(0.05)
    time.sleep(0.5)
    return p


def stop(p: subprocess.Popen) -> None:
    p.terminate()
    try:
        p.wait(10)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait(5)


def cpu_of_tree(p: psutil.Process) -> float:
    total = 0.0
    for q in [p, *p.children(recursive=True)]:
        try:
            t = q.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    # Runs must last several snapshot intervals (default: one 0.2 s window per 1 s),
    # or nothing is sampled and the "overhead" measures only the agent.
    iters, runs = ("500", 3) if args.quick else ("1200", 7)
    with tempfile.TemporaryDirectory() as d:
        exe = os.path.join(d, "threads")
        subprocess.run(["gcc", "-O2", "-pthread", "-o", exe, str(SRC)], check=True)
        rt = os.path.join(d, "rt")
        os.mkdir(rt)
        base_env = dict(os.environ)
        base_env.pop("LD_PRELOAD", None)
        svc = start_service(rt, ["-o", "patching=false"])
        try:
            agent_env = dict(base_env, DBR_RUNTIME_DIR=rt, LD_PRELOAD=dbr_agent.agent_path())
            cmd = [exe, iters, "1"]
            overhead = ab("client-sampling-only", timed(cmd, base_env), timed(cmd, agent_env),
                          runs=runs)
            # Service CPU per busy thread: 2 busy threads for a fixed time.
            sp = psutil.Process(svc.pid)
            c0, t0 = cpu_of_tree(sp), time.monotonic()
            subprocess.run([exe, iters, "2"], env=agent_env, stdout=subprocess.DEVNULL,
                           check=True)
            c1, t1 = cpu_of_tree(sp), time.monotonic()
            per_thread = (c1 - c0) / (2 * (t1 - t0))
            sampled = subprocess.run([sys.executable, "-m", "dbr_service.commands.cli", "ctl",
                                      "--json",
                                      "clients", "--all"], env=dict(base_env, DBR_RUNTIME_DIR=rt),
                                     capture_output=True, text=True).stdout
            n_samples = sum(c.get("samples", 0) for c in json.loads(sampled or "[]"))
            if n_samples == 0:
                raise SystemExit("no client was sampled: the measurement would be empty")
        finally:
            stop(svc)
        # Time to hot spots (default settings, embedded service, from the report).
        ttfh = []
        for _ in range(2 if args.quick else 4):
            rep = os.path.join(d, "rep.json")
            subprocess.run([sys.executable, "-m", "dbr_service.commands.cli", "run", "--embedded",
                            "--quiet", "-o", "patching=false", "--report", rep, "--",
                            exe, iters, "1"], env=base_env, stdout=subprocess.DEVNULL,
                           check=True)
            tl = json.load(open(rep))["clients"][0].get("timeline", {})
            if "first_job_done" in tl:
                ttfh.append(tl["first_job_done"])
    rows = [
        ("client wall, sampling only / native (median)", f"{overhead.ratio:.4f}",
         "<= 1.01", overhead.ratio <= 1.01),
        ("service CPU per sampled busy thread", f"{per_thread * 100:.2f} %", "", None),
        ("samples taken across the runs (proof something was sampled)", str(n_samples), "",
         None),
        ("connection -> hot spots known (median, default settings)",
         f"{statistics.median(ttfh):.2f} s" if ttfh else "n/a", "", None),
    ]
    print(f"# sampling cost ({overhead.runs} alternated runs, default settings)")
    print("| metric | value | target | met |\n|---|---|---|---|")
    for name, val, target, met in rows:
        print(f"| {name} | {val} | {target} | {'' if met is None else ('yes' if met else 'NO')} |")
    path = write_results("sampling_overhead", {
        "machine": machine(), "overhead": overhead, "service_cpu_per_thread": per_thread,
        "samples": n_samples,
        "time_to_hotspots_s": ttfh})
    print(f"written {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
