"""Agent sessions: one :class:`ClientSession` (and one thread) per connected client.

The session thread is the only reader of its :class:`AgentConnection` ("one reader at
a time"): it runs the handshake, answers MAP_CHANGED with ACK at once, tracks the
client's threads and memory map, and executes commands posted by other threads
(sampling windows, unpatch, BYE) between messages, so the control thread never waits
on a client.  A client that exits, crashes or sends garbage ends only its own session.
"""

from __future__ import annotations

import bisect
import collections
import enum
import logging
import mmap
import os
import queue
import select
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from dbr_service import protocol as P
from dbr_service.agentconn import (AgentConnection, CensusResult, CodeBufferHandle, Received,
                                   gather_census, result_name)
from dbr_service.clientfiles import (TID_MAX, USER_TOP, PerfMap, ProcHandle, ThreadCheck,
                                     code_buffer_problem, safe_text)
from dbr_service.errors import AgentError, MemoryViewError, ProtocolError, SamplingError
from dbr_service.paths import program_key
from dbr_service.procfs import proc_dir, started_boottime, started_monotonic
from dbr_service.reuse import Job
from dbr_service.sampling.perf import SwitchGate
from dbr_service.install import HELD, Installer, InstallState
from dbr_service.codegen.frames import CfiSource
from dbr_service.optimize import Evaluator, install_regions, region_extent
from dbr_service.speedcheck import CHECK_TRIES, ORIGINAL, SpeedCheck, read_progress

if TYPE_CHECKING:  # pragma: no cover
    from dbr_service.sampling.base import SamplingSource
    from dbr_service.service import Service

log = logging.getLogger("dbr.clients")

#: Notices are turned off for the rest of a window once this many announced threads
#: were short-lived (ended before the service could open their event, or within
#: SHORT_LIFE_S of their THREAD_NEW) and they are at least SHORT_THREADS_SHARE of the
#: threads announced in the window (ClientSession._quiet_if_short_lived).
SHORT_THREADS_MIN = 32
SHORT_THREADS_SHARE = 0.8
SHORT_LIFE_S = 0.01
#: How many programs whose threads were too short-lived to sample the service
#: remembers (config short_thread_memory_s: for how long), the least recently seen
#: forgotten first (ShortThreadPrograms).
SHORT_THREADS_PROGRAMS = 256
#: With continuous sampling, how often the switch rates of a client's threads are
#: looked at again (ClientSession.catch_up_threads).
GATE_LOOK_S = 1.0

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
#: Most census entries gathered from one census (PC_CENSUS ... CENSUS_MORE).
CENSUS_ENTRIES_MAX = 1 << 16
#: Longest text kept of an error or a close reason (after escaping).
NOTE_MAX = 400


# --------------------------------------------------------------------------- memory
class MapEntry(NamedTuple):
    """One line of /proc/PID/maps."""

    lo: int
    hi: int
    perms: str
    offset: int
    path: str

    @property
    def executable(self) -> bool:
        return "x" in self.perms


def read_maps(pid: int) -> list[MapEntry]:
    """Parse /proc/PID/maps (sorted by address); MemoryViewError if unreadable."""
    try:
        with open(f"{proc_dir(pid)}/maps") as fh:
            return parse_maps(fh.read())
    except OSError as exc:
        raise MemoryViewError(f"cannot read maps of pid {pid}: {exc}") from exc


def parse_maps(text: str) -> list[MapEntry]:
    out = []
    for line in text.splitlines():
        parts = line.split(None, 5)
        if len(parts) < 5:
            continue
        lo, _, hi = parts[0].partition("-")
        out.append(MapEntry(int(lo, 16), int(hi, 16), parts[1], int(parts[2], 16),
                            parts[5] if len(parts) > 5 else ""))
    return out


def find_mapping(maps: list[MapEntry], addr: int) -> MapEntry | None:
    """The mapping that contains ``addr`` (``maps`` sorted by address)."""
    k = bisect.bisect_right([m.lo for m in maps], addr) - 1
    if k >= 0 and maps[k].lo <= addr < maps[k].hi:
        return maps[k]
    return None


def module_base(maps: list[MapEntry], path: str) -> int:
    """Load base of a file mapping: lowest address of a mapping of ``path``."""
    return min((m.lo - m.offset for m in maps if m.path == path), default=0)


#: Installation attempts of one selected region before it is not tried again.
INSTALL_ATTEMPTS = 3


# --------------------------------------------------------------------------- regions
class RegionState(str, enum.Enum):
    """Lifecycle of a region in a client (checked where patches change)."""

    SELECTED = "selected"
    GENERATED = "generated"
    INSTALLED = "installed"
    REMOVED = "removed"


@dataclass
class RegionRecord:
    """A region known for one client, as the operator API and the report show it."""

    id: str
    module: str
    entries: list[int]
    blocks: int
    code_bytes: int
    state: RegionState = RegionState.SELECTED
    #: Patch sites of an installed region (protocol records), for unpatch.
    sites: list[Any] = field(default_factory=list)
    #: Graph of the region for `dbr ctl region --dot` (DOT text), if the pipeline gave one.
    dot: str | None = None
    #: Free-form details from the pipeline (loops, trip counts, ...).
    info: dict[str, Any] = field(default_factory=dict)
    #: Original code an installed region replaces ([lo, hi) byte ranges).
    orig_ranges: list[tuple[int, int]] = field(default_factory=list)
    #: When it went live (time.monotonic()); 0 if it never did.
    installed_mono: float = 0.0
    #: Not before this (time.monotonic()) is it a speed check's candidate: when its last
    #: check was abandoned (0: since it went live).
    recheck_mono: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "module": self.module, "entries": list(self.entries),
                "blocks": self.blocks, "code_bytes": self.code_bytes,
                "state": self.state.value, "info": self.info}


#: Speed checks whose summaries a client keeps (dbr ctl clients, the report).
SPEED_CHECKS_KEPT = 16

