"""Thread notices only on request (DBR_HELLO_QUIET_THREADS, DBR_MSG_NOTICES).

A program's starting and ending threads cost it a message each only while the service
asks for them (while it samples with one perf event per thread).  Driven by the fake
service: quiet by default, on and off on request, refused flags change nothing, and a
new session starts quiet again.
"""

from __future__ import annotations

import time

import pytest

from dbr_service import protocol as P
from harness import compile_c, fake_service_fixture  # noqa: F401

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
