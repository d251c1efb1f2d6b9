"""The root service against a hostile local user and floods (docs/security.md).

* a runtime dir it does not own, that others can write, or that is a symlink: refused,
  and nothing in it (or behind the link) is changed;
* 1,500 connections at once: refused beyond max_handshakes / max_sessions_per_uid with
  E_LIMIT, the service keeps answering, and every descriptor and session is gone once
  the peers close;
* a client with 1,500 threads (a perf event each: descriptors above 1024) is sampled and
  ends cleanly.
"""

from __future__ import annotations

import os
import resource
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from harness import compile_c
from service_helpers import FakeAgent, ServiceProc, agent_path, kill, spawn_client

from dbr_service import protocol as P

TESTS = Path(__file__).resolve().parent
NOBODY = 65534

pytestmark = pytest.mark.skipif(os.geteuid() != 0,
                                reason="an attacker's uid needs root to set up (chown)")


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def settle(pid: int, want: int, timeout: float = 20.0) -> int:
    """The service's descriptor count once it is back at ``want`` (or the last seen)."""
    deadline = time.monotonic() + timeout
    n = fd_count(pid)
    while n > want and time.monotonic() < deadline:
        time.sleep(0.1)
        n = fd_count(pid)
    return n


def start_service(runtime_dir: str, *opts: str) -> tuple[int, str]:
    """Run `dbr service` on ``runtime_dir`` until it is ready or exits (bounded)."""
    env = dict(os.environ, DBR_RUNTIME_DIR=runtime_dir)
    argv = [sys.executable, "-m", "dbr_service.cli", "service"]
    for o in opts:
        argv += ["-o", o]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        out, _ = proc.communicate(timeout=15)
    except subprocess.TimeoutExpired:   # it started: the dir was accepted
        kill(proc)
        out = proc.stdout.read() if proc.stdout else ""
        return 0, out
    return proc.returncode, out


# ----------------------------------------------------------------------------- the dir
@pytest.fixture
def base():
    d = tempfile.mkdtemp(prefix="dbr-sec-")
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


def test_a_runtime_dir_another_user_owns_and_anyone_can_write_is_refused(base):
    """mallory's `mkdir -m777 /tmp/d`: the service used to take it (and chmod it 0755),
    after which she could move its sockets aside and listen in their place."""
    os.chmod(base, 0o755)
    d = base / "d"
    d.mkdir()
    os.chown(d, NOBODY, NOBODY)
    os.chmod(d, 0o777)
    rc, out = start_service(str(d))
    assert rc != 0, out
    assert "refusing runtime dir" in out and f"owned by uid {NOBODY}" in out, out
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o777 and os.listdir(d) == []


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o757])
def test_a_runtime_dir_of_ours_that_others_can_write_is_refused(base, mode):
    os.chmod(base, 0o755)
    d = base / "d"
    d.mkdir()
    os.chmod(d, mode)
    rc, out = start_service(str(d))
    assert rc != 0 and "writable by group or others" in out, out
    assert os.listdir(d) == []


def test_a_symlinked_runtime_dir_is_refused_and_its_target_left_alone(base):
    """A link to a root-only dir: the service used to chmod the target 0755."""
    target = base / "secret"
    target.mkdir(mode=0o700)
    (target / "keep").write_text("x")
    link = base / "link"
    link.symlink_to(target)
    rc, out = start_service(str(link))
    assert rc != 0 and "symbolic link" in out, out
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o700
    assert sorted(os.listdir(target)) == ["keep"]


def test_a_runtime_dir_under_a_dir_another_user_controls_is_refused(base):
    """mallory owns an ancestor: she could rename the service's dir away and put hers."""
    os.chmod(base, 0o755)
    hers = base / "hers"
    hers.mkdir()
    os.chown(hers, NOBODY, NOBODY)
    rc, out = start_service(str(hers / "dbr"))
    assert rc != 0 and "refusing runtime dir" in out and f"uid {NOBODY}" in out, out


def test_safe_dirs_pass_and_each_unsafe_kind_is_named(base):
    from dbr_service.paths import UnsafeDirError, open_safe_dir

    os.chmod(base, 0o755)
    fd = open_safe_dir(base / "new", create=True, mode=0o700)   # made, then checked
    try:
        assert stat.S_IMODE(os.fstat(fd).st_mode) == 0o700
    finally:
        os.close(fd)
    sticky = base / "sticky"
    sticky.mkdir()
    os.chmod(sticky, 0o1777)       # like /tmp: fine above a dir of ours
    fd = open_safe_dir(sticky / "ours", create=True)
    os.close(fd)
    with pytest.raises(UnsafeDirError, match="writable by group or others"):
        open_safe_dir(sticky)      # but not as the dir itself
    (base / "file").write_text("")
    with pytest.raises(UnsafeDirError, match="not a directory"):
        open_safe_dir(base / "file")
    with pytest.raises(UnsafeDirError, match="does not exist"):
        open_safe_dir(base / "missing")


def test_a_good_runtime_dir_still_works_and_gets_its_mode(base):
    d = base / "run"
    svc = ServiceProc(runtime_dir=str(d)).wait_ready()
    try:
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o755
        assert svc.call("status")["runtime_dir"] == str(d)
    finally:
        svc.stop()


# ----------------------------------------------------------------------------- floods
def _hello(sock: socket.socket) -> None:
    h = P.Hello(pid=os.getpid(), ppid=os.getppid(), uid=os.getuid(), flags=0, n_threads=1,
                page_size=4096, exe=b"/flood")
    try:
        sock.send(P.pack(h, P.MsgType.HELLO, 1))
    except (BrokenPipeError, ConnectionResetError):
        pass   # refused at accept already: its ERROR waits to be read


