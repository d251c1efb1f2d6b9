"""dbr ctl — talk to a running dbr service over its control socket.

Verbs: status, clients [--all], waiting, hotspots PID [--top N], regions PID,
region PID ID [--dot FILE | --svg FILE], unpatch PID [ID], pause [PID], resume [PID],
flamegraph PID [--seconds S] [--svg FILE] [--folded FILE] (commands/cmd_flame.py),
config get [KEY], config set KEY VALUE, events [--follow], shutdown,
probe add PID LOCATION --kind count|args|latency [--filter F], probe list PID,
probe show PID ID [--last N], probe del PID ID.
Human-readable tables by default, --json for scripts.  Exit status: 0 ok, 1 the
service refused the request or did not answer, 2 usage error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from dbr_service.commands.cli import pid_arg
from dbr_service.common.paths import resolve_runtime_dir, untrusted_dir
from dbr_service.commands.ctlclient import Code, ControlClient
from dbr_service.commands.cmd_flame import add_parser as add_flame_parser
from dbr_service.commands.cmd_flame import run as run_flamegraph
from dbr_service.installation.speedcheck import verdict_text

EPILOG = """examples:
  dbr ctl status
  dbr ctl --json clients               # or: dbr ctl clients --json
  dbr ctl events --follow
  dbr ctl hotspots 1234 --top 5
  dbr ctl region 1234 r1 --dot r1.dot
  dbr ctl flamegraph 1234 --seconds 5 --svg flame.svg
  dbr ctl config set snapshot_interval_s 0.5
  dbr ctl pause 1234; dbr ctl resume
  dbr ctl probe add 1234 compress+0x10 --kind count; dbr ctl probe show 1234 1
  dbr ctl probe add 1234 libc.so.6+0x9e0c0
  dbr ctl probe add 1234 parse --kind args --filter 'arg1>100'
  DBR_RUNTIME_DIR=/tmp/dbr dbr ctl shutdown
