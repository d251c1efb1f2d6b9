"""Does a process's executable code hold its files' bytes?  `dbr detach` asks once the
agent reverted its sites: every executable mapping of a regular file is read through
/proc/PID/mem and compared with the file at the mapping's offset.

Only mappings whose path is still the file the process mapped count
(``procmaps.mapped_file``); the rest are listed as unchecked.  Reads are bounded
(``MAX_BYTES`` in all) and a mapping that cannot be read is reported, never raised.
"""

from __future__ import annotations

import os
from typing import Any

from dbr_service.common.procmaps import mapped_file, read_maps

#: Most bytes compared in one check (a 30 MiB compiler's text is well inside).
MAX_BYTES = 512 << 20
CHUNK = 1 << 20


def compare_text(pid: int) -> dict[str, Any]:
    """``{"mappings": N, "bytes": B, "differences": [...], "unchecked": [...]}``; each
    difference names the path, the mapping's address and the first differing address
    and how many bytes differ; ``error`` when the process could not be read at all."""
    out: dict[str, Any] = {"mappings": 0, "bytes": 0, "differences": [], "unchecked": []}
    try:
        maps = read_maps(pid)
        mem = os.open(f"/proc/{pid}/mem", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        out["error"] = f"cannot read pid {pid}: {exc.strerror or exc}"
        return out
    except Exception as exc:   # MemoryViewError
        out["error"] = str(exc)
        return out
    try:
        for m in maps:
            # shared mappings are the agent's code buffers (memfd), no file's code
            if not m.executable or m.perms[3:4] == "s" or not m.path.startswith("/") \
                    or m.ino == 0:
                continue
            why = _compare_one(mem, m, out)
            if why:
                out["unchecked"].append({"path": m.path, "addr": hex(m.lo), "why": why})
    finally:
        os.close(mem)
    return out


def _compare_one(mem: int, m: Any, out: dict[str, Any]) -> str | None:
    try:
        st = mapped_file(m.path, m.dev, m.ino)
        if st is None:
            return "not the file the process mapped"
        fd = os.open(m.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        return exc.strerror or str(exc)
    try:
        if os.fstat(fd).st_ino != m.ino:
            return "replaced while checked"
        # the bytes past the file's end in its last page are zeros, not the file's
        length = max(0, min(m.hi - m.lo, st.st_size - m.offset))
        if out["bytes"] + length > MAX_BYTES:
            return f"over the check's bound of {MAX_BYTES >> 20} MiB"
        first, count = None, 0
        for off in range(0, length, CHUNK):
            n = min(CHUNK, length - off)
            have = os.pread(mem, n, m.lo + off)
            want = os.pread(fd, n, m.offset + off)
            if len(have) != n or len(want) != n:
                return "short read"
            if have != want:
                diff = [i for i in range(n) if have[i] != want[i]]
                count += len(diff)
                if first is None:
                    first = m.lo + off + diff[0]
        out["mappings"] += 1
        out["bytes"] += length
        if count:
            out["differences"].append({"path": m.path, "addr": hex(m.lo),
                                       "first": hex(first or 0), "bytes": count})
        return None
    except OSError as exc:
        return exc.strerror or str(exc)
    finally:
        os.close(fd)
