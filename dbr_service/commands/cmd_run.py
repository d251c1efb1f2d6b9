"""dbr run — run PROG under dbr and report what dbr did with it.

Uses the host's service when one answers on $DBR_RUNTIME_DIR, else (or with
--embedded) starts a private service for the run.  PROG is started with the agent
in LD_PRELOAD (prepended to any existing value) and DBR_RUNTIME_DIR set, so its
forks and execs are followed.  The exit status is PROG's (killed by signal N:
128+N).  At exit a short report goes to stderr; --report FILE writes dbr.run/1 JSON.
"""

from __future__ import annotations

# Start-up matters here: every module imported before PROG starts adds to the wall time
# of every `dbr run` (the service's region and codegen code alone took 0.2 s), so only
# what the host-service path needs is imported at the top; the rest is imported where
# it is used.
import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dbr_service.common.paths import (AGENT_SOCKET, QUIET_FILE, agent_quiet, resolve_runtime_dir,
                                      untrusted_dir)
from dbr_service.commands.report import format_report, run_report

#: Most pairs of `--compare` (dbr_service/commands/compare.py, which is imported only then).
MAX_PAIRS = 1000

if TYPE_CHECKING:  # pragma: no cover
    from dbr_service.common.config import ConfigSources

EPILOG = """examples:
  dbr run -- ./prog arg1 arg2
  dbr run --embedded --aggressive --report out.json -- ./prog
  dbr run -o sampling_source=agent-timer -o sample_period_us=250 -- ./prog
  dbr run --compare 10 -- ./prog     # 10 alternated pairs: is it faster under dbr?
"""

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    parser.add_argument("--embedded", action="store_true",
                        help="always start a private service for this run")
    parser.add_argument("--aggressive", action="store_true",
                        help="preset for tests and demos: short snapshot interval, low thresholds")
    parser.add_argument("--report", metavar="FILE",
                        help="write the dbr.run/1 JSON report here ('-': standard output); "
                             "checked before PROG starts")
    parser.add_argument("-c", "--config", metavar="FILE",
                        help="configuration file of the embedded service")
    parser.add_argument("-o", dest="overrides", metavar="KEY=VALUE", action="append",
                        default=[], help="set a configuration key of the embedded service")
    parser.add_argument("--quiet", action="store_true", help="no report on stderr")
    parser.add_argument("--json", action="store_true",
                        help="the report on stderr as dbr.run/1 JSON (dbr.compare/1 with "
                             "--compare) instead of lines; PROG's own output keeps stdout")
    parser.add_argument("--jitdump", action="store_true",
                        help="let perf name replacement code: PROG's agent makes "
                             "/tmp/jit-PID.dump and the service records each region there "
                             "(perf record -k mono, then perf inject --jit)")
    parser.add_argument("--compare", metavar="N", type=int,
                        help="run PROG N times natively and N times under dbr, alternated "
                             "(after one native warm-up run), outputs discarded and "
                             "compared, and print dbr's time over native's with its "
                             "interval; the exit status is PROG's, or 1 if a run's output "
                             "or status differed")
    parser.add_argument("prog", nargs=argparse.REMAINDER, metavar="-- PROG ARGS",
                        help="the program to run and its arguments")


class EmbeddedService:
    """A private service in a thread of this process, with its own runtime dir.

    Construction only makes the runtime dir and binds the agent socket there (cheap), so
    PROG can start at once and its agent connect; :meth:`start` then imports and starts
    the service (0.2-0.4 s) while PROG already runs.  The agent's HELLO waits in the
    socket's backlog until the service accepts it (the agent waits up to 2 s for the
    answer, then retries)."""

    def __init__(self, sources: ConfigSources) -> None:
        import socket
        import tempfile

        self.sources = sources
        self.tmp = tempfile.mkdtemp(prefix="dbr-run-")
        self.runtime_dir = Path(self.tmp)
        env = dict(os.environ)
        env["DBR_RUNTIME_DIR"] = self.tmp
        sources.env = env
        # The socket is bound here, so the service must use this dir whatever -o says.
        sources.overrides = (*sources.overrides, f"runtime_dir={self.tmp}")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            self.listener.bind(os.path.join(self.tmp, AGENT_SOCKET))
            self.listener.listen(64)
        except OSError:
            self.listener.close()
            os.rmdir(self.tmp)
            raise
        self.service: Any = None
        self.thread: Any = None

    def start(self, warm_delay_s: float = 0.0) -> None:
        """Start the service (raises ServiceError; the socket is closed then)."""
        import threading

        from dbr_service.commands.control import ControlServer
        from dbr_service.daemon.service import Service

        try:
            self.service = Service(self.sources, control_server=ControlServer, embedded=True,
                                   agent_listener=self.listener, warm_delay_s=warm_delay_s)
            self.service.start()
        except BaseException:
            self.service = None
            self.listener.close()
            raise
        self.thread = threading.Thread(target=self.service.run, name="dbr-embedded",
                                       daemon=True)
        self.thread.start()

    def stop(self) -> None:
        import shutil

        if self.service is not None:
            self.service.request_stop("dbr run finished")
            self.thread.join(5.0)
        else:
            self.listener.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


