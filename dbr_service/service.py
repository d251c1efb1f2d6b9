"""The dbr service: sockets, agent sessions, sampling snapshots, scheduling, shutdown.

One :class:`Service` per host (or per `dbr run --embedded`).  Threads:

* the **control thread** (whoever calls :meth:`Service.run`): accepts agent
  connections, times snapshot windows, hands snapshots to the scheduler, applies
  worker results, sends systemd notifications, handles signals and reloads;
* one **session thread** per client (:mod:`dbr_service.clients`);
* the **control-socket thread** (:mod:`dbr_service.control`);
* worker **processes** (:mod:`dbr_service.scheduler`).

The control thread never blocks on a client or a worker: work for a client is
posted to its session thread and collected through futures.
"""

from __future__ import annotations

import collections
import contextlib
import grp
import itertools
import logging
import os
import queue
import resource
import select
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq

from dbr_service import agentconn
from dbr_service import protocol as P
from dbr_service.clients import (ClientSession, RegionRecord, RegionState, SessionState,
                                 ShortThreadPrograms)
from dbr_service.config import Config, ConfigSources
from dbr_service.control import ControlServer, EventBus
from dbr_service.errors import ConfigError, DbrError, SamplingError
from dbr_service.notify import Notifier
from dbr_service.paths import (AGENT_SOCKET, CONTROL_SOCKET, EVENTS_SOCKET, QUIET_FILE,
                               UnsafeDirError, open_safe_dir, quiet_hint_ms, write_ms_file)
from dbr_service.clientfiles import remove_stale_perf_maps
from dbr_service.procfs import process_lives
from dbr_service.reuse import ReusedThreads
from dbr_service.sampling.aggregate import SampleAggregator
from dbr_service.shortruns import ShortRunPrograms
from dbr_service.speedcheck import SETTLE_PHASES
from dbr_service.scheduler import (QUICK_JOBS, ClientJob, JobResult, Scheduler, quick_job,
                                   sampling_interval)

log = logging.getLogger("dbr.service")

#: Ring of a listed timer sampler (sampling/gated.py): it holds the samples of the few
#: threads perf leaves out, a window at most (16 bytes an entry, 64 KiB).
GATED_RING_ENTRIES = 4096


class ServiceError(DbrError):
    """The service cannot start (another one runs, the runtime dir is unusable, ...)."""


# --------------------------------------------------------------------------- sampling
def sampling_capabilities() -> dict[str, Any]:
    """What this host offers (sampling/detect.py), as JSON for `dbr ctl status`."""
    from dbr_service.sampling import detect

    try:
        return detect.detect().to_json()
    except Exception as exc:  # detection must not stop the service
        log.warning("sampling detection failed: %r", exc)
        return {"best": "agent-timer", "capabilities": {}, "error": repr(exc)}


def choose_source(configured: str, caps: dict[str, Any]) -> str:
    """The live source to use: perf-cpu-clock | perf-cycles | agent-timer."""
    if configured == "agent-timer":
        return "agent-timer"
    best = caps.get("best", "agent-timer")
    if configured == "perf":
        return best if best.startswith("perf-") else "perf-cpu-clock"
    return best


def make_perf_source(session: ClientSession, cfg: Config, kind: str):
    """perf sampling of every thread of the client (threads added later via THREAD_NEW,
    which the agent sends from now until the window ends).  Threads that switch too
    often for a perf event get the agent's timer, where the agent offers a listed
    sampler (sampling/gated.py)."""
    from dbr_service.sampling.gated import GatedTimerSource
    from dbr_service.sampling.perf import PerfSource

    session.window_notices()

    pages = 64 if cfg.continuous_sampling else 16
    perf = PerfSource(event=kind.removeprefix("perf-"), sample_period_us=cfg.sample_period_us,
                      data_pages=pages, gate=session.switch_gate)
    if not (cfg.gated_thread_timer and cfg.perf_max_switch_rate > 0
            and session.hello_flags & P.HELLO_SAMPLER_LISTED
            and session.gated_timer_failed is None):
        perf.open(session.pid)
        return perf
    conn = session.conn
    timer = _agent_timer(session, cfg, GATED_RING_ENTRIES, P.SAMPLER_LISTED)
    src = GatedTimerSource(perf, timer, lambda tid, on: conn.sampler_thread(tid, on, timeout=1.0))
    src.open(session.pid)
    return src


def _agent_timer(session: ClientSession, cfg: Config, ring_entries: int, flags: int = 0):
    """An (unopened) source of the agent's per-thread timers, through the ring it hands
    over (SAMPLER_RING); start/stop run on the session thread, the connection's only
    reader.  flags: SAMPLER_LISTED for only the threads named to it."""
    from dbr_service.sampling.agent_timer import AgentTimerSource

    conn = session.conn
    return AgentTimerSource(lambda period, entries: conn.sampler_start(period, entries, flags)[0],
                            lambda: conn.sampler_stop(timeout=1.0),
                            period_us=cfg.sample_period_us, ring_entries=ring_entries)


