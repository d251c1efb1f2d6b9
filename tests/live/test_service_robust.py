"""Service death and restarts: clients survive a SIGKILLed service with correct output,
reconnect to a restarted one; a client killed mid-session does not disturb the service."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest
from service_helpers import ServiceProc, agent_path, build_example, kill, spawn_client

pytestmark = pytest.mark.skipif(agent_path() is None, reason="libdbr_agent.so cannot be built")


def _expected_check(prog: str) -> str:
    out = subprocess.run([prog, "50"], capture_output=True, text=True, timeout=20).stdout
    return out.split("check ")[1].strip()


def test_sigkill_service_then_restart():
    prog = build_example("hotloop")
    check = _expected_check(prog)
    svc = ServiceProc("--aggressive").wait_ready()
    clients, svc2 = [], None
    try:
        clients = [spawn_client(svc.dir, [prog, "5000"]) for _ in range(3)]
        pids = {c.pid for c in clients}
        svc.wait_for(lambda: pids <= {r["pid"] for r in svc.call("clients")
                                      if r["samples"] > 0}, 25.0, "clients sampled")
        os.kill(svc.proc.pid, signal.SIGKILL)
        svc.proc.wait(5)
        # A new service on the same runtime dir (stale sockets removed); agents come back.
        svc2 = ServiceProc("--aggressive", runtime_dir=svc.dir).wait_ready()
        svc2.wait_for(lambda: pids <= {r["pid"] for r in svc2.call("clients")}, 25.0,
                      "agents reconnected")
        for c in clients:
            out, err = c.communicate(timeout=30)
            assert c.returncode == 0, err
            assert out.strip().endswith(f"check {check}"), out
    finally:
        for c in clients:
            kill(c)
        svc.stop()
        if svc2:
            svc2.stop()


def test_client_killed_does_not_disturb_others():
    prog = build_example("hotloop")
    svc = ServiceProc("--aggressive").wait_ready()
    clients = []
    try:
        clients = [spawn_client(svc.dir, [prog, "4000"]) for _ in range(4)]
        pids = [c.pid for c in clients]
        svc.wait_for(lambda: set(pids) <= {r["pid"] for r in svc.call("clients")}, 15.0,
                     "clients listed")
        for c in clients[:2]:  # killed in the middle of whatever they were doing
            os.kill(c.pid, signal.SIGKILL)
            c.wait(5)
        svc.wait_for(lambda: not set(pids[:2]) & {r["pid"] for r in svc.call("clients")},
                     10.0, "killed clients dropped")
        before = {r["pid"]: r["samples"] for r in svc.call("clients")}
        svc.wait_for(lambda: all(r["samples"] > before[r["pid"]]
                                 for r in svc.call("clients") if r["pid"] in pids[2:]),
                     10.0, "survivors still sampled")
        assert {r["pid"] for r in svc.call("clients")} >= set(pids[2:])
    finally:
        for c in clients:
            kill(c)
        svc.stop()
