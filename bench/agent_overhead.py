"""What the agent costs a client that is never patched.

* start-up: a trivial program with vs. without LD_PRELOAD of the agent (no
  service answering: the agent is dormant), many alternated runs, median delta.
* steady state: a CPU-bound program with vs. without the agent, median ratio.
* thread start: a program that starts and joins threads that do nothing, one at a
  time (bench/workloads/thread_start.c), pinned to one CPU, timed inside the
  program: nanoseconds per thread without the agent, with the dormant agent, with
  the dormant agent's fallback thread (DBR_AGENT_THREAD=pthread), and with the agent
  before its birth (a runtime dir whose hint plans the birth after the run, as a
  host service's does for a program's first second, or for a program born late).

Targets: under 2 ms added start-up, under 0.5 % steady state; the thread start
figures have none (they are the agent's per-thread cost, for docs/decisions/).
usage: python -m bench.agent_overhead [--quick]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

import dbr_agent
from bench.common import ab, machine, timed, write_results
from dbr_service.common.paths import QUIET_FILE, write_ms_file

PROGS = Path(__file__).resolve().parents[1] / "tests" / "agent_progs"
WORKLOADS = Path(__file__).resolve().parent / "workloads"


def build(src: str, out_dir: str, where: Path = PROGS, libs: tuple[str, ...] = ()) -> str:
    out = os.path.join(out_dir, Path(src).stem)
    subprocess.run(["gcc", "-O2", "-o", out, str(where / src), *libs], check=True)
    return out


def per_thread_ns(exe: str, n: int, env: dict, cpu: int) -> Callable[[], float]:
    """A runner for ab(): the program's own figure, ns per thread start+join, pinned to
    ``cpu`` (a failing run or a figure that is not a number stops the benchmark)."""
    def run() -> float:
        p = subprocess.run([exe, str(n)], env=env, capture_output=True, text=True,
                           timeout=300, preexec_fn=lambda: os.sched_setaffinity(0, {cpu}))
        if p.returncode != 0:
            raise SystemExit(f"{exe} {n} exited {p.returncode}")
        try:
            return float(p.stdout.split()[-1])
        except (IndexError, ValueError):
            raise SystemExit(f"{exe} {n} printed {p.stdout!r}, not ns per thread") from None
    return run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer runs")
    args = ap.parse_args(argv)
    agent = dbr_agent.agent_path()
    with tempfile.TemporaryDirectory() as d:
        trivial, cpu = build("trivial.c", d), build("cpuloop.c", d)
        rt = os.path.join(d, "rt")  # nobody listens here: the agent stays dormant
        os.mkdir(rt)
        base = dict(os.environ, DBR_RUNTIME_DIR=rt)
        base.pop("LD_PRELOAD", None)
        with_agent = dict(base, LD_PRELOAD=agent)
        unborn = os.path.join(d, "rt-unborn")   # a hint of 5 s: born after every run here
        os.mkdir(unborn)
        write_ms_file(os.path.join(unborn, QUIET_FILE), 5000)

        # Start-up: a shell loop of K starts per sample (the agent preloaded into the
        # measured program only).  Timing single starts from Python is confounded here:
        # native starts went 0.68 -> 1.97 ms after ~100 spawns from one Python process.
        k = 100
        loops = {pre: ["sh", "-c", f"i=0; while [ $i -lt {k} ]; do {pre}{trivial}; "
                       "i=$((i+1)); done"] for pre in ("", f"LD_PRELOAD={agent} ")}
        n_start = 7 if args.quick else 21
        per = ab("startup-trivial-x100", timed(loops[""], base),
                 timed(loops[f"LD_PRELOAD={agent} "], base), runs=n_start, warmup=2)
        startup = type(per)(per.name, per.runs, per.a_median / k, per.b_median / k,
                            per.ratio, [x / k for x in per.a_all], [x / k for x in per.b_all],
                            note=f"per start, from loops of {k} starts")
        iters = "150" if args.quick else "400"
        n_cpu = 3 if args.quick else 7
        steady = ab("steady-cpuloop", timed([cpu, iters], base), timed([cpu, iters], with_agent),
                    runs=n_cpu)

        starter = build("thread_start.c", d, WORKLOADS, ("-lpthread",))
        n_threads, n_ts = (5000, 7) if args.quick else (20000, 21)
        pin = max(os.sched_getaffinity(0))
        native_ts = per_thread_ns(starter, n_threads, base, pin)
        thread_start = ab("thread-start-ns", native_ts,
                          per_thread_ns(starter, n_threads, dict(with_agent, DBR_AGENT_THREAD=""),
                                        pin), runs=n_ts)
        thread_start_p = ab("thread-start-ns-pthread", native_ts,
                            per_thread_ns(starter, n_threads,
                                          dict(with_agent, DBR_AGENT_THREAD="pthread"), pin),
                            runs=n_ts)
        thread_start_u = ab("thread-start-ns-unborn", native_ts,
                            per_thread_ns(starter, n_threads,
                                          dict(with_agent, DBR_AGENT_THREAD="",
                                               DBR_RUNTIME_DIR=unborn), pin),
                            runs=n_ts)
    rows = [
        ("start-up added (ms, median)", f"{startup.delta * 1e3:+.3f}", "< 2 ms",
         startup.delta < 0.002),
        ("start-up ratio agent/native", f"{startup.ratio:.3f}", "", None),
        ("steady state ratio agent/native", f"{steady.ratio:.4f}", "< 1.005",
         steady.ratio < 1.005),
        ("thread start, native (ns, median)", f"{thread_start.a_median:.0f}", "", None),
        ("thread start added, agent (ns, median)", f"{thread_start.delta:+.0f}", "", None),
        ("thread start added, agent pthread (ns, median)", f"{thread_start_p.delta:+.0f}", "",
         None),
        ("thread start added, agent before its birth (ns, median)",
         f"{thread_start_u.delta:+.0f}", "", None),
    ]
    print(f"# agent overhead, never patched ({startup.runs} / {steady.runs} / "
          f"{thread_start.runs} alternated runs)")
    print("| metric | value | target | met |\n|---|---|---|---|")
    for name, val, target, met in rows:
        print(f"| {name} | {val} | {target} | {'' if met is None else ('yes' if met else 'NO')} |")
    path = write_results("agent_overhead", {"machine": machine(), "startup": startup,
                                            "steady": steady, "thread_start": thread_start,
                                            "thread_start_pthread": thread_start_p,
                                            "thread_start_unborn": thread_start_u})
    print(f"written {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
