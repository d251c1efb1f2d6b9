"""Locate (and if needed build) libdbr_agent.so, the in-client agent."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

_HERE = Path(__file__).resolve().parent
_LIB = "libdbr_agent.so"


def _sources() -> list[Path]:
    return sorted(_HERE.glob("*.c")) + sorted(_HERE.glob("*.h"))


def agent_path(build: bool = True) -> str:
    """Absolute path of the built agent.

    In a source checkout the library is rebuilt with the agent's Makefile when a
    source is newer than it (``build=True``); an installed wheel ships it built.
    """
    lib = _HERE / _LIB
    makefile = _HERE / "Makefile"
    if build and makefile.exists():
        srcs = _sources() + [_HERE.parent / "shared" / "dbr_protocol.h"]
        newest = max((s.stat().st_mtime for s in srcs if s.exists()), default=0.0)
        if not lib.exists() or lib.stat().st_mtime < newest:
            subprocess.run(["make", "-s", "-C", str(_HERE)], check=True,
                           stdout=subprocess.DEVNULL)
    if not lib.exists():
        raise FileNotFoundError(f"{lib} is not built: run `make build` in the dbr checkout")
    return os.fspath(lib)
