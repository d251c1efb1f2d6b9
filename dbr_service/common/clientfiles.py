"""What the service (often root) reads and writes on behalf of a client, done so that
neither the client nor another user can redirect it.

* :func:`safe_text`: text a client sends (its exe, an agent's error message) made
  printable and bounded before it is logged or listed.
* :class:`ProcHandle`: an open ``/proc/PID`` directory.  Lookups through it fail once
  the process that connected has ended, even if its pid is taken by another process;
  the client's threads, executable, memory and maps are read through it.
* :class:`PerfMap`: ``/tmp/perf-PID.map``, created with ``O_EXCL|O_NOFOLLOW`` (a link
  planted in /tmp, or a map another writer owns, is left alone), rewritten through the
  descriptor, removed at the session's end only if the path is still that file.
  Each map the service creates is recorded in ``RUNTIME_DIR/perf-maps`` so that
  :func:`remove_stale_perf_maps` can delete maps left by a service that was killed.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import stat
import threading
from typing import NamedTuple

#: Where perf looks for JIT symbol maps (perf-PID.map).
PERF_MAP_DIR = "/tmp"
#: Subdirectory of the runtime dir holding one empty file per map the service created,
#: named PID-DEV-INO (hex dev and inode of the map).
PERF_MAP_RECORDS = "perf-maps"
#: Highest user-space address on x86-64 (4-level paging) plus one.
USER_TOP = 1 << 47
#: Largest pid/tid the kernel hands out (PID_MAX_LIMIT).
TID_MAX = 1 << 22
#: Longest text kept of a client's string (characters, after escaping).
TEXT_MAX = 300
#: Largest dbr map :func:`remove_stale_perf_maps` reads to check its format.
_LEGACY_MAP_MAX = 16 << 20

_O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_RECORD_RE = re.compile(r"([0-9]+)-([0-9a-f]+)-([0-9a-f]+)")
_MAP_NAME_RE = re.compile(r"perf-([0-9]+)\.map")
# A line installation/install.py (Installer.perf_map_lines) writes: START SIZE dbr:REGION@0xORIG
_MAP_LINE_RE = re.compile(rb"[0-9a-f]+ [0-9a-f]+ dbr:[A-Za-z0-9_.:-]+@0x[0-9a-f]+")


# --------------------------------------------------------------------------- text
def safe_text(value: str | bytes | bytearray, limit: int = TEXT_MAX) -> str:
    """``value`` with every character that is not printable (control characters, ANSI
    escapes, bidi overrides, bytes that are not UTF-8) and the backslash escaped as
    ``\\xHH``/``\\uHHHH``, cut to ``limit`` characters ("..." marks a cut)."""
    if isinstance(value, (bytes, bytearray)):
        value = bytes(value).decode("utf-8", errors="surrogateescape")
    pieces: list[str] = []
    n = 0
    for ch in value[:limit + 1]:       # each character gives at least one
        c = ord(ch)
        if ch.isprintable() and ch != "\\":
            piece = ch
        elif ch == "\\":
            piece = "\\\\"
        elif 0xDC80 <= c <= 0xDCFF:          # a byte that was not UTF-8
            piece = f"\\x{c - 0xDC00:02x}"
        elif c < 0x100:
            piece = f"\\x{c:02x}"
        elif c < 0x10000:
            piece = f"\\u{c:04x}"
        else:
            piece = f"\\U{c:08x}"
        pieces.append(piece)
        n += len(piece)
        if n > limit:
            break
    if n <= limit:
        return "".join(pieces)
    out, n = [], 0
    for piece in pieces:             # cut between escapes, never inside one
        if n + len(piece) > limit - 3:
            break
        out.append(piece)
        n += len(piece)
    return "".join(out) + "..."


# --------------------------------------------------------------------------- /proc
class Mapping(NamedTuple):
    """One line of /proc/PID/maps with its device and inode."""

    lo: int
    hi: int
    perms: str
    dev: tuple[int, int]
    ino: int
    path: str


class ThreadCheck:
    OWN = "own"          # a thread of the client
    GONE = "gone"        # no such thread now (ended, or never was)
    FOREIGN = "foreign"  # a thread of another process


class ProcHandle:
    """``/proc/PID`` of one client, held open (see the module docstring); ``fd`` is -1
    if it could not be opened (every lookup then fails).  Any thread may use it; the
    lock keeps :meth:`close` from freeing the descriptor's number while a lookup uses
    it (the number could name another file by then)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.fd = -1
        self._lock = threading.RLock()
        if 0 < pid <= TID_MAX:
            with contextlib.suppress(OSError):
                self.fd = os.open(f"/proc/{pid}", _O_DIR)
        #: Whether /proc/PID could be opened at all.
        self.opened = self.fd >= 0

    def close(self) -> None:
        with self._lock:
            fd, self.fd = self.fd, -1
            if fd >= 0:
                os.close(fd)

    def read(self, rel: str, limit: int = 1 << 16) -> bytes | None:
        """Up to ``limit`` bytes of a file under the directory; None if unreadable."""
        with self._lock:
            if self.fd < 0:
                return None
            try:
                fd = os.open(rel, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW, dir_fd=self.fd)
            except OSError:
                return None
            try:
                chunks, n = [], 0
                while n < limit:
                    b = os.read(fd, min(1 << 16, limit - n))
                    if not b:
                        break
                    chunks.append(b)
                    n += len(b)
                return b"".join(chunks)
            except OSError:
                return None
            finally:
                os.close(fd)

    def alive(self) -> bool:
        """Whether the process that was opened still exists (a zombie leader counts)."""
        with self._lock:
            if self.fd < 0:
                return False
            try:
                os.stat("stat", dir_fd=self.fd)
                return True
            except OSError:
                return False

    def thread_check(self, tid: int) -> str:
        """Whether ``tid`` is a thread of this process (its task entry exists and its
        Tgid is the pid), of another process, or of none now."""
        if not 0 < tid <= TID_MAX:
            return ThreadCheck.FOREIGN
        own = _status_tgid(self.read(f"task/{tid}/status", 4096))
        if own is not None:
            return ThreadCheck.OWN if own == self.pid else ThreadCheck.FOREIGN
        # not ours (or ours has ended): a thread of some process, or of none
        other = _status_tgid(_read_path(f"/proc/{tid}/status", 4096))
        return ThreadCheck.GONE if other is None else ThreadCheck.FOREIGN

    def tids(self) -> set[int] | None:
        """The process's threads (task/), None if unreadable."""
        with self._lock:
            if self.fd < 0:
                return None
            try:
                fd = os.open("task", _O_DIR, dir_fd=self.fd)
            except OSError:
                return None
            try:
                return {int(t) for t in os.listdir(fd) if t.isdigit()}
            except OSError:
                return None
            finally:
                os.close(fd)

    def live_dir(self) -> str:
        """``.`` (the process's directory), or ``task/TID`` of a live thread when the
        leader is a zombie (its mem and maps are then unusable: procfs.proc_dir)."""
        state = _stat_state(self.read("stat", 4096))
        if state not in ("Z", "X"):
            return "."
        for tid in sorted(self.tids() or ()):
            if tid != self.pid and _stat_state(self.read(f"task/{tid}/stat", 4096)) \
                    not in ("Z", "X", None):
                return f"task/{tid}"
        return "."

    def exe(self) -> str | None:
        """The kernel's path of the executable (readlink), None if unreadable."""
        with self._lock:
            if self.fd < 0:
                return None
            for rel in ("exe", f"{self.live_dir()}/exe"):
                with contextlib.suppress(OSError):
                    return os.readlink(rel, dir_fd=self.fd)
            return None

    def exe_stat(self) -> os.stat_result | None:
        with self._lock:
            if self.fd < 0:
                return None
            for rel in ("exe", f"{self.live_dir()}/exe"):
                with contextlib.suppress(OSError):
                    return os.stat(rel, dir_fd=self.fd)
            return None

    def ppid(self) -> int | None:
        text = self.read("status", 8192)
        m = re.search(rb"\nPPid:\s*([0-9]+)", text or b"")
        return int(m.group(1)) if m else None

    def open_mem(self) -> int:
        """A read-only descriptor of the process's memory (OSError if it cannot be had)."""
        with self._lock:
            if self.fd < 0:
                raise ProcessLookupError(f"no /proc entry of pid {self.pid}")
            return os.open(f"{self.live_dir()}/mem", os.O_RDONLY | os.O_CLOEXEC, dir_fd=self.fd)

    def maps(self) -> list[Mapping] | None:
        """The process's mappings with device and inode; None if unreadable."""
        text = self.read(f"{self.live_dir()}/maps", 256 << 20)
        if text is None:
            return None
        out = []
        for line in text.splitlines():
            parts = line.split(None, 5)
            if len(parts) < 5:
                continue
            try:
                lo, _, hi = parts[0].partition(b"-")
                major, _, minor = parts[3].partition(b":")
                out.append(Mapping(int(lo, 16), int(hi, 16), parts[1].decode(),
                                   (int(major, 16), int(minor, 16)), int(parts[4]),
                                   parts[5].decode(errors="replace") if len(parts) > 5
                                   else ""))
            except ValueError:
                continue
        return out


