"""From selected super-regions to live replacement code, and back (docs/architecture.md,
"One cycle" 5-7): emit each region where the code space has room, install it, and later
judge from fresh samples whether it stays.

Region selection runs in a worker; this runs where the agent session lives (the
service's control side), because the code buffer and the session belong there.
Emission is cheap next to selection, so a region is emitted once to learn its size
and once more at the address it gets.

Real calls whose callee is the entry of a live region (a patched site at the callee's
first byte) are emitted as calls to that region's copy when it is in rel32 reach
(codegen/calls.py, "Calls to live copies"); the installer then ties the two regions
(installation/install.py: reclamation, removal and suspension follow the callee).  A batch of
regions is installed callees first, so that its callers find their copies live.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

from dbr_service.codegen.blocks import CountPlan
from dbr_service.codegen.cfi import CfiBlob, CfiError
from dbr_service.codegen.emit import GeneratedCode, check_generated, emit_region, far_exit_bound
from dbr_service.codegen.frames import blobs_size, region_blobs
from dbr_service.common.errors import AgentError, CodegenError, DbrError
from dbr_service.installation.install import Installer
from dbr_service.installation.installed import InstalledRegion
from dbr_service.installation.keptcode import KeptCode, anchor_of, module_refs, placed
from dbr_service.region.model import START, SuperRegion
from dbr_service.common.states import InstallState, RegionState

PROVISIONAL_ALIGN = 16


def region_extent(sr: SuperRegion) -> tuple[list[tuple[int, int]], list[int]]:
    """Original code ranges of the region's blocks, and every original address its
    code reaches (block addresses and exit targets): the rel32 reach set."""
    ranges = sorted({(bb.start, bb.end) for _, bb in sr.blocks()})
    reach = [lo for lo, _ in ranges] + [hi for _, hi in ranges]
    for _, exits in sr.exit_edges():
        reach.extend(exits)
    return ranges, reach


def provisional_base(sr: SuperRegion) -> int:
    """Where ``sr`` is emitted to learn its size: at its lowest patch site, aligned
    (the patch sites must be in reach of the code in any case); a transfer-only SR:
    at its lowest block."""
    points = sr.entry_points() or [bb.start for _, bb in sr.blocks()]
    return (min(points) // PROVISIONAL_ALIGN) * PROVISIONAL_ALIGN


def emit_with_frames(installer: Installer, sr: SuperRegion, base: int,
                     call_target: Callable[[int], int | None] | None = None,
                     counting: CountPlan | None = None
                     ) -> tuple[GeneratedCode, list[CfiBlob], str | None]:
    """Emit ``sr`` at ``base`` and, when it makes real calls, the unwind information
    for its code (codegen/frames.py), placed after the code.  A region whose CFI
    cannot be made (a copied function without an FDE, CFI that does not translate, an
    agent that takes no FRAMES_ADD, a client without a CFI source) is emitted again
    without real calls: (code, blobs, why real calls were given up, or None).
    ``call_target``, ``counting``: see :func:`~dbr_service.codegen.emit.emit_region`."""
    gen = emit_region(sr, base, call_target=call_target, counting=counting)
    if not gen.calls:
        return gen, [], None
    try:
        if installer.cfi is None or not installer.frames_enabled:
            raise CfiError("the agent takes no unwind information (FRAMES_ADD)")
        blobs = region_blobs(gen.addr_map, base + gen.size, installer.cfi.module_at,
                             skip=gen.far_exits.values())
        return gen, blobs, None
    except CfiError as exc:
        return emit_region(sr, base, real_calls=False, counting=counting), [], str(exc)


@dataclass(frozen=True)
class Provisional:
    """What a region's emission near its patch sites tells :func:`placement`: bytes of
    code and of unwind information, the data operands' addresses, the number of exit
    targets.  A selection made ahead keeps it (``sr.info["provisional"]``,
    profiles/warmprep.py): emitted at the same place relative to its module, the code
    is the same wherever the module is (its copied bytes are checked first)."""

    size: int
    frames: int
    data_refs: list[int]
    targets: int


def provisional(installer: Any, sr: SuperRegion, counting: CountPlan | None = None
                ) -> tuple[Provisional, str | None]:
    """``sr`` emitted near its patch sites: (what placement needs, why real calls
    were given up or None)."""
    base = provisional_base(sr)
    gen, blobs, why = emit_with_frames(installer, sr, base, counting=counting)
    # the blobs' sizes do not depend on where the code goes; 8 bytes for their alignment
    frames = blobs_size(blobs, base + gen.size) + 8 if blobs else 0
    return Provisional(gen.size, frames, list(gen.data_refs),
                       len({t for _, t in gen.exits})), why


def placement(installer: Installer, sr: SuperRegion,
              counting: CountPlan | None = None) -> tuple[int, list[int]]:
    """Bytes to reserve for ``sr`` and the addresses its code buffer must reach.

    Normally everything the region touches (its blocks and exit targets) is within
    2 GiB and the buffer goes where all of it is in rel32 reach.  When it is not (a call
    inlined into a shared library far from the executable), only the patch sites (a
    5-byte ``jmp rel32`` each) and the RIP-relative data operands (disp32) must be in
    reach; exits beyond it go through far-exit stubs (:mod:`~dbr_service.codegen.emit`),
    so room for a stub per exit target is reserved."""
    ranges, reach = region_extent(sr)
    if not ranges:
        raise CodegenError(f"{sr.id}: no blocks")
    entries = sr.entry_points()
    if not entries and not sr.transfer_only:
        raise CodegenError(f"{sr.id}: no entry points")
    # Emitted near the patch sites (which must be in reach in any case) to learn the size,
    # the data operands and the exit targets; or as a selection made ahead was, with
    # unwind information as this client takes it
    pre = sr.info.get("provisional")
    if not isinstance(pre, Provisional) or counting is not None or \
            not installer.frames_enabled or installer.cfi is None:
        pre, _ = provisional(installer, sr, counting)
    full = reach + pre.data_refs
    if installer.space.span_fits(pre.size, full):
        return pre.size + pre.frames, full
    return pre.size + far_exit_bound(pre.targets) + pre.frames, entries + pre.data_refs


def kept_code(installer: Installer, sr: SuperRegion, counting: CountPlan | None,
              copies: Mapping[int, Any]) -> tuple[int, list[int]] | None:
    """Bytes to reserve for ``sr``'s code kept from a selection made ahead
    (``sr.info["kept_code"]``, installation/keptcode.py) and the addresses its buffer
    must reach; None when it is to be emitted instead: none kept, a counting region,
    real calls whose unwind information this client does not take or whose callee
    has a live copy they should call, or no buffer reaching all it reaches."""
    kept = sr.info.get("kept_code")
    if not isinstance(kept, KeptCode) or counting is not None:
        return None
    if kept.gen.calls and (not installer.frames_enabled or installer.cfi is None):
        return None
    if any(copies.get(t) for t in real_call_targets(sr)):
        return None
    _, reach = region_extent(sr)
    dm = anchor_of(sr) - kept.anchor
    full = reach + [x + dm for x in module_refs(kept.gen.data_refs, kept.base, kept.size)]
    return (kept.size, full) if installer.space.span_fits(kept.size, full) else None


def check_original(installer: Installer, sr: SuperRegion) -> None:
    """Raise CodegenError unless the client's code still holds the bytes the region
    was built from (the agent checks only the patch sites' bytes; threads moved in by
    TRANSFER rely on every copied instruction, a transfer-only region has no site, and
    a selection made on another process or a file, ``info["verify_original"]``, was
    never read from this one).
    Bytes under our own installed patches are not compared (another region's patch
    may have gone in since; the region copies the original instruction there)."""
    ours = installer.patched_ranges()
    want: dict[int, int] = {}                      # address -> byte the region copied
    for _, bb in sr.blocks():
        if not bb.is_clone:
            want.update(zip(range(bb.start, bb.start + len(bb.data)), bytes(bb.data)))
    # one read per run of nearby blocks (a /proc/PID/mem read each)
    runs: list[list[int]] = []
    for a in sorted(want):
        if runs and a - runs[-1][1] <= 64:
            runs[-1][1] = a + 1
        else:
            runs.append([a, a + 1])
    for lo, hi in runs:
        try:
            now = installer.read_original(lo, hi - lo)
        except OSError as exc:
            raise CodegenError(f"{sr.id}: cannot read {lo:#x}: {exc}") from exc
        for i, byte in enumerate(now):
            a = lo + i
            if a in want and want[a] != byte and not any(s <= a < e for s, e in ours):
                raise CodegenError(f"{sr.id}: original code at {a:#x} changed since "
                                   "the region was selected")
        if len(now) != hi - lo:
            raise CodegenError(f"{sr.id}: original code at {lo:#x} is no longer readable")


def install_region(installer: Installer, sr: SuperRegion,
                   counting: CountPlan | None = None,
                   mark: Callable[[str], None] | None = None) -> InstalledRegion:
    """Emit ``sr`` into space reachable from everything it must reach and patch its
    entries (and move threads in, see :meth:`Installer.transfer`); with ``counting``,
    as a counting region (codegen/blocks.py).  ``mark(step)``: told as each step
    ends ("code_checked", "code_reserved", "code_emitted"), for the timeline."""
    mark = mark or (lambda step: None)
    if installer.transfer_enabled or sr.transfer_only or sr.info.get("verify_original"):
        check_original(installer, sr)
        mark("code_checked")
    ranges, _ = region_extent(sr)
    copies = installer.copy_entries()
    kept = kept_code(installer, sr, counting, copies)
    # a call to a copy: as long as any
    size, reach = kept if kept is not None else placement(installer, sr, counting)
    chunk = installer.reserve(size, reach)
    mark("code_reserved")
    got = placed(sr.info["kept_code"], sr, chunk.addr) if kept is not None else None
    try:
        if got is not None:
            (gen, blobs), cfi_refused = got, sr.info["kept_code"].cfi_refused
        else:
            gen, blobs, cfi_refused = emit_with_frames(
                installer, sr, chunk.addr, call_target=lambda t: copies.get(t, (None,))[0],
                counting=counting)
        check_generated(gen)
    except DbrError:
        installer.space.release(chunk)
        raise
    sr.info["code_from"] = "kept" if got is not None else "emitted"
    installer.kept_placed += got is not None
    mark("code_emitted")
    end = chunk.addr + gen.size + blobs_size(blobs, chunk.addr + gen.size)
    if end > chunk.addr + chunk.size:
        installer.space.release(chunk)
        raise CodegenError(f"{sr.id}: {end - chunk.addr} bytes at {chunk.addr:#x} > "
                           f"{chunk.size} reserved")
    modules = [bb.module for _, bb in sr.blocks() if bb.module]
    depends = ranges + [(t, t + 1) for _, t in gen.exits]
    called = {c.region_id: c for a in gen.call_copies.values() for _, c in copies.values()
              if c.contains_code(a)}
    reg = installer.install(chunk, gen, name=sr.id, exit_ranges=depends,
                            module=modules[0] if modules else None, orig_ranges=ranges,
                            frames=blobs, cfi_refused=cfi_refused,
                            entry_sites=sr.info.get("entry_sites"),
                            calls_into=list(called.values()))
    sr.state = RegionState.INSTALLED if reg.state is InstallState.INSTALLED else sr.state
    reg.free_entries = frozenset(k for k, _ in sr.entry_edges() if isinstance(k, int) and
                                 all(u == START for u in sr.g.predecessors(k)))
    return reg


@dataclass
class InstallOutcome:
    """What one batch of regions did."""

    installed: list[InstalledRegion] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)   # (region id, why)


def install_regions(installer: Installer, regions: Iterable[SuperRegion],
                    already: Iterable[InstalledRegion] = (),
                    counting_for: Callable[[SuperRegion], CountPlan | None] | None = None,
                    went_live: Callable[[InstalledRegion], None] | None = None,
                    mark: Callable[[str], None] | None = None) -> InstallOutcome:
    """Install every region whose entry sites are not already patched; a failure in
    one region is recorded and the others go on.  ``counting_for(sr)``: the counters
    of a region to install as a counting region, or None; ``went_live(reg)``: called as
    each region is installed, before the next one is emitted; ``mark``: see
    :func:`install_region`."""
    out = InstallOutcome()
    taken = {s.site for r in already if r.state is InstallState.INSTALLED
             for s in r.patched_sites}
    for sr in callees_first(regions):
        entries = set(sr.entry_points())
        if entries & taken:
            out.failed.append((sr.id, "entry already patched by an installed region"))
            continue
        try:
            reg = install_region(installer, sr,
                                 counting_for(sr) if counting_for is not None else None,
                                 mark=mark)
        except (DbrError, OSError) as exc:
            out.failed.append((sr.id, f"{type(exc).__name__}: {exc}"))
            continue
        if reg.state is InstallState.INSTALLED:
            out.installed.append(reg)
            taken |= {s.site for s in reg.patched_sites}
            if went_live is not None:
                went_live(reg)
        else:
            out.failed.append((sr.id, reg.why_removed))
    return out


def real_call_targets(sr: SuperRegion) -> set[int]:
    """Original callees of the region's real calls (direct and promoted)."""
    out: set[int] = set()
    for s in sr.info.get("inline", {}).get("sites", {}).values():
        if s.get("decision") == "call" and s.get("callee") is not None:
            out.add(s["callee"])
        elif s.get("decision") == "promoted":
            out.update(s.get("targets", ()))
    return out


