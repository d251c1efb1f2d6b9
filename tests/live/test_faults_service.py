"""Faults at the level of the real service daemon: the client stays
correct and the service goes on serving other clients.

* No code buffer can be placed within +-2 GiB of the client's code: the client has
  filled that neighbourhood with reservations (tests/fault_progs/crowded.c), so the
  agent answers E_RANGE.  The region stays unplaced with the reason in its record,
  the client's output equals the native run's, and the same service then patches a
  normal client.

The installer-level cases (code that does not fit its chunk, a buffer out of reach,
sites the agent refuses, a client exiting mid-install, a service killed between
writing code and patching) are in tests/agent/test_install.py and tests/agent/test_faults.py.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from dbr_service.common.config import AGGRESSIVE
from harness import compile_c
from service_helpers import ServiceProc, agent_path, kill, spawn_client

pytestmark = pytest.mark.skipif(agent_path() is None, reason="libdbr_agent.so cannot be built")

HERE = Path(__file__).resolve().parent.parent


def _native(exe: Path, args: list[str]) -> str:
    return subprocess.run([str(exe), *args], capture_output=True, text=True, check=True,
                          timeout=120).stdout


def _entry(svc: ServiceProc, pid: int) -> dict:
    """The client's report entry ({} before its agent has connected)."""
    entries = svc.call("report", {"pids": [pid]})
    assert len(entries) <= 1, entries
    return entries[0] if entries else {}


def test_no_buffer_within_reach_client_correct_service_serving():
    crowded = compile_c([HERE / "fault_progs" / "crowded.c"], flags=["-O2", "-s"],
                        out_name="crowded")
    normal = compile_c([HERE / "e2e_progs" / "calls.c"], flags=["-O2", "-s"],
                       out_name="calls-fault")
    c_args, n_args = ["1500"], ["1500"]
    c_expected, n_expected = _native(crowded, c_args), _native(normal, n_args)
    svc = ServiceProc(*(f"{k}={v}" for k, v in AGGRESSIVE.items())).wait_ready()
    procs: list[subprocess.Popen] = []
    try:
        # 1. the crowded client: a region is selected but cannot be placed
        p = spawn_client(svc.dir, [str(crowded), *c_args])
        procs.append(p)
        failed = svc.wait_for(
            lambda: [r for r in _entry(svc, p.pid).get("regions", [])
                     if "E_RANGE" in r.get("info", {}).get("install_error", "")],
            timeout=60, what="a region refused for want of a buffer in reach")
        assert failed
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        assert out == c_expected
        entry = svc.wait_for(lambda: (e := _entry(svc, p.pid)).get("close_reason") and e,
                             what="the crowded client's session to end")
        assert entry["patches_installed"] == 0
        assert all(r["state"] != "installed" for r in entry["regions"])
        # selected at every snapshot, but not retried without end
        from dbr_service.session.session_regions import INSTALL_ATTEMPTS
        tries = [r["info"].get("install_failures", 0) for r in entry["regions"]]
        assert 1 <= max(tries) <= INSTALL_ATTEMPTS, entry["regions"]
        # 2. the same service serves the next client normally
        assert svc.call("status")["clients"] is not None
        q = spawn_client(svc.dir, [str(normal), *n_args])
        procs.append(q)
        svc.wait_for(lambda: _entry(svc, q.pid).get("patches_installed", 0) >= 1, timeout=60,
                     what="the normal client to be patched")
        out, err = q.communicate(timeout=120)
        assert q.returncode == 0, err
        assert out == n_expected
    finally:
        for proc in procs:
            kill(proc)
        svc.stop()
