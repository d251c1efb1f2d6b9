"""perf jitdump records for replacement code (`perf inject --jit`).

With ``DBR_JITDUMP=1`` in a client's environment its agent creates
``/tmp/jit-PID.dump`` (the format's 40-byte header) and maps it executable, which is
how perf finds a JIT's records (dbr_agent/jitdump.c).  The service appends one
``JIT_CODE_LOAD`` record per installed region: the code's address and bytes, named
``dbr:FUNCTION+0xOFF [REGION]`` after the original code the region starts at.  Then

    perf record -k mono -p PID ...; perf inject --jit -i perf.data -o jit.data
    perf report -i jit.data

shows samples in replacement code under those names.  The file is the client's: the
service writes it only when it is a regular file with one link, owned by the
client's uid, whose header is the format's with the client's pid, and stops at
:data:`MAX_BYTES`.
"""

from __future__ import annotations

import os
import stat
import struct
import time

JITDUMP_MAGIC = 0x4A695444
HEADER = struct.Struct("<IIIIIIQQ")        # magic version size mach pad pid time flags
JIT_CODE_LOAD = 0
LOAD = struct.Struct("<IIQIIQQQQ")          # id size time pid tid vma addr size index
#: Most bytes the service appends to one client's file.
MAX_BYTES = 64 << 20


def path_of(pid: int) -> str:
    return f"/tmp/jit-{pid}.dump"


class JitDump:
    """The service's side of one client's jitdump file."""

    def __init__(self, pid: int, uid: int) -> None:
        self.pid, self.uid = pid, uid
        self.fd = -1
        self.written = 0
        self.index = 0
        #: Why nothing is written ("" while it may be; "absent" until the file exists).
        self.refused = ""
        self.loaded: set[int] = set()       # installer region ids already recorded

    def _open(self) -> str:
        try:
            fd = os.open(path_of(self.pid), os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW |
                         os.O_CLOEXEC | os.O_NONBLOCK)
        except FileNotFoundError:
            return "absent"
        except OSError as exc:
            return f"{path_of(self.pid)}: {exc}"
        try:
            st = os.fstat(fd)
            why = ("not a regular file" if not stat.S_ISREG(st.st_mode) else
                   "more than one link" if st.st_nlink != 1 else
                   f"owned by uid {st.st_uid}, not the client's" if st.st_uid != self.uid
                   else "")
            if not why:
                with open(f"/proc/self/fd/{fd}", "rb") as fh:
                    head = fh.read(HEADER.size)
                if len(head) < HEADER.size:
                    why = "no jitdump header"
                else:
                    magic, _v, _s, _m, _p, pid, _t, _f = HEADER.unpack(head)
                    if magic != JITDUMP_MAGIC or pid != self.pid:
                        why = "not this client's jitdump file"
        except OSError as exc:
            why = str(exc)
        if why:
            os.close(fd)
            return f"{path_of(self.pid)}: {why}"
        self.fd = fd
        return ""

    def load(self, key: int, name: str, addr: int, code: bytes) -> str | None:
        """Record the code of one installed region (once per installer region id).  Returns a
        message the first time the file is refused, else None."""
        if key in self.loaded or self.refused not in ("", "absent"):
            return None
        if self.fd < 0:
            self.refused = self._open()
            if self.refused:
                return None if self.refused == "absent" else self.refused
        raw = name.encode(errors="replace")[:200] + b"\0"
        rec = LOAD.pack(JIT_CODE_LOAD, LOAD.size + len(raw) + len(code),
                        time.clock_gettime_ns(time.CLOCK_MONOTONIC), self.pid, self.pid,
                        addr, addr, len(code), self.index) + raw + code
        if self.written + len(rec) > MAX_BYTES:
            self.refused = f"{path_of(self.pid)}: {MAX_BYTES} bytes written, no more"
            return self.refused
        try:
            os.write(self.fd, rec)
        except OSError as exc:
            self.refused = f"{path_of(self.pid)}: {exc}"
            return self.refused
        self.written += len(rec)
        self.index += 1
        self.loaded.add(key)
        return None

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
