"""`make bench` / `python -m bench [--quick] [NAME...]`: run the registered benchmarks."""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import time

#: Left out of --quick (which must finish in 3 minutes), with the reason printed.
QUICK_SKIP = {
    "sampling_overhead": "its runs must last several default snapshot intervals to be "
                         "sampled at all (about a minute); run it by name",
    "steady_state": "its runs must last long enough for a quiet client's sampling to "
                    "back off (about 18 minutes); run it by name",
}

#: Run only when named (`python -m bench long ...`): too long for a plain `make bench`.
NAMED_ONLY = {
    "long": "long-running programs against BOLT and PGO (about 45 minutes, --quick under "
            "10); run it by name: python -m bench long [--quick]",
    "probes": "dbr count probes against kernel uprobes: needs root, perf and tracefs; run "
              "it by name: python -m bench probes",
}

# name -> module with main(argv) -> int, in the order they run.
BENCHMARKS = [
    ("agent_overhead", "bench.agent_overhead"),      # the agent, never patched
    ("sampling_overhead", "bench.sampling_overhead"),  # what sampling costs
    ("compare", "bench.compare"),     # dbr vs native, PGO, perf, valgrind
    ("codegen_rate", "bench.codegen_rate"),  # replacement-code bytes per second
    ("pipeline_rate", "bench.pipeline_rate"),  # region selection on cc1: instructions/s
    ("scaling", "bench.scaling"),     # 1..64 clients under one service
    ("steady_state", "bench.steady_state"),  # long runs, sampling backoff
    ("long", "bench.long.main"),      # 15-60 s programs vs BOLT and PGO
    ("probes", "bench.probes"),       # cost per hit: dbr count probe vs uprobe
]


def _terminate(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="fewer runs, smaller inputs")
    ap.add_argument("names", nargs="*", help="subset of: " + ", ".join(n for n, _ in BENCHMARKS))
    given = list(sys.argv[1:] if argv is None else argv)
    if given and given[0] == "long" or given[:2] == ["--quick", "long"]:
        # `python -m bench long ...`: its own options (--pairs, --only, --setup, ...)
        given.remove("long")
        return importlib.import_module("bench.long.main").main(given)
    args = ap.parse_args(argv)
    unknown = set(args.names) - {n for n, _ in BENCHMARKS}
    if unknown:
        ap.error(f"unknown benchmark(s): {', '.join(sorted(unknown))}")
    # One session: the benchmarks of this invocation share bench/results/latest.json.
    os.environ.setdefault("DBR_BENCH_SESSION", f"{os.getpid()}-{time.time():.0f}")
    os.environ.setdefault("DBR_BENCH_COMMAND", " ".join(["python", "-m", "bench", *(argv if argv
                                                         is not None else sys.argv[1:])]))
    # SIGTERM unwinds like Ctrl-C: runs in progress are killed, partial results written.
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    t0 = time.monotonic()
    rc = 0
    for name, mod in BENCHMARKS:
        if args.names and name not in args.names:
            continue
        if not args.names and name in NAMED_ONLY:
            print(f"== {name}: not run unless named ({NAMED_ONLY[name]})", flush=True)
            continue
        if args.quick and not args.names and name in QUICK_SKIP:
            print(f"== {name}: skipped in --quick ({QUICK_SKIP[name]})", flush=True)
            continue
        print(f"== {name}", flush=True)
        try:
            rc |= importlib.import_module(mod).main(["--quick"] if args.quick else [])
        except Exception as exc:  # a crashed benchmark is reported, the rest still run
            print(f"!! {name} failed: {exc!r}", flush=True)
            rc = 1
    print(f"== done in {time.monotonic() - t0:.0f} s", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