"""


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return v


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    parser.add_argument("--json", action="store_true", help="print the raw JSON result")
    parser.add_argument("--timeout", type=float, default=1.5, metavar="S",
                        help="seconds to wait for the service (default 1.5)")
    # the same two options after the verb (`dbr ctl clients --json`); SUPPRESS keeps
    # the values given before the verb when they are not repeated
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                        help="print the raw JSON result")
    common.add_argument("--timeout", type=float, default=argparse.SUPPRESS, metavar="S",
                        help="seconds to wait for the service (default 1.5)")
    sub = parser.add_subparsers(dest="verb", metavar="VERB", required=True)

    def verb(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=help, parents=[common])

    pid_help = "the client's process id (`dbr ctl clients` lists them)"
    verb("status", "version, uptime, sampling source, clients, config")
    p = verb("clients", "connected clients")
    p.add_argument("--all", action="store_true", help="also sessions that ended")
    verb("waiting", "processes that carry the agent but have no session yet, and why")
    p = verb("hotspots", "hottest addresses of a client")
    p.add_argument("pid", type=pid_arg, help=pid_help)
    p.add_argument("--top", type=_positive, default=20, metavar="N",
                   help="how many addresses, hottest first (default 20)")
    p = verb("regions", "regions of a client")
    p.add_argument("pid", type=pid_arg, help=pid_help)
    p = verb("region", "one region (JSON, or its graph with --dot/--svg)")
    p.add_argument("pid", type=pid_arg, help=pid_help)
    p.add_argument("id", help="the region's id (r1, ...), as `dbr ctl regions PID` lists it")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--dot", metavar="FILE", help="write the region graph as DOT")
    g.add_argument("--svg", metavar="FILE", help="write the region graph as SVG")
    p = verb("unpatch", "remove a client's patches (one region or all); they stay out "
                        "until `dbr ctl resume PID`")
    p.add_argument("pid", type=pid_arg, help=pid_help)
    p.add_argument("id", nargs="?", help="only this region (r1, ...); default: every region")
    for name in ("pause", "resume"):
        p = verb(name, f"{name} sampling of one client or of the service" +
                 ("; resume also allows what `unpatch` held back" if name == "resume" else ""))
        p.add_argument("pid", type=pid_arg, nargs="?",
                       help=pid_help + "; default: the whole service")
    p = verb("config", "config get [KEY] | config set KEY VALUE")
    csub = p.add_subparsers(dest="op", metavar="OP", required=True)
    g = csub.add_parser("get", help="one key's value, or every key's",
                        parents=[common])
    g.add_argument("key", nargs="?", help="a configuration key (docs/operators.md)")
    s = csub.add_parser("set", help="change a key the running service can change",
                        parents=[common])
    s.add_argument("key", help="a configuration key (docs/operators.md)")
    s.add_argument("value", help="its new value, as in the configuration file")
    p = verb("events", "recent events (installs, removals, sessions)")
    p.add_argument("--follow", "-f", action="store_true",
                   help="keep printing new events until interrupted (--json: one JSON "
                        "object a line)")
    p.add_argument("--since", type=int, default=0, metavar="SEQ",
                   help="only events after this sequence number")
    add_flame_parser(verb, pid_arg, pid_help)
    verb("shutdown", "stop the service")
    p = verb("probe", "dynamic probes: probe add|list|show|del (docs/operators.md, Probes)")
    psub = p.add_subparsers(dest="op", metavar="OP", required=True)
    a = psub.add_parser("add", parents=[common], help="place a probe at a location")
    a.add_argument("pid", type=pid_arg, help=pid_help)
    a.add_argument("location", help="SYMBOL[+OFF] or MODULE+OFF (a mapped file's path or "
                                    "basename, as `dbr ctl hotspots` prints it)")
    a.add_argument("--kind", choices=("count", "args", "latency"), default="count",
                   help="count: passes; args: argument registers at a function's start; "
                        "latency: a function's call times (a histogram)")
    a.add_argument("--filter", metavar="F", help="args only: record a pass only if "
                                                 "argI OP N holds (OP: == != < <= > >=)")
    for op, text in (("list", "a client's probes"), ("show", "one probe and its data"),
                     ("del", "remove a probe (its site gets its original bytes back)")):
        q = psub.add_parser(op, parents=[common], help=text)
        q.add_argument("pid", type=pid_arg, help=pid_help)
        if op != "list":
            q.add_argument("id", type=_positive, help="the probe's id (`probe list`)")
        if op == "show":
            q.add_argument("--last", type=int, default=16, metavar="N",
                           help="args: the last N records (default 16, at most 64)")


def request_of(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    """The JSON verb and args of a parsed command line."""
    v = args.verb
    if v in ("status", "shutdown", "waiting"):
        return v, {}
    if v == "events":
        return v, ({"since": args.since} if args.since else {})
    if v == "clients":
        return v, {"all": args.all}
    if v == "hotspots":
        return v, {"pid": args.pid, "top": args.top}
    if v == "regions":
        return v, {"pid": args.pid}
    if v == "region":
        fmt = "dot" if args.dot else "svg" if args.svg else "json"
        return v, {"pid": args.pid, "id": args.id, "format": fmt}
    if v == "unpatch":
        return v, {"pid": args.pid, **({"id": args.id} if args.id else {})}
    if v in ("pause", "resume"):
        return v, ({"pid": args.pid} if args.pid else {})
    if v == "probe":
        req: dict[str, Any] = {"pid": args.pid}
        if args.op == "add":
            req.update(location=args.location, kind=args.kind,
                       **({"filter": args.filter} if args.filter is not None else {}))
        elif args.op != "list":
            req["id"] = args.id
        if args.op == "show":
            req["last"] = args.last
        return f"probe_{args.op}", req
    if args.op == "get":
        return "config_get", ({"key": args.key} if args.key else {})
    return "config_set", {"key": args.key, "value": args.value}


def _output_problem(path: str) -> str | None:
    """Why a file could not be written at ``path``, asked before the request is sent."""
    p = os.path.abspath(path)
    parent = os.path.dirname(p)
    if os.path.isdir(p):
        return "it is a directory"
    if not os.path.isdir(parent):
        return f"no directory {parent}"
    if not os.access(p if os.path.exists(p) else parent, os.W_OK):
        return "permission denied"
    return None


def run(args: argparse.Namespace) -> int:
    rdir = resolve_runtime_dir()
    why = untrusted_dir(rdir)
    if why:
        print(f"dbr ctl: not talking to a service there: {why}", file=sys.stderr)
        return 1
    client = ControlClient(rdir, timeout=args.timeout)
    if args.verb == "flamegraph":
        return run_flamegraph(client, args, _output_problem)
    verb, vargs = request_of(args)
    out = (args.dot or args.svg) if args.verb == "region" else None
    why = _output_problem(out) if out else None
    if why:
        print(f"dbr ctl: cannot write {out}: {why}", file=sys.stderr)
        return 2
    if args.verb == "events" and args.follow:
        return _follow(client, vargs.get("since", 0), args.json)
    try:
        reply = client.call(verb, vargs)
    except (OSError, TimeoutError) as exc:
        print(f"dbr ctl: no dbr service answers on {rdir}: {exc}", file=sys.stderr)
        return 1
    if not reply.get("ok"):
        err = reply.get("error", {})
        if args.json:
            print(json.dumps(reply, indent=2))
        print(f"dbr ctl: {verb} refused: {err.get('message')} (code {err.get('code')})",
              file=sys.stderr)
        return 2 if err.get("code") in (Code.BAD_ARGS, Code.UNKNOWN_VERB) else 1
    result = reply["result"]
    if args.verb == "region" and (args.dot or args.svg):
        path = args.dot or args.svg
        try:
            with open(path, "w") as fh:
                fh.write(result["dot" if args.dot else "svg"])
        except OSError as exc:
            print(f"dbr ctl: cannot write {path}: {exc.strerror or exc}", file=sys.stderr)
            return 1
        if not args.json:
            print(f"wrote {path}")
    if args.json:
        print(json.dumps(result, indent=2, sort_keys=True))
    elif not (args.verb == "region" and (args.dot or args.svg)):
        print(render(args.verb, result))
    return 0


#: Seconds between two polls of `dbr ctl events --follow`.
FOLLOW_POLL_S = 0.5


def _follow(client: ControlClient, since: int, as_json: bool) -> int:
    """`events --follow`: new events as they come, until interrupted (exit 0) or the
    service stops answering (exit 1)."""
    try:
        while True:
            try:
                reply = client.call("events", {"since": since} if since else {})
            except (OSError, TimeoutError) as exc:
                print(f"dbr ctl: the service stopped answering: {exc}", file=sys.stderr)
                return 1
            if not reply.get("ok"):
                err = reply.get("error", {})
                print(f"dbr ctl: events refused: {err.get('message')}", file=sys.stderr)
                return 1
            events = reply["result"]
            for e in events:
                print(json.dumps(e, sort_keys=True) if as_json else render("events", [e]),
                      flush=True)
            if events:
                since = max(since, max(int(e.get("seq", 0)) for e in events))
            time.sleep(FOLLOW_POLL_S)
    except KeyboardInterrupt:
        return 0


# --------------------------------------------------------------------------- tables
def table(rows: list[list[Any]], header: list[str]) -> str:
    cells = [header] + [[("" if c is None else str(c)) for c in r] for r in rows]
    widths = [max(len(r[k]) for r in cells) for k in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells)


def _speed(region: dict[str, Any]) -> str:
    """A region's speed-check verdict for the regions table."""
    info = region.get("info", {})
    sc = info.get("speed_check")
    if sc:
        return verdict_text(sc["verdict"], sc.get("ratio"), sc.get("measure"))
    n = info.get("speed_checks_abandoned")
    return f"abandoned x{n}, again" if n else ""     # to be checked again


