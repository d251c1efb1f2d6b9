"""Service side of one agent session (one AF_UNIX SOCK_SEQPACKET connection).

Used by the service for every client and by the tests' fake service.  It owns
framing (one datagram = one message, file descriptors as SCM_RIGHTS), peer
credential checks, the HELLO handshake, and synchronous request/reply helpers
with bounded waits.  Messages that arrive while a request waits for its reply
(THREAD_NEW, MAP_CHANGED, ...) are queued in ``inbox`` and passed to the
``on_unsolicited`` callback.
"""

from __future__ import annotations

import array
import collections
import ctypes
import mmap
import os
import select
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from dbr_service.wire import protocol as P
from dbr_service.common.errors import AgentError, ProtocolError

# Which reply answers which request, and the field that carries the request id.
_REPLY_OF: dict[P.MsgType, tuple[P.MsgType, str]] = {
    P.MsgType.CODE_BUFFER_REQ: (P.MsgType.CODE_BUFFER, "req_id"),
    P.MsgType.CODE_BUFFER_FREE: (P.MsgType.ACK, "req_id"),
    P.MsgType.REGION: (P.MsgType.ACK, "req_id"),
    P.MsgType.REGION_FORGET: (P.MsgType.ACK, "req_id"),
    P.MsgType.FRAMES_ADD: (P.MsgType.ACK, "req_id"),
    P.MsgType.FRAMES_DEL: (P.MsgType.ACK, "req_id"),
    P.MsgType.PATCH: (P.MsgType.PATCH_RESULT, "batch_id"),
    P.MsgType.UNPATCH: (P.MsgType.PATCH_RESULT, "batch_id"),
    P.MsgType.PC_CENSUS_REQ: (P.MsgType.PC_CENSUS, "req_id"),
    P.MsgType.SAMPLER_START: (P.MsgType.SAMPLER_RING, "req_id"),
    P.MsgType.SAMPLER_STOP: (P.MsgType.ACK, "req_id"),
    P.MsgType.TRANSFER: (P.MsgType.TRANSFER_RESULT, "req_id"),
    P.MsgType.EVICT: (P.MsgType.TRANSFER_RESULT, "req_id"),
    P.MsgType.NOTICES: (P.MsgType.ACK, "req_id"),
    P.MsgType.SAMPLER_THREAD: (P.MsgType.ACK, "req_id"),
}


#: The only messages whose descriptors the service keeps (a code buffer's memfd, the
#: sampler's ring); any other message's are closed as it is received.
_CARRIES_FD = frozenset({P.MsgType.CODE_BUFFER, P.MsgType.SAMPLER_RING})


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the peer process, from SO_PEERCRED."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", raw)


@dataclass
class CodeBufferHandle:
    """A code buffer in the client, mapped read-write in this process."""

    buffer_id: int
    base: int          # address of the client's R-X mapping
    size: int
    mem: mmap.mmap     # our RW view of the same pages

    def write(self, addr: int, data: bytes) -> None:
        """Write ``data`` at client address ``addr`` (must lie inside the buffer)."""
        off = addr - self.base
        if off < 0 or off + len(data) > self.size:
            raise AgentError(f"write of {len(data)} bytes at {addr:#x} outside buffer "
                             f"[{self.base:#x}, {self.base + self.size:#x})")
        self.mem[off:off + len(data)] = data

    def read(self, addr: int, n: int) -> bytes:
        off = addr - self.base
        return bytes(self.mem[off:off + n])

    def read_u64(self, addr: int) -> int | None:
        """The 8-byte counter at client address ``addr``; None once the buffer is closed
        or if ``addr`` is not an aligned slot inside it."""
        off = addr - self.base
        if self.mem.closed or off < 0 or off % 8 or off + 8 > self.size:
            return None
        return int.from_bytes(self.mem[off:off + 8], "little")

    def contains(self, addr: int, n: int = 1) -> bool:
        return self.base <= addr and addr + n <= self.base + self.size

    def close(self) -> None:
        if not self.mem.closed:
            self.mem.close()


class CensusResult(list):
    """A census: its entries (``P.CensusEntry``, one per thread: a list) and what it
    found in the ranges it asked about: ``range_refs[i]`` stack and register words
    inside ``ranges[i]`` over every thread.  ``result`` other than OK: the agent
    found nothing out (bad ranges, no memory), and there are no entries."""

    def __init__(self, entries: Iterable[P.CensusEntry] = (),
                 ranges: Sequence[tuple[int, int]] = (), range_refs: Sequence[int] = (),
                 result: int = P.Result.OK) -> None:
        super().__init__(entries)
        self.ranges = [(int(lo), int(hi)) for lo, hi in ranges]
        self.range_refs = list(range_refs) or [0] * len(self.ranges)
        self.result = int(result)


