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

from dbr_service.wire import protocol as P

TESTS = Path(__file__).resolve().parent.parent
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
    argv = [sys.executable, "-m", "dbr_service.commands.cli", "service"]
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
    from dbr_service.common.paths import UnsafeDirError, open_safe_dir

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
        for s in socks:
            s.close()
        svc.wait_for(lambda: not [c for c in svc.call("clients") if c["state"] != "closed"],
                     timeout=15, what="every flood session to end")
        n = settle(svc.proc.pid, base_fds)
        assert n <= base_fds, f"{n - base_fds} descriptors left behind"
        st = svc.call("status")
        assert st["clients"] == 0 and st["handshakes"] == 0 and st["refused_at_limit"] > 0
        assert "Traceback" not in svc.output() and "out of range" not in svc.output()
    finally:
        for s in socks:
            s.close()
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



def _ready(svc: subprocess.Popen, d: Path):
    """A control client of the service ``svc`` started on ``d``, once it answers."""
    from dbr_service.commands.ctlclient import ControlClient

    ctl = ControlClient(str(d), timeout=2.0)
    deadline = time.monotonic() + 15
    while not ctl.answers(timeout=0.5):
        assert svc.poll() is None, svc.stdout.read() if svc.stdout else "service exited"
        assert time.monotonic() < deadline, "service not ready"
        time.sleep(0.1)
    return ctl


def _stop(svc: subprocess.Popen) -> None:
    if svc.poll() is None:
        svc.terminate()
        try:
            svc.wait(5)
        except subprocess.TimeoutExpired:
            pass
    kill(svc)


# ----------------------------------------------------------------------------- capabilities
#: What the service needs besides a uid (docs/security.md): perf events on other users'
#: threads, /proc/PID/mem and maps of other users' processes, perf rings beyond
#: perf_event_mlock_kb, and reading their binaries.
SERVICE_CAPS = "perfmon,sys_ptrace,ipc_lock,dac_read_search"


def _setpriv_can(*args: str) -> bool:
    if shutil.which("setpriv") is None:
        return False
    r = subprocess.run(["setpriv", *args, "true"], capture_output=True)
    return r.returncode == 0