#: Evaluation moves threads into a live region (TRANSFER) when a window finds at
#: least this many of the region's samples, and this share of them, in its original code.
TRANSFER_MIN_SAMPLES = 2
TRANSFER_MIN_SHARE = 0.05


# --------------------------------------------------------------------------- session
class SessionState(str, enum.Enum):
    HANDSHAKE = "handshake"
    CONNECTED = "connected"
    CLOSED = "closed"


class ShortThreadPrograms:
    """Programs seen starting threads too short-lived to sample (a window whose notices
    were turned off early, ClientSession._quiet_if_short_lived), by (exe, build id).

    Each such window cost the program a system call per thread started and the service
    a wake-up per notice (churn: 280-1350 notices, 6-40 ms of the service's CPU, most of
    a window's cost), and taught nothing: the threads end before an event can be
    opened.  A program seen doing it is not asked for notices again for
    ``keep_s`` (config short_thread_memory_s; 0 remembers nothing); a long-lived
    thread it starts meanwhile is found in /proc/PID/task when the next window
    opens, as after a quiet.  Shared by the session threads."""

    def __init__(self, keep_s: float, max_programs: int = SHORT_THREADS_PROGRAMS) -> None:
        self.keep_s, self.max_programs = keep_s, max_programs
        self._seen: collections.OrderedDict[tuple[str, str], float] = collections.OrderedDict()
        self._lock = threading.Lock()

    def note(self, exe: str, build_id: str, now: float | None = None) -> None:
        if not exe or self.keep_s <= 0:
            return
        now = time.monotonic() if now is None else now
        with self._lock:
            self._seen[(exe, build_id)] = now
            self._seen.move_to_end((exe, build_id))
            while len(self._seen) > self.max_programs:
                self._seen.popitem(last=False)

    def known(self, exe: str, build_id: str, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        with self._lock:
            at = self._seen.get((exe, build_id))
            if at is None:
                return False
            if now - at > self.keep_s or self.keep_s <= 0:
                del self._seen[(exe, build_id)]
                return False
            return True


class _Notes(collections.deque):
    """A session's error notes: each made printable and bounded (agents' texts end
    up here, and from here in the log and `dbr ctl clients`)."""

    def append(self, x: Any) -> None:
        super().append(safe_text(str(x), NOTE_MAX))


class CheckedConnection:
    """The session's connection as the installer sees it.  The replies the service maps
    memory for or adds up (CODE_BUFFER, PC_CENSUS, TRANSFER_RESULT) are checked before
    they are used, and descriptors sent along with them are closed; everything else is
    the connection's own.  A reply that fails a check ends the session
    (``on_violation``): the agent lies about its own memory."""

    def __init__(self, conn: AgentConnection, proc: ProcHandle,
                 on_violation: Callable[[str], None]) -> None:
        self._conn, self._proc, self._on_violation = conn, proc, on_violation

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)

    def _violation(self, why: str) -> None:
        self._on_violation(why)
        raise ProtocolError(why)

    def code_buffer(self, near: int, size: int, timeout: float = 2.0) -> CodeBufferHandle:
        """Ask for a code buffer near ``near`` and map it here once it checks out
        (clientfiles.code_buffer_problem): a hostile size or fd is never mapped."""
        conn = self._conn
        rec = conn.request(P.MsgType.CODE_BUFFER_REQ,
                           P.CodeBufferReq(req_id=conn.next_id(), near=near, size=size),
                           timeout=timeout)
        cb: P.CodeBuffer = rec.msg.body  # type: ignore[assignment]
        fds, rec.fds = list(rec.fds), []
        try:
            if cb.result != P.Result.OK:
                raise AgentError(f"code buffer refused: {result_name(cb.result)}")
            why = (f"{len(fds)} fds, expected 1" if len(fds) != 1 else
                   f"buffer id {cb.buffer_id} in use" if cb.buffer_id in conn.buffers else
                   code_buffer_problem(self._proc, fds[0], cb.base, cb.size, size))
            if why:
                self._violation(f"CODE_BUFFER: {why}")
            try:
                mem = mmap.mmap(fds[0], cb.size, mmap.MAP_SHARED,
                                mmap.PROT_READ | mmap.PROT_WRITE)
            except (OSError, ValueError, OverflowError) as exc:
                raise AgentError(f"cannot map code buffer {cb.buffer_id}: {exc}") from exc
        finally:
            for fd in fds:
                os.close(fd)
        handle = CodeBufferHandle(cb.buffer_id, cb.base, cb.size, mem)
        conn.buffers[cb.buffer_id] = handle
        return handle

    def census(self, timeout_ms: int = 200,
               ranges: Sequence[tuple[int, int]] = ()) -> CensusResult:
        """Every thread's PC and its stack words in ``ranges``; a reply of more than
        CENSUS_ENTRIES_MAX entries, one about other ranges, or one not complete within
        its bound, is refused."""
        def check(rec: Received, n: int) -> None:
            for fd in rec.fds:
                os.close(fd)
            rec.fds = []
            if n > CENSUS_ENTRIES_MAX:
                self._violation(f"PC_CENSUS: more than {CENSUS_ENTRIES_MAX} entries")
            if rec.msg.body.n_ranges != len(ranges):
                self._violation(f"PC_CENSUS: {rec.msg.body.n_ranges} ranges, asked about "
                                f"{len(ranges)}")

        return gather_census(self._conn, timeout_ms, ranges, check)

    def transfer(self, region_id: int, points: dict[int, int] | list[tuple[int, int]],
                 timeout_ms: int = 100) -> P.TransferResult:
        pts = sorted(dict(points).items())
        return self._move(P.MsgType.TRANSFER, region_id,
                          [P.TransferPoint(orig=o, repl=r) for o, r in pts], timeout_ms)

    def evict(self, region_id: int, points: dict[int, int] | list[tuple[int, int]],
              timeout_ms: int = 100) -> P.TransferResult:
        pts = sorted(dict(points).items())
        return self._move(P.MsgType.EVICT, region_id,
                          [P.TransferPoint(orig=o, repl=r) for r, o in pts], timeout_ms)

    def _move(self, kind: P.MsgType, region_id: int, items: list[P.TransferPoint],
              timeout_ms: int) -> P.TransferResult:
        """AgentConnection._move, with the reply's counts checked: none is more than
        the threads signalled, and those are at most a process's."""
        if not 0 < len(items) <= P.MAX_TRANSFER:
            raise AgentError(f"a {kind.name} holds 1..{P.MAX_TRANSFER} points, not {len(items)}")
        conn = self._conn
        rec = conn.request(kind, P.Transfer(req_id=conn.next_id(), region_id=region_id,
                                            timeout_ms=timeout_ms),
                           items=items, timeout=timeout_ms / 1000 + 3.0)
        for fd in rec.fds:
            os.close(fd)
        res: P.TransferResult = rec.msg.body  # type: ignore[assignment]
        if res.threads > TID_MAX or max(res.moved, res.no_reply, res.left) > res.threads:
            raise AgentError(f"{kind.name}: counts out of bounds (threads {res.threads}, "
                             f"moved {res.moved}, no reply {res.no_reply}, left {res.left})")
        return res


