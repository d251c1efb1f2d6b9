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
