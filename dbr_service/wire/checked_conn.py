"""The agent connection as a session's installer uses it, its replies checked."""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable, Sequence
from typing import Any

from dbr_service.wire import protocol as P
from dbr_service.wire.agentconn import (AgentConnection, CensusResult, CodeBufferHandle, Received,
                                        gather_census, result_name)
from dbr_service.common.clientfiles import TID_MAX, ProcHandle, code_buffer_problem
from dbr_service.common.errors import AgentError, ProtocolError

#: Most census entries gathered from one census (PC_CENSUS ... CENSUS_MORE).
CENSUS_ENTRIES_MAX = 1 << 16


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

    def code_buffer(self, near: int, size: int, timeout: float = 2.0,
                    flags: int = 0) -> CodeBufferHandle:
        """Ask for a code buffer (a data buffer with ``P.BUFFER_F_DATA``, at most
        ``P.DATA_BUFFER_MAX`` bytes) near ``near`` and map it here once it checks out
        (clientfiles.code_buffer_problem): a hostile size or fd is never mapped."""
        conn = self._conn
        data = bool(flags & P.BUFFER_F_DATA)
        if flags & ~P.BUFFER_F_DATA or (data and not 0 < size <= P.DATA_BUFFER_MAX):
            raise AgentError(f"no such buffer to ask for: flags {flags:#x}, {size} bytes")
        rec = conn.request(P.MsgType.CODE_BUFFER_REQ,
                           P.CodeBufferReq(req_id=conn.next_id(), flags=flags, near=near,
                                           size=size),
                           timeout=timeout)
        cb: P.CodeBuffer = rec.msg.body  # type: ignore[assignment]
        fds, rec.fds = list(rec.fds), []
        try:
            if cb.result != P.Result.OK:
                raise AgentError(f"code buffer refused: {result_name(cb.result)}")
            why = (f"{len(fds)} fds, expected 1" if len(fds) != 1 else
                   f"buffer id {cb.buffer_id} in use"
                   if cb.buffer_id in conn.buffers or cb.buffer_id in conn.data_buffers else
                   code_buffer_problem(self._proc, fds[0], cb.base, cb.size, size, data))
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
        conn.buffer_table(flags)[cb.buffer_id] = handle
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