class ClientSession:
    """One agent session: the connection, the client's threads, map, samples and regions.

    Fields written by the session thread are read by other threads without a lock
    (single attribute reads); compound updates hold ``self.lock``.
    """

    def __init__(self, service: Service, conn: AgentConnection, session_id: int) -> None:
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
        #: THREAD_NEW tids that are not threads of this process, and MAP_CHANGED ranges
        #: or kinds out of bounds: refused (nothing done for them), counted here.
        self.foreign_tids = 0
        self.map_changes_refused = 0
        self.connected_at = time.time()
        self.connected_mono = time.monotonic()
        #: Its starttime (procfs.started_boottime: the process's identity beside its pid)
        #: and its executable's key (paths.program_key; shortruns.py), "" if unknown.
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
        #: Thread ids (from /proc/PID/task and THREAD_NEW/THREAD_EXIT notices).
        self.threads: set[int] = set()
        #: The agent sends thread notices now (HELLO_QUIET_THREADS agents: only while
        #: asked, see thread_notices()); older agents send them always.
        self.thread_notices_on = False
        self.thread_notices_received = 0
        #: Since the notices were last turned on: threads announced, those of them that
        #: were short-lived, and when each of the others was announced (monotonic s).
        self._announced = self._short_lived = 0
        self._announced_at: dict[int, float] = {}
        #: Counts the times the notices were turned on; a quiet for short-lived threads
        #: is posted at most once per count (the one it was posted in).
        self._notices_gen = 0
        self._quiet_gen = -1
        #: Windows whose notices were turned off early for short-lived threads.
        self.short_thread_windows = 0
        #: THREAD_NEW notices that arrived after the quiet was asked for (no event
        #: opened for them).
        self.notices_after_quiet = 0
        #: perf windows opened without asking for notices (a program known to start
        #: threads too short-lived to sample: ShortThreadPrograms).
        self.windows_without_notices = 0
        #: Which threads a per-thread perf event may follow (perf_max_switch_rate);
        #: kept for the session so a thread's rate is measured from window to window.
        self.switch_gate = SwitchGate(self.pid, service.config.perf_max_switch_rate)
        #: Threads the gate refused that the agent's timer sampled instead
        #: (sampling/gated.py), the samples those timers gave, and why that fallback
        #: was given up for the session, if it was.
        self.timer_sampled_tids: set[int] = set()
        self.gated_timer_samples = 0
        self.gated_timer_failed: str | None = None
        self._gate_look = 0.0   # monotonic s of catch_up_threads' last look
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
        self.regions: dict[str, RegionRecord] = {}
        #: Stable ids ("r1", ...) of regions by (module, entries), across worker jobs.
        self._region_ids: dict[tuple[str, tuple[int, ...]], str] = {}
        self.region_status = "no job run yet"
        self.patches_installed = 0
        self.patches_removed = 0
        #: Regions that went live (patched, or entered by a thread moved in).
        self.regions_went_live = 0
        self.first_patch_mono: float | None = None
        self.samples_after_first_patch = 0
        self.samples_in_replacement = 0
        self.jobs_done = 0
        #: Sampling cadence (service.py, scheduler.sampling_interval): ``activity``
        #: counts what changes the client for selection (regions installed or
        #: removed, threads moved in, code mapped or unmapped); snapshots in a row
        #: that changed nothing make it quiet, and a quiet client is sampled less.
        self.activity = 0
        self.activity_judged = 0
        self.quiet_snapshots = 0
        self.last_selected: frozenset[str] = frozenset()
        self.last_window_mono = 0.0
        self.next_window_mono = 0.0
        self.sampling_interval_s = 0.0
        self.errors: collections.deque[str] = _Notes(maxlen=20)
        self.source: SamplingSource | None = None
        self.source_name = ""
        #: Installation of replacement code (session thread only; created on first use).
        self.installer: Installer | None = None
        self.evaluator: Evaluator | None = None
        #: Raw sample IPs outside replacement code, one Counter per recent snapshot:
        #: what region selection sees (old samples of code already optimized fade out).
        self.recent: collections.deque[collections.Counter[int]] = collections.deque(maxlen=4)
        #: Region ids never to install again (judged not effective).
        self.blocked_regions: set[str] = set()
        #: What the operator unpatched (`dbr ctl unpatch`): these regions, or with
        #: operator_hold_all every region, are not installed until `dbr ctl resume`.
        self.operator_held: set[str] = set()
        self.operator_hold_all = False
        #: The speed check under way (dbr_service/speedcheck.py), its finished ones,
        #: and original code a region was found slower than: (module, lo, hi).
        self.speed_check: SpeedCheck | None = None
        self.speed_checks: collections.deque[dict[str, Any]] = collections.deque(
            maxlen=SPEED_CHECKS_KEPT)
        self.slow_ranges: list[tuple[str, int, int]] = []
        #: The last speed-check command posted (control thread).
        self.speed_fut: Future | None = None
        self._perf_map: PerfMap | None = None
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
        #: could (dbr_service/reuse.py: a thread's birth costs the client).
        self.thread: Job | None = None
        #: /proc/PID of the process that connected, held open (clientfiles.ProcHandle).
        self.proc = ProcHandle(self.pid)
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
        self.thread_notices_on = not hello.flags & P.HELLO_QUIET_THREADS
        st = self.proc.exe_stat()     # None: another user's process, unless root
        if st is not None:
            self.exe_key = program_key(st)
        self._refresh_threads()
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

    def _drain_source(self) -> list:
        """Samples still buffered when the session ends (a short client's last window)."""
        with self.lock:
            if self.source is None:
                return []
            try:
                return self.source.read()
            except SamplingError:
                return []

    def _finish(self) -> None:
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
            self._thread_notice(t, rec.msg.body.tid)
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
                    self.activity += 1   # new or lost code: sample at the full rate again
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

    def _thread_notice(self, t: P.MsgType, tid: int) -> None:
        # A tid the service acts on (an event opened, a timer armed) must be one of
        # this process's threads; one that has ended counts as short-lived, as an event
        # that could not be opened did.
        check = self.proc.thread_check(tid) if t is P.MsgType.THREAD_NEW else ThreadCheck.OWN
        with self.lock:
            self.thread_notices_received += 1
            if check == ThreadCheck.FOREIGN:
                self.foreign_tids += 1
                log.debug("pid %d: THREAD_NEW of tid %d, not a thread of it: refused",
                          self.pid, tid)
                return
            if t is P.MsgType.THREAD_NEW:
                if check == ThreadCheck.OWN:
                    self.threads.add(tid)
                src = self.source
                if self._quiet_gen == self._notices_gen:
                    # Quiet already asked for in this window: the notices still
                    # arriving were sent before the agent had it (churn: hundreds,
                    # ~20 us of the service's CPU each with an event opened and
                    # closed).  A long-lived one is found in /proc/PID/task later.
                    self.notices_after_quiet += 1
                elif src is not None:
                    self._announced += 1
                    try:
                        if check == ThreadCheck.OWN and src.add_thread(tid):
                            self._announced_at[tid] = time.monotonic()
                        else:
                            self._short_lived += 1   # ended already
                            self._quiet_if_short_lived()
                    except SamplingError as exc:
                        self.errors.append(str(exc))
            else:
                self.threads.discard(tid)
                at = self._announced_at.pop(tid, None)
                if at is not None and time.monotonic() - at < SHORT_LIFE_S:
                    self._short_lived += 1
                    self._quiet_if_short_lived()
                if self.source is not None:
                    self.source.remove_thread(tid)

    def _quiet_if_short_lived(self) -> None:
        """Most announced threads ended before their event could be opened, or soon
        after: they live too briefly to take a sample (one per sample_period_us of CPU
        time), and their notices and events only cost the program and the service.
        Quiet for the rest of the window; longer threads are found in /proc/PID/task
        when the next one opens."""
        short = self._short_lived
        if (short < SHORT_THREADS_MIN or short < SHORT_THREADS_SHARE * self._announced
                or not self.thread_notices_on or self._quiet_gen == self._notices_gen):
            return
        self._quiet_gen = self._notices_gen
        self.short_thread_windows += 1
        self.service.short_thread_programs.note(self.exe, self.build_id)
        # Not from here: this may run inside another request's wait (its reply could
        # be taken for ours); the session thread's next command asks.
        gen = self._notices_gen

        def quiet() -> None:
            if gen == self._notices_gen:  # not a later window's notices
                self.thread_notices(False)
        self._commands.put((quiet, Future()))
        self._wake()

    def window_notices(self) -> None:
        """Session thread, a perf window opening (or a continuous one looking again):
        ask for THREAD_NEW/THREAD_EXIT, unless the program (this one, or an earlier run
        of the same executable) proved its threads too short-lived to sample
        (ShortThreadPrograms); that window is counted instead."""
        if self.service.short_thread_programs.known(self.exe, self.build_id):
            self.windows_without_notices += 1
        else:
            self.thread_notices(True)

    def thread_notices(self, on: bool) -> None:
        """Session thread: ask the agent for THREAD_NEW/THREAD_EXIT (on) or for quiet.

        Only a source with one event per thread (perf) needs them, and only while it is
        open: each notice costs the program a system call and the service a wake-up, and
        a program that starts threads by the thousand would pay for them all the time
        (4x the native time for 5000 threads, docs/design-notes.md).  They are turned on
        before the source lists /proc/PID/task, so no thread falls between the two.  A
        refusal or a timeout is kept in ``errors``: threads started during the window are
        then sampled from the next one."""
        if on == self.thread_notices_on or not self.hello_flags & P.HELLO_QUIET_THREADS:
            return
        try:
            rc = self.conn.notices(P.NOTICE_THREADS if on else 0, timeout=1.0)
        except AgentError as exc:
            self.errors.append(f"thread notices {'on' if on else 'off'}: {exc}")
            return
        if rc == P.Result.OK:
            self.thread_notices_on = on
            if on:
                self._announced = self._short_lived = 0
                self._announced_at.clear()
                self._notices_gen += 1
        else:
            self.errors.append(f"thread notices {'on' if on else 'off'}: agent answered {rc}")

    def _task_tids(self) -> set[int] | None:
        """The client's threads in /proc/PID/task; None if unreadable."""
        return self.proc.tids()

    def _refresh_threads(self) -> None:
        tids = self._task_tids()
        if tids is not None:
            with self.lock:
                self.threads = tids

    @property
    def sampling_source_name(self) -> str:
        """The source's name, with "+agent-timer" once the agent's timer has sampled a
        thread perf left out (each window's source starts as plain perf)."""
        name = self.source_name
        if self.timer_sampled_tids and not name.endswith("+agent-timer"):
            name += "+agent-timer"
        return name

    def thread_count(self) -> int:
        """Threads of the client now (the notices only arrive during perf windows); of
        an ended session, those it had last (its pid may be another process's now)."""
        tids = self._task_tids() if self.alive else None
        return len(self.threads) if tids is None else len(tids)

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

    # ------------------------------------------------------------------ sampling
    def begin_window(self, make_source: Callable[[ClientSession], SamplingSource]) -> None:
        """Session thread: open (if needed) and enable the sampling source."""
        self._refresh_threads()
        self._refresh_maps()  # cheap; also catches mappings no agent hook announced
        with self.lock:
            if self.source is None:
                self.source = make_source(self)
                self.source_name = self.source.name
            self.source.enable()

    def catch_up_threads(self) -> None:
        """Session thread, continuous sampling (the source stays open), each snapshot:
        after a quiet for short-lived threads, notices on again (not for a program
        known to start such threads: ShortThreadPrograms), then open events for
        the threads /proc/PID/task lists now and drop those of ended ones.  With a
        switch gate, also once a second (GATE_LOOK_S) while the notices are on: a
        sampled thread that now switches too often loses its event, a gated one that
        calmed down gets one (a look reads each thread's status: not at every
        snapshot of a client with a thousand threads)."""
        with self.lock:
            src = self.source
            if src is None or not hasattr(src, "refresh_threads"):
                return
            now = time.monotonic()
            if self.thread_notices_on and (getattr(src, "gate", None) is None
                                           or now - self._gate_look < GATE_LOOK_S):
                return
            self._gate_look = now
            self.window_notices()
            try:
                src.refresh_threads()
            except SamplingError as exc:
                self.errors.append(str(exc))

    def end_window(self, keep_open: bool) -> list:
        """Session thread: disable (unless continuous), drain, and return the samples."""
        samples: list = []
        with self.lock:
            src = self.source
            if src is not None:
                if not keep_open:
                    src.disable()
                samples = src.read()
                self._count_gated_timer(src)
                if not keep_open:
                    self._close_source()
        if not keep_open:
            self.thread_notices(False)
        return samples

    def _close_source(self) -> None:
        with self.lock:
            src, self.source = self.source, None
            if src is not None:
                try:
                    src.close()
                except SamplingError as exc:
                    self.errors.append(str(exc))
                self._count_gated_timer(src)

    def _count_gated_timer(self, src: SamplingSource) -> None:
        """Add what a gated timer source (sampling/gated.py) did since the last look;
        a fallback it gave up is not tried again in this session."""
        take = getattr(src, "take_counts", None)
        if take is None:
            return
        tids, n, failed = take()
        if len(self.timer_sampled_tids) > 1024:      # ended threads' tids go first
            self.timer_sampled_tids &= self.threads
        self.timer_sampled_tids |= tids
        self.gated_timer_samples += n
        if failed is not None:
            self.gated_timer_failed = failed
            self.errors.append(failed)
            log.warning("pid %d: %s; such threads stay unsampled", self.pid, failed)

    def add_samples(self, ips: collections.Counter[int],
                    per_thread: dict[int, int] | None = None) -> None:
        """Control thread: account one snapshot's samples of this client."""
        n = sum(ips.values())
        with self.lock:
            self.thread_samples.update(per_thread or {})
            self.ip_counts.update(ips)
            self.samples_total += n
            self.snapshots += 1

    def region_id(self, module: str, entries: list[int]) -> str:
        """The stable id of the region with these entries (new ids count up)."""
        key = (module, tuple(sorted(entries)))
        if key not in self._region_ids:
            self._region_ids[key] = f"r{len(self._region_ids) + 1}"
        return self._region_ids[key]

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

    def _get_installer(self) -> Installer:
        if self.installer is None:
            cfg = self.service.config
            variant = {"int3": P.Variant.INT3, "self-branch": P.Variant.SELF_BRANCH,
                       "single": P.Variant.SINGLE}[cfg.patch_variant]
            conn = CheckedConnection(self.conn, self.proc,
                                     lambda why: self.stop(f"protocol error: {why}"))
            proc = self.proc
            self.installer = Installer(conn, self._read_original, variant=variant,
                                       transfer=cfg.transfer,
                                       evict=cfg.evict
                                       and bool(self.hello_flags & P.HELLO_EVICT),
                                       frames=bool(self.hello_flags & P.HELLO_FRAMES),
                                       cfi=CfiSource(lambda: [(m.lo, m.hi, m.path, m.dev,
                                                               m.ino) for m in
                                                              proc.maps() or []]))
            self.evaluator = Evaluator(self.installer)
        return self.installer

    def patched_ranges(self) -> list[tuple[int, int]]:
        """Byte ranges of installed patch sites (for discovery in the next job)."""
        inst = self.installer
        return [] if inst is None else inst.patched_ranges()

    def covered(self, rid: str, module: str, entries: list[int]) -> bool:
        """Whether region ``rid``, not installed itself, has every entry in original
        code that an installed region of the same module already replaces.  Such a
        region is a variant of one that is live (sampling noise moves a loop's
        entries by a block from job to job): it is not installed, and selecting it
        is no news (the client may turn quiet).  Once the covering region is
        removed, it is installable again."""
        if not entries:
            return False
        with self.lock:
            rec = self.regions.get(rid)
            if rec is not None and rec.state is RegionState.INSTALLED:
                return False
            ranges = [rg for r in self.regions.values()
                      if r.state is RegionState.INSTALLED and r.module == module
                      for rg in r.orig_ranges]
        return all(any(lo <= e < hi for lo, hi in ranges) for e in entries)

    def install_selected(self, srs: list[Any], ids: list[str]) -> int:
        """Session thread: emit and install the regions not yet installed (nor covered
        by an installed one); regions installed.  One region's failure is recorded;
        the others go on."""
        if self.speed_check is not None:
            return 0   # not while one is measured: selected again at the next snapshot
        if self.operator_hold_all:
            return 0   # the operator unpatched this client: until `dbr ctl resume`
        inst = self._get_installer()
        todo = []
        for rid, sr in zip(ids, srs):
            rec = self.regions.get(rid)
            if rid in self.blocked_regions or rid in self.operator_held or (
                    rec is not None and rec.state is RegionState.INSTALLED):
                continue
            if rec is not None and self.covered(rid, rec.module, rec.entries):
                rec.info["not_installed"] = "its entries are in code an installed region replaces"
                continue
            if rec is not None and self._in_slow_code(rec.module, region_extent(sr)[0]):
                rec.info["not_installed"] = ("it copies code that a region was found "
                                             "slower than (speed check)")
                continue
            todo.append((rid, sr))
        if not todo:
            return 0
        live = [r for r in inst.regions.values() if r.state is InstallState.INSTALLED]
        out = install_regions(inst, [sr for _, sr in todo], already=live)
        by_name = {r.name: r for r in out.installed}
        n = 0
        with self.lock:
            for rid, sr in todo:
                rec = self.regions.get(rid)
                reg = by_name.get(sr.id)
                if rec is None:
                    continue
                if reg is None:
                    why = next((w for i, w in out.failed if i == sr.id), "not installed")
                    rec.info["install_error"] = why
                    tries = rec.info["install_failures"] = rec.info.get("install_failures", 0) + 1
                    if tries >= INSTALL_ATTEMPTS:
                        # Selected again at every snapshot; a region that failed this often
                        # (no buffer in reach, sites refused, ...) is not tried again.
                        self.blocked_regions.add(rid)
                        rec.info["install_error"] = f"{why} (gave up after {tries} attempts)"
                    continue
                rec.state = RegionState.INSTALLED
                rec.installed_mono = reg.installed_at
                rec.sites = reg.patched_sites
                rec.orig_ranges = list(reg.orig_ranges)
                rec.code_bytes = reg.gen.size
                rec.info.update(install_id=reg.region_id, code_at=hex(reg.chunk.addr),
                                sites=len(reg.patched_sites), transferred=reg.transferred,
                                transfer_only=not reg.sites, layout=reg.gen.layout_kind,
                                real_calls=len(reg.gen.calls), frames=reg.frames)
                if reg.cfi_refused is not None:
                    rec.info["cfi_refused"] = reg.cfi_refused
                reg.name = rid
                n += 1
                self.activity += 1
                self.regions_went_live += 1
                self.patches_installed += len(reg.patched_sites)
                if self.first_patch_mono is None:
                    self.first_patch_mono = time.monotonic()
                    self.mark("first_patch")
                self.service.events.publish("patch-installed", pid=self.pid, region=rid,
                                            sites=len(reg.patched_sites),
                                            code_bytes=reg.gen.size)
        for rid, why in out.failed:
            self.errors.append(f"region {rid}: {why}")
        self._write_perf_map()
        return n

    def uninstall_region(self, rid: str, why: str) -> bool:
        """Session thread: restore the patch sites of one installed region (the
        operator's unpatch), and move threads inside its code back to the original
        code, so that the region's code stops running now, not when they leave it."""
        rec = self.regions.get(rid)
        if rec is None or rec.state is not RegionState.INSTALLED or self.installer is None:
            return False
        reg = self.installer.regions.get(rec.info.get("install_id", -1))
        if reg is not None and reg.state in HELD:
            self.installer.uninstall(reg.region_id, why, evict=True)
            with self.lock:
                rec.info["evicted"] = reg.evicted
        self._region_removed(rec, why)
        self._write_perf_map()
        return True

    # ------------------------------------------------------------------ speed checks
    def _in_slow_code(self, module: str, ranges: list[tuple[int, int]]) -> bool:
        """Whether a region copying ``ranges`` overlaps code whose region a speed
        check found slower: a variant of it would most likely be slower too."""
        return any(m == module and lo < b and a < hi
                   for a, b in ranges for m, lo, hi in self.slow_ranges)

    def speed_candidates(self, settle_s: float, now: float) -> list[str]:
        """Any thread: ids of the live regions with patch sites that no speed check has
        judged yet, once the youngest of them has been live for ``settle_s`` (until
        then the set may still grow) and ``settle_s`` has passed since a check of any
        of them was abandoned; [] if there are none."""
        with self.lock:
            new = [r for r in self.regions.values()
                   if r.state is RegionState.INSTALLED
                   and (r.sites or self._checks_transfer_only())
                   and "speed_check" not in r.info]
            if not new or now - max(max(r.installed_mono, r.recheck_mono)
                                    for r in new) < settle_s:
                return []
            return [r.id for r in new]

    def _checks_transfer_only(self) -> bool:
        """A region without patch sites (entered by TRANSFER only) can be speed-checked:
        its ORIGINAL phases move threads out (EVICT), its REPLACEMENT phases move them
        in again (TRANSFER)."""
        inst = self.installer   # made before any region is installed; its flags are fixed
        return inst is not None and inst.evict_enabled and inst.transfer_enabled

    def speed_start(self, rids: list[str], pairs: int, phase_s: float, margin: float,
                    close_sampling: bool = False) -> bool:
        """Session thread: begin a speed check of the regions ``rids`` still live.  The
        first phase runs them as installed.  False if none is live, a sampling window
        is open (its samples would see the phases), or a check is under way.  With
        ``close_sampling`` (continuous sampling) an open window is closed first and its
        samples since the last snapshot are dropped; the first snapshot after the
        check opens a new one."""
        if close_sampling and self.speed_check is None and self.source is not None:
            self.end_window(keep_open=False)
        if self.speed_check is not None or self.source is not None or self.installer is None:
            return False
        todo = []
        for rid in rids:
            rec = self.regions.get(rid)
            reg = None if rec is None else self.installer.regions.get(
                rec.info.get("install_id", -1))
            if reg is not None and reg.state is InstallState.INSTALLED and \
                    (reg.patched_sites or (not reg.sites and self._checks_transfer_only())):
                todo.append((rid, reg.region_id))
            elif rec is not None:
                # nothing to take out (the agent restored its sites itself): not a
                # candidate again
                with self.lock:
                    rec.info["speed_check"] = {"verdict": "not checked", "ratio": None}
        if not todo:
            return False
        chk = SpeedCheck([i for _, i in todo], [r for r, _ in todo], pairs=pairs,
                         phase_s=phase_s, margin=margin)
        self.speed_check = chk
        chk.begin(chk.next_kind() or "", read_progress(self.pid), time.monotonic())
        if chk.done:
            self._speed_finish()
        return True

    def speed_step(self) -> None:
        """Session thread: end the running phase of the check, set the regions for the
        next one and begin it; or finish the check."""
        chk = self.speed_check
        if chk is None:
            return
        chk.end(read_progress(self.pid))
        kind = chk.next_kind()
        if kind is not None:
            try:
                if self._speed_set(chk, kind):
                    chk.begin(kind, read_progress(self.pid), time.monotonic())
                else:
                    chk.stop("abandoned", "a region of the check was removed meanwhile")
            except AgentError as exc:
                # the agent refused an UNPATCH or PATCH: end the check, and put every
                # region it can back as installed (a session that is gone raises again)
                chk.stop("abandoned", f"the agent refused a step: {exc}")
        if chk.done:
            self._speed_finish()

    def _speed_set(self, chk: SpeedCheck, kind: str) -> bool:
        """Suspend (ORIGINAL) or resume (REPLACEMENT) every region of the check; False
        if one of them is gone (map change, evaluation, operator) or failed to resume."""
        inst = self.installer
        assert inst is not None
        for iid in chk.region_ids:
            reg = inst.regions.get(iid)
            if reg is None or reg.state not in HELD:
                return False
            if kind == ORIGINAL and reg.state is InstallState.INSTALLED:
                inst.suspend(iid)
            elif kind != ORIGINAL and reg.state is InstallState.SUSPENDED and \
                    not self._speed_resume(iid):
                return False
        return True

    def _speed_resume(self, iid: int) -> bool:
        """Patch a suspended region again; False (and its record removed) if the agent
        refused every site."""
        reg = self.installer.regions[iid]
        self.installer.resume(iid)
        if reg.state is InstallState.INSTALLED:
            return True
        rec = self._record_of(iid)
        if rec is not None:
            self._region_removed(rec, reg.why_removed)
        return False

    def _speed_finish(self) -> None:
        """Session thread: act on the verdict.  Regions found slower are removed and
        their original code is left alone from then on; every other region of the
        check is patched again (if it is suspended) and stays."""
        chk, self.speed_check = self.speed_check, None
        if chk is None or self.installer is None:
            return
        inst = self.installer
        slower = chk.verdict == "slower"
        why = f"slower than its original code (speed check: {chk.why})"
        try:
            for iid in chk.region_ids:
                reg = inst.regions.get(iid)
                rec = self._record_of(iid)
                held = reg is not None and reg.state in HELD
                if held and slower:
                    # threads inside go back to the original code at once: a loop that
                    # never passes a site would otherwise run the slower code on
                    inst.uninstall(iid, why, evict=True)
                if rec is not None:
                    with self.lock:   # speed_candidates reads it on the control thread
                        if reg is not None:
                            rec.info["evicted"] = reg.evicted
                        if held and chk.verdict == "abandoned" and \
                                self._abandoned_again(rec) < CHECK_TRIES:
                            rec.recheck_mono = time.monotonic()  # not judged: checked later
                        else:
                            rec.info["speed_check"] = {"verdict": chk.verdict,
                                                       "ratio": chk.ratio}
                if not held:
                    continue
                if slower:
                    if rec is not None:
                        self.blocked_regions.add(rec.id)
                        self.slow_ranges += [(rec.module, lo, hi) for lo, hi in rec.orig_ranges]
                        self._region_removed(rec, why)
                elif reg.state is InstallState.SUSPENDED:
                    self._speed_resume(iid)
        finally:
            summary = chk.summary()
            with self.lock:
                self.speed_checks.append(summary)
            self.service.events.publish("speed-check", pid=self.pid, **summary)
            self._write_perf_map()

    @staticmethod
    def _abandoned_again(rec: RegionRecord) -> int:
        """Count one more abandoned check of a live region; the count so far."""
        tries = rec.info.get("speed_checks_abandoned", 0) + 1
        rec.info["speed_checks_abandoned"] = tries
        return tries

    def _region_removed(self, rec: RegionRecord, why: str) -> None:
        with self.lock:
            rec.state = RegionState.REMOVED
            rec.info["removed_why"] = why
            self.activity += 1
            self.patches_removed += len(rec.sites)
        self.service.events.publish("patch-removed", pid=self.pid, region=rec.id,
                                    sites=len(rec.sites), why=why)

    def _record_of(self, install_id: int) -> RegionRecord | None:
        return next((r for r in self.regions.values()
                     if r.info.get("install_id") == install_id), None)

    def _map_changed(self, lo: int, hi: int, req_id: int) -> None:
        """Session thread: unpatch regions that patch, copy or exit into [lo, hi), ACK."""
        try:
            for reg in self.installer.on_map_changed(lo, hi) if self.installer else []:
                rec = self._record_of(reg.region_id)
                if rec is not None:
                    self._region_removed(rec, f"map change {lo:#x}-{hi:#x}")
            self._write_perf_map()
        finally:
            if req_id:
                self.conn.ack(req_id, P.Result.OK)

    def split_window(self, samples: list, window_start: float
                     ) -> tuple[collections.Counter[int], int]:
        """Control thread: raw IPs of one window, and how many landed in replacement
        code (or in a code buffer: code of a region removed since).  IPs outside both
        feed the next region selection.  Only windows that began
        after the first patch count towards the after-first-patch figures (a window
        straddling it would count samples taken before any replacement code existed)."""
        raw: collections.Counter[int] = collections.Counter(smp.ip for smp in samples)
        if raw:
            self.mark("first_samples")
        # all replacement code lies in the code buffers, also that of a region removed
        # after the window was taken
        bufs = () if self.installer is None else self.installer.buffer_ranges
        in_repl = 0
        outside: collections.Counter[int] = collections.Counter()
        for ip, n in raw.items():
            if any(lo <= ip < hi for lo, hi in bufs):
                in_repl += n
            else:
                outside[ip] = n
        with self.lock:
            self.recent.append(outside)
            if self.first_patch_mono is not None and self.first_patch_mono <= window_start:
                self.samples_in_replacement += in_repl
                self.samples_after_first_patch += sum(raw.values())
        return raw, in_repl

    def selection_input(self) -> dict[int, int]:
        """Samples region selection works from: recent ones outside replacement code."""
        total: collections.Counter[int] = collections.Counter()
        with self.lock:
            for c in self.recent:
                total.update(c)
        return dict(total)

    def evaluate(self, raw: collections.Counter[int]) -> None:
        """Session thread: judge installed regions on one window; reclaim code space."""
        if self.evaluator is None or self.installer is None:
            return
        # Threads seen in the original code of a live region (entered it by a path
        # without a patch, or it has none) are moved in, and the region's judgement
        # starts over (a bounded number of times) before the verdicts.  A few samples
        # at the region's exits are no reason to signal every running thread.
        for h in self.evaluator.snapshot(raw):
            if h.in_original >= max(TRANSFER_MIN_SAMPLES, TRANSFER_MIN_SHARE * h.total) and \
                    h.region.state is InstallState.INSTALLED and \
                    self.installer.transfer(h.region):
                self.evaluator.restart(h.region.region_id)
                with self.lock:
                    self.activity += 1
                rec = self._record_of(h.region.region_id)
                if rec is not None:
                    rec.info["transferred"] = h.region.transferred
        for reg, why in self.evaluator.apply():
            rec = self._record_of(reg.region_id)
            if rec is not None:
                if why == "not effective":
                    self.blocked_regions.add(rec.id)
                self._region_removed(rec, why)
        self._write_perf_map()
        if self.installer.space.quarantine:
            try:
                self.installer.reclaim()
            except AgentError as exc:
                self.errors.append(f"census: {exc}")

    def original_address(self, ip: int) -> int:
        """Any thread: the original address of a replacement-code IP (else ``ip``)."""
        inst = self.installer
        return ip if inst is None else inst.attribute(ip)[0]

    def _write_perf_map(self) -> None:
        """/tmp/perf-PID.map names replacement code for `perf report`
        (clientfiles.PerfMap: created once, never through a link, never over a map
        another writer owns, removed when the session ends)."""
        if not self.service.config.perf_map or self.installer is None:
            return
        if self._perf_map is None:
            self._perf_map = PerfMap(self.pid, getattr(self.service, "runtime_dir", None))
        why = self._perf_map.write(self.installer.perf_map_lines())
        if why:
            self.errors.append(f"perf map: {why}")
            log.info("pid %d: perf map: %s", self.pid, why)

    # ------------------------------------------------------------------ views
    def summary(self) -> dict[str, Any]:
        """One row of `dbr ctl clients`."""
        return {"pid": self.pid, "ppid": self.ppid, "uid": self.uid,
                "session": self.session_id, "build_id": self.build_id,
                # the kernel's exe; a different claim beside it, where the table shows it
                "exe": (f"{self.exe} (claims {self.exe_claimed})" if self.exe_mismatch
                        else self.exe),
                "state": self.state.value, "threads": self.thread_count(),
                "agent_thread": ("hidden" if self.hello_flags & P.HELLO_HIDDEN_THREAD
                                 else "pthread"),
                "thread_notices": (("on" if self.thread_notices_on else "off")
                                   if self.hello_flags & P.HELLO_QUIET_THREADS else "always"),
                "thread_notices_received": self.thread_notices_received,
                "short_thread_windows": self.short_thread_windows,
                "notices_after_quiet": self.notices_after_quiet,
                "windows_without_notices": self.windows_without_notices,
                "threads_switch_gated": self.switch_gate.refused,
                "threads_timer_sampled": len(self.timer_sampled_tids),
                "gated_timer_samples": self.gated_timer_samples,
                "samples": self.samples_total, "snapshots": self.snapshots,
                "paused": self.paused, "source": self.sampling_source_name,
                "operator_hold": ("all" if self.operator_hold_all
                                  else sorted(self.operator_held) or None),
                "map_changes": self.map_changes, "jobs_done": self.jobs_done,
                "hotspots_found": len(self.hotspots),
                "regions": len(self.regions), "patches_installed": self.patches_installed,
                "regions_went_live": self.regions_went_live,
                **self.threads_moved(),
                "sampling_interval_s": self.sampling_interval_s,
                "quiet_snapshots": self.quiet_snapshots,
                "speed_check": ("running" if self.speed_check is not None else
                                self.speed_checks[-1]["verdict"] if self.speed_checks
                                else None),
                "connected_at": self.connected_at, "ended_at": self.ended_at,
                "exe_claimed": self.exe_claimed, "exe_mismatch": self.exe_mismatch,
                "foreign_tids": self.foreign_tids,
                "map_changes_refused": self.map_changes_refused,
                "close_reason": self.close_reason, "errors": list(self.errors)[-3:]}

    def threads_moved(self) -> dict[str, int]:
        """Threads moved into replacement code (TRANSFER) and out of it (EVICT), as the
        clients row and the report name them."""
        inst = self.installer
        return {"threads_transferred": 0 if inst is None else inst.threads_transferred,
                "threads_evicted": 0 if inst is None else inst.threads_evicted}

    def report(self) -> dict[str, Any]:
        """This client's entry of a dbr.run/1 report (DESIGN.md "Reports")."""
        from dbr_service.report import client_report

        return client_report(self)
