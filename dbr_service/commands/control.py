"""Operator API: JSON request/reply over the zmq control socket, one handler per verb.

Request ``{"verb": NAME, "args": {...}}``; reply ``{"ok": true, "result": ...}`` or
``{"ok": false, "error": {"code": INT, "message": STR}}``.  Every verb is registered
with :func:`verb` together with its argument specification; arguments are checked
(names, types, required) before the handler runs, and anything else is refused with a
:class:`Fault` (the registry: commands/control_verbs.py; the verbs on a client's process beyond
its regions: commands/control_tools.py).  docs/control-api.md documents every verb and code.

The socket is served by its own thread (:class:`ControlServer`) so that requests are
answered while the control thread runs snapshots; handlers only read service state
under its lock or post work to session threads with a bounded wait.
"""

from __future__ import annotations

import grp
import logging
import os
import shutil
import stat
import subprocess
import threading
import time
from typing import TYPE_CHECKING, Any

import zmq

import dbr_service
from dbr_service.commands import control_tools
from dbr_service.commands.control_verbs import (Arg, client_of, dispatch, encode_reply, fault_reply,
                                                int_arg, verb)
from dbr_service.commands.ctlclient import MAX_REQUEST, Code, Fault
from dbr_service.common.errors import AgentError, ConfigError, ProtocolError

if TYPE_CHECKING:  # pragma: no cover
    from dbr_service.daemon.service import Service

log = logging.getLogger("dbr.control")

#: Verbs of commands/control_tools.py, registered by importing it; served like those below.
TOOL_VERBS = control_tools.NAMES

MAX_TOP = 10_000
"""Most hot spots one ``hotspots`` reply lists: each costs a mapping lookup on the
control thread and ~150 bytes of reply."""



# --------------------------------------------------------------------------- verbs
@verb("status")
def verb_status(service: Service, args: dict[str, Any]) -> dict[str, Any]:
    """Version, uptime, pid, sampling source and capabilities, clients, config."""
    with service.lock:
        live = [s for s in service.sessions.values() if s.alive]
        return {
            "version": dbr_service.__version__, "pid": os.getpid(),
            "uptime_s": round(time.monotonic() - service.started_mono, 3),
            "runtime_dir": str(service.runtime_dir), "embedded": service.embedded,
            "sampling": service.sampling_status(),
            "clients": len(live), "clients_seen": service.sessions_seen,
            "handshakes": len(service.pending),
            "refused_at_limit": service.refused_at_limit,
            "paused": service.paused, "snapshots": service.snapshot_count,
            "scheduler": service.scheduler.stats(),
            "session_threads": service.session_threads.stats(),
            "short_runs": service.short_runs.status(),
            "warm_start": service.warm.status() if service.warm is not None else None,
            "config_generation": service.config_generation,
            "config_file": service.sources.file,
            "config": service.config.to_dict(),
        }


@verb("clients", all=Arg((bool,), default=False))
def verb_clients(service: Service, args: dict[str, Any]) -> list[dict[str, Any]]:
    """Connected clients (``all``: also ended sessions still remembered)."""
    with service.lock:
        sessions = list(service.sessions.values())
        if args["all"]:
            sessions = list(service.history) + sessions
    return [s.summary() for s in sessions]


@verb("waiting")
def verb_waiting(service: Service, args: dict[str, Any]) -> list[dict[str, Any]]:
    """Processes that carry the agent and would connect to this service but have no
    session, and why (dbr_service/commands/waiting.py): read from /proc on request."""
    from dbr_service.commands.waiting import waiting_processes

    with service.lock:
        live = [s.pid for s in service.sessions.values()] + \
            [s.pid for s in service.pending.values()]
        ended = {s.pid: (s.started_boot, s.close_reason) for s in service.history}
    return waiting_processes(service.runtime_dir, live, ended)


@verb("hotspots", pid=Arg((int,), required=True), top=Arg((int,), default=20))
def verb_hotspots(service: Service, args: dict[str, Any]) -> dict[str, Any]:
    """Hottest addresses of one client, from every sample since it connected."""
    from dbr_service.common.hotnames import name_hotspots
    from dbr_service.region.worker import find_hotspots

    top = int_arg(args["top"], "top")
    if top > MAX_TOP:
        raise Fault(Code.BAD_ARGS, f"hotspots: top must be at most {MAX_TOP}")
    s = client_of(service, int_arg(args["pid"], "pid"))
    with s.lock:
        counts = dict(s.ip_counts)
        maps = list(s.maps)
        threads = {str(t): n for t, n in sorted(s.thread_samples.items())}
    hot = find_hotspots(counts, maps, threshold=service.config.hot_threshold, top=top)
    name_hotspots(hot, maps)
    return {"pid": s.pid, "samples": sum(counts.values()), "snapshots": s.snapshots,
            "source": s.sampling_source_name, "threads": threads, "hotspots": hot}


