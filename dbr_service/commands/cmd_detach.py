"""dbr detach PID — remove every patch the service installed in a client and leave its
agent dormant: no samples, no thread work, no connection until `dbr attach PID` wakes
it.  The agent stays loaded: unloading a library whose code threads may still return
into, and whose signal handlers are installed, is not safe.

After the agent reverted its sites the service compares the client's executable
mappings with their files (/proc/PID/mem); the command says what it found.  Exit
status: 0 detached with the text as in the files, 1 refused or a difference found.
"""

from __future__ import annotations

import argparse
import json
import sys

from dbr_service.commands.cli import pid_arg
from dbr_service.common.paths import resolve_runtime_dir, untrusted_dir


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("pid", type=pid_arg, help="the client to detach")
    parser.add_argument("--json", action="store_true", help="print the service's answer")


def run(args: argparse.Namespace) -> int:
    from dbr_service.commands.ctlclient import ControlClient, Fault

    rdir = resolve_runtime_dir()
    why = untrusted_dir(rdir)
    if why:
        print(f"dbr detach: not talking to a service there: {why}", file=sys.stderr)
        return 1
    try:
        res = ControlClient(rdir, timeout=15.0).result("detach", {"pid": args.pid})
    except Fault as exc:
        print(f"dbr detach: {exc}", file=sys.stderr)
        return 1
    except (OSError, TimeoutError, ValueError) as exc:
        print(f"dbr detach: {exc}", file=sys.stderr)
        return 1
    text = res.get("text", {})
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        print(f"dbr detach: pid {args.pid}: {res.get('regions_removed', 0)} regions removed, "
              "agent dormant")
        if text.get("error"):
            print(f"dbr detach: text not compared: {text['error']}")
        else:
            print(f"dbr detach: {text.get('mappings', 0)} executable mappings "
                  f"({text.get('bytes', 0)} bytes) compared with their files: "
                  f"{len(text.get('differences', []))} differ, "
                  f"{len(text.get('unchecked', []))} not compared")
            for d in text.get("differences", []):
                print(f"  {d['path']} at {d['addr']}: {d['bytes']} bytes differ from "
                      f"{d['first']}")
    return 1 if text.get("differences") or text.get("error") else 0