def _calls(region: dict[str, Any]) -> str:
    """Real calls in a region's code, or why it has none though selection kept some
    (its unwind information could not be made: installed without them)."""
    info = region.get("info", {})
    if "cfi_refused" in info:
        return "0 (no CFI)"
    return str(info["real_calls"]) if info.get("real_calls") else ""


def _state(region: dict[str, Any]) -> str:
    """A region's state for the regions table; a removed region whose code is still
    kept says what keeps it."""
    held = region.get("retained")
    if not held:
        return region["state"]
    why = [f"{held['stack_refs']} stack refs"] if held["stack_refs"] else []
    if held["threads_inside"]:
        why.append(f"{held['threads_inside']} threads inside")
    if held["threads_unknown"]:
        why.append(f"{held['threads_unknown']} threads unknown")
    if held.get("callers"):
        why.append(f"{held['callers']} callers")      # code that calls into this copy
    return f"{region['state']} (retained: {', '.join(why) or 'quarantine'})"


def _budget(c: dict[str, Any]) -> str:
    """A clients row's share of its CPU budget used ("3.1% of 5.0%", "+2 deferred")."""
    used, limit = c.get("budget_used"), c.get("budget") or 0
    text = "-" if used is None else (f"{used:.1%} of {limit:.1%}" if limit else f"{used:.1%}")
    if c.get("deferred_by_budget"):
        text += f" ({c['deferred_by_budget']} deferred)"
    return text