@verb("regions", pid=Arg((int,), required=True))
def verb_regions(service: Service, args: dict[str, Any]) -> dict[str, Any]:
    """Regions selected/installed for one client and the state of region selection."""
    s = client_of(service, int_arg(args["pid"], "pid"))
    inst = s.installer
    kept = inst.retained() if inst is not None else {}
    maps = list(s.maps)
    regions = []
    for r in list(s.region_book.regions.values()):
        j = r.to_json(maps)
        # a removed region's code stays until censuses find nothing of it in any thread
        held = kept.get(r.info.get("install_id")) if r.state.value == "removed" else None
        if held is not None:
            j["retained"] = held
        regions.append(j)
    return {"pid": s.pid, "status": s.region_status, "regions": regions}


@verb("region", pid=Arg((int,), required=True), id=Arg((str,), required=True),
      format=Arg((str,), default="json"))
def verb_region(service: Service, args: dict[str, Any]) -> dict[str, Any]:
    """One region: JSON details, or its graph as DOT or SVG text (``format``)."""
    s = client_of(service, int_arg(args["pid"], "pid"))
    fmt = args["format"]
    if fmt not in ("json", "dot", "svg"):
        raise Fault(Code.BAD_ARGS, f"region: format must be json, dot or svg, not {fmt!r}")
    r = s.region_book.regions.get(args["id"])
    if r is None:
        raise Fault(Code.NO_REGION, f"pid {s.pid} has no region {args['id']!r} "
                                    f"({s.region_status})")
    if fmt == "json":
        return r.to_json()
    if r.dot is None:
        raise Fault(Code.NOT_AVAILABLE, f"region {r.id} has no graph")
    if fmt == "dot":
        return {"id": r.id, "dot": r.dot}
    dot = shutil.which("dot")
    if dot is None:
        raise Fault(Code.NOT_AVAILABLE, "graphviz `dot` is not installed; use --dot")
    try:
        svg = subprocess.run([dot, "-Tsvg"], input=r.dot.encode(), capture_output=True,
                             timeout=10, check=True).stdout.decode()
    except (subprocess.SubprocessError, OSError) as exc:
        raise Fault(Code.INTERNAL, f"dot failed: {exc}") from None
    return {"id": r.id, "svg": svg}


@verb("unpatch", pid=Arg((int,), required=True), id=Arg((str,)))
def verb_unpatch(service: Service, args: dict[str, Any]) -> dict[str, Any]:
    """Remove one installed region's patches (``id``) or all of a client's."""
    s = client_of(service, int_arg(args["pid"], "pid"))
    if args["id"] is not None and args["id"] not in s.region_book.regions:
        raise Fault(Code.NO_REGION, f"pid {s.pid} has no region {args['id']!r}")
    if not s.alive:
        raise Fault(Code.NO_CLIENT, f"client {s.pid} is no longer connected")
    try:
        removed = service.unpatch(s, args["id"])
    except (AgentError, ProtocolError, TimeoutError) as exc:
        raise Fault(Code.AGENT, f"unpatch in pid {s.pid} failed: {exc}") from None
    return {"pid": s.pid, "regions_removed": removed,
            "held": args["id"] if args["id"] is not None else "all",
            "until": f"dbr ctl resume {s.pid}"}


@verb("pause", pid=Arg((int,)))
def verb_pause(service: Service, args: dict[str, Any]) -> dict[str, Any]:
    """Stop sampling and optimizing one client, or the whole service."""
    return _set_paused(service, args["pid"], True)


@verb("resume", pid=Arg((int,)))
def verb_resume(service: Service, args: dict[str, Any]) -> dict[str, Any]:
    """Undo ``pause``."""
    return _set_paused(service, args["pid"], False)


