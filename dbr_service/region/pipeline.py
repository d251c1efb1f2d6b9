"""The region-selection pass manager (docs/architecture.md, "Region selection").

``run_pipeline`` takes the single SR hot-code discovery produced and runs the
registered passes in order (:data:`PASSES`).  The manager times every pass,
keeps each pass's counters, optionally verifies every SR after every pass
(``SuperRegion.verify``), optionally keeps a copy of every stage and writes it
as DOT, and isolates failures: an SR whose pass or verification fails is
recorded in ``failures`` and dropped while the others go on, unless
``fail_fast`` re-raises for debugging.

Every pass maps the list of SRs to the next list (``run``).  Most work on one
SR at a time (:class:`RegionPass`, ``run_region``: one SR to zero or more); the
inliner sees all SRs at once because callees live in other SRs.  Either way a
failure in one SR goes through ``ctx.fail`` and only that SR is dropped.
"""

from __future__ import annotations

import copy
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

from dbr_service.common.errors import RegionError
from dbr_service.region import dispatch, fallthrough, inline, partition, patchpoints, prune
from dbr_service.region.model import MAX_CASCADE_TARGETS, SuperRegion
from dbr_service.common.states import RegionState


@dataclass
class RegionConfig:
    """Knobs of region selection (units in the field comments)."""

    #: Discovery: conditional jumps followed away from sampled code.
    jumps_from_hot_limit: int = 2
    #: Discovery: fewest samples an IP needs to start a search of its own (IPs with
    #: fewer still count inside the blocks reached from others).
    seed_min_samples: float = 0.0
    #: Discovery: no jump is followed once this many blocks are made (None: no bound).
    max_discovery_blocks: int | None = None
    #: A block/call is hot when its (estimated) execution count reaches this.
    hot_threshold: float = 1.0
    #: A region needs a loop with at least this many iterations per entry ...
    min_loop_trip_count: float = 4.0
    #: ... or be a hot function: patched at a function entry, with at least this many
    #: samples in its blocks (region/prune.py; None: loops only).
    function_threshold: float | None = None
    #: A region needs at least this many bytes of body code (clones included).
    min_region_size: int = 16
    #: Whole-program hot text: discovery also starts at the entry of every function
    #: holding a sample (region/functions.py, FunctionEntries.count_samples), entry
    #: sites are on, and the hot functions kept are the hottest up to
    #: ``hot_text_max_bytes`` of body code.
    hot_text: bool = False
    hot_text_max_bytes: int = 262144
    #: Inlining: growth allowed per SR as a ratio of its body bytes (1.0 = double).
    inline_budget: float = 1.0
    #: Indirect jumps with more known targets than this exit (no compare cascade).
    max_cascade_targets: int = MAX_CASCADE_TARGETS
    #: Patch-point selection may choose entry sites (region/patchpoints.py).  Off by
    #: default: discovery sees only the code around hot samples, and a branch from
    #: code it never decoded into bytes 1..4 of a function's entry (glibc's
    #: ``__mempcpy_*`` jumps to ``__memcpy_*+3``) lands in the middle of the jump.
    entry_sites: bool = False
    #: Absolute table jumps with a masked index jump through a copy of their table in
    #: replacement code, whatever their width (codegen/tables.py); else as above.
    translate_tables: bool = True
    #: Inlining: growth always allowed per SR, in bytes, whatever its size.
    inline_min_budget_bytes: int = 256
    #: Keep an SR that has no patchable block as *transfer-only*: no patch points,
    #: entered only by moving threads found in its original code (agent TRANSFER).
    transfer_only: bool = False
    #: Run INLINE-HOT-CALLS (if False, call blocks not kept as real calls are still
    #: removed).
    inline: bool = True
    #: Keep direct calls that are not inlined as real calls to the original callee
    #: (same module, no PLT stub: region/inline.py); else they exit to original code.
    real_calls: bool = False
    #: With ``real_calls``: most targets of an indirect call promoted to compare + direct
    #: real call (region/inline.py, codegen/calls.py); 0: indirect calls exit as before.
    icp_max_targets: int = 3
    #: Counts were measured (LBR, instrumentation): skip COMPUTE-FALL-THROUGH-ONLY.
    measured_counts: bool = False
    #: Verify every SR after every pass.
    verify: bool = True
    #: Keep a deep copy of the SRs after every pass in ``PipelineResult.stages``.
    keep_stages: bool = False
    #: Write ``<dump_dir>/<nn>-<pass>-<sr id>.dot`` after every pass.
    dump_dir: str | None = None
    #: Re-raise the first failure instead of dropping the SR.
    fail_fast: bool = False