@pytest.mark.parametrize("as_user", [False, True], ids=["root-uid", "dedicated-uid"])
def test_the_service_serves_another_users_program_with_only_its_capabilities(base, as_user):
    """uid 0 with a bounding set of four capabilities (CapabilityBoundingSet=), or a
    dedicated uid with them as ambient capabilities (User= + AmbientCapabilities=, its
    clients naming it with DBR_SERVICE_UID): a program of another user is sampled and
    patched, and gives its native output."""
    if agent_path() is None:
        pytest.skip("the agent could not be built")
    caps = ",".join(f"+{c}" for c in SERVICE_CAPS.split(","))
    if as_user:
        priv = ["--reuid=65534", "--regid=65534", "--clear-groups",
                f"--inh-caps=-all,{caps}", f"--ambient-caps=-all,{caps}"]
        svc_uid, client_uid = NOBODY, 0
    else:
        priv = [f"--bounding-set=-all,{caps}", "--inh-caps=-all"]
        svc_uid, client_uid = 0, NOBODY
    if not _setpriv_can(*priv):
        pytest.skip("setpriv cannot set these capabilities here")
    os.chmod(base, 0o755)
    d = base / "run"
    d.mkdir(mode=0o755)
    os.chown(d, svc_uid, svc_uid)
    prog_dir = base / "prog"
    prog_dir.mkdir(mode=0o755)
    prog = prog_dir / "hotloop"
    shutil.copy(compile_c([TESTS.parent / "examples" / "hotloop.c"], flags=["-O1"]), prog)
    os.chmod(prog, 0o755)
    native = subprocess.run([str(prog), "300"], capture_output=True, text=True, timeout=30)
    env = dict(os.environ, DBR_RUNTIME_DIR=str(d), HOME=str(base))
    svc = subprocess.Popen(["setpriv", *priv, sys.executable, "-m", "dbr_service.commands.cli",
                            "service", "--aggressive", "-o", f"allowed_uids=0,{NOBODY}"],
                           env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = None
    try:
        ctl = _ready(svc, d)
        with open(f"/proc/{svc.pid}/status") as f:
            eff = next(int(x.split()[1], 16) for x in f if x.startswith("CapEff"))
        assert eff == (1 << 2) | (1 << 14) | (1 << 19) | (1 << 38)   # only those four
        cenv = dict(env, LD_PRELOAD=agent_path(), DBR_AGENT_QUIET_MS="0")
        if as_user:
            cenv["DBR_SERVICE_UID"] = str(NOBODY)
        client = subprocess.Popen([str(prog), "3000"], env=cenv, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True,
                                  user=client_uid, group=client_uid, extra_groups=[])
        out, err = client.communicate(timeout=60)
        assert client.returncode == 0, err
        # the check line is the same natively (the slice count depends on the time)
        assert out.split("check")[-1] == native.stdout.split("check")[-1]
        rows = [r for r in ctl.result("clients", {"all": True}) if r["pid"] == client.pid]
        assert rows and rows[-1]["uid"] == client_uid and rows[-1]["patches_installed"] >= 1, \
            rows
    finally:
        kill(client)
        _stop(svc)


# ----------------------------------------------------------------------------- the unit
UNIT = TESTS.parent / "docs" / "dbr-service.service"


def _unit() -> dict[str, list[str]]:
    keys: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            k, v = line.split("=", 1)
            keys.setdefault(k.strip(), []).append(v.strip())
    return keys


def test_the_unit_is_hardened_and_its_command_starts_with_no_config_file(base):
    """The shipped unit: systemd accepts it, it keeps the hardening the threat model
    relies on, and its ExecStart, run with its environment and capability bounding set,
    starts a service that answers although no configuration file exists."""
    from dbr_service.common.config import DEFAULT_CONFIG_FILE

    u = _unit()
    for key, want in {"NoNewPrivileges": "yes", "ProtectSystem": "strict",
                      "RuntimeDirectory": "dbr", "RuntimeDirectoryMode": "0755",
                      "RestrictAddressFamilies": "AF_UNIX"}.items():
        assert u.get(key) == [want], key
    assert u["ProtectHome"][0] in ("yes", "read-only", "tmpfs")
    bounding = u["CapabilityBoundingSet"][0].split()
    assert sorted(bounding) == sorted(f"CAP_{c.upper()}" for c in SERVICE_CAPS.split(","))
    exec_start = u["ExecStart"][0].split()
    assert exec_start[1:] == ["service"], "no -c: the default file is read only if present"
    if shutil.which("systemd-analyze"):
        local = base / "dbr-service.service"
        local.write_text(UNIT.read_text().replace(exec_start[0], str(TESTS.parent / ".venv"
                                                                      / "bin" / "dbr")))
        r = subprocess.run(["systemd-analyze", "verify", "--man=no", str(local)],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and not r.stderr.strip(), r.stderr
    if os.path.exists(DEFAULT_CONFIG_FILE):
        pytest.skip(f"{DEFAULT_CONFIG_FILE} exists here: cannot show a start without it")
    caps = ",".join("+" + c.lower().removeprefix("cap_") for c in bounding)
    if not _setpriv_can(f"--bounding-set=-all,{caps}"):
        pytest.skip("setpriv cannot set the unit's bounding set here")
    os.chmod(base, 0o755)
    d = base / "run"
    env = dict(os.environ, DBR_RUNTIME_DIR=str(d))   # the unit's Environment=, moved
    svc = subprocess.Popen(["setpriv", f"--bounding-set=-all,{caps}", sys.executable, "-m",
                            "dbr_service.commands.cli", *exec_start[1:]],
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        ctl = _ready(svc, d)
        st = ctl.result("status")
        assert st["config_file"] is None and stat.S_IMODE(os.stat(d).st_mode) == 0o755
    finally:
        _stop(svc)


def test_dbr_ctl_and_dbr_run_do_not_take_another_users_dir_for_a_service(base):
    """A root operator's `dbr ctl` must not read (and print) a fake service's replies
    from a dir mallory controls; `dbr run` runs its program with an embedded service."""
    os.chmod(base, 0o755)
    d = base / "d"
    d.mkdir()
    (d / "agent.sock").touch()
    os.chown(d, NOBODY, NOBODY)
    os.chmod(d, 0o777)
    env = dict(os.environ, DBR_RUNTIME_DIR=str(d))
    r = subprocess.run([sys.executable, "-m", "dbr_service.commands.cli", "ctl", "status"], env=env,
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 1 and "not talking to a service there" in r.stderr, r.stderr
    assert f"owned by uid {NOBODY}" in r.stderr
    r = subprocess.run([sys.executable, "-m", "dbr_service.commands.cli", "run", "--", "true"],
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "starting an embedded one" in r.stderr, r.stderr
