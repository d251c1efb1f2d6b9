"""The counting phase of a session's regions (docs/decisions/0041-exact-counts.md), a
part of :class:`dbr_service.session.clients.ClientSession` (a mixin): which regions are
installed as counting regions (``profile``), their counters, the monitor that reads
them, and their replacement by the region built from the exact counts.

The region's record (``dbr ctl regions``, the run report) carries ``info["counting"]``:
the phase (``counting``, ``over``, ``ended with the client``), why it ended, the
promoted blocks, the hottest blocks' exact counts and how far the sample-inferred
counts were from them (exact_counts.sample_error); once the phase is over, when it
ended (``over_at_s``, seconds since the process started), how long the counting code
was live (``seconds``: to its removal; ``ended_after_s``: to the poll that ended the
phase) and how long removing it and installing the optimised region took
(``replace_s``).
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import capstone

from dbr_service.codegen.blocks import CountPlan
from dbr_service.session.counting_monitor import CountingRegion, CountMonitor
from dbr_service.common.errors import AgentError, DbrError
from dbr_service.installation.exact_counts import (derive, plan_counters, rebuilt, sample_error,
                                                   too_thin)
from dbr_service.installation.optimize import provisional_base
from dbr_service.installation.progress_points import CounterSpace
from dbr_service.region.model import NodeKey, SuperRegion, fmt_node
from dbr_service.common.states import HELD

log = logging.getLogger("dbr.clients")

_MD = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)

#: Blocks whose exact counts a region's record lists (the hottest).
COUNTS_SHOWN = 64


def counter_increments(gen: Any) -> int:
    """``lock inc qword [rip+d]`` instructions in a region's code: its counters."""
    code = gen.code if gen.data_start is None else gen.code[:gen.data_start]
    return sum(1 for i in _MD.disasm(code, gen.base)
               if i.mnemonic == "lock inc" and "rip" in i.op_str)


def _counts_json(counts: dict[NodeKey, int]) -> dict[str, int]:
    top = sorted(counts.items(), key=lambda kv: -kv[1])[:COUNTS_SHOWN]
    return {fmt_node(k): n for k, n in top}


