"""Samples of one binary from a ``perf.data`` file, for ``dbr analyze``.

``perf script -F pid,ip,dso --show-mmap-events`` (run as a subprocess, bounded in
time) prints every sample's pid, run-time IP and DSO, and every mapping perf recorded
(start, length, file offset, device and inode, path).  A sample in the analysed binary
becomes a file offset through the mapping of its process that holds it, and the file
offset a link address through the binary's PT_LOAD headers: PIE load addresses and
ASLR need no ``--base``.  Samples in other DSOs (libc, the kernel, ...) are counted
per DSO, so that ``dbr analyze`` can say when the binary is not where the time went.

A mapping is the binary's when its device and inode are the binary's, or its path is
the binary's real path; otherwise ``dso`` names the path perf recorded (a stripped copy
analysed for an unstripped run), or the one recorded file with the binary's name is it.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import stat
import struct
import subprocess
import tempfile
import threading
from collections import Counter
from dataclasses import dataclass, field

from dbr_service.common.errors import DbrError

#: The first eight bytes of a perf.data file (perf's own test: either byte order).
PERF_MAGIC = (b"PERFILE2", b"2ELIFREP")
#: `perf script` gets this long to go through a perf.data file before it is killed.
PERF_SCRIPT_TIMEOUT_S = 300.0
#: Lines of perf's standard error quoted when it fails.
ERR_LINES = 4
#: Program headers read from the binary at most (a hostile file).
MAX_PHDRS = 4096


class PerfDataError(DbrError):
    """A perf.data file could not be read, or perf is missing."""


def is_perf_data(path: str) -> bool:
    """Whether ``path`` is a regular file that starts as a perf.data file does (False if
    it cannot be read; a pipe, `--samples <(...)`, is not read here: its first bytes
    would be gone for the text reader)."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return False
        with open(path, "rb") as f:
            return f.read(8) in PERF_MAGIC
    except OSError:
        return False


def find_perf() -> str | None:
    """The perf binary: ``perf`` on PATH, else the versioned ``perf_*`` programs Debian's
    wrapper runs, else those of Ubuntu's linux-tools packages (newest name last)."""
    found = shutil.which("perf")
    if found:
        return found
    cands = sorted(glob.glob("/usr/bin/perf_[0-9]*")) + \
        sorted(glob.glob("/usr/lib/linux-tools*/perf")) + \
        sorted(glob.glob("/usr/lib/linux-tools/*/perf"))
    cands = [c for c in cands if os.access(c, os.X_OK)]
    return cands[-1] if cands else None


@dataclass
class PerfSamples:
    """What a perf.data file holds for one binary."""

    #: Samples in the binary, per link address.
    ips: dict[int, float] = field(default_factory=dict)
    #: Samples in all, and in the binary.
    total: int = 0
    in_binary: int = 0
    #: Samples elsewhere, per DSO as perf names it ("[kernel.kallsyms]", a path, ...).
    other: Counter = field(default_factory=Counter)
    #: The path perf recorded for the binary, if a mapping of it was found.
    dso: str | None = None

    def top_other(self, n: int = 3) -> list[tuple[str, int]]:
        return self.other.most_common(n)


# `PID PERF_RECORD_MMAP2 PID/TID: [0xSTART(0xLEN) @ PGOFF MAJ:MIN INO GEN]: PROT PATH`
# (MMAP: no device and inode; --buildid-mmap: a build-id in their place).
_MMAP = re.compile(r"^\s*(-?\d+)\s+PERF_RECORD_MMAP2?\s+\S+:\s+\[0x([0-9a-f]+)\(0x([0-9a-f]+)\)"
                   r"\s+@\s+(0x[0-9a-f]+|\d+)(?:\s+([0-9a-f]+):([0-9a-f]+)\s+(\d+))?[^\]]*\]:"
                   r"\s+\S+\s+(.*?)\s*$")
# `PID IP (DSO)`
_SAMPLE = re.compile(r"^\s*(-?\d+)\s+([0-9a-f]+)\s+\((.*)\)\s*$")


