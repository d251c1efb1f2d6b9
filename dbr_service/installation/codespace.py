"""Code space for replacement code in one client: chunks of its code buffers, their
quarantine once unused, and the censuses that free them (reclamation).

:class:`CodeSpace` hands out space in code buffers that lie within +-2 GiB of the
module a region patches (invariant 4), asks the agent for a new buffer when none
fits, and reuses freed space only after a quarantine period *and* two censuses in a
row that find neither a thread's PC nor a word of its registers or stack inside it
(invariant 1: a thread may sit in replacement code, hold such a PC in a signal frame,
or, once replacement code makes real calls, a return address into it in any frame).
Unpatching takes a region's entries away at once; its code stays mapped and
executable until then, and a thread that never returns keeps it for good.  A chunk
whose code calls into another chunk's (calls into live copies, installation/install.py) keeps that
chunk allocated (:meth:`CodeSpace.link`).  The installer (installation/install.py) drives it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from dbr_service.wire import protocol as P
from dbr_service.wire.agentconn import AgentConnection, CodeBufferHandle
from dbr_service.common.errors import AgentError, CodegenError

REL32 = (1 << 31) - 1
#: Chunks start on a 64-byte line: a region's code then sits at the same offsets within
#: cache lines (and fetch blocks) wherever it is placed, so two copies of the same code
#: run alike; the loop heads' alignment inside the code is codegen/layout.py's.
ALIGN = 64


@dataclass
class Chunk:
    """Space for one region's code (and the unwind information after it) in a buffer."""

    buffer: CodeBufferHandle
    addr: int
    size: int
    #: Unwind information the agent has for code in the chunk: (region id, address,
    #: length) of each blob FRAMES_ADD named, withdrawn when the chunk is freed.
    frames: list[tuple[int, int, int]] = field(default_factory=list)
    #: Chunks whose code this chunk's code calls (CodeSpace.link), and how many
    #: allocated chunks call into this one: it is not freed while any does.
    uses: list[Chunk] = field(default_factory=list, compare=False, repr=False)
    users: int = field(default=0, compare=False)


@dataclass
class _Quarantined:
    chunk: Chunk
    since: float
    clean_censuses: int = 0
    #: What held the chunk at the last census: words of threads' stacks and registers
    #: inside it, threads whose PC is inside it, threads whose whereabouts are unknown
    #: (no answer, a stack not scanned whole), and whether that census left it out.
    stack_refs: int = 0
    pcs: int = 0
    unknown: int = 0
    uncovered: bool = False
    censuses: int = 0

    def retention(self, now: float) -> dict[str, Any]:
        """What `dbr ctl regions` shows of a removed region whose code is still kept."""
        return {"stack_refs": self.stack_refs, "threads_inside": self.pcs,
                "threads_unknown": self.unknown, "clean_censuses": self.clean_censuses,
                "censuses": self.censuses, "quarantined_s": round(max(0.0, now - self.since), 3),
                "callers": self.chunk.users}