@dataclass
class Failure:
    """One SR dropped because a pass (or verification after it) failed."""

    pass_name: str
    region_id: str
    error: str


@dataclass
class PipelineResult:
    #: Final regions: state SELECTED, ``info["loops"]`` = forest, entries = patch points.
    regions: list[SuperRegion] = field(default_factory=list)
    #: (stage name, deep copies of its SRs), "discovery" first; only with keep_stages.
    stages: list[tuple[str, list[SuperRegion]]] = field(default_factory=list)
    #: Seconds per pass name; "verify": all verification; "hot-code-discovery"
    #: when :func:`select_regions` ran discovery.
    timings: dict[str, float] = field(default_factory=dict)
    #: Counters per pass name (each pass's own, plus regions-in / regions-out).
    counters: dict[str, dict[str, int]] = field(default_factory=dict)
    failures: list[Failure] = field(default_factory=list)


class PassContext:
    """What a pass gets besides the SRs: the config, the client memory, the bytes of
    installed patches (``patched(addr)``, or None), and ``fail(sr, exc)`` to report
    that one SR failed (the manager drops it)."""

    def __init__(self, config: RegionConfig, mem: Any, fail: Callable,
                 patched: Callable[[int], bool] | None = None) -> None:
        self.config = config
        self.mem = mem
        self.fail = fail
        self.patched = patched


class Pass:
    """A pipeline pass: kebab-case ``name``, ``applies``, ``run``, ``counters``.

    ``run`` maps the list of SRs to the next list.  Most passes work on one SR
    at a time: they subclass :class:`RegionPass` and write ``run_region``.
    """

    name: ClassVar[str] = ""

    def __init__(self) -> None:
        self.counters: Counter = Counter()

    def applies(self, config: RegionConfig) -> bool:
        return True

    def run(self, regions: list[SuperRegion], ctx: PassContext) -> list[SuperRegion]:
        raise NotImplementedError


class RegionPass(Pass):
    """A pass over each SR on its own; one SR's failure does not stop the others."""

    def run(self, regions: list[SuperRegion], ctx: PassContext) -> list[SuperRegion]:
        out: list[SuperRegion] = []
        for sr in regions:
            try:
                out.extend(self.run_region(sr, ctx))
            except Exception as exc:
                ctx.fail(sr, exc)
        return out

    def run_region(self, sr: SuperRegion, ctx: PassContext) -> list[SuperRegion]:
        """Transform one SR into zero or more SRs."""
        raise NotImplementedError


class PartitionPass(RegionPass):
    """CUT-WIDE-DISPATCH (region/dispatch.py), then PARTITION-CODE: the cut can leave
    blocks that START no longer reaches, and partitioning connects them again."""

    name = "partition-code"

    def run_region(self, sr, ctx):
        dispatch.cut_wide_dispatch(sr, ctx.config.max_cascade_targets, self.counters,
                                   ctx.mem, ctx.config.translate_tables)
        return partition.partition_code(sr, self.counters)


class FallThroughOnlyPass(RegionPass):
    name = "fall-through-only"

    def applies(self, config):
        return not config.measured_counts

    #: Rounds of call-site floors: a floor raises a caller's counts, which can
    #: raise its own entry count and so its callers' floors (main -> step -> mix).
    FLOOR_ROUNDS = 4

    def run(self, regions, ctx):
        # One profile: branch counts anywhere mean the sampler gives them.
        self.ip_only = not any(fallthrough.has_branch_counts(sr) for sr in regions)
        self.floors: dict = {}
        out = super().run(regions, ctx)
        if not self.ip_only:
            return out
        for _ in range(self.FLOOR_ROUNDS):
            new = fallthrough.call_site_floors(out)
            if not new:
                break
            failed = set()
            for sr in out:
                if sr.id not in new:
                    continue
                self.floors.setdefault(sr.id, {}).update(new[sr.id])
                self.counters["call-site-floors"] += len(new[sr.id])
                try:
                    fallthrough.estimate_from_samples(sr, floors=self.floors[sr.id])
                except Exception as exc:
                    ctx.fail(sr, exc)
                    failed.add(sr.id)
            out = [sr for sr in out if sr.id not in failed]
        return out

    def run_region(self, sr, ctx):
        fallthrough.compute_fall_through_only(sr, self.counters, ip_only=self.ip_only)
        return [sr]


