"""How a job's result updates a client's region records (service._apply_result)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from dbr_service.clients import ClientSession, RegionRecord, RegionState
from dbr_service.scheduler import JobResult
from dbr_service.service import Service


def _session(regions: dict[str, RegionRecord], alive: bool) -> SimpleNamespace:
    s = SimpleNamespace(pid=42, jobs_done=3, hotspots=[], timeline={}, alive=alive,
                        region_status="", lock=threading.RLock(), regions=regions,
                        blocked_regions=set(), last_selected=frozenset(), paused=False)
    s.mark = lambda step: None
    s.region_id = lambda module, entries: ClientSession.region_id(s, module, entries)
    s.covered = lambda rid, module, entries: False
    s._region_ids = {}
    return s


def _apply(s: SimpleNamespace, regions: list[dict]) -> None:
    svc = SimpleNamespace(config=SimpleNamespace(patching=False),
                          _session_by_id=lambda sid: s,
                          _judge_quiet=lambda s, changed: None,
                          events=SimpleNamespace(publish=lambda *a, **k: None))
    Service._apply_result(svc, JobResult(1, 42, [], regions, "ok", 0.1, 7), 1)


def test_a_failed_installation_outlives_a_job_that_selects_nothing():
    """The client's last window (it was exiting) gave a job that selected nothing: the
    region that could not be installed, and why, stay in the records (the report and
    `dbr ctl regions` show them), as live and removed regions do.  A region that was
    only selected, never tried, is replaced by the new selection as before."""
    failed = RegionRecord("r1", "/bin/crowded", [0x1000], 5, 80,
                          info={"install_error": "E_RANGE", "install_failures": 1})
    live = RegionRecord("r2", "/bin/crowded", [0x2000], 5, 80, state=RegionState.INSTALLED)
    gone = RegionRecord("r3", "/bin/crowded", [0x3000], 5, 80, state=RegionState.REMOVED)
    stale = RegionRecord("r4", "/bin/crowded", [0x4000], 5, 80)
    s = _session({"r1": failed, "r2": live, "r3": gone, "r4": stale}, alive=False)
    _apply(s, [])
    assert set(s.regions) == {"r1", "r2", "r3"}
    assert s.regions["r1"].info["install_error"] == "E_RANGE"