def _branch_records(smp: dict) -> str:
    """The status line on branch stacks (sampling/branchperf.py): used, or why not."""
    br = smp["capabilities"].get("branch_records") or {}
    if smp.get("branch_records_used"):
        return f"branch records: used ({br.get('event')}, randomised period)"
    if br.get("available"):
        return f"branch records: available, not used (sampling {smp['active']})"
    return f"branch records: no ({br.get('reason', 'not detected')}); IP samples"


def _ns(v: int | None) -> str:
    if v is None:
        return "-"
    for unit, div in (("s", 10**9), ("ms", 10**6), ("us", 10**3)):
        if v >= div:
            return f"{v / div:.3g} {unit}"
    return f"{v} ns"


def _latency_lines(p: dict[str, Any]) -> list[str]:
    """A latency probe's histogram (docs/operators.md, "Probes")."""
    if "count" not in p:
        return []
    lines = [f"count: {p['count']}  mean: {_ns(p['mean_ns'])}  p50: <{_ns(p['p50_ns'])}  "
             f"p90: <{_ns(p['p90_ns'])}  p99: <{_ns(p['p99_ns'])}",
             f"misses: {p['misses_no_slot'] + p['misses_too_deep']} (no thread slot "
             f"{p['misses_no_slot']}, deeper than a thread's entries {p['misses_too_deep']})"]
    top = max((n for _lo, _hi, n in p["buckets"]), default=0)
    for lo, hi, n in p["buckets"]:
        bar = "#" * max(1, round(40 * n / top))
        lines.append(f"  {_ns(lo):>9} .. {_ns(hi):>9}  {n:>10}  {bar}")
    return lines


def _probe_state(p: dict[str, Any]) -> str:
    """The probe's state; a removed latency probe's with what keeps its exit stub."""
    held = p.get("retained")
    if not held:
        return p["state"]
    return (f"{p['state']} (exit stub retained: {held['stack_refs']} stack refs, "
            f"{held['threads_inside']} threads inside)")


def _probes(result: dict[str, Any]) -> str:
    """probe add/show/del: one probe; probe list: a table."""
    if "probes" in result:
        rows = [[p["id"], p["kind"], p["location"], f"{p['address']:#x}", p["filter"] or "",
                 p.get("count", p.get("records_total")), _probe_state(p)]
                for p in result["probes"]]
        return table(rows, ["ID", "KIND", "LOCATION", "ADDRESS", "FILTER", "HITS", "STATE"]) \
            if rows else f"pid {result['pid']}: no probes"
    p = result
    head = (f"probe {p['id']}: {p['kind']} at {p['location']} ({p['address']:#x}, "
            f"{p['site']} site{', flags saved' if p['flags_saved'] else ''}"
            f"{', filter ' + p['filter'] if p['filter'] else ''}); {_probe_state(p)}")
    if p["kind"] == "count":
        return f"{head}\ncount: {p['count']}"
    if p["kind"] == "latency":
        return "\n".join([head, *_latency_lines(p)])
    lines = [head, f"records: {p.get('records_total')}"]
    for r in p.get("records", []):
        lines.append(f"  #{r['n']}  " + " ".join(f"arg{i}={v:#x}" for i, v in enumerate(r["args"]))
                     + f"  return={r['return']:#x}")
    return "\n".join(lines)


