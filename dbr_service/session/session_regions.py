"""The regions a session knows of its client: their states and records."""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from dbr_service.wire import protocol as P
from dbr_service.wire.checked_conn import CheckedConnection
from dbr_service.common.clientfiles import PerfMap
from dbr_service.codegen.frames import CfiSource
from dbr_service.common.errors import AgentError
from dbr_service.common.hotnames import name_address
from dbr_service.installation.install import Installer
from dbr_service.installation.jitdump import JitDump
from dbr_service.installation.optimize import Evaluator, install_regions, region_extent
from dbr_service.common.procmaps import MapEntry
from dbr_service.common.states import HELD, InstallState, RegionState

log = logging.getLogger("dbr.clients")

#: Installation attempts of one selected region before it is not tried again.
INSTALL_ATTEMPTS = 3



@dataclass
class RegionRecord:
    """A region known for one client, as the operator API and the report show it."""

    id: str
    module: str
    entries: list[int]
    blocks: int
    code_bytes: int
    state: RegionState = RegionState.SELECTED
    #: Patch sites of an installed region (protocol records), for unpatch.
    sites: list[Any] = field(default_factory=list)
    #: Graph of the region for `dbr ctl region --dot` (DOT text), if the pipeline gave one.
    dot: str | None = None
    #: Free-form details from the pipeline (loops, trip counts, ...).
    info: dict[str, Any] = field(default_factory=dict)
    #: Original code an installed region replaces ([lo, hi) byte ranges).
    orig_ranges: list[tuple[int, int]] = field(default_factory=list)
    #: When it went live (time.monotonic()); 0 if it never did.
    installed_mono: float = 0.0
    #: Not before this (time.monotonic()) is it a speed check's candidate: when its last
    #: check was abandoned (0: since it went live).
    recheck_mono: float = 0.0

    def to_json(self, maps: list[MapEntry] | None = None) -> dict[str, Any]:
        """The record as `dbr ctl regions` and reports show it; with the client's
        ``maps``, its entries named after the functions holding them too."""
        out = {"id": self.id, "module": self.module, "entries": list(self.entries),
               "blocks": self.blocks, "code_bytes": self.code_bytes,
               "state": self.state.value, "info": self.info}
        if maps is not None:
            out["entry_names"] = [name_address(e, maps) for e in self.entries]
        return out


#: Evaluation moves threads into a live region (TRANSFER) when a window finds at
#: least this many of the region's samples, and this share of them, in its original code.
TRANSFER_MIN_SAMPLES = 2
TRANSFER_MIN_SHARE = 0.05


class RegionBook:
    """The regions a session knows of its client, by stable id ("r1", ...), and which
    of them may not be installed: those never to install again (blocked) and those
    the operator unpatched (held).  Compound updates hold the session's ``lock``."""

    def __init__(self, lock: threading.RLock) -> None:
        self.lock = lock
        self.regions: dict[str, RegionRecord] = {}
        #: Stable ids ("r1", ...) of regions by (module, entries), across worker jobs.
        self._region_ids: dict[tuple[str, tuple[int, ...]], str] = {}
        #: Region ids never to install again (judged not effective).
        self.blocked_regions: set[str] = set()
        #: What the operator unpatched (`dbr ctl unpatch`): these regions, or with
        #: operator_hold_all every region, are not installed until `dbr ctl resume`.
        self.operator_held: set[str] = set()
        self.operator_hold_all = False

    def region_id(self, module: str, entries: list[int]) -> str:
        """The stable id of the region with these entries (new ids count up)."""
        key = (module, tuple(sorted(entries)))
        if key not in self._region_ids:
            self._region_ids[key] = f"r{len(self._region_ids) + 1}"
        return self._region_ids[key]

    def covered(self, rid: str, module: str, entries: list[int]) -> bool:
        """Whether region ``rid``, not installed itself, has every entry in original
        code that an installed region of the same module already replaces.  Such a
        region is a variant of one that is live (sampling noise moves a loop's
        entries by a block from job to job): it is not installed, and selecting it
        is no news (the client may turn quiet).  Once the covering region is
        removed, it is installable again."""
        if not entries:
            return False
        with self.lock:
            rec = self.regions.get(rid)
            if rec is not None and rec.state is RegionState.INSTALLED:
                return False
            ranges = [rg for r in self.regions.values()
                      if r.state is RegionState.INSTALLED and r.module == module
                      for rg in r.orig_ranges]
        return all(any(lo <= e < hi for lo, hi in ranges) for e in entries)

    def record_of(self, install_id: int) -> RegionRecord | None:
        return next((r for r in self.regions.values()
                     if r.info.get("install_id") == install_id), None)


