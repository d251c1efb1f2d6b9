"""Running one benchmark program and the host dbr service it may run under.

``run_once`` times one run the way every A/B harness here does: in a fresh directory
and a session of its own, from just before the spawn to the return of wait4, with the
rusage of the whole process tree and a hash of its outputs; a run that outlives its
timeout has its threads recorded, then is killed.  ``HostService`` is a ``dbr service``
on a private runtime dir, started once and left running as on a deployed host."""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import tree_cpu_s

# ------------------------------------------------------------------ one run

@dataclass
class Run:
    wall: float
    exit_code: int          # waitstatus_to_exitcode: negative = killed by that signal
    digest: str
    cpu_s: float            # user + sys of the process tree (wait4 rusage)
    maxrss_kb: int          # largest RSS of any process of the tree
    timed_out: bool = False
    stderr_tail: str = ""
    extra: dict = field(default_factory=dict)
    pid: int = 0
    hung: list = field(default_factory=list)  # on a timeout: what each thread was doing
    round: int = -1         # index of its recorded round in alternate()'s result (-1: none)


def digest_outputs(run_dir: Path, outputs: list[str]) -> str:
    h = hashlib.sha256()
    for name in ["stdout", *outputs]:
        p = run_dir / name
        h.update(name.encode() + b"\0")
        if p.exists():
            with open(p, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
        else:
            h.update(b"\0MISSING\0")
    return h.hexdigest()


def run_once(argv: list[str], env: dict[str, str], run_dir: Path, outputs: list[str],
             timeout: float) -> Run:
    """One timed run in a fresh ``run_dir`` (its cwd; stdout goes to run_dir/stdout).
    Wall time from just before the spawn to the return of wait4; rusage from wait4
    covers the child and every descendant it waited for."""
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    res: dict[str, Any] = {}
    with open(run_dir / "stdout", "wb") as out, open(run_dir.parent / "stderr", "wb") as err:
        t0 = time.perf_counter()
        p = subprocess.Popen(argv, env=env, cwd=run_dir, stdin=subprocess.DEVNULL, stdout=out,
                             stderr=err, start_new_session=True)

        def waiter() -> None:
            _, status, ru = os.wait4(p.pid, 0)
            res.update(t=time.perf_counter(), status=status, ru=ru)

        th = threading.Thread(target=waiter, daemon=True)
        th.start()
        try:
            th.join(timeout)
        except BaseException:  # interrupted (SIGINT/SIGTERM): take the run down with us
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            th.join(10)
            raise
        timed_out = th.is_alive()
        hung = session_threads(p.pid) if timed_out else []
        if timed_out:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # the session we created for it
            except ProcessLookupError:
                pass
            th.join(30)
    if "status" not in res:
        raise RuntimeError(f"could not reap {argv[0]} (pid {p.pid})")
    p.returncode = os.waitstatus_to_exitcode(res["status"])  # reaped: keep Popen from waiting
    ru = res["ru"]
    tail = (run_dir.parent / "stderr").read_bytes()[-2000:].decode(errors="replace")
    return Run(wall=res["t"] - t0, exit_code=p.returncode,
               digest=digest_outputs(run_dir, outputs), cpu_s=ru.ru_utime + ru.ru_stime,
               maxrss_kb=ru.ru_maxrss, timed_out=timed_out, stderr_tail=tail, pid=p.pid,
               hung=hung)


def session_threads(sid: int) -> list[dict]:
    """Every thread of the processes in session ``sid``, as /proc shows it: name,
    state, kernel wait channel and /proc/TID/syscall (the syscall it waits in, or
    "running", with its user stack pointer and pc) -- what a timed-out run was doing,
    recorded before it is killed."""
    out: list[dict] = []
    for pid in sorted(int(d) for d in os.listdir("/proc") if d.isdigit()):
        try:
            st = Path(f"/proc/{pid}/stat").read_text()
            if int(st.rsplit(")", 1)[1].split()[3]) != sid:   # field 6: session
                continue
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(
                errors="replace").strip()[:200]
            for tid in sorted(int(t) for t in os.listdir(f"/proc/{pid}/task")):
                base = Path(f"/proc/{pid}/task/{tid}")
                tst = (base / "stat").read_text()
                rest = tst.rsplit(")", 1)[1].split()
                item = {"pid": pid, "tid": tid, "cmd": cmd,
                        "comm": tst[tst.index("(") + 1:tst.rindex(")")], "state": rest[0],
                        "utime_ticks": int(rest[11]), "stime_ticks": int(rest[12])}
                for name in ("wchan", "syscall"):
                    with contextlib.suppress(OSError):
                        item[name] = (base / name).read_text().strip()
                out.append(item)
        except (OSError, ValueError, IndexError):
            continue                       # gone meanwhile
    return out


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    if code > 128 and code - 128 < 65:
        try:
            return f"exit {code} ({signal.Signals(code - 128).name}?)"
        except ValueError:
            pass
    return f"exit {code}"


def last_line(text: str, n: int = 200) -> str:
    lines = [ln for ln in (text or "").strip().splitlines() if ln.strip()]
    return (lines[-1] if lines else "no message")[-n:]


def dbr_exe() -> str:
    venv = Path(sys.executable).parent / "dbr"
    return str(venv) if venv.exists() else (shutil.which("dbr") or str(venv))


def _terminated(signum, frame):
    raise SystemExit(128 + signum)


def exit_on_sigterm() -> None:
    """SIGTERM (timeout(1), CI, kill) unwinds a benchmark as SIGINT does: the current
    run is killed, partial results are written and atexit stops the host services
    instead of leaving them running.  A handler the benchmark set itself is kept."""
    import threading

    if threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _terminated)


