"""The end of a counting phase on the session thread (session/session_counting.py,
docs/decisions/0041-exact-counts.md): the counting region is removed before anything
else is done (its code runs tens of times slower than the original), the counts are
read after its removal, and only then is the region rebuilt and installed; a region
that could not be removed is not replaced; a region whose phase ends during a speed
check waits for the check's end instead of being lost (selected and counted again).
A session stand-in with a fake installer records the order of the steps."""

from __future__ import annotations

import math
import threading
import time
from types import SimpleNamespace

from region_graphs import sr_with_indirect

from dbr_service.common.errors import AgentError
from dbr_service.common.states import InstallState
from dbr_service.installation.exact_counts import plan_counters
from dbr_service.session import session_counting
from dbr_service.session.counting_monitor import CountingRegion, CountMonitor

#: Counts at the poll that ended the phase, and once the counting code is out.
AT_POLL, AT_REMOVAL = 3000, 3500


class FakeInstaller:
    def __init__(self, steps: list[str], counts: dict[int, int], refuse: bool) -> None:
        self.steps, self.counts, self.refuse = steps, counts, refuse
        self.regions = {7: SimpleNamespace(region_id=7, state=InstallState.INSTALLED)}

    def uninstall(self, region_id: int, why: str, evict: bool) -> None:
        assert region_id == 7 and evict
        self.steps.append("uninstall")
        if self.refuse:
            raise AgentError("E_BUSY")
        for a in self.counts:            # entries made until the code went out
            self.counts[a] = AT_REMOVAL
        self.regions[7].state = InstallState.REMOVED


class FakeSession(session_counting.SessionCounting):
    def __init__(self, refuse: bool = False) -> None:
        self.steps: list[str] = []
        self.lock = threading.RLock()
        self.errors: list[str] = []
        self.pid = 1
        self.speed_check = None
        self.started_mono = time.monotonic()
        self.rec = SimpleNamespace(info={}, recheck_mono=math.inf)
        self.region_book = SimpleNamespace(regions={"r1": self.rec})
        self.sr = sr_with_indirect()
        addrs = iter(range(0x1000, 0x2000, 8))
        plan = plan_counters(self.sr, lambda: next(addrs))
        self.counts = {a: AT_POLL for a in plan.blocks.values()}
        self.installer = FakeInstaller(self.steps, self.counts, refuse)
        self.count_monitor = CountMonitor(3000, 5000, 60.0, 0.05, lambda cr: None)
        cr = CountingRegion("r1", 7, self.sr, plan, {}, self.counts.get)
        self.count_monitor.poll_one(cr, time.monotonic())
        assert cr.done == "promoted"
        self.count_monitor.regions["r1"] = cr

    def _region_removed(self, rec, why: str) -> None:
        self.steps.append("removed")

    def install_selected(self, srs, ids) -> int:
        assert ids == ["r1"] and srs[0].info.get("exact_counts")
        if self.speed_check is not None:
            return 0
        self.steps.append("install")
        return 1


def _rebuilt_recorded(monkeypatch, s: FakeSession) -> None:
    real = session_counting.rebuilt

    def rebuilt(sr, prof):
        s.steps.append("rebuilt")
        return real(sr, prof)
    monkeypatch.setattr(session_counting, "rebuilt", rebuilt)


def test_counting_region_removed_before_the_rebuild(monkeypatch) -> None:
    s = FakeSession()
    _rebuilt_recorded(monkeypatch, s)
    assert s.counting_over("r1")
    assert s.steps == ["uninstall", "removed", "rebuilt", "install"]
    info = s.rec.info["counting"]
    # the counts are those the counting code made until it was taken out
    assert set(info["block_counts"].values()) == {AT_REMOVAL}, info
    assert info["replaced"] and info["why"] == "promoted" and s.rec.recheck_mono == 0.0
    assert info["seconds"] >= 0 and info["replace_s"] >= 0 and info["over_at_s"] >= 0
    assert "r1" not in s.count_monitor.regions and not s.errors


def test_a_counting_region_not_removed_is_not_replaced(monkeypatch) -> None:
    s = FakeSession(refuse=True)
    _rebuilt_recorded(monkeypatch, s)
    assert not s.counting_over("r1")
    assert s.steps == ["uninstall"]
    assert s.errors and "not removed" in s.errors[0]
    assert s.rec.info["counting"]["phase"] == "over"


def test_a_region_counted_during_a_speed_check_waits_for_its_end(monkeypatch) -> None:
    s = FakeSession()
    _rebuilt_recorded(monkeypatch, s)
    s.speed_check = object()             # another region's check is measuring
    assert not s.counting_over("r1")
    assert s.steps == ["uninstall", "removed", "rebuilt"]
    info = s.rec.info["counting"]
    assert not info["replaced"] and info["waits_for"]
    assert s.counted_install_waiting() == 0 and s.steps[-1] == "rebuilt"
    s.speed_check = None                 # the check ended
    assert s.counted_install_waiting() == 1
    assert s.steps == ["uninstall", "removed", "rebuilt", "install"]
    assert info["replaced"] and "waits_for" not in info
    assert s.counted_install_waiting() == 0
