"""What a program pays for the agent once it is born late, against what it pays for
any preloaded library (docs/decisions/0007-short-running-programs-born-late.md).

Four configurations of one program, alternated in a random order every round, each
run in a session of its own (a new autogroup, as bench.compare and a service manager
start programs), no service running:

* ``native``;
* ``empty``: an empty shared library preloaded (built here), with the same
  environment as the next two (its size moves the stack, and so the timing);
* ``disabled``: the agent preloaded with ``DBR_AGENT_DISABLE=1``;
* ``late``: the agent preloaded beside a runtime dir whose hint is 1000 ms and whose
  program file (dbr_service/daemon/shortruns.py) says 3000 ms, as a host service writes it
  for a program it found to run too short to gain: a run that ends sooner has no
  agent thread and no session.

Prints each configuration's median over native with its 95 % bootstrap interval
(rounds resampled whole) and the paired median, and writes preload_floor.json.

usage: python -m bench.preload_floor [--runs N] -- PROG [ARG ...]
  e.g. --runs 150 -- bench/results/cache/c/churn-*/native/churn 60000
"""

from __future__ import annotations

import argparse
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
from bench.common import machine, program_of, write_results
from bench.stats import versus
from dbr_service.common.paths import QUIET_FILE, program_key, program_quiet_file, write_ms_file


def configs(agent: str, empty: str, rundir: str) -> dict[str, dict[str, str]]:
    env = {"DBR_AGENT_DISABLE": "1", "DBR_RUNTIME_DIR": rundir}
    return {"native": {},
            "empty": {"LD_PRELOAD": empty, **env},
            "disabled": {"LD_PRELOAD": agent, **env},
            "late": {"LD_PRELOAD": agent, "DBR_RUNTIME_DIR": rundir}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.preload_floor", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=60, help="rounds (default 60)")
    ap.add_argument("--seed", type=int, default=7, help="of the order within rounds")
    ap.add_argument("prog", nargs=argparse.REMAINDER, help="-- PROG [ARG ...]")
    args = ap.parse_args(argv)
    prog = program_of(ap, args)
    exe = os.path.realpath(shutil.which(prog[0]) or prog[0])
    try:
        key = program_key(os.stat(exe))
    except OSError as exc:
        ap.error(f"cannot stat {prog[0]} ({exc}): give its path")
    agent = dbr_agent.agent_path()
    base = {k: v for k, v in os.environ.items()
            if not k.startswith("DBR_") and k != "LD_PRELOAD"}
    with tempfile.TemporaryDirectory(prefix="dbr-floor-") as tmp:
        empty = os.path.join(tmp, "libempty.so")
        src = os.path.join(tmp, "empty.c")
        Path(src).write_text("void dbr_bench_empty(void) {}\n")
        subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-o", empty, src], check=True)
        rundir = os.path.join(tmp, "run")
        os.mkdir(rundir)
        write_ms_file(Path(rundir, QUIET_FILE), 1000)
        write_ms_file(Path(rundir, program_quiet_file(key)), 3000)
        cfgs = configs(agent, empty, rundir)
        walls: dict[str, list[float]] = {k: [] for k in cfgs}
        rng = random.Random(args.seed)
        for _ in range(args.runs):
            order = list(cfgs)
            rng.shuffle(order)
            for name in order:
                t = time.monotonic()
                subprocess.run([exe, *prog[1:]], env=dict(base, **cfgs[name]), check=True,
                               stdout=subprocess.DEVNULL, start_new_session=True)
                walls[name].append(time.monotonic() - t)
    rows = {}
    for name, w in walls.items():
        v = versus(w, walls["native"])
        ci = v["ci95"]
        rows[name] = {"median_s": statistics.median(w), "ratio": v["ratio"], "ci": ci,
                      "paired": v["paired"]}
        print(f"{name:9s} median {statistics.median(w):.4f} s  over native "
              f"{v['ratio']:.4f} [{ci[0]:.4f}-{ci[1]:.4f}]  paired {v['paired']:.4f}")
    path = write_results("preload_floor", {"prog": [exe, *prog[1:]], "runs": args.runs,
                                           "machine": machine(), "configs": rows,
                                           "walls": walls})
    print(f"written {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
