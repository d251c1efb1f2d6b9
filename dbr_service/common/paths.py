"""Where the service's sockets live (a module of its own: `dbr run` needs it before
PROG starts and must not pay for importing the configuration code then)."""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Callable, Mapping
from pathlib import Path

AGENT_SOCKET = "agent.sock"
CONTROL_SOCKET = "control.sock"
EVENTS_SOCKET = "events.sock"


def _resolve(configured: str, env: Mapping[str, str] | None, var: str, as_root: str,
             user_base: Callable[[Mapping[str, str]], str]) -> Path:
    """The precedence both directories follow: configured, else ``$var``, else
    ``as_root`` for root, else ``user_base(env)/dbr``."""
    env = os.environ if env is None else env
    if configured:
        return Path(configured)
    if env.get(var):
        return Path(env[var])
    if os.geteuid() == 0:
        return Path(as_root)
    return Path(user_base(env)) / "dbr"


def resolve_runtime_dir(configured: str = "", env: Mapping[str, str] | None = None) -> Path:
    """Configured value, else $DBR_RUNTIME_DIR, else /run/dbr (root) or $XDG_RUNTIME_DIR/dbr."""
    return _resolve(configured, env, "DBR_RUNTIME_DIR", "/run/dbr",
                    lambda e: e.get("XDG_RUNTIME_DIR") or f"/tmp/dbr-{os.getuid()}")


def resolve_state_dir(configured: str = "", env: Mapping[str, str] | None = None) -> Path:
    """Configured value, else $DBR_STATE_DIR, else /var/lib/dbr (root) or
    $XDG_STATE_HOME/dbr ($HOME/.local/state/dbr without it): where the profile store
    lives (dbr_service/profiles/profilestore.py)."""
    return _resolve(configured, env, "DBR_STATE_DIR", "/var/lib/dbr",
                    lambda e: e.get("XDG_STATE_HOME") or os.path.join(
                        e.get("HOME") or os.path.expanduser("~"), ".local", "state"))


class UnsafeDirError(OSError):
    """A directory the service would write into could be changed by someone else."""


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _check_ancestor(st: os.stat_result, where: str) -> None:
    """An ancestor of a private dir: owned by root or us, and writable by nobody else
    unless sticky (/tmp), where others cannot rename or remove what is ours."""
    if st.st_uid not in (0, os.geteuid()):
        raise UnsafeDirError(f"{where} is owned by uid {st.st_uid}, not root or uid "
                             f"{os.geteuid()}")
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise UnsafeDirError(f"{where} is writable by group or others "
                             f"(mode {stat.S_IMODE(st.st_mode):04o}) and not sticky")


def open_safe_dir(path: str | Path, *, create: bool = False, mode: int = 0o755) -> int:
    """A descriptor of directory ``path`` after checking that nobody but this process's
    user (and root) can change what it holds: the directory itself is not a symlink,
    is owned by our euid and is not writable by group or others; every ancestor is
    owned by root or us and is not writable by others unless sticky.  Symlinks above
    the directory are resolved first and the resolved components checked.  The walk
    opens each component relative to its parent with O_NOFOLLOW, so the descriptor
    returned is the directory that was checked.  ``create``: make missing components
    (``mode`` for the last, 0755 above it).  Raises UnsafeDirError or OSError."""
    p = Path(os.path.abspath(path))
    name = p.name
    if name in ("", ".", ".."):
        raise UnsafeDirError(f"{path}: not a usable directory name")
    parent = Path(os.path.realpath(p.parent))
    fd = os.open("/", _DIR_FLAGS)
    try:
        where = "/"
        _check_ancestor(os.fstat(fd), where)
        for comp in parent.parts[1:]:
            where = os.path.join(where, comp)
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(comp, 0o755, dir_fd=fd)
            nfd = os.open(comp, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = nfd
            _check_ancestor(os.fstat(fd), where)
        if create:
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, mode, dir_fd=fd)
        where = str(p)
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            raise UnsafeDirError(f"{where} does not exist") from None
        if stat.S_ISLNK(st.st_mode):
            raise UnsafeDirError(f"{where} is a symbolic link")
        if not stat.S_ISDIR(st.st_mode):
            raise UnsafeDirError(f"{where} is not a directory")
        dfd = os.open(name, _DIR_FLAGS, dir_fd=fd)
    finally:
        os.close(fd)
    try:
        st = os.fstat(dfd)
        if st.st_uid != os.geteuid():
            raise UnsafeDirError(f"{where} is owned by uid {st.st_uid}, not by this "
                                 f"process's uid {os.geteuid()}")
        if st.st_mode & 0o022:
            raise UnsafeDirError(f"{where} is writable by group or others "
                                 f"(mode {stat.S_IMODE(st.st_mode):04o})")
    except BaseException:
        os.close(dfd)
        raise
    return dfd


