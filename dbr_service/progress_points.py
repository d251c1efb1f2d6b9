"""Progress points of a speed check: how a program with little I/O is measured
(docs/decisions/0028-speed-checks.md).

A progress point is an address of original code that the program passes equally
often per unit of its work whichever code runs.  The points chosen are the checked
regions' exit targets -- where their copies jump back to original code, which is where
the original code goes the same way -- that lie outside every held region's copied
code (so no copy runs past them) and outside every patch site.  Each is patched, for
the length of the check and in both of its phases, to a counting trampoline
(codegen/counting.py): the same counter code in both phases, so its cost falls on
both sides of every pair.  A trampoline is installed like a tiny region, through the
installer's relocation and patch machinery; its counter lives in a data buffer
(CODE_BUFFER_REQ with DBR_BUFFER_F_DATA) that the service reads.

A point is used only where a plain patch site is valid (its first instruction spans
5 bytes or more) and the counter's flags are dead; where in doubt, it is not used.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from dbr_service import protocol as P
from dbr_service.agentconn import CodeBufferHandle
from dbr_service.codegen.counting import counting_trampoline
from dbr_service.codegen.relocate import CannotRelocate, Relocator
from dbr_service.errors import AgentError, CodegenError, ProtocolError
from dbr_service.installed import InstalledRegion
from dbr_service.states import HELD, InstallState

#: Points counted in one check at most (each is a patch while the check runs).
POINTS_MAX = 16
#: Bytes of one counter.
SLOT = 8
#: A data buffer is used for counters within this distance of both ends (rel32 reach
#: less the agent's own margin).
_REACH = (1 << 31) - (64 << 10)


def _overlaps(lo: int, hi: int, ranges: Sequence[tuple[int, int]]) -> bool:
    return any(a < hi and lo < b for a, b in ranges)


def choose_points(checked: Sequence[InstalledRegion], held: Sequence[InstalledRegion],
                  read_original: Callable[[int, int], bytes],
                  limit: int = POINTS_MAX) -> list[int]:
    """The progress points of a check of ``checked``, among every region ``held``
    (installed or suspended, the checked ones included): exit targets of the checked
    regions' copies that no held region copies or patches, where a counting
    trampoline can be placed, in address order, at most ``limit``."""
    copied = [r for reg in held for r in reg.orig_ranges]
    sites = [(s.site, s.site + P.PATCH_LEN) for reg in held
             for s in [*reg.sites, *reg.suspended_sites]]
    rel = Relocator()
    out: list[int] = []
    for t in sorted({t for reg in checked for _, t in reg.gen.exits}):
        if len(out) >= limit:
            break
        if _overlaps(t, t + P.PATCH_LEN, copied) or _overlaps(t, t + P.PATCH_LEN, sites):
            continue
        try:
            code = read_original(t, 64)
            if rel.decode(code, t).size < P.PATCH_LEN:
                continue        # not a plain site: a thread may be inside its bytes
            counting_trampoline(code, t, t, t, rel)
        except (CannotRelocate, OSError, ValueError):
            continue
        out.append(t)
    return out


@dataclass
class TrampolineCode:
    """A counting trampoline as the installer takes a region's code (Generated)."""

    code: bytes
    base: int
    entries: dict[int, int]
    addr_map: list[tuple[int, int, int]]
    exits: list[tuple[int, int]]
    transfers: dict[int, int] = field(default_factory=dict)


class CounterSpace:
    """A session's data buffers and the counters handed out in them.  Kept for the
    session: code within their reach may still address them (a trampoline in
    quarantine), so a counter is never handed out twice."""

    def __init__(self, conn) -> None:
        self.conn = conn
        self.buffers: list[CodeBufferHandle] = []
        self.used: dict[int, int] = {}     # buffer id -> bytes handed out

    def counter(self, near: int) -> tuple[CodeBufferHandle, int]:
        """A fresh zeroed 8-byte counter within reach of ``near``: (its buffer, its
        address).  A new data buffer if no buffer in reach has one left."""
        for buf in self.buffers:
            if self.used[buf.buffer_id] + SLOT <= buf.size and \
                    abs(buf.base - near) < _REACH and abs(buf.base + buf.size - near) < _REACH:
                break
        else:
            buf = self.conn.code_buffer(near=near, size=4096, flags=P.BUFFER_F_DATA)
            self.buffers.append(buf)
            self.used[buf.buffer_id] = 0
        addr = buf.base + self.used[buf.buffer_id]
        self.used[buf.buffer_id] += SLOT
        buf.write(addr, bytes(SLOT))
        return buf, addr


class ProgressPoints:
    """The counting trampolines of one speed check."""

    def __init__(self, installer, space: CounterSpace) -> None:
        self.installer = installer
        self.space = space
        #: point -> (its trampoline's region id, counter buffer, counter address)
        self.points: dict[int, tuple[int, CodeBufferHandle, int]] = {}
        self.refused: dict[int, str] = {}                   # point -> why not counted

    def install(self, points: Sequence[int]) -> int:
        """Patch each point to a counting trampoline; how many are counted.  A point
        whose trampoline cannot be made or patched is left alone (``refused``)."""
        inst = self.installer
        rel = Relocator()
        for t in points:
            try:
                code = inst.read_original(t, 64)
                counting_trampoline(code, t, t, t, rel)    # refused before a counter
                buf, ctr = self.space.counter(t)
                probe = counting_trampoline(code, t, t, ctr, rel)
                chunk = inst.reserve(len(probe.code), [t, t + probe.covered, ctr])
                tr = counting_trampoline(code, t, chunk.addr, ctr, rel)
                gen = TrampolineCode(tr.code, chunk.addr, {t: chunk.addr},
                                     [(chunk.addr, chunk.addr + len(tr.code), t)],
                                     list(tr.exits))
                reg = inst.install(chunk, gen, name=f"count@{t:#x}",
                                   orig_ranges=[(t, t + tr.covered)],
                                   exit_ranges=[(t, t + tr.covered + 1),
                                                *((x, x + 1) for _, x in tr.exits)])
            except (CodegenError, AgentError, ProtocolError, OSError) as exc:
                self.refused[t] = str(exc)
                continue
            if reg.state is InstallState.INSTALLED:
                self.points[t] = (reg.region_id, buf, ctr)
            else:
                self.refused[t] = reg.why_removed
        return len(self.points)

    def read(self) -> int | None:
        """Passes of every counted point so far; None if there is none, or one of them
        is no longer patched (a map change took it: the sum would lose its passes)."""
        if not self.points:
            return None
        total = 0
        for rid, buf, ctr in self.points.values():
            reg = self.installer.regions.get(rid)
            n = buf.read_u64(ctr)
            if reg is None or reg.state is not InstallState.INSTALLED or n is None:
                return None
            total += n
        return total

    def remove(self, why: str = "speed check over") -> None:
        """Restore every point (the trampolines' code goes to quarantine)."""
        for rid, _, _ in self.points.values():
            reg = self.installer.regions.get(rid)
            if reg is not None and reg.state in HELD:
                try:
                    self.installer.uninstall(rid, why)
                except AgentError:
                    pass
        self.points.clear()
