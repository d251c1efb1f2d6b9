"""The service's side of thread notices (NOTICES, HELLO_QUIET_THREADS), seen by a
fake agent: an agent that says HELLO_QUIET_THREADS is asked for notices when a perf
window opens and for quiet when it closes; an agent that does not (an older one) is
never sent NOTICES, which it would not know.  Every wait is bounded."""

from __future__ import annotations

import time

from service_helpers import FakeAgent, ServiceProc

from dbr_service.wire import protocol as P


def requests_seen(agent: FakeAgent, seconds: float) -> list[tuple[P.MsgType, int]]:
    """Answer every request for ``seconds`` (ACK OK); (type, NOTICES flags or -1)."""
    seen = []
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        try:
            msg = agent.recv_or_eof(timeout=left)
        except TimeoutError:   # socket.timeout: nothing more within the time
            break
        assert msg is not None, "the service closed the session"
        t = msg.type
        body = msg.body
        seen.append((t, body.flags if t is P.MsgType.NOTICES else -1))
        if hasattr(body, "req_id") and t is not P.MsgType.ACK:
            agent.send(P.MsgType.ACK, P.Ack(req_id=body.req_id, result=0))
    return seen


def test_a_quiet_agent_is_asked_for_notices_only_while_a_window_is_open():
    svc = ServiceProc("--aggressive", "patching=false").wait_ready()
    agent = FakeAgent(svc.dir)
    try:
        ack = agent.hello(flags=P.HELLO_QUIET_THREADS)
        assert ack.type is P.MsgType.HELLO_ACK
        notices = [f for t, f in requests_seen(agent, 1.5) if t is P.MsgType.NOTICES]
        # windows of 0.1 s every 0.15 s: on, off, on, off, ... and never twice the same
        assert len(notices) >= 4, notices
        assert notices[0] == P.NOTICE_THREADS
        assert all(a != b for a, b in zip(notices, notices[1:])), notices
        assert set(notices) == {P.NOTICE_THREADS, 0}
    finally:
        agent.close()
        svc.stop()


def test_an_agent_without_the_flag_is_never_sent_notices():
    svc = ServiceProc("--aggressive", "patching=false").wait_ready()
    agent = FakeAgent(svc.dir)
    try:
        ack = agent.hello(flags=0)
        assert ack.type is P.MsgType.HELLO_ACK
        seen = requests_seen(agent, 1.0)
        assert all(t is not P.MsgType.NOTICES for t, _ in seen), seen
        rows = svc.call("clients")
        assert len(rows) == 1 and rows[0]["thread_notices"] == "always", rows
    finally:
        agent.close()
        svc.stop()
