"""The region-selection pass manager (DESIGN "The region-selection pipeline").

``run_pipeline`` takes the single SR hot-code discovery produced and runs the
registered passes in order (:data:`PASSES`).  The manager times every pass,
keeps each pass's counters, optionally verifies every SR after every pass
(``SuperRegion.verify``), optionally keeps a copy of every stage and writes it
as DOT, and isolates failures: an SR whose pass or verification fails is
recorded in ``failures`` and dropped while the others go on, unless
``fail_fast`` re-raises for debugging.

Two kinds of pass: a *region* pass maps one SR to zero or more SRs
(``run_region``); a *set* pass sees all SRs at once (``run_set``; the inliner,
whose callees live in other SRs) and reports a per-SR failure through
``ctx.fail``.
"""

from __future__ import annotations

import copy
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, ClassVar

from dbr_service.errors import RegionError
from dbr_service.region import fallthrough, inline, partition, patchpoints, prune
from dbr_service.region.model import RegionState, SuperRegion


@dataclass
class RegionConfig:
    """Knobs of region selection (units in the field comments)."""

    #: Discovery: conditional jumps followed away from sampled code.
    jumps_from_hot_limit: int = 2
    #: A block/call is hot when its (estimated) execution count reaches this.
    hot_threshold: float = 1.0
    #: A region needs a loop with at least this many iterations per entry.
    min_loop_trip_count: float = 4.0
    #: A region needs at least this many bytes of body code (clones included).
    min_region_size: int = 16
    #: Inlining: growth allowed per SR as a ratio of its body bytes (1.0 = double).
    inline_budget: float = 1.0
    #: Inlining: growth always allowed per SR, in bytes, whatever its size.
    inline_min_budget_bytes: int = 256
    #: Run INLINE-HOT-CALLS (if False, call blocks are still removed: no call
    #: may run in replacement code).
    inline: bool = True
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
    #: Seconds per pass name.
    timings: dict[str, float] = field(default_factory=dict)
    #: Counters per pass name.
    counters: dict[str, dict[str, int]] = field(default_factory=dict)
    failures: list[Failure] = field(default_factory=list)


class _Ctx:
    """What a set pass gets from the manager."""

    def __init__(self, config: RegionConfig, mem: Any, fail) -> None:
        self.config = config
        self.mem = mem
        self.fail = fail


class Pass:
    """A pipeline pass: kebab-case ``name``, ``applies``, ``run_*``, ``counters``."""

    name: ClassVar[str] = ""
    scope: ClassVar[str] = "region"          # or "set"

    def __init__(self) -> None:
        self.counters: Counter = Counter()

    def applies(self, config: RegionConfig) -> bool:
        return True

    def run_region(self, sr: SuperRegion, mem: Any, config: RegionConfig) -> list[SuperRegion]:
        raise NotImplementedError

    def run_set(self, regions: list[SuperRegion], ctx: _Ctx) -> list[SuperRegion]:
        raise NotImplementedError


class PartitionPass(Pass):
    name = "partition-code"

    def run_region(self, sr, mem, config):
        return partition.partition_code(sr, self.counters)


class FallThroughOnlyPass(Pass):
    name = "fall-through-only"

    def applies(self, config):
        return not config.measured_counts

    def run_region(self, sr, mem, config):
        fallthrough.compute_fall_through_only(sr, self.counters)
        return [sr]


class InlineHotCallsPass(Pass):
    name = "inline-hot-calls"
    scope = "set"

    def run_set(self, regions, ctx):
        c = ctx.config
        if c.inline:
            inline.inline_hot_calls(regions, hot_threshold=c.hot_threshold,
                                    inline_budget=c.inline_budget,
                                    inline_min_budget_bytes=c.inline_min_budget_bytes,
                                    counters=self.counters, on_error=ctx.fail)
        else:
            for sr in regions:
                try:
                    inline.remove_call_blocks(sr, set(), self.counters)
                except Exception as exc:
                    ctx.fail(sr, exc)
        return regions


class PatchPointSelectionPass(Pass):
    name = "patch-point-selection"

    def run_region(self, sr, mem, config):
        return [sr] if patchpoints.select_patch_points(sr, self.counters) else []


class PruneCodePass(Pass):
    name = "prune-code"

    def run_region(self, sr, mem, config):
        return prune.prune_code(sr, hot_threshold=config.hot_threshold,
                                min_loop_trip_count=config.min_loop_trip_count,
                                min_region_size=config.min_region_size, counters=self.counters)


#: Passes run in the order they are registered here (seed 001, fig. 3):
#: partition first, so every later pass sees one routine-sized, single-component
#: SR whose START reaches everything; fall-through counts next, because the
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


def run_pipeline(first_sr: SuperRegion, mem: Any, config: RegionConfig) -> PipelineResult:
    """Run every applicable registered pass on the SR from hot-code discovery."""
    res = PipelineResult()
    regions = [first_sr]
    _record(res, config, 0, "discovery", regions)
    for i, cls in enumerate(PASSES, start=1):
        p = cls()
        if not p.applies(config):
            continue
        t0 = time.perf_counter()
        regions = _run_one(p, regions, mem, config, res)
        if config.verify:
            regions = _verify_all(p.name, regions, config, res)
        res.timings[p.name] = time.perf_counter() - t0
        res.counters[p.name] = dict(p.counters)
        _record(res, config, i, p.name, regions)
    for sr in regions:
        sr.state = RegionState.SELECTED
    res.regions = regions
    return res


def select_regions(samples: Any, mem: Any, config: RegionConfig, *, branch_samples: Any = None,
                   patched: Any = None) -> PipelineResult:
    """Hot-code discovery from aggregated samples, then :func:`run_pipeline`."""
    from dbr_service.region.discovery import hot_code_discovery  # written alongside

    t0 = time.perf_counter()
    first = hot_code_discovery(samples, mem, jumps_from_hot_limit=config.jumps_from_hot_limit,
                               branch_samples=branch_samples, patched=patched)
    took = time.perf_counter() - t0
    res = run_pipeline(first, mem, config)
    res.timings = {"hot-code-discovery": took, **res.timings}
    return res


# ---- manager internals ---------------------------------------------------------------
def _failer(pass_name: str, config: RegionConfig, res: PipelineResult, failed: set[str]):
    def fail(sr: SuperRegion, exc: BaseException) -> None:
        if config.fail_fast:
            raise exc
        failed.add(sr.id)
        res.failures.append(Failure(pass_name, sr.id, f"{type(exc).__name__}: {exc}"))
    return fail


def _run_one(p: Pass, regions: list[SuperRegion], mem: Any, config: RegionConfig,
             res: PipelineResult) -> list[SuperRegion]:
    failed: set[str] = set()
    fail = _failer(p.name, config, res, failed)
    if p.scope == "set":
        try:
            out = p.run_set(regions, _Ctx(config, mem, fail))
        except Exception as exc:  # the pass as a whole broke: every SR fails
            if config.fail_fast:
                raise
            for sr in regions:
                fail(sr, exc)
            return []
        return [sr for sr in out if sr.id not in failed and len(sr) > 0]
    out = []
    for sr in regions:
        try:
            out.extend(x for x in p.run_region(sr, mem, config) if len(x) > 0)
        except Exception as exc:
            fail(sr, exc)
    return out


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
                f.write(sr.to_dot(f"{sr.id} after {name}"))