def make_agent_timer_source(session: ClientSession, cfg: Config):
    """The agent's own timers on every thread of the client."""
    src = _agent_timer(session, cfg, cfg.agent_ring_entries)
    src.open(session.pid)
    return src


# --------------------------------------------------------------------------- snapshots
@dataclass
class Snapshot:
    """One sampling window in progress."""

    gen: int
    started: float
    end_at: float
    phase: str = "sampling"           # sampling -> collecting
    begun: dict[int, Any] = field(default_factory=dict)      # session id -> Future
    collecting: dict[int, Any] = field(default_factory=dict)  # session id -> Future
    collect_deadline: float = 0.0


#: How long a session's end waits for its process to end (Service._count_run).
RUN_END_WAIT_S = 0.1

#: Connections refused at a limit (max_handshakes, max_sessions_per_uid) are logged at
#: most once per this many seconds.
LIMIT_LOG_S = 10.0


def raise_nofile_limit() -> None:
    """Soft RLIMIT_NOFILE up to the hard one: each client costs a socket and a wake pipe,
    and each of its threads a perf event, so 1024 (systemd's soft default) is soon
    reached on a busy host.  Not for an embedded service: the program it starts would
    inherit the raised limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


# --------------------------------------------------------------------------- service
class Service:
    """See the module docstring."""

    def __init__(self, sources: ConfigSources, *, embedded: bool = False,
                 notifier: Notifier | None = None,
                 agent_listener: socket.socket | None = None,
                 warm_delay_s: float = 0.0) -> None:
        """``agent_listener``: an agent socket already bound and listening in this
        service's runtime dir (`dbr run` binds it before PROG starts, so PROG's agent
        connects at once while the service is still starting; the runtime dir is then
        private to this service and is not probed for another one).  ``warm_delay_s``:
        start the worker pool only after this long (see :meth:`Scheduler.warm`)."""
        self.sources = sources
        self._warm_delay_s = warm_delay_s
        self._prebound = agent_listener
        self.config: Config = sources.load()
        self.runtime_dir = self.config.effective_runtime_dir(sources.env)
        self.embedded = embedded
        self.notifier = notifier or (Notifier({}) if embedded else Notifier())
        self.lock = threading.RLock()
        self.sessions: dict[int, ClientSession] = {}
        self.pending: dict[int, ClientSession] = {}
        self.history: collections.deque[ClientSession] = collections.deque(maxlen=1024)
        self.short_thread_programs = ShortThreadPrograms(self.config.short_thread_memory_s)
        #: Programs whose runs end too soon to gain: their agents are born late.
        self.short_runs = ShortRunPrograms(self.runtime_dir, self.config.short_run_s,
                                           self.config.short_run_memory_s)
        self.sessions_seen = 0
        #: pid -> live session, rebuilt at each snapshot (sample attribution).
        self._by_pid: dict[int, ClientSession] = {}
        self.paused = False
        self.stopping = False
        self.stop_reason = ""
        self.snapshot_count = 0
        self.config_generation = 1
        self.started_mono = time.monotonic()
        self.scheduler = Scheduler(self._job_done)
        #: Threads that run client sessions, kept from one session to the next.
        self.session_threads = ReusedThreads()
        self.events = EventBus(None, None)
        self.capabilities: dict[str, Any] = {}
        self.source_kind = "none"
        self._ids = itertools.count(1)
        self._id_base = (int(time.time()) & 0xFFFFFFFF) << 20
        self._inbox: queue.Queue[Callable[[], None]] = queue.Queue()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._reload = False
        self._snap: Snapshot | None = None
        self._next_snapshot = 0.0
        self._listen: socket.socket | None = None
        self._ctx: zmq.Context | None = None
        self._control: ControlServer | None = None
        self._started = False
        self.stopped = threading.Event()
        #: The runtime dir, opened and checked (_prepare_runtime_dir); files in it are
        #: written relative to this descriptor.
        self.dir_fd = -1
        #: Agent connections refused at max_handshakes or max_sessions_per_uid.
        self.refused_at_limit = 0
        self._limit_logged = -LIMIT_LOG_S

    # ------------------------------------------------------------------ paths
    def path(self, name: str) -> str:
        return str(self.runtime_dir / name)

    # ------------------------------------------------------------------ start
    def start(self) -> None:
        """Create the runtime dir, bind every socket, start serving control requests.
        The signal handlers come first: a service manager may send SIGTERM the moment
        the service answers, and the loop then stops it cleanly (BYE, sockets removed)."""
        self._install_signals()
        try:
            self._start()
        except (OSError, zmq.ZMQError) as exc:
            self._release_sockets()
            raise ServiceError(f"cannot set up the sockets in {self.runtime_dir}: {exc}") from exc
        except ServiceError:
            self._release_sockets()
            raise

    def _start(self) -> None:
        if not self.embedded:
            raise_nofile_limit()
        self._prepare_runtime_dir()
        if self._prebound is not None:
            self._listen = self._prebound
        else:
            self._refuse_if_running()
            allowed = self.config.effective_allowed_uids()
            mode = 0o660 if self.config.socket_group else (
                0o600 if allowed <= {0, os.getuid()} else 0o666)
            self._listen = agentconn.listen(self.path(AGENT_SOCKET), mode=mode)
        self._listen.setblocking(False)
        self.short_runs.remove_stale()   # only now: the runtime dir is this service's
        if not self.embedded:            # a killed service's perf maps, still in /tmp
            for path in remove_stale_perf_maps(self.runtime_dir):
                log.info("removed the stale perf map %s", path)
        self.write_quiet_hint()
        self._ctx = zmq.Context()
        self._control = ControlServer(self, self._ctx, self.path(CONTROL_SOCKET))
        self.events = EventBus(self._ctx, self.path(EVENTS_SOCKET))
        self._chgrp_sockets()
        self.capabilities = sampling_capabilities()
        self.source_kind = choose_source(self.config.sampling_source, self.capabilities)
        self._control.start()
        self.scheduler.warm(self.config.max_workers, delay_s=self._warm_delay_s)
        self.session_threads.prestart()   # born now, not when the first client connects
        self._started = True
        self._next_snapshot = time.monotonic() + min(0.05, self.config.snapshot_interval_s)
        log.info("dbr service pid %d on %s; sampling: %s", os.getpid(), self.runtime_dir,
                 self.source_kind)
        self.notifier.ready(self._status_line())

    def _prepare_runtime_dir(self) -> None:
        """Open the runtime dir, refusing one that anybody but this service's user could
        change (a symlink, another owner, writable by group or others, an unsafe
        ancestor: paths.open_safe_dir).  Its mode is then set through the descriptor,
        never through a path that could lead elsewhere."""
        d = self.runtime_dir
        group = self.config.socket_group
        try:
            gid = grp.getgrnam(group).gr_gid if group else -1
        except KeyError:
            raise ServiceError(f"socket_group {group!r} does not exist") from None
        try:
            fd = open_safe_dir(d, create=True, mode=0o700)
        except UnsafeDirError as exc:
            raise ServiceError(f"refusing runtime dir: {exc}") from None
        except OSError as exc:
            raise ServiceError(f"runtime dir {d}: {exc}") from None
        try:
            os.fchmod(fd, 0o750 if group else 0o755)
            if group:
                os.fchown(fd, -1, gid)
        except OSError as exc:
            os.close(fd)
            raise ServiceError(f"runtime dir {d}: {exc}") from None
        if self.dir_fd >= 0:
            os.close(self.dir_fd)
        self.dir_fd = fd
        self.short_runs.dir_fd = fd

    def write_quiet_hint(self) -> None:
        """Tell agents how young a client this service samples (paths.QUIET_FILE,
        read by the agent's constructor unless DBR_AGENT_QUIET_MS is set):
        ``min_client_age_s`` in ms, 0 under --aggressive.  An agent makes its thread,
        and connects, only once its program is that old and running (dbr_agent/agent.c,
        "born when the service would look"): a program that ends sooner, or that
        sleeps, pays for no second thread.  A host service cannot set its clients'
        environment.  Written whole (a temporary file renamed), so an agent never reads
        half of it; failing to write it is logged, and agents then keep the default
        quiet (their thread made at once, connecting after 50 ms)."""
        path = self.path(QUIET_FILE)
        ms = quiet_hint_ms(self.config.min_client_age_s)
        self._configure_short_runs(ms)
        try:
            write_ms_file(QUIET_FILE, ms, dir_fd=self.dir_fd)
        except OSError as exc:
            log.warning("cannot write the agents' quiet hint %s: %s", path, exc)

    def _configure_short_runs(self, hint_ms: int) -> None:
        """Programs born late are forgotten when what they were learned under changes;
        with patching off nothing is learned (sampling is then the point)."""
        cfg = self.config
        self.short_runs.configure(cfg.short_run_s if cfg.patching else 0.0,
                                  cfg.short_run_memory_s, hint_ms)

    def _chgrp_sockets(self) -> None:
        group = self.config.socket_group
        if not group:
            return
        gid = grp.getgrnam(group).gr_gid
        for name in (AGENT_SOCKET, CONTROL_SOCKET, EVENTS_SOCKET):
            os.chown(self.path(name), -1, gid)
            os.chmod(self.path(name), 0o660)

    def _refuse_if_running(self) -> None:
        """Another service answering on agent.sock: refuse.  Stale socket files: remove."""
        agent = self.path(AGENT_SOCKET)
        if os.path.exists(agent):
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
            probe.settimeout(0.5)
            try:
                probe.connect(agent)
            except OSError:
                pass  # nobody listening: stale
            else:
                raise ServiceError(f"another dbr service is already running on "
                                   f"{self.runtime_dir} (it answers on {agent}); stop it "
                                   f"first or set DBR_RUNTIME_DIR")
            finally:
                probe.close()
        for name in (AGENT_SOCKET, CONTROL_SOCKET, EVENTS_SOCKET):
            try:
                os.unlink(name, dir_fd=self.dir_fd)
                log.info("removed stale %s", self.path(name))
            except FileNotFoundError:
                pass

    # ------------------------------------------------------------------ run
    def run(self) -> None:
        """The control thread's loop, until :meth:`request_stop`; then shut down."""
        if not self._started:
            self.start()
        try:
            while not self.stopping:
                try:
                    self._loop_once()
                except Exception:  # a bug must not take every client's service down
                    log.exception("control loop iteration failed")
                    self.events.publish("error", message="internal error in the control loop")
                    time.sleep(0.05)
        finally:
            self._shutdown()

    def _install_signals(self) -> None:
        if self.embedded or threading.current_thread() is not threading.main_thread():
            return  # embedded (dbr run forwards its signals to PROG): not the service's
        signal.signal(signal.SIGTERM, lambda *_: self.request_stop("SIGTERM"))
        signal.signal(signal.SIGINT, lambda *_: self.request_stop("SIGINT"))
        signal.signal(signal.SIGHUP, lambda *_: self.request_reload())

    def request_stop(self, reason: str) -> None:
        """Any thread or a signal handler: end the loop and shut down."""
        if not self.stop_reason:
            self.stop_reason = reason
        self.stopping = True
        self._wake()

    def request_reload(self) -> None:
        self._reload = True
        self._wake()

    def post(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the control thread."""
        self._inbox.put(fn)
        self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    def _loop_once(self) -> None:
        timeout = self._next_deadline() - time.monotonic()
        p = select.poll()
        p.register(self._listen.fileno(), select.POLLIN)
        p.register(self._wake_r, select.POLLIN)
        ready = {fd for fd, _ in p.poll(int(min(0.25, max(0.0, timeout)) * 1000 + 0.999))}
        if self._wake_r in ready:
            try:
                os.read(self._wake_r, 4096)
            except BlockingIOError:
                pass
        if self._listen.fileno() in ready:
            self._accept()
        while True:
            try:
                fn = self._inbox.get_nowait()
            except queue.Empty:
                break
            try:
                fn()
            except Exception:
                log.exception("control-thread task failed")
        if self._reload:
            self._reload = False
            self.reload()
        self._snapshot_tick(time.monotonic())
        self._speed_tick(time.monotonic())
        self.notifier.watchdog()

    def _next_deadline(self) -> float:
        now = time.monotonic()
        snap = self._snap
        if snap is None:
            t = self._next_snapshot if not self.paused else now + 0.25
        elif snap.phase == "sampling":
            t = snap.end_at
        else:
            t = now + 0.02
        for s in self.live_sessions():
            chk = s.speed_check
            if chk is not None and chk.next_at:
                t = min(t, chk.next_at)
        due = self.notifier.watchdog_due()
        return min(t, now + due) if due is not None else t

    # ------------------------------------------------------------------ sessions
    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listen.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.warning("accept failed: %s", exc)
                return
            sock.setblocking(True)
            try:
                conn = agentconn.AgentConnection(
                    sock, allowed_uids=set(self.config.effective_allowed_uids()))
            except OSError as exc:
                sock.close()
                log.warning("agent connection dropped before credentials: %s", exc)
                continue
            why = self._over_limit(conn.peer_uid)
            if why:
                self._refuse_at_once(conn, why)
                continue
            sid = self._id_base + next(self._ids)
            s = ClientSession(self, conn, sid)
            with self.lock:
                self.pending[sid] = s
            s.start()

    def _over_limit(self, uid: int) -> str:
        """Why a new connection of ``uid`` is refused before its handshake (a flood of
        connections must not cost a thread and descriptors each), or ''."""
        cfg = self.config
        with self.lock:
            if len(self.pending) >= cfg.max_handshakes:
                return f"too many handshakes in progress (max_handshakes {cfg.max_handshakes})"
            n = sum(1 for s in self.sessions.values() if s.uid == uid) + \
                sum(1 for s in self.pending.values() if s.uid == uid)
        if n >= cfg.max_sessions_per_uid:
            return f"uid {uid} holds {n} sessions (max_sessions_per_uid " \
                   f"{cfg.max_sessions_per_uid})"
        return ""

    def _refuse_at_once(self, conn: agentconn.AgentConnection, why: str) -> None:
        """ERROR E_LIMIT and close, on the control thread, never waiting on the peer;
        logged at most once per LIMIT_LOG_S with the count refused since."""
        self.refused_at_limit += 1
        try:
            conn.sock.setblocking(False)
            conn.error(P.Result.E_LIMIT, why)
            # What the peer sent already (its HELLO) is read first: closing a socket with
            # unread data resets the connection, and the peer would not see the ERROR.
            for _ in range(4):
                conn.sock.recv(P.MSG_MAX + 1)
        except OSError:
            pass
        finally:
            conn.close()
        now = time.monotonic()
        if now - self._limit_logged >= LIMIT_LOG_S:
            log.warning("agent connection from pid %d uid %d refused: %s (%d refused at a "
                        "limit so far)", conn.peer_pid, conn.peer_uid, why,
                        self.refused_at_limit)
            self._limit_logged = now
        self.events.publish("client-refused", pid=conn.peer_pid, uid=conn.peer_uid,
                            reason=why, peer_gone=False)

    def session_started(self, s: ClientSession) -> None:
        with self.lock:
            self.pending.pop(s.session_id, None)
            self.sessions[s.session_id] = s
            self.sessions_seen += 1
        log.info("client pid %d (%s) connected, session %d", s.pid, s.exe, s.session_id)
        self.short_runs.connected(s.exe_key, s.connected_mono - s.started_mono)
        self.events.publish("client-connected", pid=s.pid, exe=s.exe, session=s.session_id,
                            ppid=s.ppid)
        if self.stopping:
            s.stop("service shutting down")

    def session_refused(self, s: ClientSession, why: str, peer_gone: bool = False) -> None:
        with self.lock:
            self.pending.pop(s.session_id, None)
        if peer_gone:
            # Routine: a liveness probe (a second service, dbr run) or a process that
            # exited or exec'd during the handshake (a shell script's every command).
            log.debug("agent connection from pid %d left during the handshake: %s", s.pid, why)
            self.events.publish("client-refused", pid=s.pid, uid=s.uid, reason=why,
                                peer_gone=True)
            return
        log.warning("agent connection from pid %d uid %d refused: %s", s.pid, s.uid, why)
        self.events.publish("client-refused", pid=s.pid, uid=s.uid, reason=why, peer_gone=False)

    def session_ended(self, s: ClientSession, leftover: list | None = None) -> None:
        """Session thread: the client left; ``leftover`` are samples of its open window."""
        if leftover:
            # The open window counts towards the after-first-patch figures like any
            # other (a short client's last window is often the only one after its patch).
            snap = self._snap
            s.split_window(leftover, snap.started if snap is not None else time.monotonic())
            agg = SampleAggregator(attribute=self.attribute)
            agg.add(leftover)
            s.add_samples(collections.Counter(agg.ips.get(s.pid, {})), agg.per_thread(s.pid))
        with self.lock:
            self.sessions.pop(s.session_id, None)
            self.history.append(s)
        log.info("client pid %d left: %s", s.pid, s.close_reason)
        self.events.publish("client-left", pid=s.pid, session=s.session_id,
                            reason=s.close_reason, samples=s.samples_total)
        self._wake()
        self._count_run(s)   # last: it may wait for the process to end

    def _count_run(self, s: ClientSession) -> None:
        """Tell short_runs how the run of an ended session's process went (not that of a
        session the service ended, a process that lives on, or a fork child of a client
        of the same program: shortruns.py)."""
        if self.stopping or not s.exe_key or s.close_reason == "service shutting down":
            return
        life = time.monotonic() - s.started_mono
        # The agent's BYE (its destructor) and the end of the connection come while the
        # process is still exiting: it is given a moment to end.  One that lives on had
        # its agent step aside, or exec'd: not the end of a run.
        deadline = time.monotonic() + RUN_END_WAIT_S
        while process_lives(s.pid, s.started_boot):
            if time.monotonic() >= deadline:
                return
            time.sleep(0.005)
        with self.lock:
            parent = next((x for x in list(self.sessions.values()) + list(self.history)
                           if x.pid == s.ppid and x.exe_key == s.exe_key), None)
        if parent is not None:
            return
        self.short_runs.ended(s.exe_key, s.exe, life, installed=s.first_patch_mono is not None)

    def find_client(self, pid: int) -> ClientSession | None:
        """The live session of ``pid``, else its most recent ended one."""
        with self.lock:
            for s in self.sessions.values():
                if s.pid == pid:
                    return s
            for s in reversed(self.history):
                if s.pid == pid:
                    return s
        return None

    def live_sessions(self) -> list[ClientSession]:
        with self.lock:
            return [s for s in self.sessions.values() if s.state is SessionState.CONNECTED]

    # ------------------------------------------------------------------ sampling
    def sampling_status(self) -> dict[str, Any]:
        return {"configured": self.config.sampling_source, "active": self.source_kind,
                "capabilities": self.capabilities,
                "continuous": self.config.continuous_sampling,
                "interval_s": self.config.snapshot_interval_s,
                "window_s": self.config.snapshot_window_s,
                "period_us": self.config.sample_period_us}

    def _make_source(self, s: ClientSession):
        """Session thread: the sampling source for one client (perf, else agent timer)."""
        cfg = self.config
        kind = s.forced_source or self.source_kind
        if kind.startswith("perf-"):
            try:
                return make_perf_source(s, cfg, kind)
            except SamplingError as exc:
                if cfg.sampling_source != "auto":
                    raise
                log.warning("pid %d: perf refused (%s); using the agent timer", s.pid, exc)
                s.thread_notices(False)   # asked for the perf source; the agent's timer
                s.forced_source = "agent-timer"   # samples new threads on its own
                self.events.publish("sampling-fallback", pid=s.pid, reason=str(exc))
        return make_agent_timer_source(s, cfg)

    def _snapshot_tick(self, now: float) -> None:
        self.short_runs.expire()
        snap = self._snap
        if snap is None:
            if now >= self._next_snapshot and not self.paused and not self.stopping:
                self._begin_snapshot(now)
            return
        if snap.phase == "sampling" and now >= snap.end_at:
            self._end_snapshot(now)
        elif snap.phase == "collecting":
            done = all(f.done() for f in snap.collecting.values())
            if done or now >= snap.collect_deadline:
                self._finish_snapshot()

    def _begin_snapshot(self, now: float) -> None:
        cfg = self.config
        window = cfg.snapshot_interval_s if cfg.continuous_sampling else cfg.snapshot_window_s
        snap = Snapshot(gen=self.snapshot_count + 1, started=now, end_at=now + window)
        for s in self.live_sessions():
            if s.paused or self._resting(s, now) or self._speed_checking(s):
                continue
            if now - s.started_mono < cfg.min_client_age_s:
                # Young: a program that ends within min_client_age_s could not gain
                # from replacement code; it is sampled from its first snapshot after.
                # Its age counts from its start, not its connection: under the hint an
                # agent connects only once its program is that old.
                if not s.samples_total:
                    s.region_status = (f"not sampled yet: younger than min_client_age_s "
                                       f"({cfg.min_client_age_s:g} s)")
                continue
            if cfg.continuous_sampling and s.source is not None:
                snap.begun[s.session_id] = None  # already sampling
                # quiet since short-lived threads, or switch rates to look at again
                s.post(s.catch_up_threads)
                continue
            snap.begun[s.session_id] = s.post(lambda s=s: s.begin_window(self._make_source))
        self._snap = snap
        self._next_snapshot = now + cfg.snapshot_interval_s

    @staticmethod
    def _speed_checking(s: ClientSession) -> bool:
        """A speed check is under way (or about to start): no sampling window, whose
        samples would see its phases, and no new region while it measures."""
        return s.speed_check is not None or (s.speed_fut is not None and not s.speed_fut.done())

    def _speed_tick(self, now: float) -> None:
        """Start speed checks of regions that settled, and step the running ones
        (dbr_service/speedcheck.py); each step runs on the client's session thread."""
        cfg = self.config
        for s in self.live_sessions():
            if s.speed_fut is not None and not s.speed_fut.done():
                continue
            chk = s.speed_check
            if chk is not None:
                if now >= chk.next_at:
                    self._speed_post(s, s.speed_step)
                continue
            if not cfg.speed_check or not cfg.patching or \
                    s.paused or self.paused or self.stopping:
                continue
            snap = self._snap
            in_window = snap is not None and s.session_id in snap.begun
            # a window of its own is let run to its end; a continuous one, never
            # ending, is closed for the check (not while it is being collected)
            if in_window and not (cfg.continuous_sampling and snap.phase == "sampling"):
                continue
            rids = s.speed_candidates(SETTLE_PHASES * cfg.speed_check_phase_s, now)
            if rids:
                if in_window:
                    del snap.begun[s.session_id]     # not collected at this snapshot
                self._speed_post(s, lambda s=s, rids=rids, close=in_window: s.speed_start(
                    rids, cfg.speed_check_pairs, cfg.speed_check_phase_s,
                    cfg.speed_check_margin, close_sampling=close))

    def _speed_post(self, s: ClientSession, fn: Callable[[], Any]) -> None:
        s.speed_fut = s.post(fn)
        s.speed_fut.add_done_callback(
            lambda f: self._task_failed(s, f, "speed check") if s.alive else None)

    def _resting(self, s: ClientSession, now: float) -> bool:
        """A quiet client skips snapshots until its own interval has passed, unless
        something changed for it since it was judged quiet (a dlopen, say)."""
        with s.lock:
            if s.quiet_snapshots < 1 or s.activity != s.activity_judged:
                return False
            due = s.last_window_mono + sampling_interval(self.config, s.quiet_snapshots)
        return due - now > self.config.snapshot_interval_s / 2

    def _judge_quiet(self, s: ClientSession, changed: bool) -> None:
        """After a client's snapshot (and its job, if one ran): quiet when it changed
        nothing; its sampling interval follows (scheduler.sampling_interval)."""
        with s.lock:
            act = s.activity
            quiet = not changed and act == s.activity_judged
            s.quiet_snapshots = s.quiet_snapshots + 1 if quiet else 0
            s.activity_judged = act
            before, s.sampling_interval_s = s.sampling_interval_s, sampling_interval(
                self.config, s.quiet_snapshots)
        if s.sampling_interval_s != before:
            self.events.publish("sampling-interval", pid=s.pid,
                                interval_s=s.sampling_interval_s, quiet=s.quiet_snapshots)

    def _end_snapshot(self, now: float) -> None:
        snap = self._snap
        keep = self.config.continuous_sampling
        for sid, fut in snap.begun.items():
            s = self.sessions.get(sid)
            if s is None:
                continue
            if fut is not None and fut.done() and fut.exception() is not None:
                self._sampling_failed(s, fut.exception())
                continue
            snap.collecting[sid] = s.post(lambda s=s: s.end_window(keep_open=keep))
        snap.phase = "collecting"
        snap.collect_deadline = now + 1.0

    def _sampling_failed(self, s: ClientSession, exc: BaseException) -> None:
        if not s.alive:
            return  # the client left during the window: not a sampling failure
        msg = f"sampling failed: {exc}"
        if not s.errors or s.errors[-1] != msg:
            s.errors.append(msg)
            log.warning("pid %d: %s", s.pid, msg)
            self.events.publish("error", pid=s.pid, message=msg)

    def _finish_snapshot(self) -> None:
        """Aggregate the window by (client, IP) and hand the hottest clients to workers."""
        snap, self._snap = self._snap, None
        self.snapshot_count += 1
        self._by_pid = {x.pid: x for x in self.live_sessions()}  # for attribute()
        agg = SampleAggregator(attribute=self.attribute)
        agg.start_window()
        done: list[ClientSession] = []
        for sid, fut in snap.collecting.items():
            s = self._session_by_id(sid)
            if s is None or not fut.done():
                continue
            if fut.exception() is not None:
                self._sampling_failed(s, fut.exception())
                continue
            samples = fut.result()
            raw, _ = s.split_window(samples, snap.started)  # before attribution
            if s.evaluator is not None and s.alive:
                s.post(lambda s=s, raw=raw: s.evaluate(raw))
            agg.add(samples)
            done.append(s)
        window = agg.end_window().aggregator
        jobs = []
        for s in done:
            counts = collections.Counter(window.ips.get(s.pid, {}))
            s.add_samples(counts, window.per_thread(s.pid))
            selection = s.selection_input()
            if counts and selection and s.alive and not s.paused:
                jobs.append(ClientJob(s.session_id, s.pid, s.exe, dict(counts),
                                      selection, list(s.maps), self.config.to_dict(),
                                      branches=window.branch_counts(s.pid),
                                      patched=s.patched_ranges(),
                                      quick=quick_job(s.jobs_done, bool(s.regions))))
        if jobs and not self.paused:
            queued = set(self.scheduler.schedule(jobs, self.config.max_workers))
            for s in done:
                if s.session_id in queued:
                    s.mark("first_job_queued")
        with_job = {j.session_id for j in jobs}
        for s in done:
            s.last_window_mono = snap.started
            if s.session_id not in with_job:
                self._judge_quiet(s, changed=False)   # nothing to select from
            # a queued job's client is judged when its job is done (_apply_result); one
            # left unqueued (every worker busy) is not judged this time
        self.notifier.status(self._status_line())

    def attribute(self, pid: int, ip: int) -> int:
        """Replacement-code address -> original address (the hook the aggregator
        calls), so hot spots and later selection see one program."""
        s = self._by_pid.get(pid)
        return ip if s is None else s.original_address(ip)

    def _session_by_id(self, sid: int) -> ClientSession | None:
        with self.lock:
            return self.sessions.get(sid) or next(
                (h for h in self.history if h.session_id == sid), None)

    # ------------------------------------------------------------------ results
    def _job_done(self, res: JobResult | BaseException, session_id: int) -> None:
        """Pool thread: hand the result to the control thread."""
        self.post(lambda: self._apply_result(res, session_id))

    def _apply_result(self, res: JobResult | BaseException, session_id: int) -> None:
        s = self._session_by_id(session_id)
        if s is None:
            return
        s.jobs_done += 1
        s.mark("first_job_done")
        if isinstance(res, BaseException):
            s.errors.append(f"worker job failed: {res!r}")
            self.events.publish("error", pid=s.pid, message=f"worker job failed: {res!r}")
            return
        s.hotspots = res.hotspots
        s.timeline.setdefault("first_job_worker_s", round(res.elapsed_s, 4))
        if res.regions is None and not s.alive and s.jobs_done > 1:
            return  # the client left while its last job ran: keep the earlier outcome
        s.region_status = res.region_status
        ids = [] if res.regions is None else [s.region_id(d["module"], d["entries"])
                                              for d in res.regions]
        with s.lock:
            # a region whose entries are all in code an installed region replaces is a
            # variant of it, not news (ClientSession.covered); nor is it installed
            news = [rid for rid, d in zip(ids, res.regions or [])
                    if not s.covered(rid, d["module"], d["entries"])]
            pending = self.config.patching and any(
                rid not in s.blocked_regions and (
                    rid not in s.regions or s.regions[rid].state is not RegionState.INSTALLED)
                for rid in news)
            # a client's first jobs (quick ones among them) see few samples: what they
            # do not find is no sign that nothing is left to find
            changed = pending or frozenset(news) != s.last_selected or \
                s.jobs_done <= QUICK_JOBS + 1
            s.last_selected = frozenset(news)
        self._judge_quiet(s, changed)
        if res.regions is not None:
            with s.lock:
                # with their history: live and removed regions, and those whose
                # installation failed (a job on the client's last window that selects
                # nothing must not erase why nothing was installed)
                keep = {k: r for k, r in s.regions.items()
                        if r.state in (RegionState.INSTALLED, RegionState.REMOVED)
                        or r.info.get("install_failures")}
                for rid, d in zip(ids, res.regions):
                    if rid not in keep:
                        keep[rid] = RegionRecord(rid, d["module"], d["entries"], d["blocks"],
                                                 d["code_bytes"], dot=d.get("dot"),
                                                 info={"pipeline_id": d["id"]})
                s.regions = keep
            if self.config.patching and res.srs and s.alive and not s.paused:
                fut = s.post(lambda s=s, srs=res.srs, ids=ids: s.install_selected(srs, ids))
                fut.add_done_callback(lambda f, s=s: self._task_failed(s, f, "installation"))
        self.events.publish("job-done", pid=s.pid, hotspots=len(res.hotspots),
                            regions=None if res.regions is None else len(res.regions),
                            status=res.region_status, elapsed_s=round(res.elapsed_s, 3))

    def _task_failed(self, s: ClientSession, fut, what: str) -> None:
        """A session-thread task's done callback: its exception, if any, becomes one of
        the client's errors and an ``error`` event."""
        exc = fut.exception()
        if exc is not None:
            msg = f"{what} failed: {exc!r}"
            s.errors.append(msg)
            self.events.publish("error", pid=s.pid, message=msg)

    # ------------------------------------------------------------------ operations
    def unpatch(self, s: ClientSession, region_id: str | None) -> int:
        """Remove the patches of one installed region (or all); regions removed.  What
        the operator took out stays out (that region, or every region of the client)
        until `dbr ctl resume PID` (ClientSession.operator_hold)."""
        with s.lock:
            if region_id is None:
                s.operator_hold_all = True
            else:
                s.operator_held.add(region_id)
        targets = [r.id for r in s.regions.values()
                   if r.state is RegionState.INSTALLED and (region_id in (None, r.id))]
        removed = 0
        for rid in targets:
            if s.call(lambda rid=rid: s.uninstall_region(rid, "operator"), timeout=6.0):
                removed += 1
        return removed

    def set_config(self, new: Config) -> None:
        with self.lock:
            old, self.config = self.config, new
            self.config_generation += 1
        if new.sampling_source != old.sampling_source:
            for s in self.live_sessions():
                s.forced_source = None
            self.source_kind = choose_source(new.sampling_source, self.capabilities)
        self.short_thread_programs.keep_s = new.short_thread_memory_s
        if new.log_level != old.log_level:
            logging.getLogger("dbr").setLevel(new.log_level.upper())
        if new.min_client_age_s != old.min_client_age_s and self._started:
            self.write_quiet_hint()
        elif self._started:
            self._configure_short_runs(quiet_hint_ms(new.min_client_age_s))
        changed = {k: v for k, v in new.to_dict().items() if old.to_dict()[k] != v}
        self.events.publish("config-changed", changed=changed)

    def reload(self) -> bool:
        """SIGHUP: load the configuration again; on error keep the old one (logged)."""
        self.notifier.reloading()
        try:
            new = self.sources.load()
            if new.effective_runtime_dir(self.sources.env) != self.runtime_dir:
                raise ConfigError("runtime_dir cannot change on reload (restart instead)")
        except ConfigError as exc:
            log.error("reload failed, keeping the old configuration: %s", exc)
            self.events.publish("error", message=f"reload failed: {exc}")
            self.notifier.ready(self._status_line())
            return False
        self.set_config(new)
        log.info("configuration reloaded (generation %d)", self.config_generation)
        self.notifier.ready(self._status_line())
        return True

    def _status_line(self) -> str:
        return (f"{len(self.sessions)} clients, {self.snapshot_count} snapshots, "
                f"sampling {self.source_kind}")

    # ------------------------------------------------------------------ shutdown
    def _shutdown(self) -> None:
        """BYE to every agent (revert per on_shutdown), stop threads, remove sockets."""
        self.stopping = True
        self.notifier.stopping()
        log.info("stopping: %s", self.stop_reason or "requested")
        revert = self.config.on_shutdown == "revert"
        with self.lock:
            sessions = list(self.sessions.values()) + list(self.pending.values())

        def farewell(s: ClientSession) -> None:
            s._close_source()
            s.conn.bye(revert=revert)
            s.stop("service shutting down")

        for s in sessions:
            s.post(lambda s=s: farewell(s))
            s.stop("service shutting down")
        # Everything below shares one bound: SIGTERM to exit stays under 2 s.
        deadline = time.monotonic() + 0.8
        for s in sessions:
            if s.thread is not None:
                s.thread.join(max(0.0, deadline - time.monotonic()))
        self.session_threads.close()
        self.scheduler.shutdown(timeout=1.0)
        self._release_sockets()
        self.notifier.close()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
        self.stopped.set()
        log.info("stopped")

    def _release_sockets(self) -> None:
        """Close and remove every socket this service bound (also after a failed start)."""
        if self._control is not None:
            if self._control.thread.is_alive():
                self._control.stop()
            else:
                self._control.sock.close(0)
        self.events.close()
        if self._listen is not None:
            self._listen.close()
            for name in (AGENT_SOCKET, CONTROL_SOCKET, EVENTS_SOCKET):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=self.dir_fd)
            with contextlib.suppress(OSError):   # not ours if it is not a file
                os.unlink(QUIET_FILE, dir_fd=self.dir_fd)
            self.short_runs.remove_stale()
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        if self.dir_fd >= 0:
            self.short_runs.dir_fd = None
            os.close(self.dir_fd)
            self.dir_fd = -1