class InlineHotCallsPass(Pass):
    """Works on all SRs at once: a callee usually lives in another SR."""

    name = "inline-hot-calls"

    def run(self, regions, ctx):
        c = ctx.config
        real = {"real_calls": c.real_calls, "mem": ctx.mem, "patched": ctx.patched,
                "icp_targets": c.icp_max_targets}
        if c.inline:
            inline.inline_hot_calls(regions, hot_threshold=c.hot_threshold,
                                    inline_budget=c.inline_budget,
                                    inline_min_budget_bytes=c.inline_min_budget_bytes,
                                    counters=self.counters, on_error=ctx.fail, **real)
        else:
            for sr in regions:
                try:
                    inline.remove_call_blocks(sr, set(), self.counters, **real)
                except Exception as exc:
                    ctx.fail(sr, exc)
        return regions


class PatchPointSelectionPass(RegionPass):
    name = "patch-point-selection"

    def run_region(self, sr, ctx):
        return [sr] if patchpoints.select_patch_points(
            sr, self.counters, transfer_only=ctx.config.transfer_only,
            entry_sites=ctx.config.entry_sites or ctx.config.hot_text,
            prefer_entries=ctx.config.hot_text) else []


class PruneCodePass(RegionPass):
    name = "prune-code"

    def run_region(self, sr, ctx):
        config = ctx.config
        return prune.prune_code(sr, hot_threshold=config.hot_threshold,
                                min_loop_trip_count=config.min_loop_trip_count,
                                min_region_size=config.min_region_size, counters=self.counters,
                              function_threshold=config.function_threshold)


#: Passes run in the order they are registered here (patent fig. 3; docs/architecture.md):
#: partition first (after cutting the edges of indirect jumps that code generation
#: leaves as exits, so every pass sees the graph the code will have), so every later
#: pass sees one routine-sized, single-component SR whose START reaches everything;
#: fall-through counts next, because the
#: inliner's hotness test and count scaling need block counts; inlining before
#: patch-point selection, because the inliner needs whole routines and is not
#: to be hampered by patch constraints (clones are unpatchable anyway); prune
#: last, because it removes what the entry moves left unreachable and judges
#: each region by its final loops.
PASSES: list[type[Pass]] = [
    PartitionPass,
    FallThroughOnlyPass,
    InlineHotCallsPass,
    PatchPointSelectionPass,
    PruneCodePass,
]


def run_pipeline(first_sr: SuperRegion, mem: Any, config: RegionConfig, *,
                 patched: Callable[[int], bool] | None = None) -> PipelineResult:
    """Run every applicable registered pass on the SR from hot-code discovery
    (``patched(addr)``: whether a byte belongs to an installed patch)."""
    if first_sr.state != RegionState.DISCOVERED:
        raise RegionError(f"{first_sr.id}: region selection needs a discovered SR, "
                          f"not a {first_sr.state.value} one")
    res = PipelineResult()
    regions = [first_sr]
    _record(res, config, 0, "discovery", regions)
    for i, cls in enumerate(PASSES, start=1):
        p = cls()
        if not p.applies(config):
            continue
        n_in = len(regions)
        t0 = time.perf_counter()
        regions = _run_one(p, regions, mem, config, res, patched)
        t1 = time.perf_counter()
        res.timings[p.name] = t1 - t0
        if config.verify:
            regions = _verify_all(p.name, regions, config, res)
            res.timings["verify"] = res.timings.get("verify", 0.0) + time.perf_counter() - t1
        p.counters["regions-in"] += n_in
        p.counters["regions-out"] += len(regions)
        res.counters[p.name] = dict(p.counters)
        _record(res, config, i, p.name, regions)
    for sr in regions:
        sr.state = RegionState.SELECTED
    res.regions = regions
    return res