class SessionRegions:
    """The installation part of :class:`dbr_service.session.clients.ClientSession` (a mixin):
    regions of its book installed and removed through the installer, evaluated, and
    named in the perf map."""

    def _get_installer(self) -> Installer:
        if self.installer is None:
            cfg = self.service.config
            variant = {"int3": P.Variant.INT3, "self-branch": P.Variant.SELF_BRANCH,
                       "single": P.Variant.SINGLE}[cfg.patch_variant]
            conn = CheckedConnection(self.conn, self.proc,
                                     lambda why: self.stop(f"protocol error: {why}"))
            proc = self.proc
            self.installer = Installer(conn, self._read_original, variant=variant,
                                       transfer=cfg.transfer,
                                       evict=cfg.evict
                                       and bool(self.hello_flags & P.HELLO_EVICT),
                                       frames=bool(self.hello_flags & P.HELLO_FRAMES),
                                       cfi=CfiSource(lambda: [(m.lo, m.hi, m.path, m.dev,
                                                               m.ino) for m in
                                                              proc.maps() or []]))
            self.evaluator = Evaluator(self.installer)
        return self.installer

    def patched_ranges(self) -> list[tuple[int, int]]:
        """Byte ranges of installed patch sites (for discovery in the next job)."""
        inst = self.installer
        return [] if inst is None else inst.patched_ranges()

    def install_selected(self, srs: list[Any], ids: list[str]) -> int:
        """Session thread: emit and install the regions not yet installed (nor covered
        by an installed one); regions installed.  One region's failure is recorded;
        the others go on."""
        if self.speed_check is not None:
            # not while one is measured: the latest selection waits for its end
            self.install_after_check = (srs, ids)
            return 0
        self.install_after_check = None
        book = self.region_book
        if book.operator_hold_all:
            return 0   # the operator unpatched this client: until `dbr ctl resume`
        inst = self._get_installer()
        todo = []
        for rid, sr in zip(ids, srs):
            rec = book.regions.get(rid)
            if rid in book.blocked_regions or rid in book.operator_held or (
                    rec is not None and rec.state is RegionState.INSTALLED):
                continue
            if rec is not None and book.covered(rid, rec.module, rec.entries):
                rec.info["not_installed"] = "its entries are in code an installed region replaces"
                continue
            if self.probed_in(region_extent(sr)[0]):
                if rec is not None:   # its copy would run instead of the probe
                    rec.info["not_installed"] = "it copies a probed location"
                continue
            if rec is not None and self._in_slow_code(rec.module, region_extent(sr)[0]):
                rec.info["not_installed"] = ("it copies code that a region was found "
                                             "slower than (speed check)")
                continue
            todo.append((rid, sr))
        if not todo:
            return 0
        live = [r for r in inst.regions.values() if r.state is InstallState.INSTALLED]
        self.mark("install_started")
        out = install_regions(inst, [sr for _, sr in todo], already=live,
                              counting_for=self.counting_plan, went_live=self._went_live,
                              mark=self.mark)
        by_name = {r.name: r for r in out.installed}
        n = 0
        with self.lock:
            for rid, sr in todo:
                rec = book.regions.get(rid)
                reg = by_name.get(sr.id)
                if rec is None:
                    continue
                if reg is None:
                    why = next((w for i, w in out.failed if i == sr.id), "not installed")
                    rec.info["install_error"] = why
                    tries = rec.info["install_failures"] = rec.info.get("install_failures", 0) + 1
                    if tries >= INSTALL_ATTEMPTS:
                        # Selected again at every snapshot; a region that failed this often
                        # (no buffer in reach, sites refused, ...) is not tried again.
                        book.blocked_regions.add(rid)
                        rec.info["install_error"] = f"{why} (gave up after {tries} attempts)"
                    continue
                rec.state = RegionState.INSTALLED
                rec.installed_mono = reg.installed_at
                rec.sites = reg.patched_sites
                rec.orig_ranges = list(reg.orig_ranges)
                rec.code_bytes = reg.gen.size
                rec.info.update(install_id=reg.region_id, code_at=reg.chunk.addr,
                                sites=len(reg.patched_sites), transferred=reg.transferred,
                                transfer_only=not reg.sites, layout=reg.gen.layout_kind,
                                real_calls=len(reg.gen.calls), frames=reg.frames,
                                code_from=sr.info.get("code_from"))
                if reg.cfi_refused is not None:
                    rec.info["cfi_refused"] = reg.cfi_refused
                reg.name = rid
                self.counting_installed(rid, sr, reg, rec)
                n += 1
                self.cadence.activity += 1
                self.regions_went_live += 1
                self.patches_installed += len(reg.patched_sites)
                self.service.events.publish("patch-installed", pid=self.pid, region=rid,
                                            sites=len(reg.patched_sites),
                                            code_bytes=reg.gen.size)
                log.info("pid %d (%s): region %s installed at %s: %d site(s), %d bytes of "
                         "code, %d real call(s)", self.pid, self.exe, rid, self._where(reg),
                         len(reg.patched_sites), reg.gen.size, len(reg.gen.calls))
        for rid, why in out.failed:
            self.errors.append(f"region {rid}: {why}")
        self._write_perf_map()
        return n

    def _went_live(self, reg: Any) -> None:
        """Session thread: a region of a batch is installed: the client's first patch
        is timed when it is in place, not when the whole batch is."""
        if self.first_patch_mono is None:
            self.first_patch_mono = time.monotonic()
            self.mark("first_patch")

    def uninstall_region(self, rid: str, why: str) -> bool:
        """Session thread: restore the patch sites of one installed region (the
        operator's unpatch), and move threads inside its code back to the original
        code, so that the region's code stops running now, not when they leave it."""
        rec = self.region_book.regions.get(rid)
        if rec is None or rec.state is not RegionState.INSTALLED or self.installer is None:
            return False
        reg = self.installer.regions.get(rec.info.get("install_id", -1))
        if reg is not None and reg.state in HELD:
            self.installer.uninstall(reg.region_id, why, evict=True)
            with self.lock:
                rec.info["evicted"] = reg.evicted
        self._region_removed(rec, why)
        self._cascaded_removed()
        self._write_perf_map()
        return True

    def _cascaded_removed(self) -> None:
        """Session thread: record as removed the regions the installer took out with a
        region whose copy they called (install.Installer._cascade)."""
        if self.installer is None:
            return
        for reg in self.installer.pop_cascaded():
            rec = self.region_book.record_of(reg.region_id)
            if rec is not None and rec.state is RegionState.INSTALLED:
                self._region_removed(rec, reg.why_removed or "the copy it calls was removed")

    def _region_removed(self, rec: RegionRecord, why: str) -> None:
        with self.lock:
            rec.state = RegionState.REMOVED
            rec.info["removed_why"] = why
            self.cadence.activity += 1
            self.patches_removed += len(rec.sites)
        self.service.events.publish("patch-removed", pid=self.pid, region=rec.id,
                                    sites=len(rec.sites), why=why)
        log.info("pid %d (%s): region %s removed: %s", self.pid, self.exe, rec.id, why)

    def _map_changed(self, lo: int, hi: int, req_id: int) -> None:
        """Session thread: unpatch regions that patch, copy or exit into [lo, hi), ACK."""
        try:
            self._speed_map_changed(lo, hi)
            for reg in self.installer.on_map_changed(lo, hi) if self.installer else []:
                rec = self.region_book.record_of(reg.region_id)
                if rec is not None:
                    self._region_removed(rec, f"map change {lo:#x}-{hi:#x}")
            self._write_perf_map()
        finally:
            if req_id:
                self.conn.ack(req_id, P.Result.OK)

    def evaluate(self, raw: collections.Counter[int]) -> None:
        """Session thread: judge installed regions on one window; reclaim code space."""
        if self.evaluator is None or self.installer is None:
            return
        # Threads seen in the original code of a live region (entered it by a path
        # without a patch, or it has none) are moved in, and the region's judgement
        # starts over (a bounded number of times) before the verdicts.  A few samples
        # at the region's exits are no reason to signal every running thread.
        for h in self.evaluator.snapshot(raw):
            if h.in_original >= max(TRANSFER_MIN_SAMPLES, TRANSFER_MIN_SHARE * h.total) and \
                    h.region.state is InstallState.INSTALLED and \
                    self.installer.transfer(h.region):
                self.evaluator.restart(h.region.region_id)
                with self.lock:
                    self.cadence.activity += 1
                rec = self.region_book.record_of(h.region.region_id)
                if rec is not None:
                    rec.info["transferred"] = h.region.transferred
        for reg, why in self.evaluator.apply():
            rec = self.region_book.record_of(reg.region_id)
            if rec is not None:
                if why == "not effective":
                    self.region_book.blocked_regions.add(rec.id)
                self._region_removed(rec, why)
        self._write_perf_map()
        self.counting_refresh()
        if self.installer.space.quarantine:
            try:
                self.installer.reclaim()
            except AgentError as exc:
                self.errors.append(f"census: {exc}")

    def original_address(self, ip: int) -> int:
        """Any thread: the original address of a replacement-code IP (else ``ip``)."""
        inst = self.installer
        return ip if inst is None else inst.attribute(ip)[0]

    def _where(self, reg: Any) -> str:
        """The installed region's lowest entry named in the client (``func+0x12``), as
        the log line of its install and its jitdump symbol give it; named once."""
        where = self._where_names.get(reg.region_id)
        if where is None:
            entry = min(reg.gen.entries, default=None)
            where = name_address(entry, self.maps) if entry is not None else "?"
            self._where_names[reg.region_id] = where
        return where

    def _write_jitdump(self) -> None:
        """A JIT_CODE_LOAD record for every region installed since the last call, when
        the client's agent made /tmp/jit-PID.dump (DBR_JITDUMP=1;
        dbr_service/installation/jitdump.py)."""
        inst = self.installer
        if inst is None:
            return
        if self._jitdump is None:
            self._jitdump = JitDump(self.pid, self.uid)
        for reg in list(inst.regions.values()):
            if reg.state is not InstallState.INSTALLED or reg.region_id in self._jitdump.loaded:
                continue
            why = self._jitdump.load(reg.region_id, f"dbr:{self._where(reg)} [{reg.name}]",
                                     reg.gen.base,
                                     bytes(reg.gen.code))
            if why:
                self.errors.append(f"jitdump: {why}")
                log.info("pid %d: jitdump: %s", self.pid, why)
                return

    def _write_perf_map(self) -> None:
        """/tmp/perf-PID.map names replacement code for `perf report`
        (clientfiles.PerfMap: created once, never through a link, never over a map
        another writer owns, removed when the session ends); the jitdump records too."""
        self._write_jitdump()
        if not self.service.config.perf_map or self.installer is None:
            return
        if self._perf_map is None:
            self._perf_map = PerfMap(self.pid, getattr(self.service, "runtime_dir", None))
        why = self._perf_map.write(self.installer.perf_map_lines())
        if why:
            self.errors.append(f"perf map: {why}")
            log.info("pid %d: perf map: %s", self.pid, why)

    def threads_moved(self) -> dict[str, int]:
        """Threads moved into replacement code (TRANSFER) and out of it (EVICT), as the
        clients row and the report name them."""
        inst = self.installer
        return {"threads_transferred": 0 if inst is None else inst.threads_transferred,
                "threads_evicted": 0 if inst is None else inst.threads_evicted}
