"""Worker job results, applied on the service's control thread: hot spots, the
client's region records, its job cadence, and the installation of what was selected."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from dbr_service.session.cadence import next_job_gap
from dbr_service.session.session_regions import RegionRecord
from dbr_service.common.states import RegionState
from dbr_service.region.worker import QUICK_JOBS, JobResult

if TYPE_CHECKING:  # pragma: no cover
    from dbr_service.session.clients import ClientSession


class JobResults:
    """The results part of :class:`dbr_service.daemon.service.Service` (a mixin)."""

    # ------------------------------------------------------------------ results
    def _job_done(self, res: JobResult | BaseException, session_id: int) -> None:
        """Pool thread: hand the result to the control thread."""
        self.post(lambda: self._apply_result(res, session_id))

    def _apply_result(self, res: JobResult | BaseException, session_id: int) -> None:
        full = False
        if self.warm is not None:
            # a warm job's selection is kept for the program's next processes, also
            # when this one has ended meanwhile; before installation annotates it
            full = self.warm.job_done(session_id,
                                      None if isinstance(res, BaseException) else res)
        s = self._session_by_id(session_id)
        if s is None:
            return
        if full and s.alive:
            # a quick warm job found nothing to patch: a full one from the same counts
            self.post(lambda: self.start_warm_job(s, *self.warm.job_input(s), quick=False))
        s.jobs_done += 1
        s.mark("first_job_done")
        if isinstance(res, BaseException):
            s.errors.append(f"worker job failed: {res!r}")
            self.events.publish("error", pid=s.pid, message=f"worker job failed: {res!r}")
            return
        self.scheduler.charge(s.cpu_budget, res)
        s.hotspots = res.hotspots
        s.timeline.setdefault("first_job_worker_s", round(res.elapsed_s, 4))
        if res.regions is None and not s.alive and s.jobs_done > 1:
            return  # the client left while its last job ran: keep the earlier outcome
        s.region_status = res.region_status
        book = s.region_book
        ids = [] if res.regions is None else [book.region_id(d["module"], d["entries"])
                                              for d in res.regions]
        with s.lock:
            # a region whose entries are all in code an installed region replaces is a
            # variant of it, not news (RegionBook.covered); nor is it installed
            news = [rid for rid, d in zip(ids, res.regions or [])
                    if not book.covered(rid, d["module"], d["entries"])]
            pending = self.config.patching and any(
                rid not in book.blocked_regions and (
                    rid not in book.regions or book.regions[rid].state is not RegionState.INSTALLED)
                for rid in news)
            # a client's first jobs (quick ones among them) see few samples: what they
            # do not find is no sign that nothing is left to find
            changed = pending or frozenset(news) != s.cadence.last_selected or \
                s.jobs_done <= QUICK_JOBS + 1
            s.cadence.last_selected = frozenset(news)
            s.cadence.job_gap_s = next_job_gap(self.config, s.cadence.job_gap_s, changed)
            s.cadence.next_job_mono = time.monotonic() + s.cadence.job_gap_s
        self._judge_quiet(s, changed)
        if res.regions is not None:
            with s.lock:
                # with their history: live and removed regions, and those whose
                # installation failed (a job on the client's last window that selects
                # nothing must not erase why nothing was installed)
                keep = {k: r for k, r in book.regions.items()
                        if r.state in (RegionState.INSTALLED, RegionState.REMOVED)
                        or r.info.get("install_failures")}
                for rid, d in zip(ids, res.regions):
                    if rid not in keep:
                        keep[rid] = RegionRecord(rid, d["module"], d["entries"], d["blocks"],
                                                 d["code_bytes"], dot=d.get("dot"),
                                                 info={"pipeline_id": d["id"]})
                        if d.get("hot_function"):
                            keep[rid].info["hot_function"] = True
                        if d.get("functions"):
                            keep[rid].info["functions"] = d["functions"]
                        if d.get("function_starts"):
                            keep[rid].info["function_starts"] = d["function_starts"]
                book.regions = keep
            if self.config.patching and res.srs and s.alive and not s.paused:
                fut = s.post(lambda s=s, srs=res.srs, ids=ids: s.install_selected(srs, ids))
                fut.add_done_callback(lambda f, s=s: self._task_failed(s, f, "installation"))
        self.events.publish("job-done", pid=s.pid, hotspots=len(res.hotspots),
                            regions=None if res.regions is None else len(res.regions),
                            status=res.region_status, elapsed_s=round(res.elapsed_s, 3),
                            cpu_s=round(res.cpu_s, 3), decode_cached=res.decode_cached,
                            decode_new=res.decode_new)

    def _task_failed(self, s: ClientSession, fut, what: str) -> None:
        """A session-thread task's done callback: its exception, if any, becomes one of
        the client's errors and an ``error`` event."""
        exc = fut.exception()
        if exc is not None:
            msg = f"{what} failed: {exc!r}"
            s.errors.append(msg)
            self.events.publish("error", pid=s.pid, message=msg)
