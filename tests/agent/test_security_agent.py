"""The agent talks only to a listener it trusts (dbr_agent/connect.c, "what the agent
trusts"; docs/agent.md).

The exploit: an unprivileged user (mallory, uid 65534 here) owns a world-writable
runtime dir, or listens on agent.sock herself; a root client's agent that sent her
HELLO would take her code buffer and patch and run her code as root.  Each case
runs a root client with the agent preloaded for ~1.5 s beside a small stdlib
listener (LISTENER, below) that records every connection and datagram: an
untrusted dir or listener must get no HELLO, and with DBR_AGENT_DEBUG=1 the agent
says why, once.  A positive control (a root listener in a root 0700 dir) gets the
HELLO, so the test can fail.

DBR_SECURITY_TEST_AGENT=/path/to/libdbr_agent.so runs the cases against another
build of the agent (an older one, to see them fail).
"""

from __future__ import annotations

import os
import select
import shutil
import socket
import subprocess
import sys
import tempfile

import pytest

import dbr_agent

MALLORY = 65534   # nobody: an unprivileged uid with no files of ours
HELLO = 1         # DBR_MSG_HELLO
MAGIC = 0x31524244
CLIENT_S = 1.5

pytestmark = pytest.mark.skipif(os.geteuid() != 0,
                                reason="needs root: the clients run as root, mallory as uid 65534")

# A listener that speaks just enough of the protocol to see HELLO: it prints
# "listening UID" once it listens, then "conn" per connection and "datagram LEN
# MAGIC TYPE" per datagram, until its stdin closes.  argv: PATH FD (FD >= 0: a socket
# already bound by someone else, listen() called here, as this process's uid).
LISTENER = r"""
import os, select, socket, struct, sys
path, fd = sys.argv[1], int(sys.argv[2])
if fd >= 0:
    s = socket.socket(fileno=fd)
else:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.bind(path)
s.listen(8)
print("listening", os.getuid(), flush=True)
conns = []
while True:
    r, _, _ = select.select([sys.stdin, s] + conns, [], [], 1.0)
    for x in r:
        if x is sys.stdin:
            if not sys.stdin.readline():
                sys.exit(0)
        elif x is s:
            c, _ = s.accept()
            conns.append(c)
            print("conn", flush=True)
        else:
            try:
                d = x.recv(65536)
            except OSError:
                d = b""
            if not d:
                conns.remove(x)
                x.close()
                continue
            magic, ver, typ = struct.unpack_from("<IHH", d) if len(d) >= 8 else (0, 0, 0)
            print("datagram", len(d), hex(magic), typ, flush=True)
"""


def _python() -> str:
    """A python mallory can run (the venv's may sit under a dir she cannot enter)."""
    for p in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.access(p, os.X_OK):
            return p
    return sys.executable


def _agent() -> str:
    return os.environ.get("DBR_SECURITY_TEST_AGENT") or dbr_agent.agent_path()


def _can_drop() -> None:
    r = subprocess.run([_python(), "-c", "import os; print(os.getuid())"], user=MALLORY,
                       group=MALLORY, extra_groups=[], capture_output=True, text=True, timeout=10)
    if r.returncode != 0 or r.stdout.strip() != str(MALLORY):
        pytest.skip(f"cannot run a process as uid {MALLORY}: {r.stderr.strip()}")


