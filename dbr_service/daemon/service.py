"""The dbr service: sockets, agent sessions, sampling snapshots, scheduling, shutdown.

One :class:`Service` per host (or per `dbr run --embedded`).  Threads:

* the **control thread** (whoever calls :meth:`Service.run`): accepts agent
  connections, times snapshot windows, hands snapshots to the scheduler, applies
  worker results, sends systemd notifications, handles signals and reloads;
* one **session thread** per client (:mod:`dbr_service.session.clients`);
* the **control-socket thread** (:mod:`dbr_service.commands.control`);
* worker **processes** (:mod:`dbr_service.daemon.scheduler`).

The control thread never blocks on a client or a worker: work for a client is
posted to its session thread and collected through futures.
"""

from __future__ import annotations

import collections
import contextlib
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
from typing import Any, Protocol

import zmq

from dbr_service.wire import agentconn
from dbr_service.wire import protocol as P
from dbr_service.session.clients import ClientSession
from dbr_service.common.config import Config, ConfigSources
from dbr_service.common.errors import ConfigError, ServiceError
from dbr_service.common.events import EventBus
from dbr_service.daemon.notify import Notifier
from dbr_service.common.paths import AGENT_SOCKET, CONTROL_SOCKET, EVENTS_SOCKET, quiet_hint_ms
from dbr_service.common.clientfiles import remove_stale_perf_maps
from dbr_service.common.procfs import process_lives
from dbr_service.daemon.results import JobResults
from dbr_service.session.reuse import ReusedThreads
from dbr_service.daemon.runtime_dir import RuntimeDir
from dbr_service.sampling.aggregate import SampleAggregator
from dbr_service.common.states import RegionState, SessionState
from dbr_service.session.session_threads import ShortThreadPrograms
from dbr_service.daemon.shortruns import ShortRunPrograms
from dbr_service.daemon.snapshots import Snapshot, SnapshotCycle
from dbr_service.session.sources import choose_source, sampling_capabilities
from dbr_service.session.budget import client_cpu_s
from dbr_service.daemon.scheduler import Scheduler
from dbr_service.profiles.warmstart import WarmStart

log = logging.getLogger("dbr.service")

#: Longest sleep of the control loop when nothing is due: every wake-up costs (1.7 ms
#: of CPU a wake-up from poll() on the 2-core development VM), and everything that
#: needs the loop sooner wakes it (connections, posted tasks, collected windows,
#: signals) or is a deadline of its own (snapshots, speed checks, the watchdog).
LOOP_WAIT_MAX_S = 1.0

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


class ControlEndpoint(Protocol):
    """What the service needs of its control-socket server (control.ControlServer):
    it is started with the service and stopped, or its socket closed, at the end."""

    thread: threading.Thread
    sock: Any

    def start(self) -> None: ...

    def stop(self) -> None: ...


#: Makes the control-socket server of a service: (service, zmq context, socket path).
#: The control layer sits above the service, so whoever starts a service hands it in
#: (control.ControlServer).
ControlFactory = Callable[["Service", zmq.Context, str], ControlEndpoint]


