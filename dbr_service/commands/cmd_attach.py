"""dbr attach PID — load the agent into a running process, which the service then
serves like any other client.

The ptrace is done by this command, with your privileges (the kernel's checks and
Yama's ptrace_scope apply): you can attach to what you could debug.  A process whose
agent was made dormant by `dbr detach` is woken again, not loaded twice.  Exit status:
0 attached, 1 refused (the message says why), 2 usage error.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from dbr_service.commands.cli import pid_arg
from dbr_service.common.paths import resolve_runtime_dir, untrusted_dir


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("pid", type=pid_arg, help="the process to attach to")
    parser.add_argument("--wait", type=float, default=5.0, metavar="S",
                        help="how long to wait for the service to list it (default 5 s)")


def run(args: argparse.Namespace) -> int:
    import dbr_agent
    from dbr_service.commands.attach import AttachError, attach

    rdir = os.path.abspath(resolve_runtime_dir())
    why = untrusted_dir(rdir)
    if why:
        print(f"dbr attach: not pointing an agent at {rdir}: {why}", file=sys.stderr)
        return 1
    try:
        got = attach(args.pid, dbr_agent.agent_path(), rdir)
    except AttachError as exc:
        print(f"dbr attach: {exc}", file=sys.stderr)
        return 1
    print(f"dbr attach: agent {'loaded into' if got.loaded else 'woken again in'} pid "
          f"{got.pid} (through thread {got.tid}); it connects to {rdir}/agent.sock")
    row = _served(rdir, args.pid, min(max(args.wait, 0.0), 60.0))
    if row is None:
        print(f"dbr attach: no service at {rdir} lists pid {args.pid} yet; the agent keeps "
              "trying to connect", file=sys.stderr)
    else:
        print(f"dbr attach: pid {args.pid} is served (session {row.get('session')})")
    return 0


def _served(rdir: str, pid: int, wait: float) -> dict | None:
    """The service's clients row of ``pid`` once it is there, within ``wait`` seconds."""
    from dbr_service.commands.ctlclient import ControlClient, Fault

    client = ControlClient(rdir, timeout=1.0)
    deadline = time.monotonic() + wait
    while True:
        try:
            rows = client.result("clients")
            row = next((r for r in rows if r.get("pid") == pid and r.get("state") != "closed"),
                       None)
            if row is not None:
                return row
        except (OSError, TimeoutError, ValueError, Fault):
            pass
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.1)
