"""Daemon lifecycle under a fake NOTIFY_SOCKET: READY, ctl, SIGHUP reload, SIGTERM, refusal."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from service_helpers import FakeAgent, ServiceProc, agent_path, build_example, kill, spawn_client

from dbr_service.wire import protocol as P
from dbr_service.common.paths import QUIET_FILE


def _dbr(*argv: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dbr_service.commands.cli", *argv], env=env,
                          capture_output=True, text=True, timeout=20)


class Notifications:
    """Reads the fake NOTIFY_SOCKET in a thread (like systemd, it never stops reading)."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.sock.settimeout(0.1)
        self.lines: list[str] = []
        self._stop = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop:
            try:
                self.lines.extend(self.sock.recv(4096).decode().splitlines())
            except TimeoutError:
                continue

    def wait(self, line: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if line in self.lines:
                return True
            time.sleep(0.02)
        return False

    def close(self) -> None:
        self._stop = True
        self.thread.join(1)
        self.sock.close()


def test_notify_ctl_reload_and_sigterm(tmp_path):
    nsock_path = str(tmp_path / "notify.sock")
    nsock = Notifications(nsock_path)
    conf = tmp_path / "dbr.toml"
    conf.write_text("hot_threshold = 0.01\n")
    svc = ServiceProc(config=str(conf), env={"NOTIFY_SOCKET": nsock_path,
                                              "WATCHDOG_USEC": "400000"})
    clients, fakes = [], []
    try:
        assert nsock.wait("READY=1", 15.0), nsock.lines
        # READY comes after the sockets are bound: ctl answers at once.
        r = _dbr("ctl", "status", env=svc.env)
        assert r.returncode == 0 and "dbr service" in r.stdout, r.stderr
        assert "agent-timer=yes" in r.stdout and "sampling: " in r.stdout, r.stdout
        r = _dbr("ctl", "--json", "config", "get", "hot_threshold", env=svc.env)
        assert '"hot_threshold": 0.01' in r.stdout
        assert nsock.wait("WATCHDOG=1", 2.0), nsock.lines

        # SIGHUP: a changed file is picked up; a broken one keeps the old config.
        conf.write_text("hot_threshold = 0.25\n")
        svc.proc.send_signal(signal.SIGHUP)
        svc.wait_for(lambda: svc.call("config_get", {"key": "hot_threshold"})
                     ["hot_threshold"] == 0.25, 5.0, "reload")
        conf.write_text("hot_threshold = 'lots'\n")
        svc.proc.send_signal(signal.SIGHUP)
        svc.wait_for(lambda: "reload failed" in svc.output(), 5.0, "reload error logged")
        assert svc.call("config_get", {"key": "hot_threshold"})["hot_threshold"] == 0.25

        # A second service on the same runtime dir is refused with a clear message.
        r = _dbr("service", env=svc.env)
        assert r.returncode == 1 and "already running" in r.stderr

        # Clients attached (fake agents, and a real one when the agent builds).
        for _ in range(3):
            fa = FakeAgent(svc.dir)
            assert fa.hello().type.name == "HELLO_ACK"
            fakes.append(fa)
        if agent_path():
            clients.append(spawn_client(svc.dir, [build_example("hotloop"), "20000"]))
        svc.wait_for(lambda: svc.call("status")["clients"] >= 3 + len(clients), 10.0,
                     "clients attached")
        r = _dbr("ctl", "clients", env=svc.env)
        assert r.returncode == 0 and r.stdout.startswith("PID") and "/fake/agent" in r.stdout
        r = _dbr("ctl", "hotspots", str(os.getpid()), "--top", "3", env=svc.env)
        assert r.returncode == 0 and r.stdout.startswith(f"pid {os.getpid()}:"), r.stderr
        t0 = time.monotonic()
        svc.proc.send_signal(signal.SIGTERM)
        svc.proc.wait(5)
        elapsed = time.monotonic() - t0
        assert elapsed < 2.0, f"SIGTERM took {elapsed:.2f}s"
        assert svc.proc.returncode == 0
        assert nsock.wait("STOPPING=1", 1.0), nsock.lines[-5:]
        for fa in fakes:  # every agent got BYE, then the session closed
            msg = fa.recv_or_eof(2.0)
            assert msg is not None and msg.type.name == "BYE", msg
            assert not msg.body.flags & P.BYE_REVERT  # on_shutdown = keep (default)
            assert fa.recv_or_eof(2.0) is None
        assert not os.path.exists(os.path.join(svc.dir, "agent.sock"))
        for c in clients:  # the real client keeps running after the service left
            assert c.poll() is None
    finally:
        for c in clients:
            kill(c)
        for fa in fakes:
            fa.close()
        svc.stop()
        nsock.close()


def test_sigterm_as_soon_as_the_service_is_ready_is_a_clean_stop():
    """A service manager may stop a unit the moment it reports ready: the handlers are
    in place before the service answers (a SIGTERM in between used to kill it with
    the default action, leaving its sockets behind and its agents without BYE)."""
    for _ in range(6):
        svc = ServiceProc().wait_ready()
        try:
            svc.proc.send_signal(signal.SIGTERM)
            assert svc.proc.wait(5) == 0, svc.output()
            assert not os.path.exists(os.path.join(svc.dir, "agent.sock"))
        finally:
            svc.stop()


def test_service_tells_its_agents_how_long_to_stay_quiet(tmp_path):
    """A service writes how young a client it samples (min_client_age_s in ms;
    --aggressive sets 0) to QUIET_FILE in its runtime dir, keeps it in step with its
    configuration, and removes it when it stops: its clients' environment is not its to
    set.  A stale file is replaced.  A real agent started beside it connects without
    the default quiet."""
    rdir = tmp_path / "rt"
    rdir.mkdir()
    hint = rdir / QUIET_FILE
    hint.write_text("3000\n")   # a killed service's
    svc = ServiceProc("--aggressive", runtime_dir=str(rdir)).wait_ready()
    client = None
    try:
        assert hint.read_text() == "0\n"
        if agent_path():
            client = spawn_client(svc.dir, [build_example("hotloop"), "800"],
                                  env={"DBR_AGENT_DEBUG": "1"})
            svc.wait_for(lambda: svc.call("status")["clients"] >= 1, 10.0, "client attached")
        svc.call("config_set", {"key": "min_client_age_s", "value": 0.02})
        assert hint.read_text() == "20\n"
        svc.call("config_set", {"key": "min_client_age_s", "value": 2.5})
        assert hint.read_text() == "2500\n"   # agents then make their thread at 2.5 s
        svc.call("config_set", {"key": "min_client_age_s", "value": 0})
        assert hint.read_text() == "0\n"
        svc.proc.send_signal(signal.SIGTERM)
        svc.proc.wait(5)
        assert not hint.exists()
        if client is not None:
            _, err = client.communicate(timeout=30)
            assert f"agent thread quiet for 0 ms (the service's hint, {hint})" in err, err
    finally:
        if client is not None:
            kill(client)
        svc.stop()
    # the default service samples clients of 1 s and older
    rdir.mkdir(exist_ok=True)   # stop() removed it
    hint.write_text("0\n")
    svc = ServiceProc(runtime_dir=str(rdir)).wait_ready()
    try:
        assert hint.read_text() == "1000\n"
    finally:
        svc.stop()
    # a hint that cannot be written (a directory in its place): logged, the service
    # serves and stops cleanly, and leaves neither a temporary file nor the directory's
    # contents changed
    rdir.mkdir(exist_ok=True)
    hint.mkdir()
    (hint / "keep").write_text("x")
    svc = ServiceProc("--aggressive", runtime_dir=str(rdir)).wait_ready()
    try:
        assert svc.call("status")["clients"] == 0
        svc.wait_for(lambda: "cannot write the agents' quiet hint" in svc.output(), 5.0,
                     "warning logged")
        assert sorted(p.name for p in rdir.iterdir() if "quiet" in p.name) == [QUIET_FILE]
        svc.proc.send_signal(signal.SIGTERM)
        assert svc.proc.wait(5) == 0
        assert (hint / "keep").read_text() == "x"
    finally:
        svc.stop()


def test_ctl_without_service_and_usage_errors(tmp_path):
    env = dict(os.environ, DBR_RUNTIME_DIR=str(tmp_path))
    t0 = time.monotonic()
    r = _dbr("ctl", "status", env=env)
    assert r.returncode == 1 and "no dbr service" in r.stderr
    assert time.monotonic() - t0 < 10
    assert _dbr("ctl", "hotspots", "notapid", env=env).returncode == 2
    assert _dbr("ctl", "frobnicate", env=env).returncode == 2
    assert _dbr("run", env=env).returncode == 2
    assert _dbr("service", "-o", "bogus=1", env=env).returncode == 2
    # Help texts carry examples (smoke test of each command).
    for cmd in ("run", "service", "ctl"):
        r = _dbr(cmd, "--help", env=env)
        assert r.returncode == 0 and "examples:" in r.stdout


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="posix only")
def test_stale_socket_is_replaced(tmp_path):
    rdir = tmp_path / "rt"
    rdir.mkdir()
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    stale.bind(str(rdir / "agent.sock"))
    stale.close()  # a socket file nobody listens on
    svc = ServiceProc(runtime_dir=str(rdir))
    try:
        svc.wait_ready()
        assert svc.call("status")["pid"] == svc.proc.pid
    finally:
        svc.stop()


