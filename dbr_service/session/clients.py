"""Agent sessions: one :class:`ClientSession` (and one thread) per connected client.

The session thread is the only reader of its :class:`AgentConnection` ("one reader at
a time"): it runs the handshake, answers MAP_CHANGED with ACK at once, tracks the
client's threads and memory map, and executes commands posted by other threads
(sampling windows, unpatch, BYE) between messages, so the control thread never waits
on a client.  A client that exits, crashes or sends garbage ends only its own session.
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import select
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol

from dbr_service.wire import protocol as P
from dbr_service.wire.agentconn import AgentConnection, Received
from dbr_service.session.cadence import SessionCadence
from dbr_service.common.clientfiles import USER_TOP, PerfMap, ProcHandle, safe_text
from dbr_service.installation.jitdump import JitDump
from dbr_service.common.errors import AgentError, ProtocolError
from dbr_service.common.paths import program_key
from dbr_service.common.procfs import started_boottime, started_monotonic
from dbr_service.common.procmaps import MapEntry, parse_maps
from dbr_service.session.reuse import Job
from dbr_service.session.budget import CpuBudget
from dbr_service.installation.install import Installer
from dbr_service.installation.optimize import Evaluator
from dbr_service.session.probes import SessionProbes
from dbr_service.session.session_counting import SessionCounting
from dbr_service.session.session_views import SessionViews
from dbr_service.session.session_regions import RegionBook, SessionRegions
from dbr_service.session.session_sampling import SessionSampling
from dbr_service.session.session_speed import SPEED_CHECKS_KEPT, SessionSpeedChecks
from dbr_service.session.session_threads import ThreadTracker
from dbr_service.installation.speedcheck import SpeedCheck
from dbr_service.common.states import SessionState

if TYPE_CHECKING:  # pragma: no cover
    from dbr_service.common.config import Config
    from dbr_service.common.events import EventBus
    from dbr_service.session.reuse import ReusedThreads
    from dbr_service.sampling.base import SamplingSource
    from dbr_service.session.session_threads import ShortThreadPrograms

log = logging.getLogger("dbr.clients")

# Replies that may arrive late, after their request timed out: dropped, not fatal.
_LATE_REPLIES = {P.MsgType.ACK, P.MsgType.CODE_BUFFER, P.MsgType.PATCH_RESULT,
                 P.MsgType.PC_CENSUS, P.MsgType.SAMPLER_RING}
#: Map changes that add or remove code (a munmap or mprotect of data is no news;
#: one that touches installed code removes regions, which counts by itself).
_CODE_MAP_KINDS = {int(P.MapKind.DLOPEN), int(P.MapKind.DLCLOSE), int(P.MapKind.MMAP_EXEC)}
_MAP_KINDS = {int(k) for k in P.MapKind}
#: MAP_CHANGED rereads /proc/PID/maps at most this often; a burst's last change is
#: read when the interval is over (the session loop), so the map is never left stale.
MAPS_REREAD_S = 0.02
#: How often the session loop checks that the process that connected still exists (a
#: socket handed to another process outlives it; its pid may be another's by then).
ALIVE_CHECK_S = 1.0
#: Longest text kept of an error or a close reason (after escaping).
NOTE_MAX = 400


# --------------------------------------------------------------------------- session
class SessionHost(Protocol):
    """What a session needs of the service that runs it (service.Service): its
    configuration, events and session threads, and to be told when the session
    starts, is refused or ends.  The session never imports the service."""

    config: Config
    events: EventBus
    session_threads: ReusedThreads
    short_thread_programs: ShortThreadPrograms

    def session_started(self, s: ClientSession) -> None: ...

    def session_refused(self, s: ClientSession, why: str, peer_gone: bool = False) -> None: ...

    def session_ended(self, s: ClientSession, leftover: list | None = None) -> None: ...


class _Notes(collections.deque):
    """A session's error notes: each made printable and bounded (agents' texts end
    up here, and from here in the log and `dbr ctl clients`)."""

    def append(self, x: Any) -> None:
        super().append(safe_text(str(x), NOTE_MAX))


#: Snapshots region selection sees with hot text (else 4): a flat profile's functions
#: of 0.05 % of the samples need a few thousand of them to be seen at all.
HOT_TEXT_SNAPSHOTS = 24


class ClientSession(SessionSampling, SessionRegions, SessionSpeedChecks, SessionProbes,
                    SessionCounting, SessionViews):
    """One agent session: the connection, the client's threads, map, samples and regions.

    Fields written by the session thread are read by other threads without a lock
    (single attribute reads); compound updates hold ``self.lock``.
    """

    def __init__(self, service: SessionHost, conn: AgentConnection, session_id: int) -> None:
        self.service = service
        self.conn = conn
        self.session_id = session_id
        self.pid = conn.peer_pid
        self.uid = conn.peer_uid
        self.ppid = 0
        self.exe = ""
        self.build_id = ""
        self.hello_flags = 0
        self.state = SessionState.HANDSHAKE
        self._close_reason = ""
        #: The exe the agent claimed (escaped), and whether the kernel's differs; ``exe``
        #: is the kernel's where /proc tells it.
        self.exe_claimed = ""
        self.exe_mismatch = False
        #: MAP_CHANGED ranges or kinds out of bounds: refused (nothing done for them),
        #: counted here (foreign THREAD_NEW tids: thread_tracker.foreign_tids).
        self.map_changes_refused = 0
        self.connected_at = time.time()
        self.connected_mono = time.monotonic()
        #: Its starttime (procfs.started_boottime: the process's identity beside its pid)
        #: and its executable's key (paths.program_key; daemon/shortruns.py), "" if unknown.
        self.started_boot = started_boottime(f"/proc/{self.pid}/stat") if self.pid > 0 \
            else None
        self.exe_key = ""
        #: When the process started (monotonic clock), for min_client_age_s: an agent
        #: under the service's hint connects only once its program is that old
        #: (dbr_agent/agent.c, "born when the service would look").  The connection's
        #: time if /proc cannot tell (a FakeAgent's made-up pid).
        started = started_monotonic(self.pid, self.started_boot) \
            if self.started_boot is not None else None
        self.started_mono = min(started, self.connected_mono) if started is not None \
            else self.connected_mono
        self.ended_at: float | None = None
        self.lock = threading.RLock()
        self.maps: list[MapEntry] = []
        self.map_changes = 0
        self.paused = False
        #: Samples per IP, cumulative.
        self.ip_counts: collections.Counter[int] = collections.Counter()
        #: Samples per thread id, cumulative.
        self.thread_samples: collections.Counter[int] = collections.Counter()
        self.samples_total = 0
        self.snapshots = 0
        #: Hot spots from the last finished worker job (list of dicts, hottest first).
        self.hotspots: list[dict[str, Any]] = []
        #: The regions known for it, and those not to install (session/session_regions.py).
        self.region_book = RegionBook(self.lock)
        self.region_status = "no job run yet"
        self.patches_installed = 0
        self.patches_removed = 0
        #: Regions that went live (patched, or entered by a thread moved in).
        self.regions_went_live = 0
        self.first_patch_mono: float | None = None
        self.samples_after_first_patch = 0
        self.samples_in_replacement = 0
        self.jobs_done = 0
        #: How often it is sampled and gets a region job (session/cadence.py).
        self.cadence = SessionCadence()
        #: The service's CPU spent on this client against its own (budget.CpuBudget);
        #: ``session_cpu_s`` is this session thread's CPU time so far, ``control_cpu_s``
        #: its share of the control thread's (snapshots.SnapshotCycle._finish_snapshot).
        self.cpu_budget = CpuBudget(self.started_mono, service.config.service_cpu_window_s)
        self.session_cpu_s = 0.0
        self.control_cpu_s = 0.0
        self.errors: collections.deque[str] = _Notes(maxlen=20)
        self.source: SamplingSource | None = None
        self.source_name = ""
        #: Installation of replacement code (session thread only; created on first use).
        self.installer: Installer | None = None
        self.evaluator: Evaluator | None = None
        #: Raw sample IPs outside replacement code, one Counter per recent snapshot:
        #: what region selection sees (old samples of code already optimized fade out);
        #: hot text, after functions too rare for a few windows, keeps more of them.
        self.recent: collections.deque[collections.Counter[int]] = collections.deque(
            maxlen=HOT_TEXT_SNAPSHOTS if service.config.hot_text else 4)
        #: The speed check under way (dbr_service/installation/speedcheck.py), its finished ones,
        #: and original code a region was found slower than: (module, lo, hi).
        self.speed_check: SpeedCheck | None = None
        #: The last job's selection (SRs, region ids) that came during a speed check:
        #: installed when the check ends (install_selected).
        self.install_after_check: tuple[list, list[str]] | None = None
        self.speed_checks: collections.deque[dict[str, Any]] = collections.deque(
            maxlen=SPEED_CHECKS_KEPT)
        self.slow_ranges: list[tuple[str, int, int]] = []
        #: The running check's counting trampolines, and the data buffers of every
        #: counter handed out (dbr_service/installation/progress_points.py).
        self.speed_points: Any = None
        self.counter_space: Any = None
        self.probes: dict[int, Any] = {}       # dbr_service/session/probes.py
        self.probe_rings: list[Any] = []
        #: The last speed-check command posted (control thread).
        self.speed_fut: Future | None = None
        self._perf_map: PerfMap | None = None
        self._jitdump: JitDump | None = None
        self._where_names: dict[str, str] = {}    # region id -> named entry (_where)
        self._maps_due = 0.0     # monotonic s a deferred maps reread is due (0: none)
        self._maps_read = 0.0    # monotonic s of the last reread
        self._alive_look = time.monotonic()
        #: Seconds from connection to the first occurrence of each step of the cycle.
        self.timeline: dict[str, float] = {}
        #: Source this client must use (set when perf was refused for it).
        self.forced_source: str | None = None
        self._commands: queue.Queue[tuple[Callable[[], Any], Future]] = queue.Queue()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._wake_lock = threading.Lock()  # the pipe closes at the end: no write after
        self._stop = False
        #: The session's thread, one the service kept from an earlier session if it
        #: could (dbr_service/session/reuse.py: a thread's birth costs the client).
        self.thread: Job | None = None
        #: /proc/PID of the process that connected, held open (clientfiles.ProcHandle).
        self.proc = ProcHandle(self.pid)
        #: The client's threads, thread notices and gated timers (session/session_threads.py).
        self.thread_tracker = ThreadTracker(
            self.pid, self.proc, conn, self.lock, self.errors, service.short_thread_programs,
            service.config.perf_max_switch_rate, lambda: self.source, self._queue_command)
        conn.on_unsolicited = self._on_unsolicited

    @property
    def close_reason(self) -> str:
        return self._close_reason

    @close_reason.setter
    def close_reason(self, text: str) -> None:
        self._close_reason = safe_text(text, NOTE_MAX)

    # ------------------------------------------------------------------ control
    def start(self) -> None:
        self.thread = self.service.session_threads.run(
            self._main, name=f"dbr-session-{self.session_id}")

    def post(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn`` on the session thread (the connection's only reader); a Future."""
        fut: Future = Future()
        if self.state is SessionState.CLOSED:
            fut.set_exception(AgentError(f"session of pid {self.pid} is closed"))
            return fut
        self._commands.put((fn, fut))
        self._wake()
        return fut

    def call(self, fn: Callable[[], Any], timeout: float = 5.0) -> Any:
        """``post`` and wait (bounded) for the result."""
        return self.post(fn).result(timeout)

    def stop(self, reason: str = "stopped") -> None:
        """Ask the session thread to end (it closes the connection)."""
        if not self.close_reason:
            self.close_reason = reason
        self._stop = True
        self._wake()

    def _queue_command(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` as the session thread's next command, nobody waiting on it."""
        self._commands.put((fn, Future()))
        self._wake()

    def _wake(self) -> None:
        with self._wake_lock:
            if self._wake_w < 0:
                return
            try:
                os.write(self._wake_w, b"x")
            except OSError:
                pass  # full: the thread is awake anyway

    @property
    def alive(self) -> bool:
        return self.state is not SessionState.CLOSED

    # ------------------------------------------------------------------ thread
    def _main(self) -> None:
        svc = self.service
        self._cpu0 = time.thread_time()   # the thread is reused: this session's share
        try:
            self._handshake()
        except Exception as exc:   # a bug too: the session must not stay pending
            if not isinstance(exc, (AgentError, ProtocolError, OSError)):
                log.exception("session %d (pid %d): handshake failed", self.session_id,
                              self.pid)
            why = safe_text(str(exc), NOTE_MAX)
            self.close_reason = f"refused: {why}"
            self._finish()
            # A peer that hung up before the handshake ended exited or exec'd meanwhile
            # (every short command a shell script runs under dbr), or was a probe.
            gone = isinstance(exc.__cause__, (BrokenPipeError, ConnectionResetError)) \
                or "closed the session" in str(exc)
            svc.session_refused(self, why, peer_gone=gone)
            return
        self.state = SessionState.CONNECTED
        svc.session_started(self)
        try:
            self._loop()
        except ProtocolError as exc:
            self.close_reason = self.close_reason or f"protocol error: {exc}"
            self.conn.error(P.Result.E_PROTO, str(exc)[:100])
        except (AgentError, OSError) as exc:
            self.close_reason = self.close_reason or f"disconnected: {exc}"
        except Exception as exc:  # a bug must end this session only
            log.exception("session %d (pid %d) failed", self.session_id, self.pid)
            self.close_reason = self.close_reason or f"internal error: {exc!r}"
        try:
            leftover = self._drain_source()
        except Exception:
            log.exception("session %d (pid %d): last samples lost", self.session_id, self.pid)
            leftover = []
        self._finish()
        svc.session_ended(self, leftover)

    def _handshake(self) -> None:
        cfg = self.service.config
        hello = self.conn.handshake(
            service_pid=os.getpid(), session_id=self.session_id,
            on_disconnect=P.DISCONNECT_REVERT if cfg.on_disconnect == "revert"
            else P.DISCONNECT_KEEP,
            map_wait_ms=cfg.map_wait_ms, timeout=2.0)
        why = P.hello_problem(hello)
        if why:
            self.conn.error(P.Result.E_INVAL, why, 0)
            raise ProtocolError(f"HELLO: {why}")
        kernel_ppid = self.proc.ppid()
        self.ppid = hello.ppid if kernel_ppid is None else kernel_ppid
        self._check_exe(bytes(hello.exe))
        self.build_id = bytes(hello.build_id[: hello.build_id_len]).hex()
        self.hello_flags = hello.flags
        self.thread_tracker.hello(self.exe, self.build_id, hello.flags)
        st = self.proc.exe_stat()     # None: another user's process, unless root
        if st is not None:
            self.exe_key = program_key(st)
        self.thread_tracker.refresh()
        # The memory map is read when the first sampling window opens (begin_window):
        # a client that ends before (min_client_age_s) never costs a parse of it.

    def _check_exe(self, claimed: bytes) -> None:
        """``exe`` is the kernel's path where /proc tells it, else the claimed one; both
        escaped.  A claim that is not the kernel's path is flagged (a path longer than
        the agent can send matches by its start; a deleted file's " (deleted)" too)."""
        self.exe_claimed = safe_text(claimed)
        kernel = self.proc.exe()
        if kernel is None:
            self.exe = self.exe_claimed
            return
        self.exe = safe_text(kernel)
        real = os.fsencode(kernel)
        same = claimed == real or (len(claimed) >= P.EXE_MAX - 1 and real.startswith(claimed)) \
            or (real.endswith(b" (deleted)") and claimed == real[:-len(b" (deleted)")])
        if not same:
            self.exe_mismatch = True
            self.errors.append(f"the agent claims exe {self.exe_claimed}, the kernel says "
                               f"{self.exe}")
            log.warning("pid %d claims exe %s; the kernel says %s", self.pid,
                        self.exe_claimed, self.exe)

    def _loop(self) -> None:
        sock_fd = self.conn.fileno()
        poller = select.poll()   # not select: descriptors above FD_SETSIZE on a busy host
        poller.register(sock_fd, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        while True:
            self._run_commands()  # also after stop(): a posted farewell (BYE) still runs
            self.session_cpu_s = time.thread_time() - self._cpu0
            if self._stop:
                break
            now = time.monotonic()
            if self._maps_due and now >= self._maps_due:
                self._refresh_maps()
            wait = 1.0 if not self._maps_due else max(0.0, self._maps_due - now)
            ready = {fd for fd, _ in poller.poll(int(min(wait, ALIVE_CHECK_S) * 1000 + 0.999))}
            if self._wake_r in ready:
                try:
                    os.read(self._wake_r, 4096)
                except BlockingIOError:
                    pass
            if sock_fd in ready:
                rec = self.conn.recv(0)
                if rec is not None:
                    self._handle(rec)
            elif self._process_gone(time.monotonic()):
                self.close_reason = self.close_reason or "the process ended"
                break

    def _process_gone(self, now: float) -> bool:
        """Whether the process that connected has ended while its socket, held by
        another process, stays open (looked at every ALIVE_CHECK_S, when nothing is
        to be read: an ended process's own socket reads EOF, its BYE first)."""
        if not self.proc.opened or now - self._alive_look < ALIVE_CHECK_S:
            return False
        self._alive_look = now
        return not self.proc.alive()

    def _run_commands(self) -> None:
        while True:
            try:
                fn, fut = self._commands.get_nowait()
            except queue.Empty:
                return
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as exc:  # delivered to the caller
                fut.set_exception(exc)
                if isinstance(exc, (AgentError, ProtocolError)) and self.conn.closed:
                    raise

    def _finish(self) -> None:
        self.probes_closed(self.close_reason or "the session ended")
        try:
            # while the counters' buffers are mapped, and before the session shows as
            # closed (a report taken then has the last counts)
            self.counting_final()
        except Exception:   # the records miss their last counts; the session still ends
            log.exception("session %d (pid %d): last counts not read", self.session_id,
                          self.pid)
        self.state = SessionState.CLOSED
        self.ended_at = time.time()
        try:
            self._close_source()
        except Exception:   # every descriptor below is closed all the same
            log.exception("session %d (pid %d): closing its source failed",
                          self.session_id, self.pid)
        self.conn.close()
        if self._perf_map is not None:
            self._perf_map.close()
        if self._jitdump is not None:
            self._jitdump.close()
        self.proc.close()
        while True:  # fail whatever is still queued
            try:
                _, fut = self._commands.get_nowait()
            except queue.Empty:
                break
            if fut.set_running_or_notify_cancel():
                fut.set_exception(AgentError(f"session of pid {self.pid} ended"))
        with self._wake_lock:
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._wake_r = self._wake_w = -1

    # ------------------------------------------------------------------ messages
    def _on_unsolicited(self, rec: Received) -> None:
        """Messages that arrive while a request waits: handled at once (MAP_CHANGED
        must be ACKed promptly, the agent is waiting)."""
        self.conn.inbox.clear()
        self._handle(rec)

    def _handle(self, rec: Received) -> None:
        t = rec.type
        # No message handled here keeps a descriptor (a late reply's is not used).
        for fd in rec.fds:
            os.close(fd)
        rec.fds.clear()
        if t in (P.MsgType.THREAD_NEW, P.MsgType.THREAD_EXIT):
            self.thread_tracker.notice(t, rec.msg.body.tid)
        elif t is P.MsgType.MAP_CHANGED:
            body = rec.msg.body
            lo, hi, req_id, kind = body.lo, min(body.hi, USER_TOP), body.req_id, int(body.kind)
            if kind not in _MAP_KINDS or not lo < hi:
                # nothing in user space, or no kind the agent sends: nothing done
                with self.lock:
                    self.map_changes_refused += 1
                log.debug("pid %d: MAP_CHANGED kind %d [%#x, %#x) refused", self.pid, kind,
                          body.lo, body.hi)
                if req_id:
                    self.conn.ack(req_id, P.Result.E_INVAL)
                return
            if self.source is None and self.installer is None and not self.snapshots:
                # Never sampled yet (a young client loading its libraries): the map is
                # read when its first window opens; nothing here would use it before.
                self.map_changes += 1
            else:
                self._refresh_maps(soon=True)
            if self.installer is not None and self.installer.affected_by(lo, hi):
                # Unpatching needs requests of its own: never from inside another
                # request's wait (its reply could be taken for ours), so it runs as the
                # next command of this thread; the agent waits (bounded) for the ACK.
                self._commands.put((lambda: self._map_changed(lo, hi, req_id), Future()))
                self._wake()
            elif req_id:
                self.conn.ack(req_id, P.Result.OK)
            if kind in _CODE_MAP_KINDS:
                with self.lock:
                    self.cadence.activity += 1   # new or lost code: sample at the full rate again
            self.service.events.publish("map-changed", pid=self.pid, kind=kind, lo=lo, hi=hi)
        elif t is P.MsgType.BYE:
            self.close_reason = "agent said BYE"
            self._stop = True
        elif t is P.MsgType.ERROR:
            err = rec.msg.body
            raise AgentError(f"agent error {err.code}: {safe_text(err.msg, P.ERRMSG_MAX)}")
        elif t in _LATE_REPLIES:
            log.debug("pid %d: late %s dropped", self.pid, t.name)
        else:  # HELLO again, or a service-only type
            raise ProtocolError(f"unexpected {t.name} from the agent")

    def refresh_maps_now(self) -> None:
        """Session thread: reread the client's map now (a warm start's first job needs
        it before any sampling window has read it)."""
        self._refresh_maps()

    def _refresh_maps(self, soon: bool = False) -> None:
        """Reread the client's map.  ``soon`` (a MAP_CHANGED): not more often than
        MAPS_REREAD_S; a reread due later is done by the session loop (a client
        announcing changes in a loop costs the service no more than that)."""
        now = time.monotonic()
        if soon and now - self._maps_read < MAPS_REREAD_S:
            self._maps_due = self._maps_due or self._maps_read + MAPS_REREAD_S
            return
        self._maps_due, self._maps_read = 0.0, now
        text = self.proc.read(f"{self.proc.live_dir()}/maps", 256 << 20)
        if text is None:
            self.errors.append(f"cannot read maps of pid {self.pid}")
            return
        self.maps = parse_maps(text.decode(errors="replace"))
        self.map_changes += 1
        if self.installer is not None and self.installer.cfi is not None:
            self.installer.cfi.refresh()      # modules' biases: read the maps again

    # ------------------------------------------------------------------ replacement code
    def mark(self, step: str) -> None:
        """Record the first time ``step`` happened (report field ``timeline``)."""
        if step not in self.timeline:
            self.timeline[step] = round(time.monotonic() - self.connected_mono, 4)

    def _read_original(self, addr: int, n: int) -> bytes:
        fd = self.proc.open_mem()
        try:
            return os.pread(fd, n, addr)
        finally:
            os.close(fd)
