"""Warm start (dbr_service/profiles/warmstart.py): a program's second run is patched from the
profile its first run left in the store, from its start, where a cold run of the
same length is never patched; the next runs reuse that selection, moved to where each
process maps the program (dbr_service/profiles/rebase.py)."""

from __future__ import annotations

import os
import subprocess
import time

import pytest
from harness import compile_c
from service_helpers import ServiceProc, agent_path, run_client

from dbr_service.common.paths import program_key, program_quiet_file

needs_agent = pytest.mark.skipif(agent_path() is None, reason="libdbr_agent.so cannot be built")


LONG, SHORT = "600", "40"      # about 3 s and 0.2 s here


def _report(svc: ServiceProc, pid: int) -> dict:
    return svc.call("report", {"pids": [pid]})[0]


def _run(svc: ServiceProc, prog: str, rounds: str) -> tuple[str, int]:
    return run_client(svc.dir, [prog, rounds])


@needs_agent
def test_a_second_run_is_patched_from_the_stored_profile(tmp_path):
    prog = str(compile_c(["warmwork.c"], flags=["-O1"], out_name="warmwork"))
    native = {n: subprocess.run([prog, n], capture_output=True, text=True, timeout=60).stdout
              for n in (LONG, SHORT)}
    state = {"DBR_STATE_DIR": str(tmp_path / "state")}
    svc = ServiceProc(env=state).wait_ready()   # default settings: min_client_age_s 1 s
    try:
        hint = os.path.join(svc.dir, program_quiet_file(program_key(os.stat(prog))))
        # a cold short run: too young to be sampled, never patched
        out, pid = _run(svc, prog, SHORT)
        assert out == native[SHORT]
        assert not os.path.exists(hint)

        for attempt in range(3):              # long runs until one is patched
            out, pid = _run(svc, prog, LONG)
            assert out == native[LONG]
            svc.wait_for(lambda a=attempt: (svc.call("status")["warm_start"] or {}).get(
                "runs_recorded", 0) > a, timeout=10, what="the run recorded")
            first = _report(svc, pid)
            assert "warm_job_queued" not in first["timeline"], first["timeline"]
            if first["time_to_first_patch_s"] is not None:
                break
        assert first["time_to_first_patch_s"] is not None, first
        deadline = time.monotonic() + 5
        while not os.path.exists(hint) and time.monotonic() < deadline:
            time.sleep(0.05)
        with open(hint) as f:
            assert f.read() == "0\n"          # its agents connect at their start now

        out, pid = _run(svc, prog, SHORT)       # warm: patched from its start
        assert out == native[SHORT]
        warm = _report(svc, pid)
        assert "warm_job_queued" in warm["timeline"], warm["timeline"]
        assert warm["time_to_first_patch_s"] is not None, warm
        assert svc.call("status")["warm_start"]["warm_jobs"] >= 1

        out, pid = _run(svc, prog, SHORT)       # the next: that selection, moved here
        assert out == native[SHORT]
        again = _report(svc, pid)
        assert "warm_selection_reused" in again["timeline"], again["timeline"]
        assert "warm_job_queued" not in again["timeline"], again["timeline"]
        assert again["time_to_first_patch_s"] is not None, again
        assert svc.call("status")["warm_start"]["reused_selections"] >= 1
    finally:
        svc.stop()
    # a new service on the same store writes the hint at its start
    svc2 = ServiceProc(env=state).wait_ready()
    try:
        with open(os.path.join(svc2.dir, program_quiet_file(program_key(os.stat(prog))))) as f:
            assert f.read() == "0\n"
    finally:
        svc2.stop()