class CodeSpace:
    """Bump allocation inside code buffers near each module, with quarantined reuse."""

    def __init__(self, conn: AgentConnection, *, buffer_size: int = 1 << 20,
                 quarantine_s: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.conn = conn
        self.buffer_size = buffer_size
        self.quarantine_s = quarantine_s
        self.clock = clock
        self.free: list[Chunk] = []              # reusable holes
        self.bump: dict[int, int] = {}           # buffer_id -> next free offset
        self.quarantine: list[_Quarantined] = []

    @staticmethod
    def _reaches(buf: CodeBufferHandle, addr: int, size: int, points: Sequence[int]) -> bool:
        return all(abs(addr - p) < REL32 - size and abs(addr + size - p) < REL32 for p in points)

    def span_fits(self, size: int, reach: Sequence[int]) -> bool:
        """Whether one buffer can be placed with every address of ``reach`` in rel32
        reach (the test :meth:`allocate` applies before asking for a new buffer)."""
        return max(reach) - min(reach) <= REL32 - max(self.buffer_size, size)

    def allocate(self, size: int, reach: Sequence[int]) -> Chunk:
        """Space for ``size`` bytes from which every address in ``reach`` is rel32-reachable."""
        size = (size + ALIGN - 1) & ~(ALIGN - 1)
        for i, c in enumerate(self.free):
            if c.size >= size and self._reaches(c.buffer, c.addr, size, reach):
                self.free.pop(i)
                if c.size > size:
                    self.free.append(Chunk(c.buffer, c.addr + size, c.size - size))
                return Chunk(c.buffer, c.addr, size)
        for buf in self.conn.buffers.values():
            off = self.bump.get(buf.buffer_id, 0)
            if off + size <= buf.size and self._reaches(buf, buf.base + off, size, reach):
                self.bump[buf.buffer_id] = off + size
                return Chunk(buf, buf.base + off, size)
        want = max(self.buffer_size, size)
        near = (min(reach) + max(reach)) // 2
        if not self.span_fits(size, reach):
            raise CodegenError("region reaches addresses more than 2 GiB apart")
        buf = self.conn.code_buffer(near=near, size=want)
        if not self._reaches(buf, buf.base, size, reach):
            raise CodegenError(f"agent placed a buffer at {buf.base:#x}, out of reach of "
                               f"{near:#x}")
        self.bump[buf.buffer_id] = size
        return Chunk(buf, buf.base, size)

    def release(self, chunk: Chunk) -> None:
        """Code no longer entered: quarantine it until censuses prove nobody is inside."""
        self.quarantine.append(_Quarantined(chunk, self.clock()))

    @staticmethod
    def link(user: Chunk, used: Chunk) -> None:
        """``user``'s code calls into ``used``'s: ``used`` is not freed while ``user`` is
        allocated (installed or quarantined); freeing ``user`` lets it go.  Links are
        made only to code already installed, so they form no cycle."""
        if used is not user and not any(u is used for u in user.uses):
            user.uses.append(used)
            used.users += 1

    def census_ranges(self) -> list[tuple[int, int]]:
        """The ranges the next census asks about: the quarantined chunks, ascending,
        one range each (overlapping ones joined).  Adjacent chunks stay apart: a word in
        a range holds every chunk in it, and a thread parked in the newest copy of a
        region must not hold the older copies laid out right before it.  Beyond
        MAX_CENSUS_RANGES the smallest gaps between them are closed (conservative, and
        least so this way)."""
        spans: list[tuple[int, int]] = []
        for lo, hi in sorted((q.chunk.addr, q.chunk.addr + q.chunk.size) for q in self.quarantine):
            if spans and lo < spans[-1][1]:
                spans[-1] = (spans[-1][0], max(spans[-1][1], hi))
            else:
                spans.append((lo, hi))
        excess = len(spans) - P.MAX_CENSUS_RANGES
        if excess <= 0:
            return spans
        gaps = sorted(range(len(spans) - 1), key=lambda k: (spans[k + 1][0] - spans[k][1], k))
        closed = set(gaps[:excess])        # the gap after spans[k] is closed
        out = [spans[0]]
        for k in range(1, len(spans)):
            if k - 1 in closed:
                out[-1] = (out[-1][0], spans[k][1])
            else:
                out.append(spans[k])
        return out

    def census_done(self, census: Sequence[P.CensusEntry]) -> int:
        """Feed one census; returns how many chunks became reusable.

        A chunk is held while any thread's PC is inside it, any words of threads'
        stacks or registers are (the census's range totals), or any thread's
        whereabouts are unknown (NO_REPLY, UNKNOWN: every chunk), and when the census
        did not ask about it; and, even once clean, while a chunk that calls into it
        (:meth:`link`) is allocated.  ``census`` is what AgentConnection.census returns (a
        CensusResult); a plain list of entries (recorded by hand) has no range totals:
        an entry with refs holds the chunk of its first_ref, and every chunk if it has
        more than one."""
        freed = 0
        now = self.clock()
        ranges = getattr(census, "ranges", None)
        range_refs = getattr(census, "range_refs", None) or []
        failed = getattr(census, "result", P.Result.OK) != P.Result.OK
        unknown = sum(1 for e in census if e.state in (P.CENSUS_NO_REPLY, P.CENSUS_UNKNOWN))
        scattered = ranges is None and any(e.refs > 1 for e in census)
        clean = []
        for q in self.quarantine:
            lo, hi = q.chunk.addr, q.chunk.addr + q.chunk.size
            q.pcs = sum(1 for e in census if e.state in (P.CENSUS_OK, P.CENSUS_UNKNOWN)
                        and lo <= e.pc < hi)
            if ranges is None:
                q.uncovered = False
                q.stack_refs = sum(e.refs for e in census if e.refs and lo <= e.first_ref < hi)
            else:
                q.uncovered = not any(rlo <= lo and hi <= rhi for rlo, rhi in ranges)
                q.stack_refs = sum(n for (rlo, rhi), n in zip(ranges, range_refs)
                                   if rlo < hi and lo < rhi)
            q.unknown = unknown
            q.censuses += 1
            held = failed or unknown or scattered or q.uncovered or q.pcs or q.stack_refs
            q.clean_censuses = 0 if held else q.clean_censuses + 1
            if q.clean_censuses >= 2 and now - q.since >= self.quarantine_s:
                clean.append(q)
        # a chunk that code still allocated calls into waits for that code to go; callers
        # go first, which may let the chunks they call go in the same round
        progress = True
        while progress:
            progress = False
            for q in [q for q in clean if q.chunk.users == 0]:
                clean.remove(q)
                self._free(q.chunk)
                self.quarantine = [x for x in self.quarantine if x is not q]
                freed += 1
                progress = True
        return freed

    def _free(self, chunk: Chunk) -> None:
        self._frames_del(chunk)
        chunk.buffer.write(chunk.addr, b"\xcc" * chunk.size)  # int3 fill
        for u in chunk.uses:
            u.users -= 1
        chunk.uses = []
        self.free.append(chunk)

    def _frames_del(self, chunk: Chunk) -> None:
        """Withdraw the chunk's unwind information before its bytes go (nothing runs
        there any more: the censuses found nothing of it)."""
        for rid, addr, n in chunk.frames:
            try:
                self.conn.frames(False, rid, addr, n)
            except AgentError:
                pass      # a session that ended: the agent keeps what it had
        chunk.frames = []

    def retained(self, chunk: Chunk) -> dict[str, Any] | None:
        """What holds a released chunk (:meth:`_Quarantined.retention`), or None once it
        is free again (or was never released).  Safe from any thread."""
        now = self.clock()
        for q in list(self.quarantine):
            if q.chunk is chunk:
                return q.retention(now)
        return None
