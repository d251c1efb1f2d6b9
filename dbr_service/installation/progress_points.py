"""Progress points of a speed check: how a program with little I/O is measured
(docs/decisions/0028-speed-checks.md).

A progress point is an address of original code that the program passes equally
often per unit of its work whichever code runs.  Two kinds are counted:

* **Entry points**: a checked region's plain entry sites that no edge inside the
  region targets (a loop head is passed by its back edge inside the copy: not one),
  of a region that neither calls another's copy nor is called by one (calls that
  enter a copy without passing its site).  With the regions in, the site is patched
  to a *counting entry* instead of the copy's entry: ``lock inc`` of the counter and
  ``jmp`` to the copy's entry; with them out, to a counting trampoline at the site.
* **Exit points**: the checked regions' exit targets, where their copies jump back
  to original code just where the original code goes.  Patched to a counting
  trampoline in both phases.

Either kind lies outside every other held region's copied code (no copy runs past
it).  Both phases run the same counter instruction per pass, so its cost falls on
both sides of every pair.  Trampolines are installed like tiny regions, through the
installer's relocation and patch machinery; counters live in a data buffer
(CODE_BUFFER_REQ with DBR_BUFFER_F_DATA) that the service reads.

A point is used only where a plain patch site is valid (its first instruction spans
5 bytes or more) and the counter's flags are dead; where in doubt, it is not used.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from dbr_service.wire import protocol as P
from dbr_service.wire.agentconn import CodeBufferHandle, make_site
from dbr_service.codegen.counting import counting_entry, counting_trampoline
from dbr_service.codegen.relocate import CannotRelocate, Relocator
from dbr_service.common.errors import AgentError, CodegenError, ProtocolError
from dbr_service.installation.installed import InstalledRegion
from dbr_service.common.states import HELD, InstallState

#: Points counted in one check at most (each is a patch while the check runs).
POINTS_MAX = 16
#: Bytes of one counter.
SLOT = 8
#: Bytes of a counting entry: ``lock inc qword [rip+d]``, ``jmp rel32``.
COUNTING_ENTRY_LEN = 13
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

    def forget(self, buffers: Sequence[CodeBufferHandle]) -> None:
        """The program unmapped these (the agent forgot them): no counter goes there."""
        self.buffers = [b for b in self.buffers if b not in buffers]

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


@dataclass
class _Entry:
    """A counted entry site of a checked region."""

    region_id: int
    site: int
    trampoline_id: int          # the counting trampoline at the site (original phases)
    stub: Any                   # the chunk holding the counting entry (codespace.Chunk)
    direct: P.PatchSite         # the region's own record for the site


class ProgressPoints:
    """The counting trampolines and counting entries of one speed check."""

    def __init__(self, installer, space: CounterSpace) -> None:
        self.installer = installer
        self.space = space
        #: point -> (its trampoline's region id, counter buffer, counter address)
        self.points: dict[int, tuple[int, CodeBufferHandle, int]] = {}
        self.refused: dict[int, str] = {}                   # point -> why not counted
        self.entries: dict[int, _Entry] = {}                # entry point -> its parts

    def _trampoline(self, t: int, buf: CodeBufferHandle, ctr: int, rel: Relocator):
        """Install the counting trampoline for ``t`` (patched); its InstalledRegion."""
        inst = self.installer
        code = inst.read_original(t, 64)
        probe = counting_trampoline(code, t, t, ctr, rel)
        chunk = inst.reserve(len(probe.code), [t, t + probe.covered, ctr])
        tr = counting_trampoline(code, t, chunk.addr, ctr, rel)
        gen = TrampolineCode(tr.code, chunk.addr, {t: chunk.addr},
                             [(chunk.addr, chunk.addr + len(tr.code), t)], list(tr.exits))
        return inst.install(chunk, gen, name=f"count@{t:#x}",
                            orig_ranges=[(t, t + tr.covered)],
                            exit_ranges=[(t, t + tr.covered + 1),
                                         *((x, x + 1) for _, x in tr.exits)])

    def install_entries(self, checked: Sequence[InstalledRegion],
                        held: Sequence[InstalledRegion]) -> int:
        """Count the checked regions' entry points (module docstring); each region is
        suspended and resumed once to retarget its sites.  How many are counted."""
        inst = self.installer
        rel = Relocator()
        for reg in checked:
            if reg.state is not InstallState.INSTALLED or reg.calls_into or \
                    inst.linkers(reg):
                continue
            others = [r for x in held if x is not reg for r in x.orig_ranges]
            wanted = []
            for s in reg.patched_sites:
                if s.flags & P.SITE_F_ENTRY or s.site not in reg.free_entries or \
                        s.site in self.points or _overlaps(s.site, s.site + P.PATCH_LEN, others):
                    continue
                try:
                    # the site holds the region's jmp now: its own bytes from the record
                    code = bytes(s.orig)[:P.PATCH_LEN] + \
                        inst.read_original(s.site + P.PATCH_LEN, 64 - P.PATCH_LEN)
                    counting_trampoline(code, s.site, s.site, s.site, rel)
                except (CannotRelocate, OSError, ValueError) as exc:
                    self.refused[s.site] = str(exc)
                    continue
                wanted.append(s)
            if wanted:
                self._count_entries(reg, wanted, rel)
        return len(self.entries)

    def _count_entries(self, reg: InstalledRegion, wanted: list[P.PatchSite],
                       rel: Relocator) -> None:
        inst = self.installer
        inst.suspend(reg.region_id)
        retarget: dict[int, P.PatchSite] = {}
        try:
            for s in wanted:
                try:
                    buf, ctr = self.space.counter(s.site)
                    entry = reg.gen.entries[s.site]
                    stub = inst.reserve(COUNTING_ENTRY_LEN, [s.site, ctr, entry])
                    stub.buffer.write(stub.addr, counting_entry(stub.addr, ctr, entry))
                    tramp = self._trampoline(s.site, buf, ctr, rel)
                    if tramp.state is not InstallState.INSTALLED:
                        inst.space.release(stub)
                        self.refused[s.site] = tramp.why_removed
                        continue
                    inst.suspend(tramp.region_id)
                except (CodegenError, AgentError, ProtocolError, OSError) as exc:
                    self.refused[s.site] = str(exc)
                    continue
                retarget[s.site] = make_site(s.site, stub.addr, bytes(s.orig)[:P.PATCH_LEN],
                                             s.variant, reg.region_id)
                self.entries[s.site] = _Entry(reg.region_id, s.site, tramp.region_id, stub, s)
                self.points[s.site] = (tramp.region_id, buf, ctr)
        finally:
            _retarget(reg, retarget)
            inst.resume(reg.region_id)

    def original_phase(self, region_id: int) -> None:
        """The region was just suspended: its counted entries go to their trampolines."""
        for e in self.entries.values():
            t = self.installer.regions.get(e.trampoline_id)
            if e.region_id == region_id and t is not None and \
                    t.state is InstallState.SUSPENDED:
                self.installer.resume(e.trampoline_id)

    def replacement_phase(self, region_id: int) -> None:
        """The region is about to be resumed: its entries' trampolines come off first."""
        for e in self.entries.values():
            t = self.installer.regions.get(e.trampoline_id)
            if e.region_id == region_id and t is not None and \
                    t.state is InstallState.INSTALLED:
                self.installer.suspend(e.trampoline_id)

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
        is gone (a map change took its trampoline or its region: the sum would lose
        its passes)."""
        if not self.points:
            return None
        total = 0
        for t, (rid, buf, ctr) in self.points.items():
            held = [rid] + ([self.entries[t].region_id] if t in self.entries else [])
            n = buf.read_u64(ctr)
            if n is None or any((r := self.installer.regions.get(i)) is None or
                                r.state not in HELD for i in held):
                return None
            total += n
        return total

    def remove(self, why: str = "speed check over") -> None:
        """Restore every point (the trampolines' code goes to quarantine) and the
        counted regions' own entries: a region still patched through its counting
        entries is suspended and left so, with its own records back, for the caller
        to resume (or remove)."""
        inst = self.installer
        for rid, _, _ in self.points.values():
            reg = inst.regions.get(rid)
            if reg is not None and reg.state in HELD:
                try:
                    inst.uninstall(rid, why)
                except AgentError:
                    pass
        by_region: dict[int, dict[int, P.PatchSite]] = {}
        for e in self.entries.values():
            by_region.setdefault(e.region_id, {})[e.site] = e.direct
        for rid, direct in by_region.items():
            reg = inst.regions.get(rid)
            if reg is None or reg.state not in HELD:
                continue
            if reg.state is InstallState.INSTALLED:
                try:
                    inst.suspend(rid)
                except AgentError:
                    # the sites stay patched through the counting entries: the region
                    # keeps those records (and the stubs their code) until it goes
                    by_region[rid] = {}
                    continue
            _retarget(reg, direct)
        for e in self.entries.values():
            if e.site in by_region.get(e.region_id, {}):
                inst.space.release(e.stub)
        self.points.clear()
        self.entries.clear()


def _retarget(reg: InstalledRegion, records: dict[int, P.PatchSite]) -> None:
    """Replace a region's patch records for the sites in ``records`` (its suspended
    ones too): what it patches on resume and unpatches on removal."""
    reg.sites = [records.get(s.site, s) for s in reg.sites]
    reg.suspended_sites = [records.get(s.site, s) for s in reg.suspended_sites]
