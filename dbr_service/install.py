"""Installing generated replacement code into one client, and taking it out again.

This is the process-plumbing half of "Replacement code" (DESIGN.md, One cycle
steps 6-8); ``codegen/`` is the pure half.  Per client:

* :class:`CodeSpace` hands out space in code buffers that lie within +-2 GiB of
  the module a region patches (invariant 4), asks the agent for a new buffer
  when none fits, and reuses freed space only after a quarantine period *and*
  two censuses in a row that find neither a thread's PC nor a word of its
  registers or stack inside it (invariant 1: a thread may sit in replacement
  code, hold such a PC in a signal frame, or, once replacement code makes real
  calls, a return address into it in any frame).  Unpatching takes a region's
  entries away at once; its code stays mapped and executable until then, and a
  thread that never returns keeps it for good.
* :class:`Installer` writes a region's bytes through the service's RW mapping,
  describes the region to the agent (REGION: code range and exit ranges, for
  its dlclose/munmap/mprotect hooks), names the unwind information written after
  the code of a region with real calls (FRAMES_ADD, before the patch that makes the
  code reachable), patches its entry sites in one batch, and unpatches,
  invalidates and reclaims.  The unwind information stays while the code does:
  threads may return into code long after its region was unpatched, so it is
  withdrawn (FRAMES_DEL) only when the censuses free the chunk.

Nothing here runs while the installer is not called: the service drives it.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

from dbr_service import protocol as P
from dbr_service.agentconn import AgentConnection, CodeBufferHandle, make_site, result_name
from dbr_service.codegen.frames import records_len
from dbr_service.errors import AgentError, CodegenError

REL32 = (1 << 31) - 1
ALIGN = 16


class Generated(Protocol):
    """What codegen hands over (dbr_service.codegen.emit.GeneratedCode)."""

    code: bytes
    base: int
    entries: dict[int, int]                    # original patch site -> replacement address
    addr_map: list[tuple[int, int, int]]       # (repl_start, repl_end, original address)
    exits: list[tuple[int, int]]               # (replacement address, original target)
    transfers: dict[int, int]                  # original instruction -> replacement address


class InstallState(str, enum.Enum):
    """Lifecycle of one installed region (mirrors region.model.RegionState)."""

    WRITTEN = "written"          # bytes in the buffer, no site patched yet
    INSTALLED = "installed"      # at least one entry site patched, or (a region without
                                 # patch sites) at least one thread moved in
    SUSPENDED = "suspended"      # sites restored for a while (a speed check), code and
                                 # REGION kept: resume() patches the same sites again
    REMOVED = "removed"          # every site restored; code space quarantined
    FAILED = "failed"            # nothing patched (agent refused every site)


#: States in which a region's code is in place and depends on the original code: live,
#: or suspended for a speed check (its sites restored for a while).
HELD = frozenset({InstallState.INSTALLED, InstallState.SUSPENDED})


@dataclass
class Chunk:
    buffer: CodeBufferHandle
    addr: int
    size: int
    #: Unwind information the agent has for code in the chunk: (region id, address,
    #: length) of each blob FRAMES_ADD named, withdrawn when the chunk is freed.
    frames: list[tuple[int, int, int]] = field(default_factory=list)


@dataclass
class InstalledRegion:
    """One region's code in the client and its patch sites."""

    region_id: int
    name: str
    chunk: Chunk
    gen: Generated
    sites: list[P.PatchSite] = field(default_factory=list)
    results: dict[int, int] = field(default_factory=dict)     # site -> dbr_result
    state: InstallState = InstallState.WRITTEN
    installed_at: float = 0.0
    removed_at: float = 0.0
    module: str | None = None
    why_removed: str = ""
    #: Original code ranges the region copies (its blocks), for evaluation.
    orig_ranges: list[tuple[int, int]] = field(default_factory=list)
    #: Threads the agent moved from original code into this region (TRANSFER).
    transferred: int = 0
    #: Threads the agent moved out of this region's code into original code (EVICT).
    evicted: int = 0
    #: While SUSPENDED: the sites that were patched, to patch again on resume.
    suspended_sites: list[P.PatchSite] = field(default_factory=list)
    #: Why the region's real calls were given up (its CFI could not be made), or None.
    cfi_refused: str | None = None
    #: Unwind information blobs named to the agent (FRAMES_ADD).
    frames: int = 0

    @property
    def patched_sites(self) -> list[P.PatchSite]:
        return [s for s in self.sites if self.results.get(s.site) == P.Result.OK]

    def code_range(self) -> tuple[int, int]:
        return self.chunk.addr, self.chunk.addr + self.chunk.size

    def contains_code(self, addr: int) -> bool:
        lo, hi = self.code_range()
        return lo <= addr < hi

    def original_of(self, addr: int) -> int | None:
        """Original address of a replacement-code address (sample attribution)."""
        for lo, hi, orig in self.gen.addr_map:
            if lo <= addr < hi:
                return orig
        return None


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
                "censuses": self.censuses, "quarantined_s": round(max(0.0, now - self.since), 3)}


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

    def census_ranges(self) -> list[tuple[int, int]]:
        """The ranges the next census asks about: the quarantined chunks, ascending,
        adjacent ones joined.  Beyond MAX_CENSUS_RANGES the smallest gaps between them
        are closed: a word in a covering range holds every chunk in it (live code or
        anything else in the gaps included: conservative, and least so this way)."""
        spans: list[tuple[int, int]] = []
        for lo, hi in sorted((q.chunk.addr, q.chunk.addr + q.chunk.size) for q in self.quarantine):
            if spans and lo <= spans[-1][1]:
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
        did not ask about it.  ``census`` is what AgentConnection.census returns (a
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
        keep = []
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
                self._frames_del(q.chunk)
                q.chunk.buffer.write(q.chunk.addr, b"\xcc" * q.chunk.size)  # int3 fill
                self.free.append(q.chunk)
                freed += 1
            else:
                keep.append(q)
        self.quarantine = keep
        return freed

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


class Installer:
    """Installs and removes regions in one client through its agent session."""

    def __init__(self, conn: AgentConnection, read_original: Callable[[int, int], bytes], *,
                 variant: int = P.Variant.INT3, space: CodeSpace | None = None,
                 on_event: Callable[[str, dict], None] | None = None,
                 transfer: bool = True, evict: bool = False, frames: bool = False,
                 cfi: Any = None) -> None:
        self.conn = conn
        #: The agent takes FRAMES_ADD (HELLO_FRAMES), and where the client's modules'
        #: .eh_frame is (codegen.frames.CfiSource): regions with real calls get unwind
        #: information; without either, they are emitted without real calls.
        self.frames_enabled = frames
        self.cfi = cfi
        #: Regions whose real calls were given up because their CFI could not be made.
        self.cfi_refused = 0
        #: Move threads found in a new region's original code into it (TRANSFER).
        self.transfer_enabled = transfer
        self.threads_transferred = 0
        #: The agent understands EVICT (HELLO_EVICT): suspend() and uninstall(...,
        #: evict=True) move threads out of the region's code into original code.
        self.evict_enabled = evict
        self.threads_evicted = 0
        self.read_original = read_original
        self.variant = variant
        self.space = space or CodeSpace(conn)
        self.regions: dict[int, InstalledRegion] = {}
        self.on_event = on_event or (lambda kind, data: None)
        self._next_id = 1
        self.patches_installed = 0
        self.patches_removed = 0
        self.first_patch_at: float | None = None
        #: Installed regions' code as (lo, hi, region), replaced whole on every change so
        #: other threads (sample attribution) read it without a lock.
        self.live: tuple[tuple[int, int, InstalledRegion], ...] = ()
        #: Every code buffer of the client as (lo, hi), same rules as ``live``: all
        #: replacement code, live or removed (a thread may still run it), lies in them,
        #: and an IP there is never original code.
        self.buffer_ranges: tuple[tuple[int, int], ...] = ()

    def _refresh_live(self) -> None:
        # a suspended region's code stays: threads inside it finish there
        self.live = tuple((*r.code_range(), r) for r in self.regions.values()
                          if r.state in HELD)
        self.buffer_ranges = tuple((b.base, b.base + b.size)
                                   for b in list(self.conn.buffers.values()))

    def patched_ranges(self) -> list[tuple[int, int]]:
        """Byte ranges of the live regions' patch sites; safe from any thread."""
        return [(s.site, s.site + P.PATCH_LEN) for _, _, r in self.live
                for s in r.patched_sites]

    # ---- install ---------------------------------------------------------
    def reserve(self, size: int, reach: Sequence[int]) -> Chunk:
        """Space for a region of ``size`` bytes; codegen then emits at ``chunk.addr``."""
        return self.space.allocate(size, reach)

    def install(self, chunk: Chunk, gen: Generated, *, name: str = "",
                exit_ranges: Sequence[tuple[int, int]] = (), module: str | None = None,
                orig_ranges: Sequence[tuple[int, int]] = (), frames: Sequence[Any] = (),
                cfi_refused: str | None = None) -> InstalledRegion:
        """Write ``gen`` (emitted for ``chunk.addr``) and patch its entry sites.

        ``exit_ranges`` tells the agent which original code the region depends on
        (copied blocks and exit targets; default: the exit targets).  ``frames``: the
        unwind information blobs (codegen.cfi.CfiBlob, placed in the chunk after the
        code), written and named to the agent before any site is patched.
        ``cfi_refused``: why the region was emitted without its real calls."""
        if gen.base != chunk.addr or len(gen.code) > chunk.size:
            self.space.release(chunk)
            raise CodegenError(f"code for {gen.base:#x} ({len(gen.code)} bytes) does not fit "
                               f"chunk {chunk.addr:#x}+{chunk.size}")
        region_id = self._next_id
        self._next_id += 1
        reg = InstalledRegion(region_id, name or f"r{region_id}", chunk, gen, module=module,
                              orig_ranges=list(orig_ranges), cfi_refused=cfi_refused)
        self.cfi_refused += cfi_refused is not None
        for b in frames:
            if not chunk.addr + len(gen.code) <= b.at and b.at + len(b.data) <= \
                    chunk.addr + chunk.size:
                self.space.release(chunk)
                raise CodegenError(f"unwind information at {b.at:#x} outside the chunk")
        chunk.buffer.write(chunk.addr, gen.code)
        for b in frames:
            chunk.buffer.write(b.at, b.data)
        lo, hi = reg.code_range()
        exits = _merge_ranges(list(exit_ranges) or [(t, t + 1) for _, t in gen.exits])
        if len(exits) > P.MAX_EXITS:
            exits = [(min(a for a, _ in exits), max(b for _, b in exits))]
        try:
            rc = self.conn.region(region_id, lo, hi, exits)
            if rc != P.Result.OK:
                raise AgentError(f"agent refused REGION: {result_name(rc)}")
            for b in frames:
                n = records_len(b.data)
                rc = self.conn.frames(True, region_id, b.register_at, n)
                if rc != P.Result.OK:
                    raise AgentError(f"agent refused FRAMES_ADD at {b.register_at:#x}: "
                                     f"{result_name(rc)}")
                chunk.frames.append((region_id, b.register_at, n))
                reg.frames += 1
            reg.sites = [make_site(site, target, self.read_original(site, P.PATCH_LEN),
                                   self.variant, region_id)
                         for site, target in sorted(gen.entries.items())]
            results = self.conn.patch(reg.sites) if reg.sites else []
        except (AgentError, OSError):
            # The client refused or went away mid-install: nothing of this region is
            # patched by us (a lost PATCH_RESULT leaves the agent's own policy in charge);
            # its space goes to quarantine like any removed region's.
            self.space.release(chunk)
            raise
        self.regions[region_id] = reg
        reg.results = {s.site: r for s, r in zip(reg.sites, results)}
        ok = sum(1 for r in results if r == P.Result.OK)
        moved = self.transfer(reg) if ok or not reg.sites else 0
        if ok == 0 and moved == 0:
            reg.state = InstallState.FAILED
            self._retire(reg, "agent refused every site: " +
                         ", ".join(sorted({result_name(r) for r in results}))
                         if reg.sites else "no patch site, and no thread was in its "
                         "original code to move in")
            return reg
        reg.state = InstallState.INSTALLED
        self._refresh_live()
        reg.installed_at = time.monotonic()
        self.first_patch_at = self.first_patch_at or reg.installed_at
        self.patches_installed += ok
        self.on_event("patch-installed", {"region": reg.name, "sites": ok})
        return reg

    def transfer(self, reg: InstalledRegion, timeout_ms: int = 100) -> int:
        """TRANSFER: threads stopped in ``reg``'s original code at a point of its
        transfer map continue in its replacement code.  Returns threads moved; a
        refusal or a lost reply moves nobody and is only reported (the patches, if
        any, bring threads in anyway)."""
        points = sorted(getattr(reg.gen, "transfers", {}).items())
        if not self.transfer_enabled or not points or \
                reg.state not in (InstallState.WRITTEN, InstallState.INSTALLED):
            return 0
        moved = 0
        for res in self._batches(self.conn.transfer, reg, points, timeout_ms, "transfer-failed"):
            if res is None:
                break
            moved += res.moved
        reg.transferred += moved
        self.threads_transferred += moved
        return moved

    def _batches(self, send, reg: InstalledRegion, points: list[tuple[int, int]],
                 timeout_ms: int, failed: str):
        """TRANSFER or EVICT ``points`` in messages of at most MAX_TRANSFER points:
        yields each result, or None once the agent refused one or did not answer
        (reported as event ``failed``; never raised: the region's sites may be
        patched already, and its code stays correct to run)."""
        for k in range(0, len(points), P.MAX_TRANSFER):
            try:
                res = send(reg.region_id, points[k:k + P.MAX_TRANSFER], timeout_ms=timeout_ms)
            except (AgentError, OSError) as exc:
                self.on_event(failed, {"region": reg.name, "why": str(exc)})
                yield None
                return
            if res.result != P.Result.OK:
                self.on_event(failed, {"region": reg.name, "why": result_name(res.result)})
                yield None
                return
            yield res

    #: EVICT rounds before threads still inside a region's code are left there.
    EVICT_TRIES = 4

    def evict(self, reg: InstalledRegion, timeout_ms: int = 100) -> tuple[int, int]:
        """EVICT: threads stopped in ``reg``'s replacement code at a point of its
        eviction map continue in original code.  A thread found at no point (inside a
        translation of several instructions, say) gets another round, up to
        EVICT_TRIES.  Returns (threads moved, threads still inside after the last
        round).  Threads asleep in a system call are not signalled and stay; they
        leave by the region's exits as always.  A refusal or a lost reply moves
        nobody and is only reported: the region's code stays correct to run."""
        points = sorted(getattr(reg.gen, "evictions", {}).items())
        if not self.evict_enabled or not points or reg.state not in HELD:
            return 0, 0
        moved = left = 0
        refused = False
        for _ in range(self.EVICT_TRIES):
            for res in self._batches(self.conn.evict, reg, points, timeout_ms, "evict-failed"):
                if res is None:
                    refused = True
                    break
                moved += res.moved
                left = res.left + res.no_reply
                if left == 0:
                    break
            if refused or left == 0:
                break
        reg.evicted += moved
        self.threads_evicted += moved
        return moved, left

    # ---- suspension (speed checks) ----------------------------------------
    def suspend(self, region_id: int) -> InstalledRegion:
        """Restore a live region's patched sites but keep its code and its REGION with
        the agent, so that resume() can patch them again; then move threads inside
        its code back to original code (EVICT), so that the original code runs
        meanwhile, loops that never pass a site included."""
        reg = self.regions[region_id]
        if reg.state is not InstallState.INSTALLED:
            raise AgentError(f"region {reg.name} is {reg.state.value}, not installed")
        sites = reg.patched_sites
        self._unpatch(reg, sites)
        reg.suspended_sites = sites
        reg.state = InstallState.SUSPENDED
        self._refresh_live()
        self.evict(reg)
        return reg

    def resume(self, region_id: int) -> InstalledRegion:
        """Patch a suspended region's sites again, and move threads in its original code
        into it (TRANSFER), as at its install.  If the agent refuses every site (the
        original bytes changed meanwhile, say), the region is retired."""
        reg = self.regions[region_id]
        if reg.state is not InstallState.SUSPENDED:
            raise AgentError(f"region {reg.name} is {reg.state.value}, not suspended")
        sites, reg.suspended_sites = reg.suspended_sites, []
        results = self.conn.patch(sites) if sites else []
        reg.results.update({s.site: r for s, r in zip(sites, results)})
        if sites and not any(r == P.Result.OK for r in results):
            self._retire(reg, "agent refused every site on resume: " +
                         ", ".join(sorted({result_name(r) for r in results})))
            return reg
        reg.state = InstallState.INSTALLED
        self._refresh_live()
        self.transfer(reg)
        return reg

    def _unpatch(self, reg: InstalledRegion, sites: list[P.PatchSite]) -> int:
        """Restore ``sites``; how many the agent restored (the rest it had already)."""
        results = self.conn.unpatch(sites) if sites else []
        n = 0
        for s, r in zip(sites, results):
            # NOT_PATCHED: the agent already restored it (e.g. its own hook timed out).
            if r in (P.Result.OK, P.Result.E_NOT_PATCHED):
                reg.results[s.site] = P.Result.E_NOT_PATCHED
                n += r == P.Result.OK
            else:
                raise AgentError(f"unpatch of {s.site:#x} refused: {result_name(r)}")
        return n

    # ---- removal ---------------------------------------------------------
    def uninstall(self, region_id: int, why: str = "", *, evict: bool = False) -> InstalledRegion:
        """Restore every patched site of a region, then quarantine its code.  With
        ``evict``, threads inside its code are first moved back to original code (a
        region removed for being slower: a loop that never passes a site would
        otherwise run it on)."""
        reg = self.regions[region_id]
        if reg.state is InstallState.INSTALLED:
            self.patches_removed += self._unpatch(reg, reg.patched_sites)
            self.on_event("patch-removed", {"region": reg.name, "why": why})
        if evict:
            self.evict(reg)
        self._retire(reg, why)
        return reg

    def _retire(self, reg: InstalledRegion, why: str) -> None:
        reg.suspended_sites = []
        if reg.state is not InstallState.FAILED:
            reg.state = InstallState.REMOVED
        reg.removed_at = time.monotonic()
        reg.why_removed = why
        self._refresh_live()
        try:
            self.conn.region_forget(reg.region_id)
        except AgentError:
            pass
        self.space.release(reg.chunk)

    def uninstall_all(self, why: str = "") -> None:
        for rid, reg in list(self.regions.items()):
            if reg.state in HELD:
                self.uninstall(rid, why)

    def affected_by(self, lo: int, hi: int) -> list[InstalledRegion]:
        """Installed (or suspended) regions with a patch site or an exit target in
        [lo, hi)."""
        out = []
        for reg in self.regions.values():
            if reg.state not in HELD:
                continue
            if any(lo <= s.site < hi for s in reg.patched_sites + reg.suspended_sites) or \
                    any(lo <= t < hi for _, t in reg.gen.exits) or \
                    any(lo <= o < hi for _, _, o in reg.gen.addr_map):
                out.append(reg)
        return out

    def on_map_changed(self, lo: int, hi: int) -> list[InstalledRegion]:
        """Invalidate every region that patches, exits into or copies [lo, hi)."""
        hit = self.affected_by(lo, hi)
        for reg in hit:
            self.uninstall(reg.region_id, f"map change {lo:#x}-{hi:#x}")
        return hit

    def reclaim(self, census_timeout_ms: int = 100) -> int:
        """One census of PCs and stacks for the quarantined code; returns how many
        chunks became reusable."""
        if not self.space.quarantine:
            return 0
        ranges = self.space.census_ranges()
        return self.space.census_done(self.conn.census(census_timeout_ms, ranges=ranges))

    def retained(self) -> dict[int, dict[str, Any]]:
        """Removed regions whose code is still kept (quarantined), by region id: what
        holds it (CodeSpace.retained).  Safe from any thread."""
        out = {}
        for rid, reg in list(self.regions.items()):
            if reg.state in (InstallState.REMOVED, InstallState.FAILED):
                r = self.space.retained(reg.chunk)
                if r is not None:
                    out[rid] = r
        return out

    # ---- attribution -------------------------------------------------------
    def attribute(self, pc: int) -> tuple[int, InstalledRegion | None]:
        """Map a sampled PC to its original address and the installed region whose code
        holds it.  Safe from any thread (reads the ``live`` snapshot)."""
        for lo, hi, reg in self.live:
            if lo <= pc < hi:
                orig = reg.original_of(pc)
                return (orig if orig is not None else pc), reg
        return pc, None

    def perf_map_lines(self) -> list[str]:
        """Lines for /tmp/perf-PID.map naming every live piece of replacement code."""
        lines = []
        for reg in self.regions.values():
            if reg.state in HELD:
                for lo, hi, orig in reg.gen.addr_map:
                    lines.append(f"{lo:x} {hi - lo:x} dbr:{reg.name}@{orig:#x}")
        return lines


def _merge_ranges(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 64:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out
