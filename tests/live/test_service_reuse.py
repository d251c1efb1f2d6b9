"""Session threads kept from one session to the next (dbr_service/session/reuse.py).

A thread born per session cost a short program that starts many threads ~30 ms
(docs/decisions/0029-session-threads-reused.md); these tests show the pool's rules: a
job runs on an idle kept thread when there is one, the longest idle first; threads are
born only when none is idle; idle threads beyond ``keep`` end after ``idle_s``, and
beyond ``max_idle`` at once; a failing job does not end its thread; close() ends the
idle ones.  Every wait is bounded.
"""

from __future__ import annotations

import threading
import time

import pytest

from dbr_service.session.reuse import IDLE_NAME, ReusedThreads
from service_helpers import ServiceProc, agent_path, build_example, kill, spawn_client


def ident_of(pool: ReusedThreads, name: str = "job") -> int:
    got = {}

    def fn():
        got["ident"] = threading.get_ident()
        got["name"] = threading.current_thread().name
    job = pool.run(fn, name)
    job.join(5.0)
    assert not job.is_alive()
    assert got["name"] == name
    return got["ident"]


def wait_until(pred, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.01)
    return pred()


def test_jobs_one_after_another_run_on_one_thread():
    pool = ReusedThreads(keep=1)
    pool.prestart()
    assert pool.born == 1 and pool.idle() == 1
    first = ident_of(pool)
    assert wait_until(lambda: pool.idle() == 1)
    assert all(ident_of(pool) == first for _ in range(5))
    assert pool.born == 1 and pool.reused == 6
    pool.close()


def test_a_thread_is_born_only_when_every_kept_one_is_busy():
    pool = ReusedThreads(keep=2)
    pool.prestart()
    release = threading.Event()
    idents = []

    def hold():
        idents.append(threading.get_ident())
        release.wait(5.0)
    jobs = [pool.run(hold, f"hold-{i}") for i in range(3)]
    assert wait_until(lambda: len(idents) == 3)
    assert len(set(idents)) == 3 and pool.born == 3 and pool.reused == 2
    release.set()
    for j in jobs:
        j.join(5.0)
    assert wait_until(lambda: pool.idle() == 3)
    pool.close()


def test_the_longest_idle_thread_is_handed_the_next_job():
    """Its load decayed most; jobs one after another go round the kept threads."""
    pool = ReusedThreads(keep=2)
    pool.prestart()
    seq = []
    for _ in range(4):
        seq.append(ident_of(pool))
        assert wait_until(lambda: pool.idle() == 2)
    assert seq[0] != seq[1] and seq[2] == seq[0] and seq[3] == seq[1], seq
    pool.close()


def test_idle_threads_beyond_keep_end_after_idle_s():
    pool = ReusedThreads(keep=1, idle_s=0.2)
    pool.prestart(3)
    assert pool.idle() == 3
    assert wait_until(lambda: pool.idle() == 1, timeout=5.0)
    time.sleep(0.5)
    assert pool.idle() == 1, "the one kept thread ended too"
    alive = [t for t in threading.enumerate() if t.name == IDLE_NAME]
    assert len(alive) >= 1
    pool.close()


def test_a_thread_beyond_max_idle_ends_after_its_job():
    pool = ReusedThreads(keep=0, max_idle=1)
    release = threading.Event()
    jobs = [pool.run(lambda: release.wait(5.0), f"j{i}") for i in range(2)]
    release.set()
    for j in jobs:
        j.join(5.0)
    assert wait_until(lambda: pool.idle() == 1)
    time.sleep(0.1)
    assert pool.idle() == 1 and pool.born == 2
    pool.close()


def test_a_failing_job_leaves_its_thread_serving(caplog):
    pool = ReusedThreads(keep=1)
    pool.prestart()

    def boom():
        raise RuntimeError("job bug")
    job = pool.run(boom, "boom")
    job.join(5.0)
    assert not job.is_alive()
    assert "boom failed" in caplog.text
    assert wait_until(lambda: pool.idle() == 1)
    ident_of(pool)
    assert pool.born == 1
    pool.close()


def test_close_ends_idle_threads_and_refuses_jobs():
    pool = ReusedThreads(keep=2)
    pool.prestart()
    idle = [t for t in threading.enumerate() if t.name == IDLE_NAME]
    pool.close()
    for t in idle:
        t.join(5.0)
    assert not any(t.is_alive() for t in idle)
    with pytest.raises(RuntimeError):
        pool.run(lambda: None, "late")


def test_bad_limits_are_refused():
    for kw in ({"keep": -1}, {"keep": 3, "max_idle": 2}, {"idle_s": 0}):
        with pytest.raises(ValueError):
            ReusedThreads(**kw)


@pytest.mark.skipif(agent_path() is None, reason="libdbr_agent.so cannot be built")
def test_service_runs_later_sessions_on_kept_threads():
    """Clients one after another: their sessions run on the threads born at start."""
    svc = ServiceProc().wait_ready()
    prog = build_example("hotloop")
    try:
        for _ in range(4):
            client = spawn_client(svc.dir, [prog, "20000"])
            try:
                svc.wait_for(lambda: any(c["pid"] == client.pid for c in svc.call("clients")),
                             10.0, "the client's session")
            finally:
                kill(client)
            svc.wait_for(lambda: all(c["pid"] != client.pid for c in svc.call("clients"))
                         and svc.call("status")["session_threads"]["idle"] == 2,
                         10.0, "the end of the client's session")
        st = svc.call("status")["session_threads"]
        assert st["born"] == 2 and st["reused"] >= 4, st
    finally:
        svc.stop()
