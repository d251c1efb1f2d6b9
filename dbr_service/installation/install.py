"""Installing generated replacement code into one client, and taking it out again.

This is the process-plumbing half of "Replacement code" (docs/architecture.md, "One
cycle" 6-8); ``codegen/`` is the pure half.  Per client:

* :class:`~dbr_service.installation.codespace.CodeSpace` (installation/codespace.py) hands out space
in code
  buffers within +-2 GiB of the module a region patches (invariant 4), and reuses
  freed space only after a quarantine period and two clean censuses (invariant 1).
* :class:`Installer` writes a region's bytes through the service's RW mapping,
  describes the region to the agent (REGION: code range and exit ranges, for
  its dlclose/munmap/mprotect hooks), names the unwind information written after
  the code of a region with real calls (FRAMES_ADD, before the patch that makes the
  code reachable), patches its entry sites in one batch, and unpatches,
  invalidates and reclaims.  The unwind information stays while the code does:
  threads may return into code long after its region was unpatched, so it is
  withdrawn (FRAMES_DEL) only when the censuses free the chunk.
* Entry sites (installation/entry_sites.py decides which may be patched): the agent answers
  E_INSIDE while a thread is inside one: threads are moved in (TRANSFER) and the site
  is tried again, then at each later :meth:`Installer.transfer`.
* Calls into live copies (codegen/calls.py): a region whose real calls go straight to
  another region's copy (``calls_into``) depends on that copy.  Its chunk *uses* the
  copy's chunk, which is not reused while the user's chunk is allocated (live or
  quarantined: a thread may return into the user's code and call the copy again);
  its REGION names the copy's dependencies as its own, so the agent's map-change
  hooks take it out with the copy.  Whatever removes a region (map change,
  evaluation, speed check, operator, a refused resume) removes the live regions
  calling its copy first, so that the verdict takes effect; they are queued in
  :attr:`Installer.cascaded`, which :meth:`Installer.on_map_changed` and
  ``optimize.Evaluator.apply`` drain into what they return and the session drains
  after its own removals (:meth:`Installer.pop_cascaded`).  Suspending a region (a
  speed check) suspends the regions calling its copy too, and resuming it resumes
  them: the original code runs in the check's ORIGINAL phases, whoever calls it.
* Removed code still running: a census that finds a thread's PC in a removed
  region's quarantined code moves it back to original code (EVICT, with the region
  announced again for the request: the agent forgets a region once it is removed),
  unless the region went for a map change (its original code may be gone).

Nothing here runs while the installer is not called: the service drives it.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Mapping, Sequence

from dbr_service.wire import protocol as P
from dbr_service.wire.agentconn import AgentConnection, result_name
from dbr_service.codegen.frames import records_len
from dbr_service.installation.codespace import Chunk, CodeSpace
from dbr_service.installation.entry_sites import EntrySiteChecks
from dbr_service.common.errors import AgentError, CodegenError
from dbr_service.installation.installed import Generated, InstalledRegion
from dbr_service.common.states import HELD, InstallState


class Installer(EntrySiteChecks):
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
        #: Threads moved out of removed regions' code found running there by a census.
        self.threads_evicted_removed = 0
        #: Regions removed because a region whose copy they call was removed, not yet
        #: handed to the caller (pop_cascaded).
        self.cascaded: list[InstalledRegion] = []
        self.read_original = read_original
        self.variant = variant
        self.space = space or CodeSpace(conn)
        self.regions: dict[int, InstalledRegion] = {}
        self.on_event = on_event or (lambda kind, data: None)
        self._next_id = 1
        self.patches_installed = 0
        self.patches_removed = 0
        self.first_patch_at: float | None = None
        self.kept_placed = 0      # regions placed from kept code (installation/keptcode.py)
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
                cfi_refused: str | None = None,
                entry_sites: Mapping[int, Sequence[int]] | None = None,
                calls_into: Sequence[InstalledRegion] = ()) -> InstalledRegion:
        """Write ``gen`` (emitted for ``chunk.addr``) and patch its entry sites.

        ``exit_ranges`` tells the agent which original code the region depends on
        (copied blocks and exit targets; default: the exit targets).  ``frames``: the
        unwind information blobs (codegen.cfi.CfiBlob, placed in the chunk after the
        code), written and named to the agent before any site is patched.
        ``cfi_refused``: why the region was emitted without its real calls.
        ``entry_sites``: site -> inner boundaries of the entry sites region selection
        chose (``sr.info["entry_sites"]``; default ``gen.entry_sites`` if any).
        ``calls_into``: the live regions whose copies ``gen``'s real calls go to
        (``gen.call_copies``): their chunks are linked to ``chunk`` before its code is
        written, and their dependencies become the region's."""
        if gen.base != chunk.addr or len(gen.code) > chunk.size:
            self.space.release(chunk)
            raise CodegenError(f"code for {gen.base:#x} ({len(gen.code)} bytes) does not fit "
                               f"chunk {chunk.addr:#x}+{chunk.size}")
        into = self._exits_into_entry_sites(gen)
        if into:
            self.space.release(chunk)
            raise CodegenError(f"region exits into the bytes of installed entry site "
                               f"{into:#x}")
        copies = getattr(gen, "call_copies", {}).values()
        stray = [a for a in copies if not any(c.state is InstallState.INSTALLED and
                                              c.contains_code(a) for c in calls_into)]
        if stray:
            self.space.release(chunk)
            raise CodegenError(f"real call into {stray[0]:#x}: no live region's code")
        for c in calls_into:
            self.space.link(chunk, c.chunk)
        region_id = self._next_id
        self._next_id += 1
        reg = InstalledRegion(region_id, name or f"r{region_id}", chunk, gen, module=module,
                              orig_ranges=list(orig_ranges), cfi_refused=cfi_refused,
                              calls_into=[c.region_id for c in calls_into])
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
        exits = _merge_ranges((list(exit_ranges) or [(t, t + 1) for _, t in gen.exits]) +
                              [d for c in calls_into for d in c.depends])
        if len(exits) > P.MAX_EXITS:
            exits = [(min(a for a, _ in exits), max(b for _, b in exits))]
        reg.depends = exits
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
            reg.sites = self._make_sites(reg, gen, entry_sites if entry_sites is not None
                                         else getattr(gen, "entry_sites", None) or {})
            results = self.conn.patch(reg.sites) if reg.sites else []
        except (AgentError, OSError):
            # The client refused or went away mid-install: nothing of this region is
            # patched by us (a lost PATCH_RESULT leaves the agent's own policy in charge);
            # its space goes to quarantine like any removed region's.
            self.space.release(chunk)
            raise
        self.regions[region_id] = reg
        reg.results = {s.site: r for s, r in zip(reg.sites, results)}
        inside = any(r == P.Result.E_INSIDE for r in results)
        moved = self.transfer(reg) if ok_or_none(results) or inside else 0
        if inside:
            self._patch_again(reg, self.INSIDE_TRIES)
            results = [reg.results[s.site] for s in reg.sites]
        ok = sum(1 for r in results if r == P.Result.OK)
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
        any, bring threads in anyway).  An installed region's entry sites the agent
        found a thread inside (E_INSIDE) are then tried again; each one patched now
        counts in the result too."""
        points = sorted(getattr(reg.gen, "transfers", {}).items())
        moved = 0
        if self.transfer_enabled and points and \
                reg.state in (InstallState.WRITTEN, InstallState.INSTALLED):
            for res in self._batches(self.conn.transfer, reg, points, timeout_ms,
                                     "transfer-failed"):
                if res is None:
                    break
                moved += res.moved
            reg.transferred += moved
            self.threads_transferred += moved
        late = self._patch_again(reg) if reg.state is InstallState.INSTALLED else 0
        if late:
            self._refresh_live()
            self.patches_installed += late
            self.on_event("patch-installed", {"region": reg.name, "sites": late})
        return moved + late

    #: PATCH rounds for entry sites the agent found a thread inside, each after a
    #: TRANSFER (by install; transfer() itself tries once).
    INSIDE_TRIES = 3

    def _patch_again(self, reg: InstalledRegion, tries: int = 1) -> int:
        """PATCH ``reg``'s entry sites the agent last answered E_INSIDE, up to ``tries``
        rounds (each after the first after a TRANSFER); returns how many it patched
        now.  A refusal is only reported."""
        patched = 0
        for k in range(tries):
            again = [s for s in reg.sites if reg.results.get(s.site) == P.Result.E_INSIDE]
            if not again:
                break
            if k and self.transfer_enabled:
                pts = sorted(getattr(reg.gen, "transfers", {}).items())
                if pts:
                    for res in self._batches(self.conn.transfer, reg, pts, 100,
                                             "transfer-failed"):
                        if res is None:
                            break
                        reg.transferred += res.moved
                        self.threads_transferred += res.moved
            try:
                results = self.conn.patch(again)
            except (AgentError, OSError) as exc:
                self.on_event("patch-failed", {"region": reg.name, "why": str(exc)})
                break
            for s, r in zip(again, results):
                reg.results[s.site] = r
                patched += r == P.Result.OK
        return patched

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
        # never into bytes 1..4 of an installed entry site (the agent refuses those)
        points = sorted((r, o) for r, o in getattr(reg.gen, "evictions", {}).items()
                        if not self._inside_entry_site(o))
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
        # regions calling its copy would run it on: they pause with it
        for c in self.linkers(reg):
            if c.state is InstallState.INSTALLED:
                self.suspend(c.region_id)
                c.suspended_for = reg.region_id
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
        original bytes changed meanwhile, say), the region is retired.  Regions suspended
        with it (they call its copy) are resumed after it."""
        reg = self.regions[region_id]
        if reg.state is not InstallState.SUSPENDED:
            raise AgentError(f"region {reg.name} is {reg.state.value}, not suspended")
        reg.suspended_for = None
        sites, reg.suspended_sites = reg.suspended_sites, []
        # an entry site no longer safe (code installed meanwhile exits into it) stays off
        sites = [s for s in sites if not (s.flags & P.SITE_F_ENTRY and
                                          self._runs_into(s.site, reg))]
        results = self.conn.patch(sites) if sites else []
        reg.results.update({s.site: r for s, r in zip(sites, results)})
        if any(r == P.Result.E_INSIDE for r in results):
            self._patch_again(reg, self.INSIDE_TRIES)
            results = [reg.results[s.site] for s in sites]
        if sites and not any(r == P.Result.OK for r in results):
            self._retire(reg, "agent refused every site on resume: " +
                         ", ".join(sorted({result_name(r) for r in results})))
            return reg
        reg.state = InstallState.INSTALLED
        self._refresh_live()
        self.transfer(reg)
        for c in self.linkers(reg):
            if c.state is InstallState.SUSPENDED and c.suspended_for == reg.region_id:
                self.resume(c.region_id)
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
        otherwise run it on).  A region no longer held is left as it is.  The regions
        calling its copy go first (:meth:`_cascade`)."""
        reg = self.regions[region_id]
        if reg.state not in HELD:
            return reg
        self._cascade(reg, why, evict)
        if reg.state is InstallState.INSTALLED:
            self.patches_removed += self._unpatch(reg, reg.patched_sites)
            self.on_event("patch-removed", {"region": reg.name, "why": why})
        if evict:
            self.evict(reg)
        self._retire(reg, why)
        return reg

    def linkers(self, reg: InstalledRegion) -> list[InstalledRegion]:
        """Live or suspended regions whose real calls go to ``reg``'s copy."""
        return [r for r in list(self.regions.values())
                if r.state in HELD and reg.region_id in r.calls_into]

    def _cascade(self, reg: InstalledRegion, why: str, evict: bool = False) -> None:
        """Remove the regions calling ``reg``'s copy (recursively), queued in
        ``cascaded``: whatever takes ``reg`` out must stop its copy running."""
        for c in self.linkers(reg):
            self.uninstall(c.region_id, f"calls the copy of {reg.name}, removed: {why}",
                           evict=evict)
            self.cascaded.append(c)

    def pop_cascaded(self) -> list[InstalledRegion]:
        """Regions removed by :meth:`_cascade` since the last call (their ``why_removed``
        says why)."""
        out, self.cascaded = self.cascaded, []
        return out

    def copy_entries(self) -> dict[int, tuple[int, InstalledRegion]]:
        """Where real calls may enter live copies: each patched site of an installed
        region -> (its replacement address, the region).  Only sites a call to the
        original would pass through today: a refused or restored one is left out."""
        out: dict[int, tuple[int, InstalledRegion]] = {}
        for r in list(self.regions.values()):
            if r.state is InstallState.INSTALLED:
                for s in r.patched_sites:
                    if s.site in r.gen.entries:
                        out.setdefault(s.site, (r.gen.entries[s.site], r))
        return out

    def _retire(self, reg: InstalledRegion, why: str) -> None:
        self._cascade(reg, why)
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
        """Installed (or suspended) regions with a patch site, an exit target or copied
        code in [lo, hi), then those calling their copies."""
        out = self._touching(lo, hi)
        for reg in out:                  # grows while it is walked: callers of callers
            out += [c for c in self.linkers(reg) if all(c is not x for x in out)]
        return out

    def _touching(self, lo: int, hi: int) -> list[InstalledRegion]:
        out = []
        for reg in list(self.regions.values()):
            if reg.state not in HELD:
                continue
            if any(lo <= s.site < hi for s in reg.patched_sites + reg.suspended_sites) or \
                    any(lo <= t < hi for _, t in reg.gen.exits) or \
                    any(lo <= o < hi for _, _, o in reg.gen.addr_map):
                out.append(reg)
        return out

    def on_map_changed(self, lo: int, hi: int) -> list[InstalledRegion]:
        """Invalidate every region that patches, exits into or copies [lo, hi), and the
        regions calling their copies (all of them returned)."""
        hit = self._touching(lo, hi)
        for reg in hit:
            reg.original_changed = True
        before = len(self.cascaded)
        for reg in hit:
            self.uninstall(reg.region_id, f"map change {lo:#x}-{hi:#x}")
        more, self.cascaded = self.cascaded[before:], self.cascaded[:before]
        return hit + [r for r in more if all(r is not x for x in hit)]

    def reclaim(self, census_timeout_ms: int = 100) -> int:
        """One census of PCs and stacks for the quarantined code; returns how many
        chunks became reusable.  Threads it found running in a removed region's code
        are moved out (:meth:`evict_removed`), so that the space is freed at a later
        census rather than when they happen to leave."""
        if not self.space.quarantine:
            return 0
        ranges = self.space.census_ranges()
        freed = self.space.census_done(self.conn.census(census_timeout_ms, ranges=ranges))
        for q in list(self.space.quarantine):
            reg = next((r for r in list(self.regions.values()) if r.chunk is q.chunk), None)
            if q.pcs and reg is not None:
                self.evict_removed(reg)
        return freed

    def evict_removed(self, reg: InstalledRegion, timeout_ms: int = 100) -> int:
        """EVICT threads out of the code of a removed region (threads that returned into
        it, or never passed an exit).  The agent moves threads only for a region it
        knows: the region is announced again (REGION, its code range and dependencies)
        for the request and forgotten after it.  Not for a region removed for a map
        change (its original code may be gone: its threads leave by its exits as they
        would have), nor without EVICT, nor once the agent refused it.  Returns threads
        moved; a refusal is only reported."""
        points = sorted((r, o) for r, o in getattr(reg.gen, "evictions", {}).items()
                        if not self._inside_entry_site(o))
        if not self.evict_enabled or not points or reg.state is not InstallState.REMOVED \
                or reg.original_changed or reg.evict_refused:
            return 0
        lo, hi = reg.code_range()
        try:
            rc = self.conn.region(reg.region_id, lo, hi, reg.depends)
        except (AgentError, OSError) as exc:
            rc = None
            self.on_event("evict-failed", {"region": reg.name, "why": str(exc)})
        if rc != P.Result.OK:
            reg.evict_refused = True
            return 0
        moved = 0
        try:
            for _ in range(self.EVICT_TRIES):
                left, refused = 0, False
                for res in self._batches(self.conn.evict, reg, points, timeout_ms,
                                         "evict-failed"):
                    if res is None:
                        refused = reg.evict_refused = True
                        break
                    moved += res.moved
                    left = res.left + res.no_reply
                if refused or left == 0:
                    break
        finally:
            try:
                self.conn.region_forget(reg.region_id)
            except AgentError:
                pass
        reg.evicted += moved
        self.threads_evicted += moved
        self.threads_evicted_removed += moved
        if moved:
            self.on_event("evicted-from-removed", {"region": reg.name, "threads": moved})
        return moved

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


def ok_or_none(results: Sequence[int]) -> bool:
    """Some site patched, or none asked for."""
    return not results or any(r == P.Result.OK for r in results)


def _merge_ranges(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 64:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out
