"""Running tests/agent_progs/birth.c beside a FakeService that has written the
service's files (tests/agent/test_agent_birth.py, tests/live/test_short_runs.py)."""

from __future__ import annotations

import os
import re
import time

from dbr_service.wire import protocol as P
from dbr_service.common.paths import QUIET_FILE
from harness import FakeService


def write_hint(svc: FakeService, hint: str | None, name: str = QUIET_FILE) -> None:
    """Write ``hint`` and a newline to ``name`` in the service's runtime dir (nothing
    for None)."""
    if hint is not None:
        with open(os.path.join(svc.runtime_dir, name), "w") as f:
            f.write(hint + "\n")


def run_birth(birth_exe, mode: str, ms: int, hint: str | None = "300", accept: bool = False,
              files: dict[str, str] | None = None, env: dict[str, str] | None = None):
    """Run `birth MODE MS` beside a FakeService that has written ``hint`` (and
    ``files``, name -> text, into its runtime dir), with ``env`` added: (exit status,
    stdout lines, agent log lines, seconds from the start to the agent's connection or
    None)."""
    svc = FakeService()
    try:
        write_hint(svc, hint)
        for name, text in (files or {}).items():
            with open(os.path.join(svc.runtime_dir, name), "w") as f:
                f.write(text)
        t0 = time.monotonic()
        client = svc.spawn([birth_exe, mode, str(ms)], env={"DBR_AGENT_DEBUG": "1", **(env or {})})
        waited = None
        if accept:
            conn = svc.accept(pid=client.pid, timeout=10)
            waited = time.monotonic() - t0
            assert conn.hello.flags & P.HELLO_HIDDEN_THREAD
        rc, out = client.finish(timeout=30)
        client.err.rest()
        return rc, out, client.err.lines, waited
    finally:
        svc.close()


def task_changes(out: list[str], prefix: str = "") -> list[tuple[int, int]]:
    """(tasks, at ms) from the program's "tasks N at T" lines"""
    pat = re.compile(rf"^{prefix}tasks (\d+) at (\d+)$")
    return [(int(m.group(1)), int(m.group(2))) for m in map(pat.match, out) if m]
