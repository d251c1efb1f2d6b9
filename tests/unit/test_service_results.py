"""How a job's result updates a client's region records (service._apply_result)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from dbr_service.session.cadence import SessionCadence
from dbr_service.session.session_regions import RegionBook, RegionRecord, RegionState
from dbr_service.session.budget import CpuBudget
from dbr_service.region.worker import JobResult
from dbr_service.daemon.service import Service


def _session(regions: dict[str, RegionRecord], alive: bool) -> SimpleNamespace:
    lock = threading.RLock()
    book = RegionBook(lock)
    book.regions = regions
    book.covered = lambda rid, module, entries: False
    s = SimpleNamespace(pid=42, jobs_done=3, hotspots=[], timeline={}, alive=alive,
                        region_status="", lock=lock, region_book=book,
                        cadence=SessionCadence(), paused=False)
    s.mark = lambda step: None
    s.cpu_budget = CpuBudget(0.0)
    return s


def _apply(s: SimpleNamespace, regions: list[dict]) -> None:
    svc = SimpleNamespace(config=SimpleNamespace(patching=False, snapshot_interval_s=1.0,
                                                 job_backoff_max_s=30.0),
                          scheduler=SimpleNamespace(
                              charge=lambda b, res: b.charge_job(res.cpu_s, res.blocks)),
                          _session_by_id=lambda sid: s, warm=None,
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
    assert set(s.region_book.regions) == {"r1", "r2", "r3"}
    assert s.region_book.regions["r1"].info["install_error"] == "E_RANGE"


def test_a_job_that_failed_because_its_client_left_keeps_the_earlier_outcome():
    """A client that ended while its last job read its memory: the job's failure
    (``region selection failed: MemoryViewError: cannot read /proc/PID/maps``) is not
    the client's outcome; its status stays what the earlier jobs said.  Had it not
    left, the failure would be reported."""
    for alive, want in ((False, "1 region(s) selected"), (True, None)):
        s = _session({}, alive=alive)
        s.region_status = "1 region(s) selected"
        svc = SimpleNamespace(config=SimpleNamespace(patching=False, snapshot_interval_s=1.0,
                                                     job_backoff_max_s=30.0),
                              scheduler=SimpleNamespace(charge=lambda b, res: None),
                              _session_by_id=lambda sid, s=s: s, warm=None,
                              _judge_quiet=lambda s, changed: None,
                              events=SimpleNamespace(publish=lambda *a, **k: None))
        failed = ("region selection failed: MemoryViewError: cannot read /proc/42/maps")
        Service._apply_result(svc, JobResult(1, 42, [], None, failed, 0.1, 7), 1)
        assert s.region_status == (want or failed), (alive, s.region_status)