def render(verb: str, result: Any) -> str:
    """Human-readable form of a result."""
    if verb == "status":
        smp = result["sampling"]
        caps = smp["capabilities"].get("capabilities", {})
        paused = "  (paused)" if result["paused"] else ""
        lines = [(f"dbr service {result['version']}  pid {result['pid']}  "
                  f"up {result['uptime_s']:.1f}s  {result['runtime_dir']}"),
                 (f"clients: {result['clients']} connected, {result['clients_seen']} seen; "
                  f"snapshots: {result['snapshots']}{paused}"),
                 (f"sampling: {smp['active']} (configured {smp['configured']}); "
                  f"every {smp['interval_s']}s for {smp['window_s']}s at {smp['period_us']}us"),
                 "host offers: " + ", ".join(
                     f"{k}={'yes' if v.get('available') else 'no'}" for k, v in caps.items()),
                 _branch_records(smp),
                 f"workers: {result['scheduler']}"]
        cfg = result.get("config") or {}
        sch = result["scheduler"]
        if "service_cpu_budget" in cfg:
            budget = cfg["service_cpu_budget"]
            lines.append(
                ("service CPU budget: " + (f"{budget:.1%} of each client's CPU over "
                                           f"{cfg['service_cpu_window_s']:g} s"
                                           if budget > 0 else "none")) +
                f"; jobs' CPU {sch.get('job_cpu_s', 0):.2f} s; deferred by budget "
                f"{sch.get('deferred_by_budget', 0)}, skipped unchanged "
                f"{sch.get('skipped_unchanged', 0)}, backing off "
                f"{sch.get('skipped_backoff', 0)}; decode cache "
                f"{sch.get('decode_cached', 0)} hits, {sch.get('decode_new', 0)} decoded")
        if result.get("refused_at_limit"):
            lines.append(f"refused at a connection limit: {result['refused_at_limit']} "
                         f"(max_handshakes, max_sessions_per_uid)")
        late = result.get("short_runs") or []
        if late:
            lines.append(f"born late ({late[0]['birth_ms']} ms, short_run_s): " +
                         ", ".join(x["exe"] for x in late))
        return "\n".join(lines)
    if verb == "clients":
        if not result:
            return "no clients"
        return table([[c["pid"], c["state"], c["threads"], c["samples"], c["source"],
                       "yes" if c["paused"] else "", c["regions"], c.get("jobs_done", 0),
                       f"{c.get('service_cpu_s', 0):.2f}s", _budget(c), c["exe"]]
                      for c in result],
                     ["PID", "STATE", "THREADS", "SAMPLES", "SOURCE", "PAUSED", "REGIONS",
                      "JOBS", "SVC CPU", "BUDGET USED", "EXE"])
    if verb == "waiting":
        if not result:
            return "no process waiting"
        return table([[c["pid"], "" if c["age_s"] is None else f"{c['age_s']:.1f}s", c["exe"],
                       c["why"]] for c in result], ["PID", "AGE", "EXE", "WHY"])
    if verb == "hotspots":
        head = (f"pid {result['pid']}: {result['samples']} samples in "
                f"{result['snapshots']} snapshots")
        rows = [[f"{h['fraction'] * 100:.1f}%", h["samples"], f"{h['ip']:#x}",
                 h["module"].rsplit("/", 1)[-1],
                 "" if h["offset"] is None else f"{h['offset']:#x}", h.get("symbol", "")]
                for h in result["hotspots"]]
        return head + "\n" + table(rows, ["SHARE", "SAMPLES", "IP", "MODULE", "OFFSET",
                                          "FUNCTION"])
    if verb == "regions":
        head = f"pid {result['pid']}: {result['status']}"
        rows = [[r["id"], _state(r), r["blocks"], r["code_bytes"], _calls(r), _speed(r),
                 " ".join(r.get("entry_names") or [f"{e:#x}" for e in r["entries"]]),
                 r["module"]]
                for r in result["regions"]]
        refused = sum(1 for r in result["regions"] if "cfi_refused" in r.get("info", {}))
        if refused:
            head += f"; {refused} region(s) without their real calls (no CFI)"
        return head + ("\n" + table(rows, ["ID", "STATE", "BLOCKS", "BYTES", "CALLS", "SPEED",
                                           "ENTRIES", "MODULE"]) if rows else "")
    if verb == "events":
        return "\n".join(f"{time.strftime('%H:%M:%S', time.localtime(e['time']))} "
                         f"{e['event']:<18} " + " ".join(f"{k}={v}" for k, v in e.items()
                                                          if k not in ("seq", "time", "event"))
                         for e in result) or "no events"
    if verb == "probe":
        return _probes(result)
    if verb == "unpatch":
        held = "every region" if result["held"] == "all" else f"region {result['held']}"
        return (f"pid {result['pid']}: {result['regions_removed']} region(s) removed; "
                f"{held} stays out until `{result['until']}`")
    if verb == "resume" and result.get("released"):
        return (f"pid {result['pid']}: resumed; patching allowed again for "
                + ", ".join("every region" if r == "all" else r for r in result["released"]))
    if isinstance(result, dict):
        return "\n".join(f"{k}: {v}" for k, v in result.items())
    return json.dumps(result, indent=2)