def _set_paused(service: Service, pid: int | None, paused: bool) -> dict[str, Any]:
    if pid is None:
        service.paused = paused
        return {"service": True, "paused": paused}
    s = client_of(service, int_arg(pid, "pid"))
    s.paused = paused
    released: list[str] = []
    if not paused:   # resume also lifts what `unpatch` held back
        with s.lock:
            book = s.region_book
            released = sorted(book.operator_held) + (["all"] if book.operator_hold_all else [])
            book.operator_held.clear()
            book.operator_hold_all = False
            # what selection may install changed: the next snapshot gets a job even
            # when nothing new is hot (daemon/snapshots.py _job_due) and not after a backoff
            s.cadence.activity += 1
            s.cadence.next_job_mono = 0.0
    return {"pid": s.pid, "paused": paused, "released": released}


@verb("config_get", key=Arg((str,)))
def verb_config_get(service: Service, args: dict[str, Any]) -> Any:
    """The whole configuration, or one key's value."""
    if args["key"] is None:
        return service.config.to_dict()
    try:
        return {args["key"]: service.config.get(args["key"])}
    except ConfigError as exc:
        raise Fault(Code.CONFIG, str(exc)) from None


@verb("config_set", key=Arg((str,), required=True),
      value=Arg((str, int, float, bool), required=True))
def verb_config_set(service: Service, args: dict[str, Any]) -> dict[str, Any]:
    """Change one key at run time (until the next reload); runtime_dir is fixed."""
    key = args["key"]
    if key in ("runtime_dir", "socket_group"):
        raise Fault(Code.CONFIG, f"{key} cannot change while the service runs")
    try:
        service.set_config(service.config.replace_value(key, args["value"], source="config_set"))
    except ConfigError as exc:
        raise Fault(Code.CONFIG, str(exc)) from None
    return {key: service.config.get(key)}


@verb("report", pids=Arg((list,), required=True))
def verb_report(service: Service, args: dict[str, Any]) -> list[dict[str, Any]]:
    """dbr.run/1 client entries of the given pids and their descendants (by HELLO ppid),
    live or ended; used by `dbr run` at exit."""
    pids = args["pids"]
    if not all(isinstance(p, int) and not isinstance(p, bool) for p in pids):
        raise Fault(Code.BAD_ARGS, "report: pids must be a list of integers")
    with service.lock:
        sessions = list(service.history) + list(service.sessions.values())
    children: dict[int, list[int]] = {}
    for s in sessions:
        children.setdefault(s.ppid, []).append(s.pid)
    # follow forks: children of wanted pids are wanted too (each pid expanded once,
    # so the work is linear in the sessions remembered, whatever the caller sends)
    wanted = set(pids)
    todo = list(wanted)
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in wanted:
                wanted.add(child)
                todo.append(child)
    return [s.report() for s in sessions if s.pid in wanted and s.exe]


@verb("events", since=Arg((int,), default=0))
def verb_events(service: Service, args: dict[str, Any]) -> list[dict[str, Any]]:
    """Recent events (the same ones the events socket publishes), after seq ``since``."""
    return service.events.since(args["since"])


@verb("shutdown")
def verb_shutdown(service: Service, args: dict[str, Any]) -> dict[str, Any]:
    """Stop the service (agents get BYE; patches kept or reverted per on_shutdown)."""
    service.request_stop("shutdown requested over the control socket")
    return {"stopping": True}


# --------------------------------------------------------------------------- sockets
MAX_FRAME = 4 * MAX_REQUEST
"""zmq.MAXMSGSIZE of the control socket: zmq closes the connection of a peer that
announces a larger frame before reading its body, so it is never buffered.  Frames
between MAX_REQUEST and this still arrive and get a TOO_LARGE reply."""

SEND_TIMEOUT_MS = 1000
"""zmq.SNDTIMEO: a reply that cannot be queued within this is given up (REP drops
replies to peers that do not read rather than block, but the bound is explicit)."""