def _connect(sock: socket.socket, path: str, timeout: float = 5.0) -> None:
    """connect(), waiting (bounded) while the listen backlog is full."""
    deadline = time.monotonic() + timeout
    sock.setblocking(False)
    while True:
        try:
            sock.connect(path)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.005)


def _reply(sock: socket.socket, timeout: float) -> P.Message | None:
    sock.settimeout(timeout)
    try:
        data = sock.recv(P.MSG_MAX)
    except (TimeoutError, OSError):
        return None
    return P.unpack(data) if data else None


def test_1500_connections_at_once_are_refused_at_the_limits_and_leave_nothing_behind():
    """Every 5th connection says HELLO; the rest stay silent in their handshake.  The
    service used to give each a thread, crashed in select() on descriptors >= 1024 and
    kept ~7,000 descriptors after every peer closed."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if min(soft, hard) < 2000:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
        except (ValueError, OSError):
            pytest.skip(f"this process may hold only {hard} descriptors")
    svc = ServiceProc("max_sessions_per_uid=40", "patching=false").wait_ready()
    socks: list[socket.socket] = []
    try:
        time.sleep(0.5)
        base_fds = fd_count(svc.proc.pid)
        path = os.path.join(svc.dir, "agent.sock")
        for i in range(1500):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            socks.append(s)
            _connect(s, path)
            if i % 5 == 0:
                _hello(s)
        t0 = time.monotonic()
        assert svc.call("status")["pid"] == svc.proc.pid
        assert time.monotonic() - t0 < 2.0
        acks = refused = 0
        reasons = set()
        for i, s in enumerate(socks):
            if i % 5:
                continue
            m = _reply(s, 3.0)
            if m is None:
                continue
            if m.type is P.MsgType.HELLO_ACK:
                acks += 1
            elif m.type is P.MsgType.ERROR and m.body.code == P.Result.E_LIMIT:
                refused += 1
                reasons.add(m.body.msg.decode().split(" (")[-1].split(" ")[0])
        assert 0 < acks <= 40, (acks, refused)
        assert refused > 0 and reasons <= {"max_handshakes", "max_sessions_per_uid"}, reasons
        live = [c for c in svc.call("clients") if c["state"] != "closed"]
        assert len(live) <= 40
        assert svc.proc.poll() is None
    finally:
        for s in socks:
            s.close()
    try:
        svc.wait_for(lambda: not [c for c in svc.call("clients") if c["state"] != "closed"],
                     timeout=15, what="every flood session to end")
        n = settle(svc.proc.pid, base_fds)
        assert n <= base_fds, f"{n - base_fds} descriptors left behind"
        st = svc.call("status")
        assert st["clients"] == 0 and st["handshakes"] == 0 and st["refused_at_limit"] > 0
        assert "Traceback" not in svc.output() and "out of range" not in svc.output()
    finally:
        svc.stop()


def test_a_client_with_1500_threads_is_sampled_and_ends_cleanly():
    """One perf event per thread takes the service's descriptors past 1024; a client
    that connects then gets a socket above 1024, which select() could not watch."""
    if agent_path() is None:
        pytest.skip("the agent could not be built")
    prog = compile_c([TESTS / "security_progs" / "many_threads.c"])
    svc = ServiceProc("--aggressive", "patching=false", "continuous_sampling=true",
                      "snapshot_interval_s=1").wait_ready()
    client = None
    try:
        time.sleep(0.5)
        base_fds = fd_count(svc.proc.pid)
        client = spawn_client(svc.dir, [str(prog), "1500", "4"])
        line = client.stdout.readline()
        assert line.startswith("ready"), client.stderr.read()
        row = svc.wait_for(lambda: next((c for c in svc.call("clients")
                                          if c["pid"] == client.pid and c["samples"] > 0
                                          and c["threads"] > 1024), None),
                           timeout=15, what="the client sampled with all its threads")
        # each sampling window opens an event per thread, and closes them at its end
        svc.wait_for(lambda: fd_count(svc.proc.pid) > base_fds + 1024, timeout=10,
                     what="a window with more than 1024 perf events open")
        late = FakeAgent(svc.dir)
        try:
            assert late.hello().type is P.MsgType.HELLO_ACK
            svc.wait_for(lambda: any(c["pid"] == os.getpid() and c["state"] == "connected"
                                     for c in svc.call("clients")),
                         timeout=5, what="the late client's session")
        finally:
            late.sock.close()
        out, err = client.communicate(timeout=30)
        assert client.returncode == 0 and out.endswith("done\n"), err
        row = svc.wait_for(lambda: next((c for c in svc.call("clients", {"all": True})
                                          if c["pid"] == client.pid
                                          and c["state"] == "closed"), None),
                           timeout=15, what="the session to end")
        assert "internal error" not in row["close_reason"], row
        # (a request that met the client's exit is fine; a crash of the session is not)
        assert not [e for e in row["errors"] if "range" in e or "internal" in e], row
        n = settle(svc.proc.pid, base_fds)
        assert n <= base_fds, f"{n - base_fds} descriptors left behind"
    finally:
        kill(client)
        svc.stop()


def test_the_host_service_raises_its_descriptor_limit():
    """Started with systemd's soft default of 1024, it takes the hard limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= 1024:
        pytest.skip(f"the hard limit here is {hard}: nothing to raise")
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))
    try:
        svc = ServiceProc().wait_ready()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    try:
        with open(f"/proc/{svc.proc.pid}/limits") as f:
            line = next(x for x in f if x.startswith("Max open files"))
        soft, hard = line.split()[3:5]
        assert soft == hard
    finally:
        svc.stop()