def _read_path(path: str, limit: int) -> bytes | None:
    try:
        with open(path, "rb", buffering=0) as f:
            return f.read(limit)
    except OSError:
        return None


def _status_tgid(text: bytes | None) -> int | None:
    m = re.search(rb"(?:^|\n)Tgid:\s*([0-9]+)", text or b"")
    return int(m.group(1)) if m else None


def _stat_state(text: bytes | None) -> str | None:
    if not text:
        return None
    rest = text[text.rfind(b")") + 1:].split()
    return rest[0].decode("ascii", "replace") if rest else None


def code_buffer_problem(proc: ProcHandle, fd: int, base: int, size: int,
                        requested: int, data: bool = False) -> str | None:
    """Why a code buffer the agent handed over (CODE_BUFFER: ``fd`` mapped at ``base``,
    ``size`` bytes, for a request of ``requested``) is not one the service may map and
    write; None if it is.  It must be page-aligned user memory of the requested size
    (rounded up by at most 2 MiB; a ``data`` buffer to whole pages only), the fd a
    regular file of exactly that size, and the client's own mapping at
    [base, base + size) that same file."""
    page = 4096
    granule = page if data else 2 << 20
    if size < requested or size > ((requested + granule - 1) & ~(granule - 1)) \
            or size % page:
        return f"size {size:#x} for a request of {requested:#x}"
    if base % page or base == 0 or base + size > USER_TOP:
        return f"base {base:#x} is not page-aligned user memory"
    try:
        st = os.fstat(fd)
    except OSError as exc:
        return f"fd: {exc}"
    if not stat.S_ISREG(st.st_mode) or st.st_size != size:
        return f"fd is not a file of {size:#x} bytes"
    if not size_sealed(fd):
        return "fd is not sealed against shrinking (the service's mapping could fault)"
    maps = proc.maps()
    if maps is None:
        return "the client's maps are unreadable"
    dev = (os.major(st.st_dev), os.minor(st.st_dev))
    at = base
    for m in maps:
        if m.hi <= at or m.lo > at:
            continue
        if m.dev != dev or m.ino != st.st_ino:
            return f"the client maps another file at {at:#x}"
        at = m.hi
        if at >= base + size:
            return None
    return f"[{base:#x}, {base + size:#x}) is not mapped in the client"