def check_census_ranges(ranges: Sequence[tuple[int, int]]) -> None:
    """Raise AgentError unless ``ranges`` is what a PC_CENSUS_REQ may carry."""
    if len(ranges) > P.MAX_CENSUS_RANGES:
        raise AgentError(f"a census asks about at most {P.MAX_CENSUS_RANGES} ranges, "
                         f"not {len(ranges)}")
    for k, (lo, hi) in enumerate(ranges):
        if not 0 <= lo < hi < 1 << 64 or (k and lo < ranges[k - 1][1]):
            raise AgentError(f"census ranges must ascend without overlap: {ranges!r}")


def gather_census(conn: "AgentConnection", timeout_ms: int, ranges: Sequence[tuple[int, int]],
                  on_message: Callable[[Received, int], None] | None = None) -> CensusResult:
    """Send PC_CENSUS_REQ for ``ranges`` and gather its reply, several messages if the
    agent says CENSUS_MORE (bounded); ``on_message(rec, entries so far)`` sees each
    one first (a caller's checks).  The range totals and result are those of the
    last message."""
    ranges = [(int(lo), int(hi)) for lo, hi in ranges]
    check_census_ranges(ranges)
    req_id = conn.next_id()
    rec = conn.request(P.MsgType.PC_CENSUS_REQ, P.CensusReq(req_id=req_id, timeout_ms=timeout_ms),
                       items=[P.Range(lo=lo, hi=hi) for lo, hi in ranges],
                       timeout=timeout_ms / 1000 + 2.0)
    entries = list(rec.msg.items)
    deadline = time.monotonic() + 2.0
    while True:
        if on_message is not None:
            on_message(rec, len(entries))
        body: P.Census = rec.msg.body  # type: ignore[assignment]
        if body.n_ranges != len(ranges):
            raise ProtocolError(f"PC_CENSUS: {body.n_ranges} ranges, asked about {len(ranges)}")
        if not body.flags & P.CENSUS_MORE:
            return CensusResult(entries, ranges, list(body.range_refs)[:len(ranges)], body.result)
        while True:
            left = deadline - time.monotonic()
            nxt = conn.recv(left) if left > 0 else None
            if nxt is None:
                raise AgentError("census reply incomplete")
            if nxt.type is P.MsgType.PC_CENSUS and nxt.msg.body.req_id == req_id:
                break
            conn._unsolicited(nxt)
        rec = nxt
        entries.extend(rec.msg.items)


@dataclass
class Received:
    """A decoded message plus any file descriptors that came with it."""

    msg: P.Message
    fds: list[int] = field(default_factory=list)

    @property
    def type(self) -> P.MsgType:
        return self.msg.type


