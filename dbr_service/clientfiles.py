"""What the service (often root) reads and writes on behalf of a client, done so that
neither the client nor another user can redirect it.

* :class:`PerfMap`: ``/tmp/perf-PID.map``, created with ``O_EXCL|O_NOFOLLOW`` (a link
  planted in /tmp, or a map another writer owns, is left alone), rewritten through the
  descriptor, removed at the session's end only if the path is still that file.
  Each map the service creates is recorded in ``RUNTIME_DIR/perf-maps`` so that
  :func:`remove_stale_perf_maps` can delete maps left by a service that was killed.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat

#: Where perf looks for JIT symbol maps (perf-PID.map).
PERF_MAP_DIR = "/tmp"
#: Subdirectory of the runtime dir holding one empty file per map the service created,
#: named PID-DEV-INO (hex dev and inode of the map).
PERF_MAP_RECORDS = "perf-maps"
#: Largest pid/tid the kernel hands out (PID_MAX_LIMIT).
TID_MAX = 1 << 22
#: Largest dbr map :func:`remove_stale_perf_maps` reads to check its format.
_LEGACY_MAP_MAX = 16 << 20

_O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_RECORD_RE = re.compile(r"([0-9]+)-([0-9a-f]+)-([0-9a-f]+)")
_MAP_NAME_RE = re.compile(r"perf-([0-9]+)\.map")
# A line install.py (Installer.perf_map_lines) writes: START SIZE dbr:REGION@0xORIG
_MAP_LINE_RE = re.compile(rb"[0-9a-f]+ [0-9a-f]+ dbr:[A-Za-z0-9_.:-]+@0x[0-9a-f]+")


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
