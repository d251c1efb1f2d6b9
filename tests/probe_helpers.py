"""A probed program under a real service, driven line by line (the probe tests')."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator

import pytest
from harness import LineReader
from service_helpers import ServiceProc, agent_path, kill

from dbr_service.commands.ctlclient import Code, Fault


class Prog:
    """The probed program under the service, driven line by line."""

    def __init__(self, svc: ServiceProc, binary: str) -> None:
        env = dict(os.environ, DBR_RUNTIME_DIR=svc.dir, LD_PRELOAD=agent_path(),
                   DBR_AGENT_QUIET_MS="0")     # connect at once: it waits on stdin
        self.proc = subprocess.Popen([binary], env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self.out = LineReader(self.proc.stdout)
        self.out.expect("ready")
        self.pid = self.proc.pid
        self.svc = svc
        svc.wait_for(lambda: svc.call("clients") and any(
            c["pid"] == self.pid and c["state"] == "connected" for c in svc.call("clients")),
            15, "the client's session")

    def run(self, line: str, reply: str, timeout: float = 60.0) -> str:
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()
        got = self.out.expect(reply, timeout)
        self.out.expect("ready", timeout)
        return got

    def probe(self, verb: str, **args):
        return self.svc.call(f"probe_{verb}", {"pid": self.pid, **args}, timeout=40.0)

    def refused(self, location: str, **args) -> str:
        with pytest.raises(Fault) as ei:
            self.probe("add", location=location, **args)
        assert ei.value.code == Code.PROBE_REFUSED, ei.value.message
        return ei.value.message

    def close(self) -> None:
        kill(self.proc)



def paused_prog(binary: str) -> Iterator[Prog]:
    """The program under a service told to leave it alone (paused: no regions); for a
    fixture to yield from."""
    svc = ServiceProc().wait_ready()
    p = None
    try:
        p = Prog(svc, binary)
        svc.call("pause", {"pid": p.pid})
        yield p
    finally:
        if p is not None:
            p.close()
        svc.stop()