def untrusted_dir(path: str | Path) -> str | None:
    """Why a service's runtime dir at ``path`` should not be talked to (as the agent
    judges it: a symlink, owned by neither root nor us, writable by group or others),
    or None.  `dbr run` and `dbr ctl` use it before they take a socket there for a
    service's: a root user's `dbr ctl` must not read another user's fake service."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"{path}: {exc.strerror}"
    if stat.S_ISLNK(st.st_mode):
        return f"{path} is a symbolic link"
    if st.st_uid not in (0, os.geteuid()):
        return f"{path} is owned by uid {st.st_uid}, neither root nor uid {os.geteuid()}"
    if st.st_mode & 0o022:
        return f"{path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


# The agent's quiet start (dbr_agent/connect.c, "quiet while the program starts", and
# agent.c, "born when the service would look"; shared/dbr_protocol.h: DBR_QUIET_DEFAULT_MS,
# DBR_QUIET_MAX_MS, DBR_QUIET_FILE, which tests/unit/test_protocol_layout.py checks these
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


def program_key(st: os.stat_result) -> str:
    """The name a service gives an executable (``st``, a stat of it) in its runtime
    dir: device, inode and mtime in seconds, in hex, as the agent's constructor forms
    it from ``stat("/proc/self/exe")`` (dbr_agent/connect.c, program_hint).  A rebuilt or
    replaced program is another one."""
    mtime = (st.st_mtime_ns // 1_000_000_000) & 0xFFFF_FFFF_FFFF_FFFF   # tv_sec, as C has it
    return f"{st.st_dev:x}-{st.st_ino:x}-{mtime:x}"


def program_quiet_file(key: str) -> str:
    """The file beside QUIET_FILE that holds one program's own birth age: later (a
    service that learned its runs end sooner: dbr_service/daemon/shortruns.py) or 0 (one that
    holds a stored profile of it, to install at once)."""
    return f"{QUIET_FILE}.{key}"


def write_ms_file(path: str | Path, ms: int, dir_fd: int | None = None) -> None:
    """Write ``ms`` as the agents read it (dbr_parse_ms), whole: a temporary file, mode
    0644, renamed over ``path``, so an agent never reads half of it.  With ``dir_fd``
    (a directory from open_safe_dir) ``path`` is a name in it.  The temporary file is
    created with O_EXCL|O_NOFOLLOW: nothing planted there is followed or reused.
    Raises OSError (the temporary file removed)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    created = False
    try:
        try:
            fd = os.open(tmp, flags, 0o644, dir_fd=dir_fd)
        except FileExistsError:   # left by a writer of the same pid that died
            os.unlink(tmp, dir_fd=dir_fd)
            fd = os.open(tmp, flags, 0o644, dir_fd=dir_fd)
        created = True
        try:
            os.write(fd, f"{ms}\n".encode())
            os.fchmod(fd, 0o644)
        finally:
            os.close(fd)
        os.rename(tmp, path, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except OSError:
        if created:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dir_fd)
        raise


def read_ms_file(path: Path) -> int | None:
    """A number of ms as the agents read it from ``path`` (parse_ms), None if missing,
    unreadable or not a number.  O_NONBLOCK: a FIFO put there does not block; O_NOFOLLOW:
    nor is a link followed."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        return parse_ms(os.read(fd, 15).decode("ascii", "replace"))
    except OSError:
        return None
    finally:
        os.close(fd)


def agent_quiet(env: Mapping[str, str], runtime_dir: Path | None,
                exe: str | None = None) -> tuple[int, bool, bool]:
    """How long an agent started with ``env`` beside a service in ``runtime_dir``
    stays quiet, as the agent decides it; whether the service's hint said so (a hint
    of more than 0 plans the agent's thread: it is made only once the program is that
    old and running); and whether that hint is one the service wrote for the program
    ``exe`` (a path): later, having learned that its runs end sooner, or 0, holding a
    stored profile of it (warm start)."""
    ms = parse_ms(env.get("DBR_AGENT_QUIET_MS", ""))
    if ms is not None:
        return ms, False, False
    if runtime_dir is None:
        return QUIET_DEFAULT_MS, False, False
    hint = read_ms_file(runtime_dir / QUIET_FILE)
    if hint is None:
        return QUIET_DEFAULT_MS, False, False
    if hint and exe:
        try:
            key = program_key(os.stat(exe))
        except OSError:
            return hint, True, False
        own = read_ms_file(runtime_dir / program_quiet_file(key))
        if own is not None and own != hint:
            return own, True, True
    return hint, True, False


def quiet_hint_ms(min_client_age_s: float) -> int:
    """What a service that does not sample clients younger than ``min_client_age_s``
    writes to QUIET_FILE: that age in ms (at most QUIET_MAX_MS).  Its agents make
    their thread only once their program is that old and running, and connect then."""
    return min(int(max(0.0, min_client_age_s) * 1000), QUIET_MAX_MS)
