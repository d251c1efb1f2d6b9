"""Code generation throughput: bytes of replacement code emitted per second.

For each workload of ``bench/suite.py`` (C programs and real programs, same inputs
as ``compare``): start it natively, sample it with perf cpu-clock for a short window
(no agent, nothing patched), stop it (SIGSTOP), select regions over its live memory
with the service's default region settings, then kill it.  The selected regions are
pure data from then on; emission (relocation, layout, dispatch translation, far exits,
the whole ``emit_region``) runs on them repeatedly at a base near their patch sites,
the way the service's placement does.  Reported per workload: regions, their
instructions and code bytes, region selection time (one run, for scale), and emission
throughput (bytes per second of the median pass over 5 passes; each pass emits every
region once).  Selection is what makes a region's first patch slow; emission is not.

    python -m bench codegen_rate [--quick]
    python -m bench.codegen_rate [--quick] [WORKLOAD...]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from bench import suite
from bench.common import code_version, machine, write_results

#: Sampling window per workload (the suite's programs run 0.3-1.5 s natively here;
#: 0.1-0.4 s on --quick inputs).
WINDOW_S, QUICK_WINDOW_S = 0.3, 0.08
PASSES = 5
QUICK = ("interp", "xlib", "gzip", "bzip2")


def measure(w: suite.Workload, ctx: suite.Ctx, passes: int) -> dict:
    from dbr_service.codegen.emit import emit_region
    from dbr_service.common.config import Config
    from dbr_service.installation.optimize import provisional_base
    from dbr_service.region.memview import LiveMemoryView
    from dbr_service.region.pipeline import select_regions
    from dbr_service.sampling.perf import sample_ips
    from dbr_service.region.worker import region_config

    prep = w.prepare(ctx)
    with tempfile.TemporaryDirectory() as d:
        env = prep.environ(os.environ)
        env.pop("LD_PRELOAD", None)
        p = subprocess.Popen(prep.argv, cwd=d, env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
        try:
            hot = sample_ips(p.pid, QUICK_WINDOW_S if ctx.quick else WINDOW_S, 250, 0.02)
            os.kill(p.pid, signal.SIGSTOP)         # selection reads its memory meanwhile
            if p.poll() is not None or not hot:
                return {"status": "ended before it was sampled"}
            mem = LiveMemoryView(p.pid)
            t0 = time.perf_counter()
            res = select_regions(dict(hot), mem, region_config(Config(), sum(hot.values())))
            select_s = time.perf_counter() - t0
            mem.close()
        finally:
            p.kill()
            p.wait()
    regions = res.regions
    if not regions:
        return {"status": "no region selected", "samples": sum(hot.values()),
                "select_s": round(select_s, 3)}
    bases = [provisional_base(sr) for sr in regions]
    code = [emit_region(sr, b) for sr, b in zip(regions, bases)]     # warm-up, and sizes
    nbytes = sum(g.size for g in code)
    ninsns = sum(len(bb.insns) for sr in regions for _, bb in sr.blocks())
    times = []
    for _ in range(passes):
        t0 = time.perf_counter()
        for sr, b in zip(regions, bases):
            emit_region(sr, b)
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    return {"status": "ok", "samples": sum(hot.values()), "regions": len(regions),
            "insns": ninsns, "code_bytes": nbytes, "select_s": round(select_s, 3),
            "emit_s_median": med, "emit_s_all": times,
            "bytes_per_s": nbytes / med if med > 0 else None,
            "insns_per_s": ninsns / med if med > 0 else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    ap.add_argument("workloads", nargs="*")
    args = ap.parse_args(argv)
    ctx = suite.Ctx(quick=args.quick, log=lambda m: print(f"   {m}", flush=True))
    ws = suite.registry()
    names = args.workloads or ([w.name for w in ws if w.name in QUICK] if args.quick
                               else [w.name for w in ws])
    unknown = set(names) - {w.name for w in ws}
    if unknown:
        ap.error(f"unknown workload(s): {', '.join(sorted(unknown))}")
    rows = {}
    print("| workload | status | samples | regions | instructions | code bytes | "
          "selection s | emission ms (median of 5) | bytes/s | instructions/s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for w in ws:
        if w.name not in names:
            continue
        try:
            r = measure(w, ctx, 3 if args.quick else PASSES)
        except suite.Skip as e:
            r = {"status": f"skipped: {e}"}
        except Exception as e:       # a failing workload is reported, the rest still run
            r = {"status": f"failed: {type(e).__name__}: {e}"}
        rows[w.name] = r
        if r["status"] == "ok":
            print(f"| {w.name} | ok | {r['samples']} | {r['regions']} | {r['insns']} | "
                  f"{r['code_bytes']} | {r['select_s']:.2f} | {1e3 * r['emit_s_median']:.1f} "
                  f"| {r['bytes_per_s'] / 1e3:.0f} k | {r['insns_per_s'] / 1e3:.1f} k |",
                  flush=True)
        else:
            print(f"| {w.name} | {r['status']} | {r.get('samples', '–')} | 0 | – | – | "
                  f"{r.get('select_s', '–')} | – | – | – |", flush=True)
    ok = [r for r in rows.values() if r["status"] == "ok"]
    total = {"code_bytes": sum(r["code_bytes"] for r in ok),
             "emit_s": sum(r["emit_s_median"] for r in ok)}
    if total["emit_s"] > 0:
        total["bytes_per_s"] = total["code_bytes"] / total["emit_s"]
        print(f"all workloads: {total['code_bytes']} bytes in {1e3 * total['emit_s']:.1f} ms "
              f"of emission = {total['bytes_per_s'] / 1e3:.0f} kB/s", flush=True)
    path = write_results("codegen_rate", {"machine": machine(), "version": code_version(),
                                          "window_s": QUICK_WINDOW_S if args.quick else WINDOW_S,
                                          "workloads": rows, "total": total, "quick": args.quick})
    print(f"written {path}")
    return 0 if ok or not rows else 1


if __name__ == "__main__":
    sys.exit(main())
