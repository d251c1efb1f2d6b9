"""Cost per hit of dbr count and latency probes against kernel uprobes on the same
function.

`python -m bench.probes [--calls N] [--uprobe-calls N] [--rounds R]`.  The program is
tests/agent_progs/probed.c: "go N" calls ``work`` N times and prints the loop's time.
Each round, alternated in this order:

* **dbr**: the program under a dbr service (on a private runtime dir, paused so
  that no region is installed): "go N" with no probe, then with a count probe on
  ``work`` (`probe_add`), then with a latency probe instead, then without again
  (`probe_del`); each probe's count must be N.
* **uprobe**: ``perf probe -x PROG work`` and ``work%return`` (a uretprobe) once,
  then per round ``perf stat -e probe_<prog>:work -x, -- PROG`` running "go N", and
  the same with both events (what timing a call with uprobes takes: a trap at the
  entry and one at the return); perf's counts must be N.
* **native**: the program alone, "go N".

Cost per hit = (loop time with the probe - loop time without) / N, in ns; the dbr
baseline is the same process's runs without a probe, the uprobe baseline the
native run of the same round.  Medians over the rounds.  Needs root, ``perf`` and
uprobes (``/sys/bus/event_source/devices/uprobe`` and tracefs mounted at
/sys/kernel/tracing); without them only dbr is measured, and the reason is printed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from harness import LineReader, compile_c  # noqa: E402
from service_helpers import ServiceProc, agent_path, kill  # noqa: E402


def _took(lines: list[str]) -> int:
    return next(int(ln.split()[1]) for ln in lines if ln.startswith("took "))


def _go(proc: subprocess.Popen, out: LineReader, n: int) -> int:
    proc.stdin.write(f"go {n}\n".encode())
    proc.stdin.flush()
    took = int(out.expect("took", 600).split()[1])
    out.expect("ready", 60)
    return took


def uprobe_problem() -> str | None:
    """Why uprobes cannot be measured here, or None."""
    if os.geteuid() != 0:
        return "not root"
    if shutil.which("perf") is None:
        return "perf is not installed (make bench-setup installs linux-perf)"
    if not os.path.isdir("/sys/bus/event_source/devices/uprobe"):
        return "the kernel has no uprobe PMU"
    if not os.path.exists("/sys/kernel/tracing/uprobe_events"):
        return ("tracefs is not mounted at /sys/kernel/tracing (perf probe needs it: "
                "mount -t tracefs nodev /sys/kernel/tracing)")
    return None


def _probed_go(svc: ServiceProc, proc: subprocess.Popen, out: LineReader, n: int,
               kind: str) -> int:
    """Loop ns of "go n" with a ``kind`` probe on work; the probe is removed after."""
    p = svc.call("probe_add", {"pid": proc.pid, "location": "work", "kind": kind},
                 timeout=40.0)
    took = _go(proc, out, n)
    count = svc.call("probe_show", {"pid": proc.pid, "id": p["id"]})["count"]
    if count != n:
        raise SystemExit(f"dbr {kind} probe counted {count}, not {n}")
    svc.call("probe_del", {"pid": proc.pid, "id": p["id"]})
    return took


def dbr_round(svc: ServiceProc, prog: str, n: int) -> tuple[int, int, int, int]:
    """(loop ns without, with a count probe, with a latency probe, without again) in
    one process under the service."""
    env = dict(os.environ, DBR_RUNTIME_DIR=svc.dir, LD_PRELOAD=agent_path(),
               DBR_AGENT_QUIET_MS="0")
    proc = subprocess.Popen([prog], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL)
    try:
        out = LineReader(proc.stdout)
        out.expect("ready")
        svc.wait_for(lambda: any(c["pid"] == proc.pid and c["state"] == "connected"
                                 for c in svc.call("clients")), 15, "the session")
        svc.call("pause", {"pid": proc.pid})
        base = _go(proc, out, n)
        counted = _probed_go(svc, proc, out, n, "count")
        timed = _probed_go(svc, proc, out, n, "latency")
        after = _go(proc, out, n)
        return base, counted, timed, after
    finally:
        kill(proc)


def native_run(prog: str, n: int, perf_event: str | None = None) -> tuple[int, int | None]:
    """Loop ns of one run alone (or under ``perf stat -e perf_event``, events
    separated by commas), and perf's smallest count of them."""
    with tempfile.NamedTemporaryFile("w+", suffix=".csv") as stat:
        argv = [prog] if perf_event is None else \
            ["perf", "stat", "-x,", "-o", stat.name, "-e", perf_event, "--", prog]
        r = subprocess.run(argv, input=f"go {n}\nexit\n", capture_output=True, text=True,
                           timeout=900, check=True)
        count = None
        if perf_event is not None:
            stat.seek(0)
            for ln in stat.read().splitlines():
                f = ln.split(",")
                if len(f) > 2 and f[2] in perf_event.split(","):
                    count = int(f[0]) if count is None else min(count, int(f[0]))
        return _took(r.stdout.splitlines()), count


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.probes", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=10_000_000, help="calls per dbr run")
    ap.add_argument("--uprobe-calls", type=int, default=1_000_000,
                    help="calls per uprobe run (each hit traps: fewer)")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    if agent_path() is None:
        print("probes: the agent cannot be built", file=sys.stderr)
        return 1
    prog = str(compile_c([ROOT / "tests/agent_progs/probed.c"], flags=["-fcf-protection=none"],
                         out_name="probed"))
    why = uprobe_problem()
    event = ret_event = None
    if why is None:
        r = subprocess.run(["perf", "probe", "-q", "-x", prog, "work"], capture_output=True,
                           text=True, timeout=60)
        subprocess.run(["perf", "probe", "-q", "-x", prog, "work%return"], capture_output=True,
                       text=True, timeout=60)
        listed = subprocess.run(["perf", "probe", "-l"], capture_output=True, text=True,
                                timeout=60).stdout.splitlines()
        # perf names the group after the file's name up to its first '-' or '.'
        event = next((ln.split()[0] for ln in listed if prog in ln and ln.split()[0]
                      .endswith(":work")), None)
        ret_event = next((ln.split()[0] for ln in listed if prog in ln and ln.split()[0]
                          .endswith(":work__return")), None)
        if event is None or ret_event is None:
            why = f"perf probe failed: {r.stderr.strip()[:200]}"
    if why:
        print(f"probes: uprobes not measured: {why}")
    svc = ServiceProc().wait_ready()
    dbr_cost, lat_cost, up_cost, upret_cost, native_ns = [], [], [], [], []
    try:
        for rnd in range(args.rounds):
            base, counted, timed, after = dbr_round(svc, prog, args.calls)
            dbr_cost.append((counted - (base + after) / 2) / args.calls)
            lat_cost.append((timed - (base + after) / 2) / args.calls)
            line = (f"round {rnd + 1}: dbr count {dbr_cost[-1]:.2f} ns/hit, "
                    f"dbr latency {lat_cost[-1]:.2f} ns/call")
            if event is not None:
                nat, _ = native_run(prog, args.uprobe_calls)
                for events, costs in ((event, up_cost), (f"{event},{ret_event}", upret_cost)):
                    up, count = native_run(prog, args.uprobe_calls, events)
                    if count != args.uprobe_calls:
                        raise SystemExit(f"perf counted {count} hits of {events}, not "
                                         f"{args.uprobe_calls}")
                    costs.append((up - nat) / args.uprobe_calls)
                line += (f", uprobe {up_cost[-1]:.1f} ns/hit, uprobe+uretprobe "
                         f"{upret_cost[-1]:.1f} ns/call")
            nat, _ = native_run(prog, args.calls)
            native_ns.append(nat / args.calls)
            print(line + f", native call {native_ns[-1]:.2f} ns", flush=True)
    finally:
        svc.stop()
        for ev in (event, ret_event):
            if ev is not None:
                subprocess.run(["perf", "probe", "-q", "-d", ev], capture_output=True,
                               timeout=60)
    med = statistics.median
    print(f"median over {args.rounds} rounds: native call {med(native_ns):.2f} ns; "
          f"dbr count probe {med(dbr_cost):.2f} ns/hit; dbr latency probe "
          f"{med(lat_cost):.2f} ns/call"
          + (f"; uprobe {med(up_cost):.1f} ns/hit; uprobe+uretprobe {med(upret_cost):.1f} "
             f"ns/call ({med(upret_cost) / max(med(lat_cost), 1e-3):.0f}x the latency probe)"
             if up_cost else ""))
    return 0


if __name__ == "__main__":
    t0 = time.monotonic()
    rc = main()
    print(f"({time.monotonic() - t0:.0f} s)")
    sys.exit(rc)
