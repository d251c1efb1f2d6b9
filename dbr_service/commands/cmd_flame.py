"""``dbr ctl flamegraph PID``: ask the service for a client's call stacks and draw them.

The service samples for ``--seconds`` (commands/stackjobs.py); this side asks again until the
answer is complete (bounded: the sampling time plus :data:`SLACK_S`), then writes the
folded stacks (``--folded FILE``, ``-`` for standard output) and the SVG
(``--svg FILE``, stacks/flamegraph.py), and prints the hottest functions.  Output paths are
checked before the service is asked, so a bad path costs no sampling.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from typing import Any, Callable

from dbr_service.commands.ctlclient import Code, ControlClient
from dbr_service.stacks.flamegraph import render_svg
from dbr_service.stacks.stackprof import parse_folded

SLACK_S = 30.0
TOP = 15


def add_parser(verb: Callable[[str, str], argparse.ArgumentParser], pid_type,
               pid_help: str) -> None:
    p = verb("flamegraph", "sample a client's call stacks; folded stacks and an SVG "
                           "flame graph")
    p.add_argument("pid", type=pid_type, help=pid_help)
    p.add_argument("--seconds", type=float, default=5.0, metavar="S",
                   help="how long to sample (default 5, at most 60)")
    p.add_argument("--svg", metavar="FILE", help="write the flame graph as SVG")
    p.add_argument("--folded", metavar="FILE",
                   help="write the folded stacks (`main;f;g 42` lines; - for stdout)")


def hottest(folded: Counter, n: int = TOP) -> list[tuple[str, int, int]]:
    """(name, self samples, total samples) of the functions with most self samples."""
    own: Counter = Counter()
    total: Counter = Counter()
    for stack, c in folded.items():
        if stack:
            own[stack[-1]] += c
        for name in set(stack):
            total[name] += c
    return [(name, c, total[name]) for name, c in own.most_common(n)]


def run(client: ControlClient, args: argparse.Namespace,
        output_problem: Callable[[str], str | None]) -> int:
    if not 0 < args.seconds <= 60:
        print("dbr ctl: flamegraph: --seconds must be above 0 and at most 60",
              file=sys.stderr)
        return 2
    for path in (args.svg, args.folded):
        why = output_problem(path) if path and path != "-" else None
        if why:
            print(f"dbr ctl: cannot write {path}: {why}", file=sys.stderr)
            return 2
    deadline = time.monotonic() + args.seconds + SLACK_S
    while True:
        try:
            reply = client.call("flamegraph", {"pid": args.pid, "seconds": args.seconds})
        except (OSError, TimeoutError) as exc:
            print(f"dbr ctl: no dbr service answers: {exc}", file=sys.stderr)
            return 1
        if not reply.get("ok"):
            err = reply.get("error", {})
            print(f"dbr ctl: flamegraph refused: {err.get('message')} "
                  f"(code {err.get('code')})", file=sys.stderr)
            return 2 if err.get("code") in (Code.BAD_ARGS, Code.UNKNOWN_VERB) else 1
        result: dict[str, Any] = reply["result"]
        if result.get("state") == "done":
            break
        if time.monotonic() > deadline:
            print("dbr ctl: flamegraph: the service did not finish sampling in time",
                  file=sys.stderr)
            return 1
        time.sleep(min(1.0, max(0.1, float(result.get("remaining_s", 0.5)))))
    return _write(result, args)


def _write(result: dict[str, Any], args: argparse.Namespace) -> int:
    lines = [str(x) for x in result.get("folded", [])]
    folded = parse_folded(lines)
    samples = result.get("samples", 0)
    title = f"pid {args.pid}: {samples} call stacks in {result.get('seconds')} s"
    sub = (f"{result.get('truncated', 0)} truncated; unwound by "
           + ", ".join(f"{k} {v}" for k, v in sorted(result.get("methods", {}).items())))
    try:
        if args.folded == "-":
            sys.stdout.write("".join(line + "\n" for line in lines))
        elif args.folded:
            with open(args.folded, "w") as fh:
                fh.writelines(line + "\n" for line in lines)
        if args.svg:
            with open(args.svg, "w") as fh:
                fh.write(render_svg(folded, f"dbr flame graph, {title}", subtitle=sub))
    except OSError as exc:
        print(f"dbr ctl: cannot write output: {exc.strerror or exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result, indent=2, sort_keys=True))
        return 0
    if args.folded == "-":
        return 0
    out = [f"{title} ({sub})"]
    if samples:
        out.append(f"{'self %':>7} {'total %':>8}  function")
        for name, own, total in hottest(folded):
            out.append(f"{100 * own / samples:7.1f} {100 * total / samples:8.1f}  {name}")
    for path in (args.folded, args.svg):
        if path:
            out.append(f"wrote {path}")
    print("\n".join(out))
    return 0
