"""Processes that carry the agent but have no session with this service, and why
(`dbr ctl waiting`).

Since the agent makes its thread only once its program is old enough and running
(dbr_agent/agent.c, "born when the service would look"), or later for a program whose
runs end too soon to gain (daemon/shortruns.py), a process can carry the agent for seconds,
or for good, without `dbr ctl clients` listing it.  An operator who asks "is my
program under dbr?" gets the answer here: every process whose maps hold the agent
library and whose agent would connect to this service (its ``DBR_RUNTIME_DIR``, or the
default the agent derives from its uid), with the reason it has no session.

Read on request only: it lists /proc and reads each process's maps (tens of ms on a
host with hundreds of processes), and the environment of those that carry the agent.
Processes the service may not read (another user's, when not root) are left out.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from pathlib import Path

from dbr_service.common.paths import AGENT_SOCKET, agent_quiet
from dbr_service.common.procfs import process_lives, started_boottime, started_monotonic

AGENT_LIBRARY = "libdbr_agent.so"


def _environ(pid: int) -> dict[str, str] | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    env = {}
    for item in raw.split(b"\0"):
        k, sep, v = item.partition(b"=")
        if sep:
            env[k.decode(errors="replace")] = v.decode(errors="replace")
    return env


def _carries_agent(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/maps", "rb") as f:
            return AGENT_LIBRARY.encode() in f.read()
    except OSError:
        return False


def _uid(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def agent_socket_of(env: dict[str, str], uid: int) -> str | None:
    """The socket the agent of a process with ``env`` and real ``uid`` connects to, as
    dbr_agent/util.c resolves it (None: it has none)."""
    if env.get("DBR_RUNTIME_DIR"):
        return f"{env['DBR_RUNTIME_DIR']}/{AGENT_SOCKET}"
    if uid == 0:
        return f"/run/dbr/{AGENT_SOCKET}"
    if env.get("XDG_RUNTIME_DIR"):
        return f"{env['XDG_RUNTIME_DIR']}/dbr/{AGENT_SOCKET}"
    return None


def waiting_processes(runtime_dir: Path, session_pids: Iterable[int],
                      ended: dict[int, tuple[float | None, str]],
                      pids: Iterable[int] | None = None) -> list[dict]:
    """The processes that carry the agent, would connect to ``runtime_dir``'s service,
    and have no live session (``session_pids``); ``ended``: pid -> (its process's
    start, close reason) of sessions that ended while their process may live on."""
    ours = os.path.realpath(runtime_dir / AGENT_SOCKET)
    live = set(session_pids)
    me = os.getpid()
    if pids is None:
        pids = [int(d) for d in os.listdir("/proc") if d.isdigit()]
    out = []
    for pid in pids:
        if pid in live or pid == me or not _carries_agent(pid):
            continue
        env = _environ(pid)
        uid = _uid(pid)
        if env is None or uid is None:
            continue
        sock = agent_socket_of(env, uid)
        if sock is None or os.path.realpath(sock) != ours:
            continue   # another service's client, or none
        started = started_boottime(f"/proc/{pid}/stat")
        mono = started_monotonic(pid, started) if started is not None else None
        age_ms = int((time.monotonic() - mono) * 1000) if mono is not None else None
        try:
            exe = os.readlink(f"/proc/{pid}/exe")
        except OSError:
            exe = ""
        why, birth = _why(pid, env, age_ms, started, ended.get(pid), runtime_dir)
        out.append({"pid": pid, "uid": uid, "exe": exe, "age_s": None if age_ms is None
                    else round(age_ms / 1000, 1), "birth_ms": birth, "why": why})
    return sorted(out, key=lambda r: r["pid"])


def _why(pid: int, env: dict[str, str], age_ms: int | None, started: float | None,
         ended: tuple[float | None, str] | None, runtime_dir: Path) -> tuple[str, int | None]:
    """Why the process has no session, and the age its agent makes its thread at (None
    where that does not apply)."""
    if env.get("DBR_AGENT_DISABLE") == "1":
        return "its agent is disabled (DBR_AGENT_DISABLE=1)", None
    if ended is not None and ended[0] == started and process_lives(pid, started):
        return (f"its session ended while it runs on ({ended[1]}): its agent stepped aside",
                None)
    # as its agent decides it (paths.agent_quiet), from the files as they are now
    birth, planned, late = agent_quiet(env, runtime_dir, f"/proc/{pid}/exe")
    if not planned or not birth:
        return ("its agent's thread was made at its start and has not connected yet "
                "(it retries with backoff), or its agent stepped aside"), None
    source = "short_run_s: its last runs ended sooner" if late else "min_client_age_s"
    if age_ms is not None and age_ms < birth:
        return f"younger than its agent's birth age ({birth} ms, {source})", birth
    return (f"its agent makes its thread once it runs past {birth} ms ({source}): it has "
            "slept since, or its agent stepped aside"), birth
