"""The service's sampling snapshots: windows opened and collected on the clients'
session threads, their samples aggregated, quiet clients sampled less, speed checks
started between windows, and the clients whose snapshot gets a region job."""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dbr_service.common.errors import SamplingError
from dbr_service.sampling.aggregate import SampleAggregator
from dbr_service.session.cadence import hot_addresses, newly_hot, sampling_interval
from dbr_service.session.budget import budget_limit, client_cpu_s
from dbr_service.session.sources import is_perf_kind, make_agent_timer_source, make_perf_source
from dbr_service.installation.speedcheck import SETTLE_PHASES
from dbr_service.region.worker import QUICK_JOBS, ClientJob, quick_job
from dbr_service.profiles.warmstart import WarmStart

if TYPE_CHECKING:  # pragma: no cover
    from dbr_service.session.clients import ClientSession

log = logging.getLogger("dbr.service")


@dataclass
class Snapshot:
    """One sampling window in progress."""

    gen: int
    started: float
    end_at: float
    phase: str = "sampling"           # sampling -> collecting
    begun: dict[int, Any] = field(default_factory=dict)      # session id -> Future
    collecting: dict[int, Any] = field(default_factory=dict)  # session id -> Future
    collect_deadline: float = 0.0


class SnapshotCycle:
    """The snapshot part of :class:`dbr_service.daemon.service.Service` (a mixin: it works on the
    service's sessions, scheduler, configuration and events)."""

    # ------------------------------------------------------------------ sampling
    def sampling_status(self) -> dict[str, Any]:
        return {"configured": self.config.sampling_source, "active": self.source_kind,
                "branch_records_used": self.source_kind == "lbr",
                "capabilities": self.capabilities,
                "continuous": self.config.continuous_sampling,
                "interval_s": self.config.snapshot_interval_s,
                "window_s": self.config.snapshot_window_s,
                "period_us": self.config.sample_period_us}

    def _make_source(self, s: ClientSession):
        """Session thread: the sampling source for one client (perf, else agent timer)."""
        cfg = self.config
        kind = s.forced_source or self.source_kind
        if is_perf_kind(kind):
            try:
                return make_perf_source(s, cfg, kind)
            except SamplingError as exc:
                if cfg.sampling_source != "auto":
                    raise
                log.warning("pid %d: perf refused (%s); using the agent timer", s.pid, exc)
                # asked for the perf source; the agent's timer samples new threads on its own
                s.thread_tracker.thread_notices(False)
                s.forced_source = "agent-timer"
                self.events.publish("sampling-fallback", pid=s.pid, reason=str(exc))
        return make_agent_timer_source(s, cfg)

    def _snapshot_tick(self, now: float) -> None:
        self.short_runs.expire()
        snap = self._snap
        if snap is None:
            if now >= self._next_snapshot and not self.paused and not self.stopping:
                if self.live_sessions():
                    self._begin_snapshot(now)
                else:   # nobody to sample: no window, no wake-ups for one
                    self._next_snapshot = now + self.config.snapshot_interval_s
            return
        if snap.phase == "sampling" and now >= snap.end_at:
            self._end_snapshot(now)
        elif snap.phase == "collecting":
            done = all(f.done() for f in snap.collecting.values())
            if done or now >= snap.collect_deadline:
                self._finish_snapshot()

    def _begin_snapshot(self, now: float) -> None:
        cfg = self.config
        window = cfg.snapshot_interval_s if cfg.continuous_sampling else cfg.snapshot_window_s
        snap = Snapshot(gen=self.snapshot_count + 1, started=now, end_at=now + window)
        for s in self.live_sessions():
            if s.paused or self._resting(s, now) or self._speed_checking(s):
                continue
            if now - s.started_mono < cfg.min_client_age_s:
                # Young: a program that ends within min_client_age_s could not gain
                # from replacement code; it is sampled from its first snapshot after.
                # Its age counts from its start, not its connection: under the hint an
                # agent connects only once its program is that old.
                if not s.samples_total:
                    s.region_status = (f"not sampled yet: younger than min_client_age_s "
                                       f"({cfg.min_client_age_s:g} s)")
                continue
            if cfg.continuous_sampling and s.source is not None:
                snap.begun[s.session_id] = None  # already sampling
                # quiet since short-lived threads, or switch rates to look at again
                s.post(s.thread_tracker.catch_up_threads)
                continue
            snap.begun[s.session_id] = s.post(lambda s=s: s.begin_window(self._make_source))
        self._snap = snap
        self._next_snapshot = now + cfg.snapshot_interval_s

    @staticmethod
    def _speed_checking(s: ClientSession) -> bool:
        """A speed check is under way (or about to start): no sampling window, whose
        samples would see its phases, and no new region while it measures."""
        return s.speed_check is not None or (s.speed_fut is not None and not s.speed_fut.done())

    def _speed_tick(self, now: float) -> None:
        """Start speed checks of regions that settled, and step the running ones
        (dbr_service/installation/speedcheck.py); each step runs on the client's session thread."""
        cfg = self.config
        for s in self.live_sessions():
            if s.speed_fut is not None and not s.speed_fut.done():
                continue
            chk = s.speed_check
            if chk is not None:
                if now >= chk.next_at:
                    self._speed_post(s, s.speed_step)
                continue
            if not cfg.speed_check or not cfg.patching or \
                    s.paused or self.paused or self.stopping:
                continue
            snap = self._snap
            in_window = snap is not None and s.session_id in snap.begun
            # a window of its own is let run to its end; a continuous one, never
            # ending, is closed for the check (not while it is being collected)
            if in_window and not (cfg.continuous_sampling and snap.phase == "sampling"):
                continue
            rids = s.speed_candidates(SETTLE_PHASES * cfg.speed_check_phase_s, now)
            if rids:
                if in_window:
                    del snap.begun[s.session_id]     # not collected at this snapshot
                self._speed_post(s, lambda s=s, rids=rids, close=in_window: s.speed_start(
                    rids, cfg.speed_check_pairs, cfg.speed_check_phase_s,
                    cfg.speed_check_margin, close_sampling=close))

    def _speed_post(self, s: ClientSession, fn: Callable[[], Any]) -> None:
        s.speed_fut = s.post(fn)
        s.speed_fut.add_done_callback(
            lambda f: self._task_failed(s, f, "speed check") if s.alive else None)

    def _resting(self, s: ClientSession, now: float) -> bool:
        """A quiet client skips snapshots until its own interval has passed, unless
        something changed for it since it was judged quiet (a dlopen, say)."""
        c = s.cadence
        with s.lock:
            if c.quiet_snapshots < 1 or c.activity != c.activity_judged:
                return False
            due = c.last_window_mono + sampling_interval(self.config, c.quiet_snapshots)
        return due - now > self.config.snapshot_interval_s / 2

    def _judge_quiet(self, s: ClientSession, changed: bool) -> None:
        """After a client's snapshot (and its job, if one ran): quiet when it changed
        nothing; its sampling interval follows (cadence.sampling_interval)."""
        c = s.cadence
        with s.lock:
            act = c.activity
            quiet = not changed and act == c.activity_judged
            c.quiet_snapshots = c.quiet_snapshots + 1 if quiet else 0
            c.activity_judged = act
            before, c.sampling_interval_s = c.sampling_interval_s, sampling_interval(
                self.config, c.quiet_snapshots)
        if c.sampling_interval_s != before:
            self.events.publish("sampling-interval", pid=s.pid,
                                interval_s=c.sampling_interval_s, quiet=c.quiet_snapshots)

    def _end_snapshot(self, now: float) -> None:
        snap = self._snap
        keep = self.config.continuous_sampling
        for sid, fut in snap.begun.items():
            s = self.sessions.get(sid)
            if s is None:
                continue
            if fut is not None and fut.done() and fut.exception() is not None:
                self._sampling_failed(s, fut.exception())
                continue
            fut = snap.collecting[sid] = s.post(lambda s=s: s.end_window(keep_open=keep))
            fut.add_done_callback(lambda f: None if self.stopped.is_set() else self._wake())
        snap.phase = "collecting"
        snap.collect_deadline = now + 1.0

    def _sampling_failed(self, s: ClientSession, exc: BaseException) -> None:
        if not s.alive:
            return  # the client left during the window: not a sampling failure
        msg = f"sampling failed: {exc}"
        if not s.errors or s.errors[-1] != msg:
            s.errors.append(msg)
            log.warning("pid %d: %s", s.pid, msg)
            self.events.publish("error", pid=s.pid, message=msg)

    def _finish_snapshot(self) -> None:
        """Aggregate the window by (client, IP) and hand the hottest clients to workers."""
        snap, self._snap = self._snap, None
        self.snapshot_count += 1
        self._by_pid = {x.pid: x for x in self.live_sessions()}  # for attribute()
        agg = SampleAggregator(attribute=self.attribute)
        agg.start_window()
        done: list[ClientSession] = []
        for sid, fut in snap.collecting.items():
            s = self._session_by_id(sid)
            if s is None or not fut.done():
                continue
            if fut.exception() is not None:
                self._sampling_failed(s, fut.exception())
                continue
            samples = fut.result()
            raw, _ = s.split_window(samples, snap.started)  # before attribution
            if s.evaluator is not None and s.alive:
                s.post(lambda s=s, raw=raw: s.evaluate(raw))
            agg.add(samples)
            done.append(s)
        window = agg.end_window().aggregator
        jobs = []
        now = time.monotonic()
        # The control thread's CPU since the last snapshot (its windows, results, ticks)
        # is its work for the clients sampled: shared among them, on their budgets.
        cpu = time.thread_time()
        share = max(0.0, cpu - self._control_cpu_mark) / len(done) if done else 0.0
        self._control_cpu_mark = cpu
        for s in done:
            s.control_cpu_s += share
            counts = collections.Counter(window.ips.get(s.pid, {}))
            s.add_samples(counts, window.per_thread(s.pid))
            selection = s.selection_input()
            if counts and selection and s.alive and not s.paused and \
                    self._job_due(s, selection, now):
                jobs.append(ClientJob(s.session_id, s.pid, s.exe, dict(counts),
                                      selection, list(s.maps), self.config.to_dict(),
                                      branches=window.branch_counts(s.pid),
                                      fallthroughs=window.fallthrough_counts(s.pid),
                                      patched=s.patched_ranges(),
                                      quick=quick_job(s.jobs_done, bool(s.region_book.regions)),
                                      max_blocks=s.cpu_budget.max_blocks(
                                          now, s.cpu_budget.limit)))
        if jobs and not self.paused:
            queued = set(self.scheduler.schedule(jobs, self.config.max_workers))
            thr = self.config.hot_threshold / 2
            inputs = {j.session_id: j.cumulative for j in jobs}
            for s in done:
                if s.session_id in queued:
                    s.mark("first_job_queued")
                    with s.lock:   # what the next snapshots are compared with
                        s.cadence.job_hot_half = hot_addresses(inputs[s.session_id], thr)
                        s.cadence.job_activity = s.cadence.activity
        with_job = {j.session_id for j in jobs}
        for s in done:
            s.cadence.last_window_mono = snap.started
            if s.session_id not in with_job:
                self._judge_quiet(s, changed=False)   # nothing to select from
            # a queued job's client is judged when its job is done (_apply_result); one
            # left unqueued (every worker busy) is not judged this time
        self.notifier.status(self._status_line())

    def open_warm_start(self) -> WarmStart | None:
        """At the start: the profile store (None: warm start off or not available), its
        programs' birth hints written and its modules queued for selection ahead, in
        the worker pool; each selection made ahead is offered to the warm clients
        that wait for theirs (offer_prepared)."""
        warm = WarmStart.open(self.config, self.embedded, runner=lambda fn, *a:
                              self.scheduler.submit_side(self.config.max_workers, fn, *a))
        if warm is not None:
            warm.on_prepared = lambda: self.post(self.offer_prepared)
            n, ahead = warm.write_start_hints(self.dir_fd), warm.prepare_stored()
            log.info("profile store %s: %d warm program(s), %d module(s) to select ahead",
                     warm.store.path, n, ahead)
        return warm

    def offer_prepared(self) -> None:
        """Control thread: a selection was made ahead: the warm clients without a job
        result yet (their warm job waits in the pool, or they connected just before)
        get it now, as a client that connects later would."""
        if self.warm is None or self.paused:
            return
        with self.lock:
            waiting = [s for s in self.sessions.values() if s.alive and not s.jobs_done]
        for s in waiting:
            if self.warm.is_warm(s) and (res := self.warm.prepared_result(s)) is not None:
                self.apply_reused_selection(s, res, "warm_selection_prepared")

    def start_warm_job(self, s: ClientSession, selection: dict[int, int],
                       settings: dict[str, Any], quick: bool = True) -> None:
        """Control thread: a warm client's first region job, from its stored profile
        (``selection``, samples by address, under ``settings``, a configuration:
        warmstart.WarmStart.job_input), queued at once rather than after its first
        sampling windows; ``quick=False``: the full selection that follows a quick one
        that found nothing to patch (its second job)."""
        if not s.alive or s.paused or self.paused or s.jobs_done > (0 if quick else 1) or \
                s.session_id in self.scheduler.running or not selection:
            return
        own = self.config.to_dict()
        job = ClientJob(s.session_id, s.pid, s.exe, dict(selection), dict(selection),
                        list(s.maps), settings, patched=s.patched_ranges(), quick=quick,
                        fallback_config=None if settings == own else own)
        if self.scheduler.schedule([job], self.config.max_workers):
            s.mark("warm_job_queued" if quick else "warm_full_job_queued")
            if self.warm is not None:      # its result is kept with these (_apply_result)
                self.warm.job_queued(s, job.maps, settings, quick)
            if self.warm is not None:
                self.warm.warm_jobs += 1

    def apply_reused_selection(self, s: ClientSession, res: Any, how: str) -> None:
        """Control thread: a warm client's first regions, the kept selection of an
        earlier process of its program (``how``: "warm_selection_reused",
        warmstart.reused_result) or the selections made ahead of its files
        ("warm_selection_prepared", warmstart.prepared_result), moved to this one:
        installed as a job's result is, with no job."""
        if not s.alive or s.paused or self.paused or s.jobs_done:
            return
        s.mark(how)
        self._apply_result(res, s.session_id)

    def _job_due(self, s: ClientSession, selection: dict[int, int], now: float) -> bool:
        """Whether a client's snapshot gets a region job, after its first QUICK_JOBS + 1
        (which always may): not when nothing new is hot since its last job and nothing
        changed for it (cadence.newly_hot), not while its jobs back off
        (cadence.next_job_gap), and not over its CPU budget (budget.CpuBudget:
        it keeps its installed regions; the job comes once the client's CPU has grown
        enough)."""
        cfg = self.config
        if s.jobs_done > QUICK_JOBS and s.session_id not in self.scheduler.running:
            with s.lock:
                moved = s.cadence.activity != s.cadence.job_activity
                hot_before = s.cadence.job_hot_half
            if not moved and not newly_hot(selection, hot_before, cfg.hot_threshold):
                s.cadence.jobs_skipped_unchanged += 1
                self.scheduler.skipped_unchanged += 1
                return False
            if not moved and now < s.cadence.next_job_mono:
                s.cadence.jobs_skipped_backoff += 1
                self.scheduler.skipped_backoff += 1
                return False
        b = s.cpu_budget
        b.window_s = cfg.service_cpu_window_s   # a reload applies to every client
        b.observe(now, client_cpu_s(s.pid), s.session_cpu_s + s.control_cpu_s)
        return self.scheduler.admit(b, now, budget_limit(cfg, now - s.connected_mono))

    def attribute(self, pid: int, ip: int) -> int:
        """Replacement-code address -> original address (the hook the aggregator
        calls), so hot spots and later selection see one program."""
        s = self._by_pid.get(pid)
        return ip if s is None else s.original_address(ip)

    def _session_by_id(self, sid: int) -> ClientSession | None:
        with self.lock:
            return self.sessions.get(sid) or next(
                (h for h in self.history if h.session_id == sid), None)