class AgentConnection:
    """Service side of one agent session."""

    def __init__(self, sock: socket.socket, *, allowed_uids: set[int] | None = None,
                 on_unsolicited: Callable[[Received], None] | None = None) -> None:
        self.sock = sock
        self.allowed_uids = allowed_uids
        self.on_unsolicited = on_unsolicited
        self.peer_pid, self.peer_uid, self.peer_gid = peer_credentials(sock)
        self.hello: P.Hello | None = None
        self.inbox: collections.deque[Received] = collections.deque()
        self.buffers: dict[int, CodeBufferHandle] = {}
        #: data buffers (counters), mapped RW in the client and here
        self.data_buffers: dict[int, CodeBufferHandle] = {}
        self.closed = False
        self._seq = 0
        self._req = 0
        self._send_lock = threading.Lock()
        self._recv_lock = threading.RLock()

    # ---- framing -------------------------------------------------------
    def fileno(self) -> int:
        return self.sock.fileno()

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def next_id(self) -> int:
        self._req = (self._req % 0xFFFFFFFE) + 1
        return self._req

    def send(self, msg_type: P.MsgType, body: ctypes.Structure,
             items: Iterable[ctypes.Structure] | None = None) -> None:
        """Send one message (fills the header)."""
        with self._send_lock:
            seq = self._next_seq()
            if msg_type in P.MSG_ARRAY:
                raw = P.pack_array_msg(body, msg_type, list(items or []), seq)
            else:
                raw = P.pack(body, msg_type, seq)
            self.send_raw(raw)

    def send_raw(self, raw: bytes) -> None:
        """Send bytes as one datagram, as they are (tests use it for bad input)."""
        try:
            self.sock.send(raw)
        except OSError as exc:
            self.closed = True
            raise AgentError(f"send to agent pid {self.peer_pid} failed: {exc}") from exc

    def recv(self, timeout: float | None) -> Received | None:
        """Receive and decode one message; None on timeout.  EOF raises AgentError."""
        with self._recv_lock:
            if self.closed:
                raise AgentError("session closed")
            if timeout is not None and not readable(self.sock.fileno(), timeout):
                return None
            fds = array.array("i")
            try:
                data, anc, flags, _ = self.sock.recvmsg(
                    P.MSG_MAX + 1, socket.CMSG_SPACE(4 * fds.itemsize))
            except (ConnectionResetError, OSError) as exc:
                self.closed = True
                raise AgentError(f"agent pid {self.peer_pid}: {exc}") from exc
            for level, ctype, cdata in anc:
                if level == socket.SOL_SOCKET and ctype == socket.SCM_RIGHTS:
                    fds.frombytes(cdata[: len(cdata) - (len(cdata) % fds.itemsize)])
            if not data and not anc:
                self.closed = True
                raise AgentError(f"agent pid {self.peer_pid} closed the session")
            try:
                if flags & socket.MSG_TRUNC or len(data) > P.MSG_MAX:
                    raise ProtocolError(f"oversized datagram from pid {self.peer_pid}")
                msg = P.unpack(data)
            except ProtocolError:
                for fd in fds:
                    os.close(fd)
                raise
            if msg.type not in _CARRIES_FD:   # descriptors nobody asked for: closed here
                for fd in fds:
                    os.close(fd)
                fds = array.array("i")
            return Received(msg, list(fds))

    def _unsolicited(self, rec: Received) -> None:
        self.inbox.append(rec)
        if self.on_unsolicited is not None:
            self.on_unsolicited(rec)

    # ---- handshake -----------------------------------------------------
    def handshake(self, *, service_pid: int, session_id: int, on_disconnect: int = 0,
                  map_wait_ms: int = 200, timeout: float = 2.0) -> P.Hello:
        """Receive HELLO, check the peer, answer HELLO_ACK.  Refusals send ERROR first."""
        rec = self.recv(timeout)
        if rec is None:
            raise AgentError(f"no HELLO from pid {self.peer_pid} within {timeout}s")
        for fd in rec.fds:   # a first message carries none the service would use
            os.close(fd)
        rec.fds.clear()
        if rec.type is not P.MsgType.HELLO:
            self.error(P.Result.E_PROTO, f"expected HELLO, got {rec.type.name}", rec.msg.seq)
            raise ProtocolError(f"first message was {rec.type.name}, not HELLO")
        hello: P.Hello = rec.msg.body  # type: ignore[assignment]
        if hello.pid != self.peer_pid:
            self.error(P.Result.E_DENIED, "pid does not match peer credentials", rec.msg.seq)
            raise AgentError(f"HELLO pid {hello.pid} != SO_PEERCRED pid {self.peer_pid}")
        if self.allowed_uids is not None and self.peer_uid not in self.allowed_uids:
            self.error(P.Result.E_DENIED, "uid not allowed", rec.msg.seq)
            raise AgentError(f"uid {self.peer_uid} of pid {self.peer_pid} is not allowed")
        self.hello = hello
        self.send(P.MsgType.HELLO_ACK, P.HelloAck(
            service_pid=service_pid, on_disconnect=on_disconnect, session_id=session_id,
            map_wait_ms=map_wait_ms))
        return hello

    def error(self, code: int, text: str, ref_seq: int = 0) -> None:
        """Best-effort ERROR message (the peer may be gone)."""
        try:
            self.send(P.MsgType.ERROR, P.Error(code=int(code), ref_seq=ref_seq,
                                               msg=text.encode()[: P.ERRMSG_MAX - 1]))
        except AgentError:
            pass

    # ---- requests ------------------------------------------------------
    def request(self, msg_type: P.MsgType, body: ctypes.Structure, *,
                items: list[ctypes.Structure] | None = None, timeout: float = 2.0) -> Received:
        """Send a request and wait (bounded) for its reply; returns the reply."""
        reply_type, id_field = _REPLY_OF[msg_type]
        want = getattr(body, id_field)
        self.send(msg_type, body, items)
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AgentError(f"pid {self.peer_pid}: no reply to {msg_type.name} "
                                 f"within {timeout}s")
            rec = self.recv(left)
            if rec is None:
                continue
            if rec.type is reply_type and getattr(rec.msg.body, id_field) == want:
                return rec
            if rec.type is P.MsgType.ERROR:
                err: P.Error = rec.msg.body  # type: ignore[assignment]
                raise AgentError(f"agent error {result_name(err.code)}: "
                                 f"{err.msg.decode(errors='replace')}")
            if rec.type is P.MsgType.BYE:
                self.closed = True
                raise AgentError(f"agent pid {self.peer_pid} said BYE")
            self._unsolicited(rec)

    def code_buffer(self, near: int, size: int, timeout: float = 2.0,
                    flags: int = 0) -> CodeBufferHandle:
        """Ask the agent for a code buffer (a data buffer with ``P.BUFFER_F_DATA``) within
        +-2 GiB of ``near``; map it RW here."""
        rec = self.request(P.MsgType.CODE_BUFFER_REQ,
                           P.CodeBufferReq(req_id=self.next_id(), flags=flags, near=near,
                                           size=size),
                           timeout=timeout)
        cb: P.CodeBuffer = rec.msg.body  # type: ignore[assignment]
        # the agent rounds up to its 2 MiB granule at most (clientfiles.code_buffer_problem)
        most = (size + (2 << 20) - 1) & ~((2 << 20) - 1)
        if cb.result == P.Result.OK and not size <= cb.size <= most:
            for fd in rec.fds:
                os.close(fd)
            raise ProtocolError(f"CODE_BUFFER of {cb.size:#x} bytes for a request of {size:#x}")
        if cb.result != P.Result.OK:
            for fd in rec.fds:
                os.close(fd)
            raise AgentError(f"code buffer refused: {result_name(cb.result)}")
        if len(rec.fds) != 1:
            for fd in rec.fds:
                os.close(fd)
            raise ProtocolError(f"CODE_BUFFER carried {len(rec.fds)} fds, expected 1")
        fd = rec.fds[0]
        try:
            mem = mmap.mmap(fd, cb.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        handle = CodeBufferHandle(cb.buffer_id, cb.base, cb.size, mem)
        self.buffer_table(flags)[cb.buffer_id] = handle
        return handle

    def buffer_table(self, flags: int) -> dict[int, CodeBufferHandle]:
        """Where a buffer of CODE_BUFFER_REQ ``flags`` is kept: data buffers apart, so
        that code placement never sees them."""
        return self.data_buffers if flags & P.BUFFER_F_DATA else self.buffers

    def free_buffer(self, buffer_id: int, timeout: float = 2.0) -> int:
        rec = self.request(P.MsgType.CODE_BUFFER_FREE,
                           P.CodeBufferFree(req_id=self.next_id(), buffer_id=buffer_id),
                           timeout=timeout)
        result = rec.msg.body.result
        for table in (self.buffers, self.data_buffers):
            if result == P.Result.OK and buffer_id in table:
                table.pop(buffer_id).close()
        return result

    def region(self, region_id: int, code_lo: int, code_hi: int,
               exits: list[tuple[int, int]], timeout: float = 2.0) -> int:
        """Describe a region to the agent (for its map-change hooks)."""
        if len(exits) > P.MAX_EXITS:
            raise AgentError(f"region {region_id}: {len(exits)} exit ranges > {P.MAX_EXITS}")
        body = P.Region(req_id=self.next_id(), region_id=region_id, code_lo=code_lo,
                        code_hi=code_hi, n_exits=len(exits))
        for k, (lo, hi) in enumerate(exits):
            body.exits[k].lo, body.exits[k].hi = lo, hi
        return self.request(P.MsgType.REGION, body, timeout=timeout).msg.body.result

    def region_forget(self, region_id: int, timeout: float = 2.0) -> int:
        return self.request(P.MsgType.REGION_FORGET,
                            P.RegionForget(req_id=self.next_id(), region_id=region_id),
                            timeout=timeout).msg.body.result

    def frames(self, add: bool, region_id: int, addr: int, length: int,
               timeout: float = 2.0) -> int:
        """FRAMES_ADD (``add``) or FRAMES_DEL of the .eh_frame records [addr, addr+length)
        in a code buffer; the agent's result."""
        body = P.Frames(req_id=self.next_id(), region_id=region_id, addr=addr, len=length)
        return self.request(P.MsgType.FRAMES_ADD if add else P.MsgType.FRAMES_DEL, body,
                            timeout=timeout).msg.body.result

    def _batch(self, msg_type: P.MsgType, sites: list[P.PatchSite], timeout: float) -> list[int]:
        if not 0 < len(sites) <= P.MAX_SITES:
            raise AgentError(f"a batch holds 1..{P.MAX_SITES} sites, not {len(sites)}")
        rec = self.request(msg_type, P.PatchBatch(batch_id=self.next_id()), items=sites,
                           timeout=timeout)
        results = [r.result for r in rec.msg.items]
        if [r.site for r in rec.msg.items] != [s.site for s in sites]:
            raise ProtocolError("PATCH_RESULT sites do not match the request")
        return results

    def patch(self, sites: list[P.PatchSite], timeout: float = 5.0) -> list[int]:
        return self._batch(P.MsgType.PATCH, sites, timeout)

    def unpatch(self, sites: list[P.PatchSite], timeout: float = 5.0) -> list[int]:
        return self._batch(P.MsgType.UNPATCH, sites, timeout)

    def census(self, timeout_ms: int = 200,
               ranges: Sequence[tuple[int, int]] = ()) -> CensusResult:
        """Every thread's PC and, for ``ranges`` (ascending, disjoint, at most
        MAX_CENSUS_RANGES), the words of its registers and stack inside them (a
        multi-message reply is gathered here)."""
        return gather_census(self, timeout_ms, ranges)

    def transfer(self, region_id: int, points: dict[int, int] | list[tuple[int, int]],
                 timeout_ms: int = 100) -> P.TransferResult:
        """TRANSFER: threads stopped at an original address of ``points`` continue at
        its replacement address (codegen's transfer map of an announced region)."""
        pts = sorted(dict(points).items())
        return self._move(P.MsgType.TRANSFER, region_id,
                          [P.TransferPoint(orig=o, repl=r) for o, r in pts], timeout_ms)

    def evict(self, region_id: int, points: dict[int, int] | list[tuple[int, int]],
              timeout_ms: int = 100) -> P.TransferResult:
        """EVICT: threads stopped at a replacement address of ``points`` (replacement ->
        original: codegen's eviction map of an announced region) continue at its
        original address.  ``left`` in the result counts threads that answered from
        inside the region's code at no point."""
        pts = sorted(dict(points).items())
        return self._move(P.MsgType.EVICT, region_id,
                          [P.TransferPoint(orig=o, repl=r) for r, o in pts], timeout_ms)

    def _move(self, kind: P.MsgType, region_id: int, items: list[P.TransferPoint],
              timeout_ms: int) -> P.TransferResult:
        if not 0 < len(items) <= P.MAX_TRANSFER:
            raise AgentError(f"a {kind.name} holds 1..{P.MAX_TRANSFER} points, not {len(items)}")
        rec = self.request(kind, P.Transfer(req_id=self.next_id(), region_id=region_id,
                                            timeout_ms=timeout_ms),
                           items=items, timeout=timeout_ms / 1000 + 3.0)
        return rec.msg.body

    def sampler_start(self, period_us: int, ring_entries: int, flags: int = 0,
                      timeout: float = 2.0) -> tuple[int, int]:
        """Start the agent-timer sampler; returns (ring fd, ring bytes).  With
        ``SAMPLER_LISTED`` only the threads :meth:`sampler_thread` names are sampled."""
        rec = self.request(P.MsgType.SAMPLER_START,
                           P.SamplerStart(req_id=self.next_id(), period_us=period_us,
                                          ring_entries=ring_entries, flags=flags),
                           timeout=timeout)
        body: P.SamplerRing = rec.msg.body  # type: ignore[assignment]
        if body.result != P.Result.OK or len(rec.fds) != 1:
            for fd in rec.fds:
                os.close(fd)
            raise AgentError(f"sampler refused: {result_name(body.result)}")
        return rec.fds[0], body.ring_bytes

    def sampler_thread(self, tid: int, on: bool, timeout: float = 2.0) -> int:
        """Arm (again) or delete the timer of one thread of a listed sampler; the
        agent's result (OK, E_UNKNOWN: no such thread in the client, E_INVAL: not
        listed or the agent's own thread, E_LIMIT: timer table full)."""
        return self.request(P.MsgType.SAMPLER_THREAD,
                            P.SamplerThread(req_id=self.next_id(), tid=tid, on=int(on)),
                            timeout=timeout).msg.body.result

    def sampler_stop(self, timeout: float = 2.0) -> int:
        return self.request(P.MsgType.SAMPLER_STOP, P.Ack(req_id=self.next_id()),
                            timeout=timeout).msg.body.result

    def notices(self, flags: int, timeout: float = 2.0) -> int:
        """Tell an agent with HELLO_QUIET_THREADS which notices to send (NOTICE_*)."""
        return self.request(P.MsgType.NOTICES, P.Notices(req_id=self.next_id(), flags=flags),
                            timeout=timeout).msg.body.result

    def ack(self, req_id: int, result: int = 0) -> None:
        """Answer an agent request (MAP_CHANGED)."""
        self.send(P.MsgType.ACK, P.Ack(req_id=req_id, result=result))

    def bye(self, revert: bool = False, dormant: bool = False) -> None:
        """End the session; ``dormant`` (`dbr detach`): the agent reverts every patch
        and connects no more until `dbr attach` activates it."""
        flags = (P.BYE_REVERT if revert else 0) | (P.BYE_DORMANT if dormant else 0)
        try:
            self.send(P.MsgType.BYE, P.Bye(flags=flags))
        except AgentError:
            pass

    def close(self) -> None:
        self.closed = True
        for table in (self.buffers, self.data_buffers):
            for h in table.values():
                h.close()
            table.clear()
        try:
            self.sock.close()
        except OSError:
            pass


def readable(fd: int, timeout: float) -> bool:
    """Whether ``fd`` is readable (or hung up) within ``timeout`` seconds.  poll, not
    select: a service with many clients has descriptors above FD_SETSIZE (1024)."""
    p = select.poll()
    p.register(fd, select.POLLIN | select.POLLPRI)
    return bool(p.poll(max(0, int(timeout * 1000 + 0.999))))


def result_name(code: int) -> str:
    """Symbolic name of a dbr_result code (or the number if unknown)."""
    try:
        return P.Result(code).name
    except ValueError:
        return str(code)


def jmp_rel32(site: int, target: int) -> bytes:
    """The 5-byte patch: ``jmp rel32`` from ``site`` to ``target``."""
    disp = target - (site + 5)
    if not -(1 << 31) <= disp < (1 << 31):
        raise AgentError(f"target {target:#x} out of rel32 reach of {site:#x}")
    return b"\xe9" + struct.pack("<i", disp)


def make_site(site: int, target: int, orig: bytes, variant: int = P.Variant.INT3,
              region_id: int = 0, inner: Sequence[int] = ()) -> P.PatchSite:
    """A PatchSite record; ``orig`` is the 5 original bytes.  ``inner``: the instruction
    boundaries strictly inside the 5 bytes (addresses) of an entry site, the first
    instructions of a function (SITE_F_ENTRY: the agent installs it with the int3
    protocol only, and only when no thread is inside); empty for a site that is one
    instruction of at least 5 bytes."""
    s = P.PatchSite(site=site, target=target, region_id=region_id, variant=int(variant),
                    len=P.PATCH_LEN)
    for k, b in enumerate(orig[:8]):
        s.orig[k] = b
    if inner:
        offs = sorted({a - site for a in inner})
        if offs[0] < 1 or offs[-1] >= P.PATCH_LEN:
            raise AgentError(f"entry site {site:#x}: inner boundaries {offs} not in "
                             f"1..{P.PATCH_LEN - 1}")
        if int(variant) != P.Variant.INT3:
            raise AgentError(f"entry site {site:#x}: int3 protocol only")
        s.flags = P.SITE_F_ENTRY
        s.inner = sum(1 << k for k in offs)
    return s


def site_inner(s: P.PatchSite) -> list[int]:
    """The inner boundaries (addresses) of an entry site, [] for a one-instruction site."""
    if not s.flags & P.SITE_F_ENTRY:
        return []
    return [s.site + k for k in range(1, P.PATCH_LEN) if s.inner >> k & 1]


def listen(path: str, backlog: int = 64, mode: int = 0o666) -> socket.socket:
    """Bind the agent socket (SOCK_SEQPACKET) at ``path``, replacing a stale file."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    s.bind(path)
    os.chmod(path, mode)
    s.listen(backlog)
    return s
