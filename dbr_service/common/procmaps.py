"""A client's memory map: lines of /proc/PID/maps, and lookups in them."""

from __future__ import annotations

import bisect
import os
import stat
from typing import NamedTuple

from dbr_service.common.errors import MemoryViewError
from dbr_service.common.procfs import proc_dir

class MapEntry(NamedTuple):
    """One line of /proc/PID/maps."""

    lo: int
    hi: int
    perms: str
    offset: int
    path: str
    #: The file's device (major, minor) and inode; (0, 0) and 0 for anonymous memory.
    dev: tuple[int, int] = (0, 0)
    ino: int = 0

    @property
    def executable(self) -> bool:
        return "x" in self.perms


def read_maps(pid: int) -> list[MapEntry]:
    """Parse /proc/PID/maps (sorted by address); MemoryViewError if unreadable."""
    try:
        with open(f"{proc_dir(pid)}/maps") as fh:
            return parse_maps(fh.read())
    except OSError as exc:
        raise MemoryViewError(f"cannot read maps of pid {pid}: {exc}") from exc


def parse_maps(text: str) -> list[MapEntry]:
    out = []
    for line in text.splitlines():
        parts = line.split(None, 5)
        if len(parts) < 5:
            continue
        lo, _, hi = parts[0].partition("-")
        major, _, minor = parts[3].partition(":")
        try:
            dev, ino = (int(major, 16), int(minor, 16)), int(parts[4])
        except ValueError:
            dev, ino = (0, 0), 0
        out.append(MapEntry(int(lo, 16), int(hi, 16), parts[1], int(parts[2], 16),
                            parts[5] if len(parts) > 5 else "", dev, ino))
    return out


def find_mapping(maps: list[MapEntry], addr: int) -> MapEntry | None:
    """The mapping that contains ``addr`` (``maps`` sorted by address)."""
    k = bisect.bisect_right([m.lo for m in maps], addr) - 1
    if k >= 0 and maps[k].lo <= addr < maps[k].hi:
        return maps[k]
    return None


def module_base(maps: list[MapEntry], path: str) -> int:
    """Load base of a file mapping: lowest address of a private mapping of ``path``
    (as the loader maps a module's segments), less its file offset.  A shared mapping
    of the same file (a program reading an ELF file through mmap) is not the module;
    without any private one, the lowest mapping of ``path`` is."""
    private = [m for m in maps if m.path == path and m.perms[3:4] == "p"]
    return min((m.lo - m.offset for m in private or [m for m in maps if m.path == path]),
               default=0)


def mapped_file(path: str, dev: tuple[int, int], ino: int) -> os.stat_result | None:
    """The stat of ``path`` when it is a regular file with the device (major, minor)
    and inode a mapping shows, i.e. the file the process mapped; None when it is
    another file (replaced since, another mount namespace's, not regular).  A path the
    service cannot stat raises OSError."""
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode) or \
            (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino) != (*dev, ino):
        return None
    return st
