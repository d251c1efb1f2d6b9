"""Helpers of the service tests: start a `dbr service` subprocess on a private runtime
dir, talk to it, fake agents in Python, build the examples.  Every wait is bounded."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import compile_c

from dbr_service.wire import protocol as P
from dbr_service.commands.ctlclient import ControlClient, Fault

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def build_example(name: str, flags: tuple[str, ...] = ()) -> str:
    """examples/NAME.c built with -O1 (or ``flags``) and symbols; cached by content."""
    return str(compile_c([EXAMPLES / f"{name}.c"], flags=["-O1", *flags], out_name=name))


def symbol_range(binary: str, name: str) -> tuple[int, int]:
    """[start, end) file offset range of a function symbol (nm -S)."""
    out = subprocess.run(["nm", "-S", binary], capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[3] == name:
            start, size = int(parts[0], 16), int(parts[1], 16)
            return start, start + size
    raise KeyError(name)


def agent_path() -> str | None:
    """The built agent, or None when it cannot be built."""
    try:
        import dbr_agent

        return dbr_agent.agent_path()
    except Exception:
        return None


class ServiceProc:
    """A `dbr service` subprocess on its own runtime dir."""

    def __init__(self, *opts: str, env: dict[str, str] | None = None,
                 runtime_dir: str | None = None, config: str | None = None) -> None:
        self.dir = runtime_dir or tempfile.mkdtemp(prefix="dbr-svc-")
        # its own profile store: no warm start from another test's runs
        self.env = {**os.environ, "DBR_RUNTIME_DIR": self.dir,
                    "DBR_STATE_DIR": os.path.join(self.dir, "state"), **(env or {})}
        argv = [sys.executable, "-m", "dbr_service.commands.cli", "service"]
        if config:
            argv += ["-c", config]
        for o in opts:
            argv += ["-o", o] if "=" in o else [o]
        self.log = open(os.path.join(tempfile.gettempdir(), f"dbr-svc-{os.getpid()}-"
                                     f"{time.monotonic_ns()}.log"), "w+")
        self.proc = subprocess.Popen(argv, env=self.env, stdout=self.log, stderr=self.log)
        self.ctl = ControlClient(self.dir, timeout=2.0)

    def wait_ready(self, timeout: float = 15.0) -> ServiceProc:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"service exited {self.proc.returncode}: {self.output()}")
            if self.ctl.answers(timeout=0.5):
                return self
            time.sleep(0.05)
        raise TimeoutError(f"service not ready: {self.output()}")

    def call(self, verb: str, args: dict | None = None, **kw):
        return self.ctl.result(verb, args, **kw)

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def wait_for(self, pred, timeout: float = 10.0, what: str = "condition"):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                v = pred()
            except Fault:  # e.g. NO_CLIENT before the agent connected
                v = None
            if v:
                return v
            time.sleep(0.05)
        raise TimeoutError(f"timed out waiting for {what}; service log tail:\n"
                           + "\n".join(self.output().splitlines()[-15:]))

    def stop(self) -> None:
        """SIGTERM (a clean stop, workers included), SIGKILL after a bounded wait."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
        kill(self.proc)
        self.log.close()
        # the log served while the service ran (wait_for quotes its tail); it was
        # left behind in /tmp, 17 of them per `make test`
        with contextlib.suppress(OSError):
            os.unlink(self.log.name)
        shutil.rmtree(self.dir, ignore_errors=True)


def kill(proc: subprocess.Popen | None) -> None:
    """SIGKILL a process we started (by pid) and reap it."""
    if proc is None or proc.poll() is not None:
        return
    try:
        os.kill(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        pass


def spawn_client(runtime_dir: str, argv: list[str], *, nice: int = 0,
                 env: dict[str, str] | None = None) -> subprocess.Popen:
    """Run a program with the agent preloaded, connected to ``runtime_dir``."""
    e = dict(os.environ, DBR_RUNTIME_DIR=runtime_dir, LD_PRELOAD=agent_path(), **(env or {}))
    return subprocess.Popen(argv, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=(lambda: os.nice(nice)) if nice else None)


def run_client(runtime_dir: str, argv: list[str], timeout: float = 60.0) -> tuple[str, int]:
    """Run a program under the agent to its end (killed by pid after ``timeout``): its
    stdout and pid; a non-zero exit fails the test."""
    p = spawn_client(runtime_dir, argv)
    try:
        out, err = p.communicate(timeout=timeout)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(5)
    assert p.returncode == 0, err
    return out, p.pid


class FakeAgent:
    """A Python stand-in for the agent: connects and says HELLO (with any pid)."""

    def __init__(self, runtime_dir: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.settimeout(3.0)
        self.sock.connect(os.path.join(runtime_dir, "agent.sock"))
        self.seq = 0

    def send(self, msg_type: P.MsgType, body) -> None:
        self.seq += 1
        self.sock.send(P.pack(body, msg_type, self.seq))

    def hello(self, pid: int | None = None, flags: int = 0) -> P.Message:
        h = P.Hello(pid=os.getpid() if pid is None else pid, ppid=os.getppid(), uid=os.getuid(),
                    flags=flags, n_threads=1, page_size=4096, exe=b"/fake/agent")
        self.send(P.MsgType.HELLO, h)
        return self.recv()

    def recv(self) -> P.Message:
        return P.unpack(self.sock.recv(P.MSG_MAX))

    def recv_or_eof(self, timeout: float = 3.0) -> P.Message | None:
        """Next message; None when the service closed the session."""
        self.sock.settimeout(timeout)
        data = self.sock.recv(P.MSG_MAX)
        return P.unpack(data) if data else None

    def close(self) -> None:
        self.sock.close()