def load_segments(path: str) -> list[tuple[int, int, int]]:
    """``(p_offset, p_filesz, p_vaddr)`` of each PT_LOAD of the ELF64 file at ``path``;
    every length is checked against the file (empty for anything else)."""
    with open(path, "rb") as f:
        head = f.read(64)
        if len(head) < 64 or head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
            return []
        phoff, = struct.unpack_from("<Q", head, 0x20)
        phentsize, phnum = struct.unpack_from("<HH", head, 0x36)
        if phentsize < 56 or phnum > MAX_PHDRS:
            return []
        f.seek(phoff)
        table = f.read(phentsize * phnum)
    out = []
    for i in range(len(table) // phentsize):
        p_type, _flags, off, vaddr, _paddr, filesz = struct.unpack_from(
            "<IIQQQQ", table, i * phentsize)
        if p_type == 1 and filesz:
            out.append((off, filesz, vaddr))
    return out


def offset_to_vaddr(segments: list[tuple[int, int, int]], offset: int) -> int | None:
    for off, size, vaddr in segments:
        if off <= offset < off + size:
            return vaddr + offset - off
    return None


@dataclass
class _Mapping:
    start: int
    end: int
    pgoff: int
    path: str


class _Reader:
    """Folds `perf script` lines into :class:`PerfSamples` for one binary."""

    def __init__(self, binary: str, dso: str | None) -> None:
        st = os.stat(binary)
        self.ident = (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)
        self.real = os.path.realpath(binary)
        self.name = os.path.basename(binary)
        self.dso = dso
        self.segments = load_segments(binary)
        self.mine: set[str] = set()             # recorded paths that are the binary
        self.named: set[str] = set()            # recorded paths with the binary's name
        self.maps: dict[int, list[_Mapping]] = {}
        self.pending: Counter = Counter()       # (pid, ip, dso) of samples to place
        self.out = PerfSamples()

    def mmap(self, m: re.Match) -> None:
        pid, start, length = int(m[1]), int(m[2], 16), int(m[3], 16)
        path = m[8]
        if self.dso is not None:
            ours = path == self.dso
        else:
            same = m[7] is not None and (int(m[5], 16), int(m[6], 16), int(m[7])) == self.ident
            ours = same or path == self.real
            if not ours and os.path.basename(path) == self.name:
                self.named.add(path)
        if ours:
            self.mine.add(path)
        self.maps.setdefault(pid, []).append(_Mapping(start, start + length, int(m[4], 0), path))

    def sample(self, m: re.Match) -> None:
        self.pending[(int(m[1]), int(m[2], 16), m[3])] += 1

    def finish(self) -> PerfSamples:
        out = self.out
        mine = self.mine or (self.named if len(self.named) == 1 and self.dso is None else set())
        everyone = [mp for ms in self.maps.values() for mp in ms if mp.path in mine]
        for (pid, ip, dso), n in self.pending.items():
            out.total += n
            vaddr = self._place(pid, ip, dso, mine, everyone) if dso in mine else None
            if vaddr is None:
                out.other[dso if dso not in mine else f"{dso} (outside its mappings)"] += n
                continue
            out.in_binary += n
            out.ips[vaddr] = out.ips.get(vaddr, 0.0) + n
        out.dso = next(iter(sorted(mine)), None)
        return out

    def _place(self, pid: int, ip: int, dso: str, mine: set[str],
               everyone: list[_Mapping]) -> int | None:
        # the process's own mapping; a forked child has its parent's (no event of its own)
        for cands in (self.maps.get(pid, ()), everyone):
            for mp in reversed(cands):
                if mp.path == dso and mp.start <= ip < mp.end:
                    return offset_to_vaddr(self.segments, ip - mp.start + mp.pgoff)
        return None


def read_perf_data(path: str, binary: str, dso: str | None = None, perf: str | None = None,
                   timeout: float = PERF_SCRIPT_TIMEOUT_S) -> PerfSamples:
    """The samples ``path`` (a perf.data file) holds for ``binary``, at its link
    addresses, and those it holds elsewhere.  PerfDataError when perf is missing,
    fails, takes longer than ``timeout`` or the file holds no sample."""
    perf = perf or find_perf()
    if perf is None:
        raise PerfDataError(f"{path}: reading a perf.data file needs `perf` (Debian: apt "
                            f"install linux-perf; `make bench-setup` installs it)")
    try:
        reader = _Reader(binary, dso)
    except OSError as exc:
        raise PerfDataError(f"{binary}: {exc.strerror}") from None
    cmd = [perf, "script", "-i", path, "-F", "pid,ip,dso", "--show-mmap-events"]
    env = dict(os.environ, LC_ALL="C")
    with tempfile.TemporaryFile() as err:
        try:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=err, env=env, text=True, errors="replace")
        except OSError as exc:
            raise PerfDataError(f"cannot run {perf}: {exc.strerror}") from None
        expired = threading.Event()

        def expire() -> None:
            expired.set()
            proc.kill()
        timer = threading.Timer(timeout, expire)
        timer.start()
        try:
            for line in proc.stdout:
                m = _SAMPLE.match(line)
                if m:
                    reader.sample(m)
                elif "PERF_RECORD_MMAP" in line:
                    m = _MMAP.match(line)
                    if m:
                        reader.mmap(m)
            rc = proc.wait()
        finally:
            timer.cancel()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            proc.stdout.close()
        err.seek(0)
        errtext = err.read(65536).decode("utf-8", "replace")
    if expired.is_set():
        raise PerfDataError(f"{path}: `perf script` took more than {timeout:g} s; "
                            f"cut the recording short (perf record -- sleep, or -F)")
    if rc != 0:
        why = " / ".join(ln.strip() for ln in errtext.strip().splitlines()[-ERR_LINES:])
        raise PerfDataError(f"{path}: `perf script` failed (exit {rc}): "
                            f"{why or 'no message'}")
    out = reader.finish()
    if not out.total:
        raise PerfDataError(f"{path}: no samples (is it a perf.data file perf record wrote?)")
    return out