# --------------------------------------------------------------------------- service
class Service(RuntimeDir, SnapshotCycle, JobResults):
    """See the module docstring."""

    def __init__(self, sources: ConfigSources, *, control_server: ControlFactory,
                 embedded: bool = False,
                 notifier: Notifier | None = None,
                 agent_listener: socket.socket | None = None,
                 warm_delay_s: float = 0.0) -> None:
        """``control_server``: makes the control-socket server (control.ControlServer).
        ``agent_listener``: an agent socket already bound and listening in this
        service's runtime dir (`dbr run` binds it before PROG starts, so PROG's agent
        connects at once while the service is still starting; the runtime dir is then
        private to this service and is not probed for another one).  ``warm_delay_s``:
        start the worker pool only after this long (see :meth:`Scheduler.warm`)."""
        self.sources = sources
        self._control_server = control_server
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
        #: The profile store and warm start (profiles/warmstart.py); None: warm_start off, or
        #: the store could not be opened.
        self.warm: WarmStart | None = None
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
        #: The control thread's CPU time (time.thread_time) at the last snapshot.
        self._control_cpu_mark = 0.0
        self._next_snapshot = 0.0
        self._listen: socket.socket | None = None
        self._ctx: zmq.Context | None = None
        self._control: ControlEndpoint | None = None
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
        self.warm = self.open_warm_start()
        self._ctx = zmq.Context()
        self._control = self._control_server(self, self._ctx, self.path(CONTROL_SOCKET))
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

    # ------------------------------------------------------------------ run
    def run(self) -> None:
        """The control thread's loop, until :meth:`request_stop`; then shut down."""
        if not self._started:
            self.start()
        self._control_cpu_mark = time.thread_time()   # this thread's; start-up is no client's
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
        ready = {fd for fd, _ in p.poll(int(min(LOOP_WAIT_MAX_S, max(0.0, timeout)) * 1000
                                            + 0.999))}
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
        elif all(f.done() for f in snap.collecting.values()):
            t = now
        else:
            t = snap.collect_deadline   # each collected window wakes the loop
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
            return
        warm = self.warm
        if warm is not None and not self.paused and warm.is_warm(s):
            s.refresh_maps_now()
            res, how = warm.kept_selection(s)
            if res is not None:
                self.post(lambda: self.apply_reused_selection(s, res, how))
                return
            selection, settings = warm.job_input(s)
            if selection:
                self.post(lambda: self.start_warm_job(s, selection, settings))

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
        # the client's last CPU figures, for its report (a zombie's are still there)
        s.cpu_budget.observe(time.monotonic(), client_cpu_s(s.pid),
                             s.session_cpu_s + s.control_cpu_s)
        with self.lock:
            self.sessions.pop(s.session_id, None)
            self.history.append(s)
        log.info("client pid %d left: %s", s.pid, s.close_reason)
        self.events.publish("client-left", pid=s.pid, session=s.session_id,
                            reason=s.close_reason, samples=s.samples_total)
        self._wake()
        warm = self.warm.record(s) if self.warm is not None else False
        self._count_run(s, warm)   # it may wait for the process to end
        if warm and s.exe_key:     # after short_runs, which may remove a late birth's file
            self.warm.write_hint(s.exe_key, self.dir_fd)

    def _count_run(self, s: ClientSession, warm: bool = False) -> None:
        """Tell short_runs how the run of an ended session's process went (not that of a
        session the service ended, a process that lives on, or a fork child of a client
        of the same program: daemon/shortruns.py)."""
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
        # a warm program gains from its first ms: it is not born late
        self.short_runs.ended(s.exe_key, s.exe, life,
                              installed=warm or s.first_patch_mono is not None)

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

    # ------------------------------------------------------------------ operations
    def unpatch(self, s: ClientSession, region_id: str | None) -> int:
        """Remove the patches of one installed region (or all); regions removed.  What
        the operator took out stays out (that region, or every region of the client)
        until `dbr ctl resume PID` (RegionBook.operator_held, operator_hold_all)."""
        with s.lock:
            if region_id is None:
                s.region_book.operator_hold_all = True
            else:
                s.region_book.operator_held.add(region_id)
        targets = [r.id for r in s.region_book.regions.values()
                   if r.state is RegionState.INSTALLED and (region_id in (None, r.id))]
        removed = 0
        for rid in targets:
            if s.call(lambda rid=rid: s.uninstall_region(rid, "operator"), timeout=6.0):
                removed += 1
        return removed

    def detach(self, s: ClientSession) -> int:
        """`dbr detach`: remove every region of ``s`` (threads evicted as for `dbr ctl
        unpatch`), then end its session with BYE dormant: the agent reverts whatever is
        left, stops sampling and waits for `dbr attach`.  Regions removed."""
        removed = self.unpatch(s, None)

        def farewell() -> None:
            s._close_source()
            s.conn.bye(revert=True, dormant=True)
            s.stop("detached (dbr detach)")

        s.call(farewell, timeout=6.0)
        if s.thread is not None:
            s.thread.join(5.0)
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
            s.probes_remove_all("the service detached")   # probes never outlive it
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
        if self.warm is not None:
            self.warm.close()
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