class ControlServer:
    """Serves the REP control socket from its own thread.

    One request is one single-frame message; anything else gets a fault reply.  A
    zmq error while serving one request is logged and, since it may leave the REP
    socket owing a reply it can no longer send, the socket is closed and bound afresh
    on the same path: only :meth:`stop` ends the loop.
    """

    def __init__(self, service: Service, ctx: zmq.Context, path: str) -> None:
        self.service = service
        self.ctx = ctx
        self.path = path
        self.sock = self._bind()
        self._stop = threading.Event()
        # stop() writes here so the serving thread wakes at once (a stopping `dbr run`
        # used to wait out the poll period).
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.requests = 0
        self.rebinds = 0
        self.thread = threading.Thread(target=self._serve, name="dbr-control", daemon=True)

    def _bind(self, mode: int = 0o600, gid: int = -1) -> zmq.Socket:
        """A REP socket bound on ``path``, its file ``mode`` (0600: created under
        umask 0177, so it is never open to others) and group ``gid``."""
        sock = self.ctx.socket(zmq.REP)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME)
            sock.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
            # The ipc file is created 0600.  umask is per process: a file another
            # thread creates meanwhile is at worst made more private, never less.
            old = os.umask(0o177)
            try:
                sock.bind(f"ipc://{self.path}")
            finally:
                os.umask(old)
            if gid != -1:
                try:
                    os.chown(self.path, -1, gid)
                except OSError as exc:  # the group bits would then name the wrong group
                    log.error("control socket %s: chgrp failed: %s", self.path, exc)
                    mode &= 0o600
            os.chmod(self.path, mode)
        except BaseException:
            sock.close(0)
            raise
        return sock

    def start(self) -> None:
        self.thread.start()

    def _serve(self) -> None:
        try:
            while not self._stop.is_set():
                poller = zmq.Poller()
                poller.register(self.sock, zmq.POLLIN)
                poller.register(self._wake_r, zmq.POLLIN)
                try:
                    while not self._stop.is_set():
                        self._serve_one(poller)
                except zmq.ZMQError as exc:
                    # ETERM: the context is being terminated (the service releases
                    # its sockets only after stop()): nothing can be bound any more.
                    if self._stop.is_set() or exc.errno == zmq.ETERM:
                        break
                    log.error("control socket: %s; binding it afresh", exc)
                    if not self._rebind():
                        break
                except Exception:  # a bug here must not end the loop either
                    log.exception("control socket: unexpected error; binding it afresh")
                    if not self._rebind():
                        break
        finally:
            self.sock.close(0)

    def _serve_one(self, poller: zmq.Poller) -> None:
        """Wait (bounded) for one request and answer it."""
        ready = dict(poller.poll(1000))
        if self.sock not in ready:
            return
        try:
            first = self.sock.recv(zmq.NOBLOCK)
        except zmq.Again:  # woken with nothing to read
            return
        # From here the REP socket owes this peer exactly one reply.
        frames = self._drop_more_frames()
        if frames != 1:
            reply = fault_reply(Code.BAD_REQUEST, f"request has {frames} frames; send "
                                                  "one frame holding a JSON object")
        else:
            reply = dispatch(self.service, first)
        self.requests += 1
        self._send_reply(encode_reply(reply))

    def _drop_more_frames(self) -> int:
        """Read the rest of the message whose first frame was just read; its number of
        frames.  Like recv_multipart, but frames are dropped as they are read rather
        than all held at once; the parts of one message arrive together, so none waits."""
        frames = 1
        while self.sock.get(zmq.RCVMORE):
            self.sock.recv(zmq.NOBLOCK, copy=False)
            frames += 1
        return frames

    def _send_reply(self, data: bytes) -> None:
        self.sock.send(data)

    def _rebind(self) -> bool:
        """Close the socket and bind a fresh one on the same path, with the mode and
        group its file had (the service may have given it a socket_group); retried
        with back-off until it works or stop().  False when it cannot work again."""
        mode, gid = 0o600, -1
        try:
            st = os.stat(self.path)
            mode, gid = stat.S_IMODE(st.st_mode) & 0o660 | 0o600, st.st_gid
        except OSError:  # file gone: what Service._chgrp_sockets gives it
            group = getattr(self.service.config, "socket_group", "")
            if group:
                try:
                    mode, gid = 0o660, grp.getgrnam(group).gr_gid
                except KeyError:
                    log.error("socket_group %r does not exist; control socket 0600", group)
        self.sock.close(0)
        delay = 0.05
        while not self._stop.is_set():
            try:
                self.sock = self._bind(mode, gid)
            except zmq.ZMQError as exc:
                if exc.errno == zmq.ETERM:
                    return False
                log.error("cannot bind the control socket %s again: %s", self.path, exc)
            except OSError as exc:
                log.error("cannot bind the control socket %s again: %s", self.path, exc)
            else:
                self.rebinds += 1
                log.warning("control socket %s bound afresh", self.path)
                return True
            self._stop.wait(delay)
            delay = min(delay * 2, 5.0)
        return False

    def stop(self) -> None:
        self._stop.set()
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass
        self.thread.join(2.0)
        if not self.thread.is_alive():
            for fd in (self._wake_r, self._wake_w):
                os.close(fd)