def size_sealed(fd: int) -> bool:
    """Whether ``fd`` (a memfd a client sent) can neither shrink nor grow: a file shrunk
    under the service's mapping would kill the service with SIGBUS at its next access."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        return False
    return seals & (fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW) == \
        (fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)


# --------------------------------------------------------------------------- perf maps
def perf_map_path(pid: int) -> str:
    return f"{PERF_MAP_DIR}/perf-{pid}.map"


def _records_dir(runtime_dir: str | os.PathLike, create: bool) -> int | None:
    """A descriptor of RUNTIME_DIR/perf-maps (made 0700 if ``create``), None if it is
    missing, a link, or not this user's own private directory."""
    path = os.path.join(os.fspath(runtime_dir), PERF_MAP_RECORDS)
    if create:
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
    try:
        fd = os.open(path, _O_DIR | os.O_NOFOLLOW)
    except OSError:
        return None
    st = os.fstat(fd)
    if st.st_uid != os.geteuid():
        os.close(fd)
        return None
    if st.st_mode & 0o077:
        os.fchmod(fd, 0o700)
    return fd


class PerfMap:
    """The perf map of one client (see the module docstring).  :meth:`write` creates it
    at the first call; a path that exists then (a JIT's map, a planted link) is left
    alone for the session."""

    def __init__(self, pid: int, runtime_dir: str | os.PathLike | None) -> None:
        self.pid = pid
        self.path = perf_map_path(pid)
        self.runtime_dir = runtime_dir
        self.fd = -1
        self.ident: tuple[int, int] | None = None
        #: Why the service does not write this map ("" while it may).
        self.refused = ""
        self._record = ""

    def write(self, lines: list[str]) -> str | None:
        """Write ``lines`` as the whole map.  Returns a message for the session's errors
        the first time the map is refused, and on a failed write; else None."""
        if self.refused:
            return None
        if self.fd < 0:
            if not lines:
                return None   # nothing live yet: no file
            why = self._create()
            if why:
                self.refused = why
                return why
        data = "".join(f"{ln}\n" for ln in lines).encode()
        try:
            off = 0
            while off < len(data):
                off += os.pwrite(self.fd, data[off:], off)
            os.ftruncate(self.fd, len(data))   # after the write: never seen empty
        except OSError as exc:
            return f"{self.path}: {exc}"
        return None

    def _create(self) -> str:
        flags = os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_WRONLY | os.O_CLOEXEC
        try:
            fd = os.open(self.path, flags, 0o644)
        except FileExistsError:
            return f"{self.path} exists (another writer's map, or a link): left alone"
        except OSError as exc:
            return f"{self.path}: {exc}"
        try:
            os.fchmod(fd, 0o644)       # whatever the umask: perf runs as the client's user
            st = os.fstat(fd)
        except OSError as exc:
            os.close(fd)
            return f"{self.path}: {exc}"
        self.fd, self.ident = fd, (st.st_dev, st.st_ino)
        self._record = f"{self.pid}-{st.st_dev:x}-{st.st_ino:x}"
        if self.runtime_dir is not None:
            with contextlib.suppress(OSError):
                dfd = _records_dir(self.runtime_dir, create=True)
                if dfd is not None:
                    try:
                        os.close(os.open(self._record, flags & ~os.O_EXCL, 0o600,
                                         dir_fd=dfd))
                    finally:
                        os.close(dfd)
        return ""

    def close(self) -> None:
        """Remove the map if the path is still the file this session created; close it."""
        if self.fd < 0:
            return
        try:
            st = os.lstat(self.path)
            if stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) == self.ident:
                os.unlink(self.path)
        except OSError:
            pass
        if self.runtime_dir is not None:
            with contextlib.suppress(OSError):
                dfd = _records_dir(self.runtime_dir, create=False)
                if dfd is not None:
                    try:
                        os.unlink(self._record, dir_fd=dfd)
                    finally:
                        os.close(dfd)
        fd, self.fd = self.fd, -1
        os.close(fd)