def callees_first(regions: Iterable[SuperRegion]) -> list[SuperRegion]:
    """``regions`` reordered so that a region whose entry another one calls for real
    comes before it (in the given order otherwise; a cycle is cut anywhere)."""
    srs = list(regions)
    entries = [set(sr.entry_points()) for sr in srs]
    calls = [real_call_targets(sr) for sr in srs]
    order: list[int] = []
    seen: set[int] = set()

    def visit(i: int) -> None:
        seen.add(i)
        for j in range(len(srs)):
            if j not in seen and calls[i] & entries[j]:
                visit(j)
        order.append(i)

    for i in range(len(srs)):
        if i not in seen:
            visit(i)
    return [srs[i] for i in order]


# ---- evaluation -------------------------------------------------------------------------
@dataclass
class Health:
    """Samples of one snapshot for one installed region."""

    region: InstalledRegion
    in_replacement: int = 0
    in_original: int = 0

    @property
    def total(self) -> int:
        return self.in_replacement + self.in_original

    @property
    def share(self) -> float:
        return self.in_replacement / self.total if self.total else 0.0


@dataclass
class EvalPolicy:
    """When an installed region is taken out again."""

    #: Seconds after installation before a region may be judged.
    grace_s: float = 0.5
    #: A region that has had fewer than ``cold_samples`` samples per snapshot for
    #: ``cold_s`` seconds is cold and taken out.  Minutes, not a few snapshots: a
    #: program that alternates phases keeps the code of each (an idle region costs
    #: nothing; taking it out and selecting it again costs the service a job and the
    #: client two patch rounds).
    cold_s: float = 60.0
    cold_samples: int = 1
    #: Judged not effective when its original code keeps more than this share of its
    #: samples over at least ``min_samples`` samples.  A region whose hot loop keeps
    #: leaving it (an indirect dispatch that exits every iteration) bounces between
    #: original and replacement code and runs slower than native (measured: +60% on
    #: a 12-way interpreter loop with ~45% of its samples left in original code).
    ineffective_share: float = 0.3
    min_samples: int = 50
    #: Times a region's judgement restarts from zero because threads found in its
    #: original code were moved in (TRANSFER): its original code was hot since it
    #: was entered outside any patch, not because it bounces.  Bounded, so a region
    #: that does bounce is still judged.
    max_restarts: int = 3