class SessionCounting:
    """Counting regions of one session (mixin of ClientSession)."""

    count_monitor: CountMonitor | None = None
    #: Selected region (sr.id) -> (its counters, counter address -> its buffer), from
    #: the counters' allocation until the region is installed or refused.
    _count_plans: dict[str, tuple[CountPlan, dict[int, Any]]]

    def counting_plan(self, sr: SuperRegion) -> CountPlan | None:
        """Session thread: the counters of ``sr`` if it is to run as a counting region
        first (``profile``), else None."""
        cfg = self.service.config
        if cfg.profile == "sample" or sr.info.get("exact_counts") or sr.transfer_only:
            return None
        if cfg.profile == "auto" and not too_thin(sr, cfg.count_thin_samples):
            return None
        inst = self.installer
        if self.counter_space is None:
            self.counter_space = CounterSpace(inst.conn)
        near = provisional_base(sr)
        bufs: dict[int, Any] = {}

        def alloc() -> int:
            buf, addr = self.counter_space.counter(near)
            bufs[addr] = buf
            return addr
        plan = plan_counters(sr, alloc)
        if not hasattr(self, "_count_plans"):
            self._count_plans = {}
        self._count_plans[sr.id] = (plan, bufs)
        return plan

    def _monitor(self) -> CountMonitor:
        if self.count_monitor is None:
            cfg = self.service.config
            self.count_monitor = CountMonitor(
                cfg.count_threshold_direct, cfg.count_threshold_indirect,
                cfg.count_phase_max_s, cfg.count_poll_ms / 1000.0,
                lambda cr: self._queue_command(lambda: self.counting_over(cr.rid)))
        return self.count_monitor

    def counting_installed(self, rid: str, sr: SuperRegion, reg: Any, rec: Any) -> None:
        """Session thread: ``reg`` went live; if it is a counting region, the monitor
        follows it and no speed check runs until its phase is over (the counters
        would weigh on the measure)."""
        plans = getattr(self, "_count_plans", {})
        got = plans.pop(sr.id, None)
        if got is None or reg.gen.counting is None:
            return
        plan, bufs = got
        cr = CountingRegion(rid, reg.region_id, sr, plan, dict(reg.gen.counted_sides),
                            lambda a: bufs[a].read_u64(a))
        with self.lock:
            rec.recheck_mono = math.inf
            rec.info["counting"] = {"phase": "counting",
                                    "counters_in_code": counter_increments(reg.gen)}
        self._monitor().add(cr)
        log.info("pid %d: region %s counts its blocks (%d counters)", self.pid, rid,
                 len(plan.blocks) + len(plan.sides))

    def _counting_record(self, cr: CountingRegion, phase: str) -> tuple[dict[str, Any], Any]:
        """The record of ``cr``'s counts so far, and its exact profile."""
        prof = derive(cr.sr, cr.plan, cr.sides, cr.value)
        return {"phase": phase, "why": cr.done, "polls": cr.polls,
                "seconds": round(time.monotonic() - cr.started, 4),
                "ended_after_s": None if cr.done_at is None else
                round(cr.done_at - cr.started, 4),
                "promoted": {fmt_node(k): n for k, n in cr.promoted.items()},
                "block_counts": _counts_json(prof.blocks),
                "entries": sum(prof.entries.values()),
                "inexact_blocks": [fmt_node(k) for k in prof.inexact],
                "sample_error": sample_error(cr.sr, prof, cr.sides)}, prof

    def counting_refresh(self) -> None:
        """Session thread: the counting regions' records show their counts so far."""
        mon = self.count_monitor
        if mon is None:
            return
        for rid, cr in list(mon.regions.items()):
            rec = self.region_book.regions.get(rid)
            if rec is not None:
                info, _ = self._counting_record(cr, "counting")
                with self.lock:
                    rec.info["counting"] = info

    def counting_over(self, rid: str) -> bool:
        """Session thread: replace counting region ``rid`` by the region built from its
        exact counts; whether the new region went live.  The counting region goes first
        (its code runs tens of times slower than the original), then its counts are
        read, the region rebuilt from them and installed."""
        mon = self.count_monitor
        cr = mon.remove(rid) if mon is not None else None
        rec = self.region_book.regions.get(rid)
        inst = self.installer
        if cr is None or rec is None or inst is None:
            return False
        reg = inst.regions.get(cr.install_id)
        t0 = time.monotonic()
        live = reg is not None and reg.state in HELD   # else gone (a map change, the operator)
        failed = None
        if live:
            try:
                inst.uninstall(reg.region_id, "counting phase over", evict=True)
            except AgentError as exc:
                failed = f"region {rid}: counting region not removed: {exc}"
        info, prof = self._counting_record(cr, "over")
        info["over_at_s"] = round(t0 - self.started_mono, 4)
        with self.lock:
            rec.info["counting"] = info
            rec.recheck_mono = 0.0
        if failed is not None:
            self.errors.append(failed)
        if not live or failed is not None:
            return False
        self._region_removed(rec, "counting phase over")
        try:
            opt, error = rebuilt(cr.sr, prof), None
        except DbrError as exc:               # no region left: the sampled one, uncounted
            opt, error = cr.sr, str(exc)
        opt.info["exact_counts"] = True
        waits = getattr(self, "speed_check", None) is not None
        with self.lock:                       # the record is read by other threads
            info["blocks_after"] = len(opt)
            if error is not None:
                info["rebuild_error"] = error
            if waits:
                info["replaced"] = False
                info["waits_for"] = "the speed check in progress"
        if waits:
            # no install while a check measures: the region waits for its end rather
            # than being selected and counted again
            self._counted_waiting[rid] = (opt, t0)
            return False
        return self._install_counted(rid, opt, t0)

    @property
    def _counted_waiting(self) -> dict[str, tuple[SuperRegion, float]]:
        """Regions built from their counts that wait for a speed check to end."""
        if not hasattr(self, "_counted_waiting_d"):
            self._counted_waiting_d: dict[str, tuple[SuperRegion, float]] = {}
        return self._counted_waiting_d

    def counted_install_waiting(self) -> int:
        """Session thread, once no speed check runs: install the regions built from
        their counts that waited for one to end; how many went live."""
        waiting, n = self._counted_waiting, 0
        while waiting and getattr(self, "speed_check", None) is None:
            rid, (opt, t0) = waiting.popitem()
            n += self._install_counted(rid, opt, t0)
        return n

    def _install_counted(self, rid: str, opt: SuperRegion, t0: float) -> bool:
        rec = self.region_book.regions.get(rid)
        if rec is None:
            return False
        info = rec.info.get("counting", {})
        n = self.install_selected([opt], [rid])
        new = self.installer.regions.get(rec.info.get("install_id", -1)) if n else None
        with self.lock:
            info.pop("waits_for", None)
            info["replaced"] = bool(n)
            info["replace_s"] = round(time.monotonic() - t0, 4)
            if new is not None:
                info["counters_after"] = counter_increments(new.gen)
        log.info("pid %d: region %s counted; optimised region %s", self.pid, rid,
                 "installed" if n else "not installed")
        return bool(n)

    def counting_final(self) -> None:
        """Session thread, as the session ends (its buffers still mapped): the last
        counts of the regions still counting go to their records; the monitor stops."""
        mon = self.count_monitor
        if mon is None:
            return
        mon.stop()
        for rid, cr in list(mon.regions.items()):
            mon.poll_one(cr, time.monotonic())
            rec = self.region_book.regions.get(rid)
            if rec is not None:
                info, _ = self._counting_record(cr, "ended with the client")
                with self.lock:
                    rec.info["counting"] = info
        mon.regions.clear()