class Listener:
    """LISTENER run as ``uid`` (None: root) on ``path`` (or an inherited bound ``fd``)."""

    def __init__(self, path: str, uid: int | None = None, fd: int = -1) -> None:
        drop = dict(user=uid, group=uid, extra_groups=[]) if uid is not None else {}
        self.proc = subprocess.Popen([_python(), "-c", LISTENER, path, str(fd)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True,
                                     pass_fds=(fd,) if fd >= 0 else (), **drop)
        ready, _, _ = select.select([self.proc.stdout], [], [], 10.0)
        line = self.proc.stdout.readline() if ready else ""
        if not line.startswith("listening"):
            self.kill()
            raise AssertionError(f"listener did not start: {line!r} {self.proc.stderr.read()!r}")
        self.uid = int(line.split()[1])

    def finish(self) -> list[str]:
        """Stop it; every line it printed after "listening"."""
        out, err = self.proc.communicate("", timeout=5)
        assert self.proc.returncode == 0, err
        return out.splitlines()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass


def _run_client(runtime_dir: str, extra: dict[str, str] | None = None,
                argv: list[str] | None = None) -> list[str]:
    """A root client with the agent, DBR_RUNTIME_DIR=runtime_dir, connecting at once:
    its stderr lines (the agent's log)."""
    env = dict(os.environ, LD_PRELOAD=_agent(), DBR_RUNTIME_DIR=runtime_dir,
               DBR_AGENT_QUIET_MS="0", DBR_AGENT_DEBUG="1")
    env.pop("DBR_AGENT_DISABLE", None)
    env.update(extra or {})
    proc = subprocess.Popen(argv or ["sleep", str(CLIENT_S)], env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _, err = proc.communicate(timeout=CLIENT_S + 10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
    assert proc.returncode == 0, err
    return err.splitlines()


def _hellos(lines: list[str]) -> list[str]:
    return [ln for ln in lines
            if ln.startswith("datagram") and ln.split()[2] == hex(MAGIC)
            and ln.split()[3] == str(HELLO)]


def _datagrams(lines: list[str]) -> list[str]:
    return [ln for ln in lines if ln.startswith("datagram")]


def _refusals(err: list[str]) -> list[str]:
    return [ln for ln in err if "not connecting:" in ln]


@pytest.fixture
def dirs():
    """Makes temp dirs under /tmp (reachable by mallory); removes them all."""
    made: list[str] = []

    def make(owner: int = 0, mode: int = 0o700) -> str:
        d = tempfile.mkdtemp(prefix="dbr-sec-", dir="/tmp")
        made.append(d)
        os.chown(d, owner, owner)
        os.chmod(d, mode)
        return d

    def link(target: str) -> str:
        p = os.path.join("/tmp", f"dbr-sec-link-{os.getpid()}-{len(made)}")
        if os.path.lexists(p):
            os.unlink(p)
        os.symlink(target, p)
        made.append(p)
        return p

    make.link = link
    yield make
    for p in reversed(made):
        if os.path.islink(p):
            os.unlink(p)
        else:
            shutil.rmtree(p, ignore_errors=True)


def _served(runtime_dir: str, listener: Listener, extra=None) -> tuple[list[str], list[str]]:
    """A client run beside ``listener``: (listener lines, client stderr lines)."""
    try:
        err = _run_client(runtime_dir, extra)
        got = listener.finish()
    finally:
        listener.kill()
    return got, err


def test_positive_control_root_listener_in_root_0700_dir_gets_hello(dirs):
    """e: the trusted case: a root listener in a root 0700 dir hears HELLO (so the
    refusals below are the agent's choice, not a broken harness)."""
    d = dirs(0, 0o700)
    got, err = _served(d, Listener(os.path.join(d, "agent.sock")))
    assert _hellos(got), (got, err)
    assert not _refusals(err), err


def test_mallory_world_writable_dir_and_listener_get_no_hello(dirs):
    """a: mallory's own 0777 dir, mallory's listener: no HELLO, and the agent says
    why once (it retries several times within the run)."""
    _can_drop()
    d = dirs(MALLORY, 0o777)
    got, err = _served(d, Listener(os.path.join(d, "agent.sock"), uid=MALLORY))
    assert not _datagrams(got), (got, err)
    why = _refusals(err)
    assert len(why) == 1, err
    assert d in why[0] and "owned by uid 65534" in why[0], why


def _dropped_listener(dirs) -> tuple[str, Listener]:
    """A root 0755 dir whose agent.sock root bound, listening as uid 65534."""
    _can_drop()
    d = dirs(0, 0o755)
    path = os.path.join(d, "agent.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        s.bind(path)
        os.chmod(path, 0o666)
        listener = Listener(path, uid=MALLORY, fd=s.fileno())
    finally:
        s.close()       # the listener holds its own copy
    assert listener.uid == MALLORY
    return d, listener


def test_listener_that_dropped_to_nobody_before_listen_is_refused(dirs):
    """b: a root 0755 dir, agent.sock bound by root, listen() called as uid 65534:
    the dir passes, SO_PEERCRED (the creds at listen()) must refuse the peer."""
    d, listener = _dropped_listener(dirs)
    got, err = _served(d, listener)
    assert not _datagrams(got), (got, err)
    why = _refusals(err)
    assert len(why) == 1 and "listener uid 65534 is neither root nor 0" in why[0], err


def test_a_service_uid_the_owner_names_is_trusted(dirs):
    """The same listener, with DBR_SERVICE_UID=65534 in the client's environment (a
    service run as a dedicated user): it is the owner's choice, so it gets the HELLO."""
    d, listener = _dropped_listener(dirs)
    got, err = _served(d, listener, {"DBR_SERVICE_UID": str(MALLORY)})
    assert _hellos(got), (got, err)
    assert not _refusals(err), err


@pytest.mark.parametrize("slash", ["", "/"], ids=["link", "link-slash"])
def test_symlinked_runtime_dir_is_refused(dirs, slash):
    """c: DBR_RUNTIME_DIR a symbolic link to a good dir with a root listener: refused
    (O_NOFOLLOW; a trailing slash must not make it followed)."""
    d = dirs(0, 0o700)
    lnk = dirs.link(d)
    got, err = _served(lnk + slash, Listener(os.path.join(d, "agent.sock")))
    assert not got, (got, err)
    why = _refusals(err)
    assert len(why) == 1 and "symbolic link" in why[0], err


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o1777], ids=oct)
def test_root_dir_writable_by_others_is_refused(dirs, mode):
    """d: a root-owned dir that group or others may write, root listener: refused."""
    d = dirs(0, mode)
    got, err = _served(d, Listener(os.path.join(d, "agent.sock")))
    assert not got, (got, err)
    why = _refusals(err)
    assert len(why) == 1 and f"writable by group or others (mode {mode:04o})" in why[0], err


def _hint_lines(runtime_dir: str) -> list[str]:
    """The agent's quiet-hint log lines for a client in runtime_dir (no
    DBR_AGENT_QUIET_MS: the hint file may set the quiet)."""
    env = {"DBR_AGENT_QUIET_MS": ""}
    return [ln for ln in _run_client(runtime_dir, env, argv=["true"]) if "service's hint" in ln]


def test_quiet_hint_is_read_only_from_a_trusted_dir(dirs):
    """The hint beside agent.sock (agent-quiet-ms) is honoured in a root 0755 dir and
    ignored in mallory's 0777 one, where it could hold the agent's thread back."""
    good = dirs(0, 0o755)
    bad = dirs(MALLORY, 0o777)
    for d in (good, bad):
        with open(os.path.join(d, "agent-quiet-ms"), "w") as f:
            f.write("4321\n")
        os.chown(os.path.join(d, "agent-quiet-ms"), *((0, 0) if d == good else (MALLORY, MALLORY)))
    assert any("quiet for 4321 ms" in ln for ln in _hint_lines(good))
    assert _hint_lines(bad) == []