@dataclass
class _Track:
    #: When it last had ``cold_samples`` in a snapshot (None: not since installed).
    warm_at: float | None = None
    in_replacement: int = 0
    in_original: int = 0
    restarts: int = 0


class Evaluator:
    """Counts, per installed region, samples in its replacement code and in the original
    code it replaces; says which regions went cold or did not take over."""

    def __init__(self, installer: Installer, policy: EvalPolicy | None = None) -> None:
        self.installer = installer
        self.policy = policy or EvalPolicy()
        self.tracks: dict[int, _Track] = {}

    def snapshot(self, samples: Mapping[int, int], now: float | None = None) -> list[Health]:
        """Attribute one snapshot's raw sample IPs ({ip: count}) to installed regions."""
        now = time.monotonic() if now is None else now
        live = [r for r in self.installer.regions.values()
                if r.state is InstallState.INSTALLED and not r.kept]
        health = {r.region_id: Health(r) for r in live}
        for ip, n in samples.items():
            for r in live:
                if r.contains_code(ip):
                    health[r.region_id].in_replacement += n
                    break
                if any(lo <= ip < hi for lo, hi in r.orig_ranges):
                    health[r.region_id].in_original += n
                    break
        for h in health.values():
            t = self.tracks.setdefault(h.region.region_id, _Track())
            t.in_replacement += h.in_replacement
            t.in_original += h.in_original
            if h.total >= self.policy.cold_samples:
                t.warm_at = now
        return list(health.values())

    def restart(self, region_id: int) -> bool:
        """Forget the samples counted so far for a region (threads in its original code
        were just moved in); False once ``max_restarts`` is used up."""
        t = self.tracks.get(region_id)
        if t is None or t.restarts >= self.policy.max_restarts:
            return False
        t.in_replacement = t.in_original = 0
        t.restarts += 1
        return True

    def verdicts(self, now: float | None = None) -> list[tuple[InstalledRegion, str]]:
        """Regions to take out, with why ("cold" or "not effective")."""
        now = time.monotonic() if now is None else now
        out = []
        for rid, t in self.tracks.items():
            reg = self.installer.regions.get(rid)
            if reg is None or reg.state is not InstallState.INSTALLED:
                continue
            if now - reg.installed_at < self.policy.grace_s:
                continue
            total = t.in_replacement + t.in_original
            if now - max(reg.installed_at, t.warm_at or 0.0) >= self.policy.cold_s:
                out.append((reg, "cold"))
            elif total >= self.policy.min_samples and \
                    t.in_original / total > self.policy.ineffective_share:
                out.append((reg, "not effective"))
        return out

    def apply(self, now: float | None = None) -> list[tuple[InstalledRegion, str]]:
        """Uninstall every region the verdicts name; failures are recorded, not raised.
        The regions removed with them (they called their copies) come too, with their
        own reasons (taken from Installer.cascaded: whoever removes a region drains
        what its removal took along)."""
        done = []
        before = len(self.installer.cascaded)
        for reg, why in self.verdicts(now):
            if reg.state is not InstallState.INSTALLED:
                continue             # removed with a region whose copy it calls
            try:
                self.installer.uninstall(reg.region_id, why)
                done.append((reg, why))
            except AgentError as exc:
                reg.why_removed = f"unpatch failed: {exc}"
        more = self.installer.cascaded[before:]
        del self.installer.cascaded[before:]
        return done + [(r, r.why_removed) for r in more]
