"""One program under two host services with different settings, against native.

Each round runs the program natively, with the agent preloaded under service A, and
under service B (both started once, each with its own runtime dir, as a deployed
host's service would be), in an order rotated from round to round, timed like
``bench.compare`` (``bench.runner.run_once``: spawn to wait4).  Reports each
configuration's median over native,
the paired median, B over A with a 95 % bootstrap interval (rounds resampled whole),
and the CPU the services spent per run (their processes and workers, psutil).  Each
service is asked after every run whether it installed code in it; where some runs of
a service were patched and some not, its ratio is also given over each kind alone.

It answers "does this setting change what the program pays", where two whole-suite
runs taken at different times would differ by more than the effect.

usage: python -m bench.service_ab [--runs N] [-a KEY=VALUE ...] [-b KEY=VALUE ...]
                                  [--env-a NAME=VALUE ...] [--env-b NAME=VALUE ...]
                                  -- PROG [ARG ...]
  e.g. -a short_thread_memory_s=0 -a gated_thread_timer=false -- churn 60000
       --env-b DBR_AGENT_QUIET_MS=0 -- churn 60000     (the same service settings,
                                                       the program's agent told apart)
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import dbr_agent
from bench.common import machine, program_of, write_results
from bench.runner import HostService, run_once
from bench.stats import by_patch, versus
from dbr_service.commands.cmd_run import preload_env


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.service_ab", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=41, help="rounds (default 41)")
    ap.add_argument("-a", action="append", default=[], metavar="KEY=VALUE",
                    help="a setting of service A (repeatable)")
    ap.add_argument("-b", action="append", default=[], metavar="KEY=VALUE",
                    help="a setting of service B (repeatable)")
    ap.add_argument("--env-a", action="append", default=[], metavar="NAME=VALUE",
                    help="an environment variable of the program under A (repeatable)")
    ap.add_argument("--env-b", action="append", default=[], metavar="NAME=VALUE",
                    help="an environment variable of the program under B (repeatable)")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds a run may take")
    ap.add_argument("prog", nargs=argparse.REMAINDER, help="-- PROG [ARG ...]")
    args = ap.parse_args(argv)
    prog = program_of(ap, args)
    extra_env = {}
    for name, given in (("A", args.env_a), ("B", args.env_b)):
        extra_env[name] = {}
        for item in given:
            key, sep, value = item.partition("=")
            if not sep or not key:
                ap.error(f"--env-{name.lower()} {item!r}: expected NAME=VALUE")
            extra_env[name][key] = value
    exe = shutil.which(prog[0])
    if exe is None:
        ap.error(f"{prog[0]}: not found")
    agent = dbr_agent.agent_path()
    if agent is None:
        print("service_ab: libdbr_agent.so cannot be built", file=sys.stderr)
        return 1
    base = dict(os.environ, LC_ALL="C")
    base.pop("LD_PRELOAD", None)
    services = {"A": HostService(args.a), "B": HostService(args.b)}
    work = Path(tempfile.mkdtemp(prefix="dbr-service-ab-"))
    try:
        envs = {"native": base}
        for name, svc in services.items():
            why = svc.start(base)
            if why is not None:
                print(f"service_ab: service {name} {why}", file=sys.stderr)
                return 1
            envs[name] = preload_env(dict(base, DBR_RUNTIME_DIR=svc.rt, **extra_env[name]),
                                     agent)
        names = list(envs)
        walls: dict[str, list[float]] = {n: [] for n in names}
        cpu: dict[str, list[float]] = {n: [] for n in services}
        patched: dict[str, list[bool | None]] = {n: [] for n in services}
        argv_run = [exe, *prog[1:]]
        for rnd in range(args.runs + 1):           # round 0 warms up, not counted
            k = rnd % len(names)
            for n in names[k:] + names[:k]:
                svc = services.get(n)
                c0 = svc.cpu_s() if svc else None
                r = run_once(argv_run, envs[n], work / "run", [], args.timeout)
                if r.exit_code != 0 or r.timed_out:
                    print(f"service_ab: {n} run {'timed out' if r.timed_out else 'exited'} "
                          f"{r.exit_code}: {r.stderr_tail}", file=sys.stderr)
                    return 1
                if rnd:
                    walls[n].append(r.wall)
                    if svc:
                        patched[n].append(svc.patched(r.pid))
                    c1 = svc.cpu_s() if svc else None
                    if c0 is not None and c1 is not None:
                        cpu[n].append(c1 - c0)
    finally:
        for svc in services.values():
            svc.stop()
        shutil.rmtree(work, ignore_errors=True)
    rows = {}
    for n in names:
        v = versus(walls[n], walls["native"])
        rows[n] = {"median_s": statistics.median(walls[n]), "ratio": v["ratio"],
                   "paired": v["paired"]}
        if cpu.get(n):
            rows[n]["service_cpu_mean_s"] = statistics.mean(cpu[n])
        print(f"{n:7s} median {rows[n]['median_s'] * 1e3:8.1f} ms  over native "
              f"{rows[n]['ratio']:.4f} (paired {rows[n]['paired']:.4f})"
              + (f"  service CPU a run {rows[n]['service_cpu_mean_s'] * 1e3:.1f} ms"
                 if "service_cpu_mean_s" in rows[n] else ""))
    for n in services:
        p = patched[n]
        rows[n]["runs_patched"] = p.count(True)
        print(f"{n:7s} code installed in {p.count(True)} of {len(p)} runs"
              + (f" ({p.count(None)} unknown)" if None in p else ""))
        for key, side in by_patch(list(zip(walls[n], walls["native"])), p).items():
            if side["rounds"] < len(p):     # only where some runs were patched and some not
                ci = side["ratio_ci95"]
                rows[n][f"ratio_{key}"], rows[n][f"ratio_{key}_ci95"] = side["ratio"], ci
                print(f"        its {side['rounds']} {key} rounds over native "
                      f"{side['ratio']:.4f}" + (f" [{ci[0]:.4f}-{ci[1]:.4f}]" if ci else ""))
    b_a = versus(walls["B"], walls["A"])   # interval as bench.compare's verdicts
    ba, (lo, hi) = b_a["ratio"], b_a["ci95"]
    print(f"B over A {ba:.4f} [{lo:.4f}-{hi:.4f}]  "
          f"(A: {' '.join(args.a + args.env_a) or 'defaults'}; "
          f"B: {' '.join(args.b + args.env_b) or 'defaults'})")
    path = write_results("service_ab", {
        "machine": machine(), "prog": prog, "runs": args.runs, "a": args.a, "b": args.b,
        "env_a": args.env_a, "env_b": args.env_b,
        "configs": rows, "b_over_a": ba, "b_over_a_ci95": [lo, hi], "walls": walls,
        "service_cpu_s": cpu, "patched": patched})
    print(f"written {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