class HostService:
    """A ``dbr service [FLAGS] [-o KEY=VALUE ...]`` with a private DBR_RUNTIME_DIR, started
    once and left running for the whole benchmark, as on a host that runs it all the time.
    ``log``: a file its output is appended to (else discarded), and the service then runs
    in a session of its own; ``need_agent``: unavailable unless the agent is built
    (``agent`` is then its path)."""

    def __init__(self, overrides: list[str] | None = None, flags: list[str] | None = None,
                 *, log: Path | None = None, prefix: str = "dbr-bench-host-",
                 need_agent: bool = False) -> None:
        self.rt: str | None = None
        self.proc: subprocess.Popen | None = None
        self.overrides = list(overrides or [])
        self.flags = list(flags or [])
        self.log, self.prefix, self.need_agent = log, prefix, need_agent
        self.agent = ""

    def argv(self) -> list[str]:
        return [dbr_exe(), "service", *self.flags,
                *(a for o in self.overrides for a in ("-o", o))]

    def start(self, env: dict[str, str]) -> str | None:
        """None once it serves, else why it is unavailable."""
        if self.need_agent:
            try:
                import dbr_agent

                self.agent = dbr_agent.agent_path()
            except Exception as exc:  # noqa: BLE001
                return f"unavailable: the agent is not built ({exc}); run make build"
        self.rt = tempfile.mkdtemp(prefix=self.prefix)
        out: Any = subprocess.DEVNULL
        if self.log is not None:
            self.log.parent.mkdir(parents=True, exist_ok=True)
            out = open(self.log, "ab")
        try:
            self.proc = subprocess.Popen(self.argv(), env=dict(env, DBR_RUNTIME_DIR=self.rt),
                                         stdout=out, stderr=out,
                                         start_new_session=self.log is not None)
        finally:
            if self.log is not None:
                out.close()
        atexit.register(self.stop)
        exit_on_sigterm()
        deadline = time.monotonic() + 30
        while not os.path.exists(os.path.join(self.rt, "control.sock")):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                return f"unavailable: `{' '.join(['dbr', *self.argv()[1:]])}` did not start"
            time.sleep(0.05)
        time.sleep(1.0)  # let its worker pool start, as on a host that runs all the time
        return None

    def cpu_s(self) -> float | None:
        """user+sys of the service and its worker processes so far (common.tree_cpu_s)."""
        return tree_cpu_s(self.proc.pid)

    def patched(self, pid: int) -> bool | None:
        """Whether this service installed code in the client ``pid`` (asked after it
        ended, while the service keeps its session): False when it has no session for
        it (the run was born late, or ended before the service heard of it), None when
        the service cannot be asked."""
        if not self.rt or not pid:
            return None
        from dbr_service.commands.cmd_run import collect_report
        from dbr_service.commands.ctlclient import ControlClient

        try:
            clients = collect_report(ControlClient(self.rt), pid)
        except Exception:  # noqa: BLE001 - a service that does not answer: unknown
            return None
        return any(c.get("time_to_first_patch_s") is not None for c in clients or [])

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self.rt:
            shutil.rmtree(self.rt, ignore_errors=True)
