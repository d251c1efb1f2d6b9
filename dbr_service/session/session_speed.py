"""Speed checks of a session's live regions (dbr_service/installation/speedcheck.py), run on its
session thread: regions suspended and resumed phase by phase, and the verdict acted on."""

from __future__ import annotations

import logging
import time

from dbr_service.common.errors import AgentError, ProtocolError
from dbr_service.installation.progress_points import CounterSpace, ProgressPoints, choose_points
from dbr_service.session.session_regions import RegionRecord
from dbr_service.common.states import HELD, InstallState, RegionState
from dbr_service.installation.speedcheck import (CHECK_TRIES, ORIGINAL, Progress, SpeedCheck,
                                                 read_progress)

#: Speed checks whose summaries a client keeps (dbr ctl clients, the report).
SPEED_CHECKS_KEPT = 16

log = logging.getLogger("dbr.clients")


class SessionSpeedChecks:
    """The speed-check part of :class:`dbr_service.session.clients.ClientSession` (a mixin)."""

    def _in_slow_code(self, module: str, ranges: list[tuple[int, int]]) -> bool:
        """Whether a region copying ``ranges`` overlaps code whose region a speed
        check found slower: a variant of it would most likely be slower too."""
        return any(m == module and lo < b and a < hi
                   for a, b in ranges for m, lo, hi in self.slow_ranges)

    def speed_candidates(self, settle_s: float, now: float) -> list[str]:
        """Any thread: ids of the live regions with patch sites that no speed check has
        judged yet, once the youngest of them has been live for ``settle_s`` (until
        then the set may still grow) and ``settle_s`` has passed since a check of any
        of them was abandoned; [] if there are none."""
        with self.lock:
            new = [r for r in self.region_book.regions.values()
                   if r.state is RegionState.INSTALLED
                   and (r.sites or self._checks_transfer_only())
                   and "speed_check" not in r.info]
            if not new or now - max(max(r.installed_mono, r.recheck_mono)
                                    for r in new) < settle_s:
                return []
            return [r.id for r in new]

    def _checks_transfer_only(self) -> bool:
        """A region without patch sites (entered by TRANSFER only) can be speed-checked:
        its ORIGINAL phases move threads out (EVICT), its REPLACEMENT phases move them
        in again (TRANSFER)."""
        inst = self.installer   # made before any region is installed; its flags are fixed
        return inst is not None and inst.evict_enabled and inst.transfer_enabled

    def speed_start(self, rids: list[str], pairs: int, phase_s: float, margin: float,
                    close_sampling: bool = False) -> bool:
        """Session thread: begin a speed check of the regions ``rids`` still live.  The
        first phase runs them as installed.  False if none is live, a sampling window
        is open (its samples would see the phases), or a check is under way.  With
        ``close_sampling`` (continuous sampling) an open window is closed first and its
        samples since the last snapshot are dropped; the first snapshot after the
        check opens a new one."""
        if close_sampling and self.speed_check is None and self.source is not None:
            self.end_window(keep_open=False)
        if self.speed_check is not None or self.source is not None or self.installer is None:
            return False
        todo = []
        for rid in rids:
            rec = self.region_book.regions.get(rid)
            reg = None if rec is None else self.installer.regions.get(
                rec.info.get("install_id", -1))
            if reg is not None and reg.state is InstallState.INSTALLED and \
                    (reg.patched_sites or (not reg.sites and self._checks_transfer_only())):
                todo.append((rid, reg.region_id))
            elif rec is not None:
                # nothing to take out (the agent restored its sites itself): not a
                # candidate again
                with self.lock:
                    rec.info["speed_check"] = {"verdict": "not checked", "ratio": None}
        if not todo:
            return False
        chk = SpeedCheck([i for _, i in todo], [r for r, _ in todo], pairs=pairs,
                         phase_s=phase_s, margin=margin, may_count=True)
        self.speed_check = chk
        chk.begin(chk.next_kind() or "", self._speed_progress(), time.monotonic())
        if chk.done:
            self._speed_finish()
        return True

    def speed_step(self) -> None:
        """Session thread: end the running phase of the check, set the regions for the
        next one and begin it; or finish the check."""
        chk = self.speed_check
        if chk is None:
            return
        chk.end(self._speed_progress())
        if chk.wants_points:
            why, chk.wants_points = chk.wants_points, ""
            try:
                counted = self._speed_points_install(chk)
            except AgentError as exc:
                counted, why = 0, f"{why}; counting failed: {exc}"
            if not counted:
                chk.stop("unmeasurable", f"{why}; no progress point could be counted")
        kind = chk.next_kind()
        if kind is not None:
            try:
                if self._speed_set(chk, kind):
                    chk.begin(kind, self._speed_progress(), time.monotonic())
                else:
                    chk.stop("abandoned", "a region of the check was removed meanwhile")
            except AgentError as exc:
                # the agent refused an UNPATCH or PATCH: end the check, and put every
                # region it can back as installed (a session that is gone raises again)
                chk.stop("abandoned", f"the agent refused a step: {exc}")
        if chk.done:
            self._speed_finish()

    def _speed_points_install(self, chk: SpeedCheck) -> int:
        """Patch the check's progress points to counting trampolines and counting
        entries (dbr_service/installation/progress_points.py), for a program with too little I/O to
        measure; how many are counted.  A point that fails is not counted."""
        inst = self.installer
        if self.counter_space is None:
            self.counter_space = CounterSpace(inst.conn)
        checked = [inst.regions[i] for i in chk.region_ids]
        points = ProgressPoints(inst, self.counter_space)
        self.speed_points = points
        try:
            points.install_entries(checked, [r for r in inst.regions.values()
                                             if r.state in HELD])
            held = [r for r in inst.regions.values() if r.state in HELD]
            points.install(choose_points(checked, held, inst.read_original))
        except (AgentError, ProtocolError, OSError) as exc:
            points.refused[0] = str(exc)
        chk.points = sorted(points.points)
        log.info("pid %d: speed check of %s counts %d progress point(s) (%d entries)%s",
                 self.pid, ", ".join(chk.names), len(points.points), len(points.entries),
                 "".join(f"; {a:#x} not: {why}" for a, why in points.refused.items()))
        return len(points.points)

    def _speed_map_changed(self, lo: int, hi: int) -> None:
        """Session thread, before the agent's map change goes ahead: a data buffer in
        [lo, hi) (the program unmaps or reprotects it) takes the counting code that
        writes to it out first, ending the check that counts with it."""
        space = self.counter_space
        gone = [] if space is None else [b for b in space.buffers
                                         if b.base < hi and lo < b.base + b.size]
        if not gone:
            return
        space.forget(gone)
        chk = self.speed_check
        if chk is not None and self.speed_points is not None:
            chk.stop("abandoned", f"the program changed the map of a counter buffer at "
                                  f"{gone[0].base:#x}")
            self._speed_finish()

    def _speed_progress(self) -> Progress | None:
        """The program's progress now, with its progress points' passes if any."""
        at = read_progress(self.pid)
        points = self.speed_points
        if at is None or points is None or not points.points:
            return at
        return Progress(at.io_bytes, at.cpu_ns, points.read())

    def _speed_set(self, chk: SpeedCheck, kind: str) -> bool:
        """Suspend (ORIGINAL) or resume (REPLACEMENT) every region of the check; False
        if one of them is gone (map change, evaluation, operator) or failed to resume."""
        inst = self.installer
        assert inst is not None
        for iid in chk.region_ids:
            reg = inst.regions.get(iid)
            if reg is None or reg.state not in HELD:
                return False
            points = self.speed_points
            if kind == ORIGINAL and reg.state is InstallState.INSTALLED:
                inst.suspend(iid)
                if points is not None:
                    points.original_phase(iid)
            elif kind != ORIGINAL and reg.state is InstallState.SUSPENDED:
                if points is not None:
                    points.replacement_phase(iid)
                if not self._speed_resume(iid):
                    return False
        return True

    def _speed_resume(self, iid: int) -> bool:
        """Patch a suspended region again; False (and its record removed) if the agent
        refused every site."""
        reg = self.installer.regions[iid]
        self.installer.resume(iid)
        if reg.state is InstallState.INSTALLED:
            return True
        rec = self.region_book.record_of(iid)
        if rec is not None:
            self._region_removed(rec, reg.why_removed)
        self._cascaded_removed()
        return False

    def _speed_finish(self) -> None:
        """Session thread: act on the verdict.  Regions found slower are removed and
        their original code is left alone from then on; every other region of the
        check is patched again (if it is suspended) and stays."""
        chk, self.speed_check = self.speed_check, None
        points, self.speed_points = self.speed_points, None
        if chk is None or self.installer is None:
            return
        inst = self.installer
        if points is not None:
            points.remove()
        slower = chk.verdict == "slower"
        why = f"slower than its original code (speed check: {chk.why})"
        # held before any removal: a region of the check that a removal below takes
        # along (it called a removed copy) is still blocked as slower
        held0 = {iid for iid in chk.region_ids
                 if (r := inst.regions.get(iid)) is not None and r.state in HELD}
        try:
            for iid in chk.region_ids:
                reg = inst.regions.get(iid)
                rec = self.region_book.record_of(iid)
                held = iid in held0
                if held and slower:
                    # threads inside go back to the original code at once: a loop that
                    # never passes a site would otherwise run the slower code on
                    inst.uninstall(iid, why, evict=True)
                if rec is not None:
                    with self.lock:   # speed_candidates reads it on the control thread
                        if reg is not None:
                            rec.info["evicted"] = reg.evicted
                        if held and chk.verdict == "abandoned" and \
                                self._abandoned_again(rec) < CHECK_TRIES:
                            rec.recheck_mono = time.monotonic()  # not judged: checked later
                        else:
                            rec.info["speed_check"] = {"verdict": chk.verdict,
                                                       "ratio": chk.ratio,
                                                       "measure": chk.measure}
                if not held:
                    continue
                if slower:
                    if rec is not None:
                        self.region_book.blocked_regions.add(rec.id)
                        self.slow_ranges += [(rec.module, lo, hi) for lo, hi in rec.orig_ranges]
                        self._region_removed(rec, why)
                elif reg.state is InstallState.SUSPENDED:
                    self._speed_resume(iid)
        finally:
            self._cascaded_removed()
            summary = chk.summary()
            with self.lock:
                self.speed_checks.append(summary)
            self.service.events.publish("speed-check", pid=self.pid, **summary)
            self._write_perf_map()
        self.counted_install_waiting()   # regions whose counting ended during the check
        if self.install_after_check is not None:     # selected during the check
            self.install_selected(*self.install_after_check)

    @staticmethod
    def _abandoned_again(rec: RegionRecord) -> int:
        """Count one more abandoned check of a live region; the count so far."""
        tries = rec.info.get("speed_checks_abandoned", 0) + 1
        rec.info["speed_checks_abandoned"] = tries
        return tries
