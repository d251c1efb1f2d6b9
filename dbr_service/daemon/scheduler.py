"""Scheduling client work after each snapshot.

The control thread calls :meth:`Scheduler.schedule` with the clients that have fresh
samples.  The scheduler orders them by hotness, decides how many jobs the machine can
take now (``max_workers`` or CPU count minus load), and submits the worker's job
(worker.optimize_client) to a process pool; results come back through a callback and
are applied on the control thread.  The control thread never waits for a worker.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any

from dbr_service.session.budget import CpuBudget
from dbr_service.region.worker import (WORKER_PRELOAD, ClientJob, JobResult, optimize_client,
                                       warm_up, worker_init)
# imported from here by region/analyze.py, bench and tests
from dbr_service.region.worker import region_config  # noqa: F401

log = logging.getLogger("dbr.scheduler")


# --------------------------------------------------------------------------- scheduler
def auto_workers(cpu_count: int | None = None, load1: float | None = None) -> int:
    """Workers for ``max_workers = 0``: idle CPUs, at least 1, at most CPUs - 1 (but 1)."""
    cpus = cpu_count or os.cpu_count() or 1
    if load1 is None:
        load1 = os.getloadavg()[0]
    idle = int(cpus - load1 + 0.5)
    return max(1, min(max(1, cpus - 1), idle))


class Scheduler:
    """Orders clients by hotness and runs :func:`optimize_client` in worker processes.

    :meth:`schedule` (control thread) only decides; a submitter thread creates the pool
    and submits, because starting worker processes can take a while and the control
    thread must never wait for it.
    """

    def __init__(self, on_result: Callable[[JobResult | BaseException, int], None]) -> None:
        self.on_result = on_result
        self._pool: ProcessPoolExecutor | None = None
        self._pool_size = 0
        self.running: dict[int, Future | None] = {}  # session id -> job (None: queued)
        self.submitted = 0
        self.completed = 0
        self.failed = 0
        self.skipped_load = 0
        self.deferred_by_budget = 0
        #: Jobs not run because nothing new was hot, or while backing off (daemon/snapshots.py).
        self.skipped_unchanged = 0
        self.skipped_backoff = 0
        self.job_cpu_s = 0.0
        self.decode_cached = 0
        self.decode_new = 0
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[ClientJob | None, int]] = queue.Queue()
        self._closed = False
        #: Set once a pool worker has answered: until then jobs run on a thread of this
        #: process (a cold pool costs ~0.5-1 s; the first job should not wait for it).
        self._pool_ready = threading.Event()
        self._stop_warm = threading.Event()
        self._warm_lock = threading.Lock()
        self._pool_lock = threading.Lock()
        self._warming = False
        self._inline_free = threading.Semaphore(1)
        self.inline_jobs = 0
        self._thread = threading.Thread(target=self._submitter, name="dbr-scheduler",
                                        daemon=True)
        self._thread.start()

    def capacity(self, max_workers: int) -> int:
        """How many jobs may run at once now."""
        if max_workers > 0:
            return max_workers
        try:
            import psutil

            load1 = psutil.getloadavg()[0]
            cpus = psutil.cpu_count() or 1
        except Exception:
            load1, cpus = os.getloadavg()[0], os.cpu_count() or 1
        return auto_workers(cpus, load1)

    def warm(self, max_workers: int, delay_s: float = 0.0) -> None:
        """Start the pool and one worker in the background (first jobs come sooner), and
        import what jobs need in this process too, for jobs run before the pool is up.

        ``delay_s``: start the pool only after this long (`dbr run`'s embedded service:
        a program that ends sooner never pays for starting worker processes; jobs run
        inline until the pool is up anyway)."""
        self._start_warm(self._pool_limit(max_workers), delay_s)
        threading.Thread(target=warm_up, name="dbr-warm-imports", daemon=True).start()

    def _start_warm(self, limit: int, delay_s: float = 0.0) -> None:
        self._warming = True

        def later() -> None:
            if delay_s > 0 and self._stop_warm.wait(delay_s):
                return  # shut down first
            with self._warm_lock:
                if not self._closed:
                    self._warm_pool(limit)

        threading.Thread(target=later, name="dbr-warm-pool", daemon=True).start()

    def wait_ready(self, timeout: float) -> bool:
        """Wait (bounded) until a pool worker has answered; True if it has."""
        return self._pool_ready.wait(timeout)

    def _warm_pool(self, limit: int) -> None:
        """Start the pool (submitting the first job starts the forkserver and a worker,
        synchronously: never on the submitter thread, jobs would queue behind it)."""
        try:
            pool = self._ensure_pool(limit)
            pool.submit(warm_up).add_done_callback(lambda f: self._pool_ready.set())
        except Exception as exc:  # no pool: jobs keep running inline
            self._warming = False   # nothing to wait for at shutdown
            log.warning("worker pool did not start: %s", exc)

    @staticmethod
    def _pool_limit(max_workers: int) -> int:
        return max_workers if max_workers > 0 else max(1, (os.cpu_count() or 1) - 1)

    def admit(self, budget: CpuBudget, now: float, limit: float) -> bool:
        """Whether a client's next job fits its CPU budget (its figures observed just
        before); a job that does not is counted as deferred, on the client and here."""
        if budget.allows(now, limit):
            return True
        budget.deferred += 1
        self.deferred_by_budget += 1
        return False

    def charge(self, budget: CpuBudget, res: JobResult) -> None:
        """A finished job's CPU, on its client's budget and in the totals."""
        budget.charge_job(res.cpu_s, res.blocks)
        self.job_cpu_s += res.cpu_s
        self.decode_cached += res.decode_cached
        self.decode_new += res.decode_new

    def schedule(self, jobs: list[ClientJob], max_workers: int) -> list[int]:
        """Queue the hottest jobs that fit now; returns the session ids queued."""
        cap = self.capacity(max_workers)
        with self._lock:
            free = cap - len(self.running)
            order = sorted((j for j in jobs if j.session_id not in self.running),
                           key=lambda j: -sum(j.samples.values()))
            chosen = order[:max(0, free)]
            self.skipped_load += len(order) - len(chosen)
            for job in chosen:
                self.running[job.session_id] = None
        for job in chosen:
            self._queue.put((job, self._pool_limit(max_workers)))
        return [j.session_id for j in chosen]

    def submit_side(self, max_workers: int, fn: Callable[..., Any], *args: Any) -> Future:
        """``fn(*args)`` in a pool worker, outside the client jobs and their accounting
        (a warm selection made ahead of its clients: profiles/warmstart.py)."""
        return self._ensure_pool(self._pool_limit(max_workers)).submit(fn, *args)

    def _submitter(self) -> None:
        while True:
            job, limit = self._queue.get()
            if self._closed:
                return
            try:
                if job is None:
                    continue
                if not self._pool_ready.is_set():
                    if not self._warming:   # nobody called warm(): start the pool now
                        self._start_warm(limit)
                    if self._inline_free.acquire(blocking=False):  # one at a time: the
                        threading.Thread(target=self._run_inline, args=(job,),  # GIL is
                                         daemon=True,           # the control thread's too
                                         name=f"dbr-job-{job.session_id}").start()
                        continue
                pool = self._ensure_pool(limit)
                fut = pool.submit(optimize_client, job)
            except Exception as exc:  # pool broken or shut down: report, go on
                if job is not None:
                    with self._lock:
                        self.running.pop(job.session_id, None)
                    self.failed += 1
                    self.on_result(exc, job.session_id)
                continue
            with self._lock:
                self.running[job.session_id] = fut
                self.submitted += 1
            fut.add_done_callback(lambda f, sid=job.session_id: self._done(sid, f))

    def _run_inline(self, job: ClientJob) -> None:
        """A job on a thread of the service (only while the pool is still starting)."""
        with self._lock:
            self.running[job.session_id] = None
            self.inline_jobs += 1
        try:
            res: JobResult | BaseException = optimize_client(job)
        except Exception as exc:  # optimize_client records its own failures; a bug here
            res = exc
        finally:
            self._inline_free.release()
        with self._lock:
            self.running.pop(job.session_id, None)
            if isinstance(res, BaseException):
                self.failed += 1
            else:
                self.completed += 1
        self.on_result(res, job.session_id)

    def _done(self, session_id: int, fut: Future) -> None:
        with self._lock:
            self.running.pop(session_id, None)
        if fut.cancelled():
            return
        exc = fut.exception()
        if exc is None:
            self.completed += 1
            self.on_result(fut.result(), session_id)
        else:
            self.failed += 1
            self.on_result(exc, session_id)

    def _ensure_pool(self, size: int) -> ProcessPoolExecutor:
        with self._pool_lock:
            return self._ensure_pool_locked(size)

    def _ensure_pool_locked(self, size: int) -> ProcessPoolExecutor:
        if self._pool is None or size != self._pool_size:
            old = self._pool
            # forkserver: workers never inherit the service's threads, sockets or zmq.
            ctx = multiprocessing.get_context("forkserver")
            # The forkserver imports what jobs need once; every worker forks from it
            # with those modules loaded (the first job no longer pays ~0.5 s of imports).
            ctx.set_forkserver_preload(WORKER_PRELOAD)
            self._pool = ProcessPoolExecutor(max_workers=size, mp_context=ctx,
                                             initializer=worker_init,
                                             initargs=(os.getpid(),))
            self._pool_size = size
            if old is not None:
                old.shutdown(wait=False)
        return self._pool

    def stats(self) -> dict[str, Any]:
        return {"pool_size": self._pool_size, "running": len(self.running),
                "submitted": self.submitted, "completed": self.completed,
                "failed": self.failed, "deferred_for_load": self.skipped_load,
                "deferred_by_budget": self.deferred_by_budget,
                "skipped_unchanged": self.skipped_unchanged,
                "skipped_backoff": self.skipped_backoff,
                "job_cpu_s": round(self.job_cpu_s, 3),
                "decode_cached": self.decode_cached, "decode_new": self.decode_new,
                "inline_jobs": self.inline_jobs, "pool_ready": self._pool_ready.is_set()}

    def shutdown(self, timeout: float = 1.0) -> None:
        """Cancel queued jobs and stop workers without waiting for running ones
        (bounded by ``timeout`` seconds in all)."""
        deadline = time.monotonic() + timeout
        self._stop_warm.set()
        # Not while the pool is being created (bounded: a pool still starting after the
        # timeout is left to its workers' watch on this process).
        locked = self._warm_lock.acquire(timeout=timeout / 2)
        self._closed = True
        if locked:
            self._warm_lock.release()
        self._queue.put((None, 0))
        self._thread.join(timeout / 2)
        if self._pool is not None and self._warming:
            # A worker still starting unpickles the pool's semaphores from its parent:
            # shutting the pool down under it makes it die with a traceback on our
            # stderr.  Give it (bounded) time to come up.
            self._pool_ready.wait(max(0.0, deadline - time.monotonic()))
        pool, self._pool = self._pool, None
        if pool is None:
            return
        procs = list((getattr(pool, "_processes", None) or {}).values())
        pool.shutdown(wait=False, cancel_futures=True)
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