def _unlink_if(path: str, ident: tuple[int, int]) -> bool:
    """Unlink ``path`` if it is a regular file of this user with that (dev, ino).  In
    the sticky /tmp only its owner (or root) can replace such a file meanwhile."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or \
            (st.st_dev, st.st_ino) != ident:
        return False
    try:
        os.unlink(path)
        return True
    except OSError:
        return False


def _is_dbr_map(path: str) -> tuple[int, int] | None:
    """(dev, ino) of ``path`` if it is a regular file of this user, not larger than
    _LEGACY_MAP_MAX, whose every line is one dbr writes; else None."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or \
            not 0 < st.st_size <= _LEGACY_MAP_MAX:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fst = os.fstat(fd)
        if (fst.st_dev, fst.st_ino) != (st.st_dev, st.st_ino):
            return None
        data = os.read(fd, _LEGACY_MAP_MAX + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    if not data.endswith(b"\n") or len(data) > _LEGACY_MAP_MAX:
        return None
    lines = data[:-1].split(b"\n")
    if lines != [b""] and not all(_MAP_LINE_RE.fullmatch(ln) for ln in lines):
        return None
    return st.st_dev, st.st_ino


def _pid_runs(pid: int) -> bool:
    """Whether ``pid`` is a process now (also when it cannot be a pid: left alone)."""
    if not 0 < pid <= TID_MAX:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def remove_stale_perf_maps(runtime_dir: str | os.PathLike) -> list[str]:
    """At the service's start: delete the perf maps a killed service left in /tmp, and
    return their paths.

    A map recorded in RUNTIME_DIR/perf-maps is deleted if the path is still that file
    (a regular file owned by this user with the recorded device and inode); its record
    goes either way.  A map with no record (written by an older dbr, or by a service of
    another runtime dir) is deleted only if it is a regular file owned by this user,
    its pid runs no process, and every line of it is one dbr writes."""
    removed: list[str] = []
    dfd = _records_dir(runtime_dir, create=False)
    if dfd is not None:
        try:
            for name in os.listdir(dfd):
                m = _RECORD_RE.fullmatch(name)
                if m is None:
                    continue
                path = perf_map_path(int(m.group(1)))
                if _unlink_if(path, (int(m.group(2), 16), int(m.group(3), 16))):
                    removed.append(path)
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=dfd)
        finally:
            os.close(dfd)
    try:
        names = os.listdir(PERF_MAP_DIR)
    except OSError:
        return removed
    for name in names:
        m = _MAP_NAME_RE.fullmatch(name)
        if m is None or _pid_runs(int(m.group(1))):
            continue
        path = f"{PERF_MAP_DIR}/{name}"
        ident = _is_dbr_map(path)
        if ident is not None and _unlink_if(path, ident):
            removed.append(path)
    return removed
