"""Where the service's sockets live (a module of its own: `dbr run` needs it before
PROG starts and must not pay for importing the configuration code then)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

AGENT_SOCKET = "agent.sock"
CONTROL_SOCKET = "control.sock"
EVENTS_SOCKET = "events.sock"


def resolve_runtime_dir(configured: str = "", env: Mapping[str, str] | None = None) -> Path:
    """Configured value, else $DBR_RUNTIME_DIR, else /run/dbr (root) or $XDG_RUNTIME_DIR/dbr."""
    env = os.environ if env is None else env
    if configured:
        return Path(configured)
    if env.get("DBR_RUNTIME_DIR"):
        return Path(env["DBR_RUNTIME_DIR"])
    if os.geteuid() == 0:
        return Path("/run/dbr")
    xdg = env.get("XDG_RUNTIME_DIR") or f"/tmp/dbr-{os.getuid()}"
    return Path(xdg) / "dbr"


# The agent's quiet start (dbr_agent/agent.c, "quiet while the program starts" and
# "born when the service would look"; shared/dbr_protocol.h: DBR_QUIET_DEFAULT_MS,
# DBR_QUIET_MAX_MS, DBR_QUIET_FILE, which tests/test_protocol_layout.py checks these
# against).  DBR_AGENT_QUIET_MS if it holds a number, else the number a service wrote
# to QUIET_FILE in its runtime dir (its min_client_age_s), else the default.  The
# agent's thread waits this long before its first connection; under a service's hint
# of more than 0 it is not even made until the program is that old and running.
QUIET_DEFAULT_MS = 50
QUIET_MAX_MS = 5000
QUIET_FILE = "agent-quiet-ms"


def parse_ms(text: str, maximum: int = QUIET_MAX_MS) -> int | None:
    """The agent's dbr_parse_ms: decimal digits after optional blanks, then at most
    one newline; over ``maximum`` is ``maximum``; None for anything else."""
    s = text.lstrip(" \t")
    if s.endswith("\n"):
        s = s[:-1]
    if not s or not all("0" <= c <= "9" for c in s):
        return None
    return min(int(s), maximum)


def agent_quiet(env: Mapping[str, str], runtime_dir: Path | None) -> tuple[int, bool]:
    """How long an agent started with ``env`` beside a service in ``runtime_dir``
    stays quiet, as the agent decides it, and whether the service's hint said so (a
    hint of more than 0 plans the agent's thread: it is made only once the program is
    that old and running)."""
    ms = parse_ms(env.get("DBR_AGENT_QUIET_MS", ""))
    if ms is not None:
        return ms, False
    if runtime_dir is not None:
        try:
            fd = os.open(runtime_dir / QUIET_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            return QUIET_DEFAULT_MS, False
        try:
            hint = parse_ms(os.read(fd, 15).decode("ascii", "replace"))
        except OSError:
            hint = None
        finally:
            os.close(fd)
        if hint is not None:
            return hint, True
    return QUIET_DEFAULT_MS, False


def quiet_hint_ms(min_client_age_s: float) -> int:
    """What a service that does not sample clients younger than ``min_client_age_s``
    writes to QUIET_FILE: that age in ms (at most QUIET_MAX_MS).  Its agents make
    their thread only once their program is that old and running, and connect then."""
    return min(int(max(0.0, min_client_age_s) * 1000), QUIET_MAX_MS)
