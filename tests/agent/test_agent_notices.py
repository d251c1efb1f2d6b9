"""Thread notices only on request (DBR_HELLO_QUIET_THREADS, DBR_MSG_NOTICES).

A program's starting and ending threads cost it a message each only while the service
asks for them (while it samples with one perf event per thread).  Driven by the fake
service: quiet by default, on and off on request, refused flags change nothing, and a
new session starts quiet again.
"""

from __future__ import annotations

import time

import pytest

from dbr_service.wire import protocol as P
from dbr_service.sampling.perf import list_tids
from harness import compile_c

NOTICES = (P.MsgType.THREAD_NEW, P.MsgType.THREAD_EXIT)


@pytest.fixture(scope="module")
def spawner_exe():
    return compile_c(["spawner.c"])


def start(svc, exe):
    client = svc.spawn([exe])
    client.out.expect("ready")
    return client, svc.accept(pid=client.pid)


def one_thread(client, conn, quiet_for: float = 0.3) -> tuple[int, list]:
    """Start one thread in the client; (its tid, the notices that came within quiet_for
    seconds after it was joined)."""
    client.send("t")
    tid = int(client.out.expect("tid").split()[1])
    client.out.expect("joined")
    got = []
    deadline = time.monotonic() + quiet_for
    while (left := deadline - time.monotonic()) > 0:
        rec = conn.recv(timeout=left)
        if rec is None:
            break
        assert rec.type in NOTICES, f"unexpected {rec.type.name}"
        got.append((rec.type, rec.msg.body.tid))
    return tid, got


def test_agent_is_quiet_about_threads_until_asked(svc, spawner_exe):
    client, conn = start(svc, spawner_exe)
    assert conn.hello.flags & P.HELLO_QUIET_THREADS
    tid, got = one_thread(client, conn)
    assert got == [], "notices sent although nobody asked"

    assert conn.notices(P.NOTICE_THREADS) == P.Result.OK
    tid, got = one_thread(client, conn)
    assert got == [(P.MsgType.THREAD_NEW, tid), (P.MsgType.THREAD_EXIT, tid)]

    assert conn.notices(0) == P.Result.OK
    _, got = one_thread(client, conn)
    assert got == []
    rc, rest = client.finish()
    assert rc == 0


def test_unknown_notice_flags_are_refused_and_change_nothing(svc, spawner_exe):
    client, conn = start(svc, spawner_exe)
    assert conn.notices(P.NOTICE_THREADS | 0x80) == P.Result.E_INVAL
    _, got = one_thread(client, conn)
    assert got == [], "a refused request turned the notices on"
    assert conn.notices(P.NOTICE_THREADS) == P.Result.OK
    assert conn.notices(0x100) == P.Result.E_INVAL
    tid, got = one_thread(client, conn)
    assert got == [(P.MsgType.THREAD_NEW, tid), (P.MsgType.THREAD_EXIT, tid)], \
        "a refused request turned the notices off"
    rc, _ = client.finish()
    assert rc == 0


def test_a_new_session_starts_quiet(svc, spawner_exe):
    client, conn = start(svc, spawner_exe)
    assert conn.notices(P.NOTICE_THREADS) == P.Result.OK
    conn.close()                      # the service goes away; the agent reconnects
    conn = svc.accept(pid=client.pid, timeout=15.0)
    _, got = one_thread(client, conn)
    assert got == [], "the last session's request outlived it"
    rc, _ = client.finish()
    assert rc == 0


@pytest.fixture(scope="module")
def churner_exe():
    return compile_c(["churner.c"])


def _announced(conn, until: float) -> set[int]:
    """THREAD_NEW tids queued in the inbox, and those that arrive before ``until``."""
    new = set()
    while True:
        while conn.inbox:
            rec = conn.inbox.popleft()
            if rec.type is P.MsgType.THREAD_NEW:
                new.add(rec.msg.body.tid)
        left = until - time.monotonic()
        if left <= 0:
            return new
        rec = conn.recv(timeout=left)
        if rec is not None:
            conn.inbox.append(rec)


@pytest.mark.parametrize("delay_us", [0, 2000])
def test_threads_started_unwrapped_are_listed_when_notices_turn_on(svc, churner_exe, delay_us):
    """A dormant agent starts threads without its wrapper (no notices to send, no timer
    to arm), so such a thread is never announced.  The service relies on listing
    /proc/PID/task after the agent answers "notices on": every thread then alive was
    either listed or announced.  The agent waits for unwrapped starts under way
    before it answers; DBR_AGENT_TEST_START_DELAY_US widens the race it closes (2 ms
    between the look at the flags and the clone) so that it is met in most rounds."""
    env = {"DBR_AGENT_TEST_START_DELAY_US": str(delay_us)} if delay_us else None
    client = svc.spawn([churner_exe, "40", "500"], env=env)
    client.out.expect("ready")
    conn = svc.accept(pid=client.pid)
    missing: list[tuple[int, set[int]]] = []
    for rnd in range(25):
        assert conn.notices(P.NOTICE_THREADS) == P.Result.OK
        listed = set(list_tids(client.pid))
        time.sleep(0.01)
        later = set(list_tids(client.pid))   # all born within 40 ms of the answer: still alive
        announced = _announced(conn, time.monotonic() + 0.05)
        assert conn.notices(0) == P.Result.OK
        announced |= _announced(conn, time.monotonic() + 0.02)
        lost = later - listed - announced
        if lost:
            missing.append((rnd, lost))
        time.sleep(0.005 * (rnd % 4))   # vary the phase against the starts
    client.send("x")
    rc, rest = client.finish()
    assert rc == 0, rest
    assert not missing, f"threads neither listed nor announced: {missing}"