def test_events_and_bye_revert_on_shutdown():
    import json

    import zmq

    svc = ServiceProc("on_shutdown=revert").wait_ready()
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"client-")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(f"ipc://{svc.dir}/events.sock")
    fa = None
    try:
        time.sleep(0.3)  # let the subscription reach the publisher
        fa = FakeAgent(svc.dir)
        assert fa.hello().type is P.MsgType.HELLO_ACK
        assert sub.poll(5000), "no event published"
        topic, body = sub.recv_multipart()
        ev = json.loads(body)
        assert topic == b"client-connected" and ev["pid"] == os.getpid()
        svc.call("shutdown")
        msg = fa.recv_or_eof(3.0)
        assert msg is not None and msg.type is P.MsgType.BYE, msg
        assert msg.body.flags & P.BYE_REVERT
        svc.proc.wait(5)
        assert svc.proc.returncode == 0
    finally:
        sub.close(0)
        if fa:
            fa.close()
        svc.stop()


@pytest.mark.parametrize("what", ["notices", "hello-again"])
def test_agent_sending_a_service_message_ends_its_session_only(what):
    """A message only the service sends (NOTICES), or a second HELLO, from an agent is
    out of order: that session ends with E_PROTO and a close reason that names it, and
    the service goes on serving other agents."""
    svc = ServiceProc().wait_ready()
    bad = good = None
    try:
        bad = FakeAgent(svc.dir)
        assert bad.hello().type is P.MsgType.HELLO_ACK
        if what == "notices":
            bad.send(P.MsgType.NOTICES, P.Notices(req_id=7, flags=P.NOTICE_THREADS))
            name = "NOTICES"
        else:
            bad.send(P.MsgType.HELLO, P.Hello(pid=os.getpid(), ppid=os.getppid(),
                                              uid=os.getuid(), n_threads=1, page_size=4096,
                                              exe=b"/fake/agent"))
            name = "HELLO"
        msg = bad.recv_or_eof(3.0)
        assert msg is not None and msg.type is P.MsgType.ERROR, msg
        assert msg.body.code == P.Result.E_PROTO and name in msg.body.msg.decode(), msg
        assert bad.recv_or_eof(3.0) is None
        good = FakeAgent(svc.dir)
        assert good.hello().type is P.MsgType.HELLO_ACK
        entries = svc.call("report", {"pids": [os.getpid()]})
        reasons = [e.get("close_reason", "") for e in entries]
        assert any(f"unexpected {name} from the agent" in r for r in reasons), reasons
    finally:
        for fa in (bad, good):
            if fa:
                fa.close()
        svc.stop()