def select_regions(samples: Any, mem: Any, config: RegionConfig, *, branch_samples: Any = None,
                   patched: Any = None, functions: Any = None) -> PipelineResult:
    """Hot-code discovery from aggregated samples, then :func:`run_pipeline`.
    ``functions``: the client's known function entries (region/functions.py
    FunctionEntries), to which the direct call targets discovery saw are added; they
    let patch-point selection choose entry sites."""
    from dbr_service.region.discovery import hot_code_discovery  # written alongside

    t0 = time.perf_counter()
    extra = {}
    if config.hot_text and functions is not None:
        extra["entries"] = functions.count_samples(samples, config.seed_min_samples)
    first = hot_code_discovery(samples, mem, jumps_from_hot_limit=config.jumps_from_hot_limit,
                               branch_samples=branch_samples, patched=patched,
                               seed_min=config.seed_min_samples,
                               max_blocks=config.max_discovery_blocks, **extra)
    if functions is not None:
        from dbr_service.region.functions import call_targets

        functions.add(call_targets(first))
        first.info["function_entries"] = functions
    took = time.perf_counter() - t0
    res = run_pipeline(first, mem, config, patched=patched)
    if config.hot_text:
        res.regions = hot_text_budget(res.regions, config.hot_text_max_bytes,
                                      res.counters.setdefault("prune-code", {}))
    for sr in res.regions:
        sr.info.pop("function_entries", None)   # holds the worker's file look-ups
    res.timings = {"hot-code-discovery": took, **res.timings}
    return res


def hot_text_budget(regions: list[SuperRegion], max_bytes: int,
                    counters: dict[str, int]) -> list[SuperRegion]:
    """Hot functions, hottest (most samples) first, while their body bytes stay within
    ``max_bytes``; regions kept for a hot loop are not counted and always stay."""
    hot = sorted((sr for sr in regions if sr.info.get("hot_function")),
                 key=lambda sr: (-sum(bb.samples for _, bb in sr.blocks()), sr.id))
    drop: set[str] = set()
    used = 0
    for sr in hot:
        size = sum(bb.size for _, bb in sr.blocks())
        if used + size > max_bytes:
            drop.add(sr.id)
        else:
            used += size
    counters["hot-text-bytes"] = used
    counters["dropped-over-hot-text-budget"] = len(drop)
    return [sr for sr in regions if sr.id not in drop]


# ---- manager internals ---------------------------------------------------------------
def _failer(pass_name: str, config: RegionConfig, res: PipelineResult, failed: set[str]):
    def fail(sr: SuperRegion, exc: BaseException) -> None:
        if config.fail_fast:
            raise exc
        failed.add(sr.id)
        res.failures.append(Failure(pass_name, sr.id, f"{type(exc).__name__}: {exc}"))
    return fail


def _run_one(p: Pass, regions: list[SuperRegion], mem: Any, config: RegionConfig,
             res: PipelineResult, patched: Callable[[int], bool] | None = None
             ) -> list[SuperRegion]:
    failed: set[str] = set()
    fail = _failer(p.name, config, res, failed)
    try:
        out = p.run(regions, PassContext(config, mem, fail, patched))
    except Exception as exc:  # the pass as a whole broke: every SR fails
        if config.fail_fast:
            raise
        for sr in regions:
            fail(sr, exc)
        return []
    return [sr for sr in out if sr.id not in failed and len(sr) > 0]


def _verify_all(pass_name: str, regions: list[SuperRegion], config: RegionConfig,
                res: PipelineResult) -> list[SuperRegion]:
    failed: set[str] = set()
    fail = _failer(pass_name, config, res, failed)
    for sr in regions:
        try:
            sr.verify()
        except RegionError as exc:
            fail(sr, exc)
    return [sr for sr in regions if sr.id not in failed]


def _record(res: PipelineResult, config: RegionConfig, i: int, name: str,
            regions: list[SuperRegion]) -> None:
    if config.keep_stages:
        res.stages.append((name, copy.deepcopy(regions)))
    if config.dump_dir:
        os.makedirs(config.dump_dir, exist_ok=True)
        for sr in regions:
            path = os.path.join(config.dump_dir, f"{i:02d}-{name}-{sr.id}.dot")
            with open(path, "w") as f:
                functions = sr.info.get("function_entries")
                f.write(sr.to_dot(f"{sr.id} after {name}",
                                  getattr(functions, "name", None)))