def _exit_status(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def preload_env(base: Mapping[str, str], lib: str) -> dict[str, str]:
    """A copy of ``base`` with ``lib`` preloaded before anything already there."""
    env = dict(base)
    old = env.get("LD_PRELOAD", "")
    env["LD_PRELOAD"] = lib + (":" + old if old else "")
    return env


def child_env(agent: str, runtime_dir: Path, base: Mapping[str, str] | None = None,
              jitdump: bool = False) -> dict[str, str]:
    """The environment of PROG (``base``: os.environ): agent preloaded, the service's
    sockets in DBR_RUNTIME_DIR, and with ``jitdump`` DBR_JITDUMP=1 (`--jitdump`)."""
    env = preload_env(os.environ if base is None else base, agent)
    env["DBR_RUNTIME_DIR"] = str(runtime_dir)
    if jitdump:
        env["DBR_JITDUMP"] = "1"
    return env


def collect_report(client: Any, pid: int, settle_s: float = 2.0) -> list[dict[str, Any]]:
    """Client entries of PROG and its descendants, once their sessions have ended
    (bounded wait: an agent that never says goodbye does not hold the report)."""
    deadline = time.monotonic() + settle_s
    entries: list[dict[str, Any]] = []
    while True:
        try:
            entries = client.result("report", {"pids": [pid]}, timeout=1.0)
        except (OSError, TimeoutError) as exc:
            print(f"dbr run: no report from the service: {exc}", file=sys.stderr)
            return entries
        if all(e.get("close_reason") for e in entries) or time.monotonic() > deadline:
            return entries
        time.sleep(0.01)  # the agent's BYE is usually being handled: a round trip or two


def run(args: argparse.Namespace) -> int:
    prog = list(args.prog)
    if prog and prog[0] == "--":
        prog = prog[1:]
    if not prog:
        print("dbr run: no program given (dbr run [OPTIONS] -- PROG ARGS)", file=sys.stderr)
        return 2
    if args.compare is not None and not 1 <= args.compare <= MAX_PAIRS:
        print(f"dbr run: --compare takes 1 to {MAX_PAIRS} pairs, not {args.compare}",
              file=sys.stderr)
        return 2
    why = report_path_problem(args.report) if args.report else None
    if why:
        print(f"dbr run: --report {args.report}: {why}", file=sys.stderr)
        return 2
    import dbr_agent

    try:
        agent = dbr_agent.agent_path()
    except (FileNotFoundError, subprocess.CalledProcessError) as exc:
        print(f"dbr run: the agent is not available: {exc}", file=sys.stderr)
        return 1
    sources = None
    if args.config or args.overrides or args.aggressive or args.embedded:
        sources = _config_sources(args)   # validated before anything starts
        if sources is None:
            return 2
    embedded: EmbeddedService | None = None
    runtime_dir = resolve_runtime_dir()
    if args.embedded or not _host_listening(runtime_dir):
        sources = sources or _config_sources(args)
        if sources is None:
            return 2
        try:
            embedded = EmbeddedService(sources)
        except OSError as exc:
            print(f"dbr run: cannot set up the embedded service: {exc}", file=sys.stderr)
            return 1
        runtime_dir = embedded.runtime_dir
    elif args.aggressive or args.overrides:
        print(f"dbr run: using the host service on {runtime_dir}; --aggressive/-o apply only "
              f"to an embedded service (add --embedded)", file=sys.stderr)
    try:
        if args.compare is not None:
            code = _compare(args, prog, agent, runtime_dir, embedded)
        else:
            code = _run_prog(args, prog, agent, runtime_dir, embedded)
    finally:
        if embedded is not None:
            embedded.stop()
    if embedded is not None:
        _exit_now(code)
    return code


def _exit_now(code: int) -> None:
    """Leave without the interpreter's exit-time joins.  The embedded service's worker
    pool is already shut down (without waiting, its workers terminated), but
    concurrent.futures and multiprocessing still join its manager thread and child
    processes at exit, and that join can hang after shutdown(wait=False) (CPython
    #83386).  PROG's exit status and the report are already out; workers and the
    forkserver leave on their own when this process is gone (pidfd watch).  The
    resource tracker would then find the pool's semaphores unreleased and print
    warnings into our stderr after we are gone (spoiling `--json`); their names were
    unlinked when they were made, so it has nothing to clean and is stopped first."""
    import logging
    import signal
    from multiprocessing import resource_tracker

    tracker = getattr(resource_tracker, "_resource_tracker", None)
    pid = getattr(tracker, "_pid", None)
    if isinstance(pid, int) and pid > 0:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    logging.shutdown()
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _config_sources(args: argparse.Namespace) -> ConfigSources | None:
    """The embedded service's configuration sources, loaded once to check them (None
    after printing the error)."""
    from dbr_service.common.config import ConfigSources
    from dbr_service.common.errors import ConfigError

    sources = ConfigSources(file=args.config, overrides=tuple(args.overrides),
                            aggressive=args.aggressive)
    try:
        sources.load()
    except ConfigError as exc:
        print(f"dbr run: configuration error: {exc}", file=sys.stderr)
        return None
    return sources


def _import_control() -> None:
    import dbr_service.commands.control  # noqa: F401


def _host_listening(runtime_dir: Path) -> bool:
    """Whether a service listens on the host's agent socket: a connection closed before
    HELLO, which the service takes as a liveness probe.  (The standard library only: the
    control socket would need zmq, 15 ms of imports before PROG starts.)"""
    path = runtime_dir / AGENT_SOCKET
    if not path.exists():
        return False
    why = untrusted_dir(runtime_dir)
    if why:   # the agent would not connect there either
        print(f"dbr run: not using the service on {runtime_dir}: {why}; starting an "
              f"embedded one", file=sys.stderr)
        return False
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    probe.settimeout(1.0)
    try:
        probe.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        probe.close()


def _start_embedded(args: argparse.Namespace, embedded: EmbeddedService,
                    warm_delay_s: float = 0.0) -> bool:
    from dbr_service.commands.cmd_service import setup_logging
    from dbr_service.common.errors import ServiceError

    explicit = any(o.startswith("log_level=") for o in args.overrides)
    setup_logging(embedded.sources.load().log_level if explicit else "warning")
    try:
        embedded.start(warm_delay_s)
    except ServiceError as exc:
        print(f"dbr run: cannot start the embedded service: {exc}; the program runs "
              f"without dbr", file=sys.stderr)
        return False
    return True


# A PROG that ended within its agent's quiet start (dbr_agent/connect.c, "quiet while
# the program starts"; paths.agent_quiet), plus this margin for the connection and
# HELLO, had no session for that reason.
QUIET_MARGIN_S = 0.05


def _run_prog(args: argparse.Namespace, prog: list[str], agent: str, runtime_dir: Path,
              embedded: EmbeddedService | None) -> int:
    # By default PROG starts at once and the embedded service starts beside it (its
    # 0.2-0.4 s of start-up no longer delays every run; PROG's agent waits in the
    # socket's backlog meanwhile).  --aggressive wants optimization from PROG's first
    # moments, so there the service is up first, as before.
    served = True
    env = child_env(agent, runtime_dir, jitdump=args.jitdump)
    if embedded is not None and args.aggressive:
        # up first: its hint (paths.QUIET_FILE, min_client_age_s 0) has the agent's
        # thread connect at once instead of staying quiet while PROG starts
        served = _start_embedded(args, embedded)
    # what PROG's agent will read in its constructor (the report's note, below)
    quiet_ms, planned, late = agent_quiet(env, runtime_dir,
                                          shutil.which(prog[0], path=env.get("PATH")))
    learned = ("the service's short_run_s: PROG's last runs ended sooner with nothing "
               "installed, see `dbr ctl status`")
    t0 = time.monotonic()
    try:
        proc = subprocess.Popen(prog, env=env)
    except OSError as exc:
        print(f"dbr run: cannot run {prog[0]}: {exc}", file=sys.stderr)
        return 127 if isinstance(exc, FileNotFoundError) else 126
    old = {sig: signal.signal(sig, lambda n, _f: proc.send_signal(n)) for sig in FORWARDED}
    if embedded is None:
        # The report needs zmq (25 ms of imports): load it while PROG runs.
        import threading

        threading.Thread(target=_import_control, name="dbr-run-imports", daemon=True).start()
    try:
        if embedded is not None and not args.aggressive:
            # Worker processes started while PROG runs compete with it for the CPUs: a
            # PROG that ends within 0.25 s never pays for them.
            served = _start_embedded(args, embedded, warm_delay_s=0.25)
        up_at = time.monotonic()
        returncode = proc.wait()
        ended_at = time.monotonic()
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    wall = time.monotonic() - t0
    exit_code = _exit_status(returncode)
    from dbr_service.commands.ctlclient import ControlClient

    clients = collect_report(ControlClient(runtime_dir), proc.pid) if served else []
    extra = {}
    if served and not clients:
        if embedded is not None and not args.aggressive and ended_at - up_at < 0.25:
            # The service started beside PROG (above): a PROG that ended within its
            # start-up left before its agent's connection was taken.
            extra["note"] = ("PROG ended as the embedded service (started beside it) came "
                             "up, before its agent's connection was taken; --aggressive "
                             "starts the service first")
        elif quiet_ms and ended_at - t0 < quiet_ms / 1000 + QUIET_MARGIN_S:
            why = learned if late else \
                f"DBR_AGENT_QUIET_MS, or the service's {QUIET_FILE}"
            extra["note"] = (f"PROG ended within its agent's quiet start ({quiet_ms} ms: "
                             f"{why}), before the agent first connected")
        elif planned and quiet_ms:
            why = learned if late else f"the service's min_client_age_s, in its {QUIET_FILE}"
            extra["note"] = (f"PROG's agent makes its thread only once PROG is "
                             f"{quiet_ms} ms old ({why}) and running: PROG slept from "
                             "then on, or "
                             "no agent was loaded (a static or setuid program, one that "
                             "clears LD_PRELOAD, or DBR_AGENT_DISABLE=1)")
        else:
            extra["note"] = ("no agent connected: a static or setuid program, one that "
                             "clears LD_PRELOAD, or DBR_AGENT_DISABLE=1")
    rep = run_report(prog, exit_code, wall, clients,
                     service="embedded" if embedded is not None else "host",
                     runtime_dir=str(runtime_dir), **extra)
    if not args.quiet:
        print(json.dumps(rep, indent=2) if args.json else format_report(rep), file=sys.stderr)
    if args.report:
        _write_report(args.report, rep)
    return exit_code


def _compare(args: argparse.Namespace, prog: list[str], agent: str, runtime_dir: Path,
             embedded: EmbeddedService | None) -> int:
    """`--compare N`: dbr_service/commands/compare.py.  The service is up before the first run
    and serves every dbr run, as on a host where dbr is deployed."""
    from dbr_service.commands.compare import CompareError, format_compare, run_pairs
    from dbr_service.commands.ctlclient import ControlClient

    if embedded is not None and not _start_embedded(args, embedded):
        return 1
    say = ((lambda _t: None) if args.quiet or args.json
           else (lambda t: print(f"dbr: {t}", file=sys.stderr)))
    control = ControlClient(runtime_dir)
    try:
        res = run_pairs(prog, args.compare, dict(os.environ),
                        child_env(agent, runtime_dir, jitdump=args.jitdump),
                        lambda pid: collect_report(control, pid), progress=say)
    except CompareError as exc:
        print(f"dbr run: {exc}", file=sys.stderr)
        return 127
    doc = {"schema": "dbr.compare/1", "program": prog,
           "service": "embedded" if embedded else "host", **res}
    print(json.dumps(doc, indent=2) if args.json else format_compare(res), file=sys.stderr)
    if args.report:
        _write_report(args.report, doc)
    return 1 if res["mismatches"] else res["exit_code"]


def report_path_problem(path: str) -> str | None:
    """Why the report could not be written at ``path`` ('-' is standard output), so
    that `dbr run` says so before PROG runs rather than after; None if it can."""
    if path == "-":
        return None
    p = os.path.abspath(path)
    if os.path.isdir(p):
        return f"{path} is a directory"
    parent = os.path.dirname(p)
    if not os.path.isdir(parent):
        return f"no directory {parent}"
    if os.path.exists(p) and not os.access(p, os.W_OK):
        return f"{path} is not writable"
    if not os.path.exists(p) and not os.access(parent, os.W_OK | os.X_OK):
        return f"cannot create files in {parent}"
    return None


def _write_report(path: str, rep: dict[str, Any]) -> None:
    """The JSON report to ``path`` or standard output; a failure is said, and PROG's exit
    status stays dbr run's."""
    text = json.dumps(rep, indent=2) + "\n"
    try:
        if path == "-":
            sys.stdout.write(text)
            sys.stdout.flush()
        else:
            with open(path, "w") as fh:
                fh.write(text)
    except OSError as exc:
        print(f"dbr run: cannot write the report to {path}: {exc.strerror or exc}",
              file=sys.stderr)
