"""Region-selection throughput on cc1's hot code: what one job of the service costs.

gcc's ``cc1`` (a stripped distribution binary, a flat profile: its hottest address
holds under 1 % of its samples) compiles the long benchmark's generated C file.  It is
sampled by dbr's own perf sampler (cpu-clock, 1 ms per thread, as the service) for a
window, stopped (SIGSTOP), and selection runs over its live memory exactly as a
service job does: the default settings for that many samples (worker.region_config),
the client's function entries from its mapped files (FDE starts, symbols, call
targets).  Reported per window: samples, blocks and instructions discovery decoded,
seconds of discovery and of the passes after it, instructions analysed per second of
the whole job, regions selected (hot functions among them).  The time to the first hot
text a client sees is the long benchmark's "first patch s".

    python -m bench pipeline_rate [--windows 1,4] [--quick]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from bench.common import code_version, machine, write_results

WINDOWS = (1.0, 4.0)


def _cc1_command(quick: bool) -> tuple[list[str], str]:
    from bench.long import tools, workloads

    exe = tools.cc1()
    if not exe:
        raise SystemExit("pipeline_rate: gcc 12's cc1 not found "
                         "(/usr/lib/gcc/x86_64-linux-gnu/12/cc1; `make bench-setup`)")
    ctx = workloads.Ctx(quick=quick, work=Path(tempfile.gettempdir()), log=lambda m: None)
    src = workloads._c_input(ctx, workloads.CC1_FUNCS[quick])
    return [str(exe), "-quiet", "-O2", str(src), "-o", "out.s"], str(exe)


def measure(argv: list[str], window_s: float) -> dict:
    from dbr_service.common.clientfiles import ProcHandle
    from dbr_service.codegen.frames import CfiSource
    from dbr_service.common.config import Config
    from dbr_service.region.discovery import hot_code_discovery
    from dbr_service.region.functions import FunctionEntries, call_targets
    from dbr_service.region.memview import LiveMemoryView
    from dbr_service.region.pipeline import run_pipeline
    from dbr_service.sampling.perf import sample_ips
    from dbr_service.region.worker import region_config

    with tempfile.TemporaryDirectory() as d:
        env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
        p = subprocess.Popen(argv, cwd=d, env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
        try:
            hot = sample_ips(p.pid, window_s)
            os.kill(p.pid, signal.SIGSTOP)          # selection reads its memory meanwhile
            if p.poll() is not None or not hot:
                return {"status": "ended before it was sampled"}
            proc = ProcHandle(p.pid)
            maps = [(m.lo, m.hi, m.path, m.dev, m.ino) for m in proc.maps() or []
                    if m.path.startswith("/")]
            proc.close()
            functions = FunctionEntries(module_at=CfiSource(lambda: maps).module_at)
            cfg = region_config(Config(), sum(hot.values()))
            mem = LiveMemoryView(p.pid)
            t0 = time.perf_counter()
            first = hot_code_discovery(dict(hot), mem,
                                       jumps_from_hot_limit=cfg.jumps_from_hot_limit)
            functions.add(call_targets(first))
            first.info["function_entries"] = functions
            t1 = time.perf_counter()
            blocks = len(first)
            insns = sum(len(bb.insns) for _, bb in first.blocks())
            res = run_pipeline(first, mem, cfg)
            t2 = time.perf_counter()
            mem.close()
        finally:
            p.kill()
            p.wait()
    regions = res.regions
    return {"status": "ok", "window_s": window_s, "samples": sum(hot.values()),
            "distinct_ips": len(hot), "top_ip_share": round(max(hot.values()) /
                                                            sum(hot.values()), 4),
            "blocks": blocks, "insns": insns, "discovery_s": round(t1 - t0, 3),
            "passes_s": round(t2 - t1, 3), "job_s": round(t2 - t0, 3),
            "insns_per_s": round(insns / (t2 - t0)) if t2 > t0 else None,
            "regions": len(regions),
            "hot_functions": sum(1 for sr in regions if sr.info.get("hot_function")),
            "region_bytes": sum(bb.size for sr in regions for _, bb in sr.blocks()),
            "pass_s": {k: round(v, 3) for k, v in res.timings.items()},
            "failures": len(res.failures)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--windows", default=",".join(f"{w:g}" for w in WINDOWS),
                    help="sampling windows in seconds, comma-separated (default 1,4)")
    ap.add_argument("--quick", action="store_true", help="the smaller input, window 1 s")
    args = ap.parse_args(argv)
    try:
        windows = [float(w) for w in args.windows.split(",") if w.strip()]
    except ValueError:
        ap.error(f"--windows: not a list of numbers: {args.windows!r}")
    if not windows or any(not 0 < w <= 60 for w in windows):
        ap.error("--windows: each window in (0, 60] seconds")
    if args.quick:
        windows = windows[:1]
    cmd, exe = _cc1_command(args.quick)
    print("| window s | samples | top address | blocks | instructions | discovery s | "
          "passes s | instructions/s | regions (hot functions) | region bytes |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for w in windows:
        r = measure(cmd, w)
        rows.append(r)
        if r["status"] != "ok":
            print(f"| {w:g} | {r['status']} |||||||||", flush=True)
            continue
        print(f"| {w:g} | {r['samples']} | {100 * r['top_ip_share']:.1f} % | {r['blocks']} | "
              f"{r['insns']} | {r['discovery_s']:.2f} | {r['passes_s']:.2f} | "
              f"{r['insns_per_s'] / 1e3:.1f} k | {r['regions']} ({r['hot_functions']}) | "
              f"{r['region_bytes']} |", flush=True)
    path = write_results("pipeline_rate", {"machine": machine(), "code": code_version(),
                                           "program": exe, "command": cmd[1:],
                                           "rows": rows})
    print(f"results: {path}")
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
