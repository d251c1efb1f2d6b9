"""Bad input: control socket (malformed, unknown verb, wrong types, oversized) and agent
socket (pid mismatch, disallowed uid, garbage) get refusals; the service keeps serving."""

from __future__ import annotations

import json
import os
import time

import pytest
from service_helpers import FakeAgent, ServiceProc

from dbr_service.wire import protocol as P
from dbr_service.commands.ctlclient import Code


@pytest.fixture(scope="module")
def svc():
    s = ServiceProc("--aggressive").wait_ready()
    yield s
    s.stop()


def _err(svc, raw: bytes) -> dict:
    reply = svc.ctl.call("", raw=raw)
    assert reply["ok"] is False, reply
    return reply["error"]


@pytest.mark.parametrize("raw, code", [
    (b"{not json", Code.BAD_REQUEST),
    (b"\xff\xfe", Code.BAD_REQUEST),
    (b"[1, 2]", Code.BAD_REQUEST),
    (b'{"args": {}}', Code.BAD_REQUEST),
    (b'{"verb": "status", "extra": 1}', Code.BAD_REQUEST),
    (b'{"verb": "launch_missiles"}', Code.UNKNOWN_VERB),
    (b'{"verb": "hotspots", "args": {"pid": "12"}}', Code.BAD_ARGS),
    (b'{"verb": "hotspots", "args": {"pid": true}}', Code.BAD_ARGS),
    (b'{"verb": "hotspots", "args": {}}', Code.BAD_ARGS),
    (b'{"verb": "hotspots", "args": {"pid": 1, "colour": "red"}}', Code.BAD_ARGS),
    (b'{"verb": "clients", "args": []}', Code.BAD_ARGS),
    (b'{"verb": "hotspots", "args": {"pid": 1}}', Code.NO_CLIENT),
    (b'{"verb": "region", "args": {"pid": 1, "id": "r1", "format": "png"}}', Code.NO_CLIENT),
    (b'{"verb": "config_set", "args": {"key": "nope", "value": 1}}', Code.CONFIG),
    (b'{"verb": "config_set", "args": {"key": "max_workers", "value": "many"}}', Code.CONFIG),
    (b'{"verb": "config_get", "args": {"key": "nope"}}', Code.CONFIG),
])
def test_control_refusals(svc, raw, code):
    err = _err(svc, raw)
    assert err["code"] == code, err
    assert isinstance(err["message"], str) and err["message"]
    assert svc.call("status")["pid"] == svc.proc.pid  # still serving


def test_oversized_request(svc):
    big = json.dumps({"verb": "status", "args": {"pad": "x" * (70 * 1024)}}).encode()
    assert _err(svc, big)["code"] == Code.TOO_LARGE
    assert svc.call("status")["pid"] == svc.proc.pid


def test_config_set_and_pause(svc):
    assert svc.call("config_set", {"key": "sample_period_us", "value": 700}) == \
        {"sample_period_us": 700}
    assert svc.call("config_get", {"key": "sample_period_us"})["sample_period_us"] == 700
    assert svc.call("pause")["paused"] is True
    assert svc.call("status")["paused"] is True
    assert svc.call("resume")["paused"] is False


def test_agent_pid_mismatch_refused(svc):
    fa = FakeAgent(svc.dir)
    try:
        msg = fa.hello(pid=os.getpid() + 100000)
        assert msg.type is P.MsgType.ERROR and msg.body.code == P.Result.E_DENIED
        assert fa.recv_or_eof() is None  # and the session is closed
    finally:
        fa.close()
    svc.wait_for(lambda: any(e["event"] == "client-refused" for e in svc.call("events")),
                 5.0, "refusal event")


def test_agent_disallowed_uid_refused(tmp_path):
    s = ServiceProc("allowed_uids=").wait_ready()   # nobody allowed, not even root
    fa = None
    try:
        fa = FakeAgent(s.dir)
        msg = fa.hello()
        assert msg.type is P.MsgType.ERROR and msg.body.code == P.Result.E_DENIED
        assert b"uid" in msg.body.msg
        assert s.call("status")["clients"] == 0
    finally:
        if fa:
            fa.close()
        s.stop()


def test_garbage_drops_only_that_session(svc):
    good = FakeAgent(svc.dir)
    bad = FakeAgent(svc.dir)
    mid = FakeAgent(svc.dir)
    try:
        assert good.hello().type is P.MsgType.HELLO_ACK
        assert bad.hello().type is P.MsgType.HELLO_ACK
        assert mid.hello().type is P.MsgType.HELLO_ACK
        svc.wait_for(lambda: svc.call("status")["clients"] >= 3, 5.0, "3 clients")
        before = svc.call("status")["clients"]
        bad.sock.send(b"\x00garbage that is no message\x00" * 3)
        msg = bad.recv_or_eof()
        while msg is not None and msg.type is not P.MsgType.ERROR:
            msg = bad.recv_or_eof()
        assert bad.recv_or_eof() is None
        # A client that dies mid-message: half a HELLO-sized datagram, then gone.
        mid.sock.send(P.make_hdr(P.MsgType.THREAD_NEW, 24, 2).to_bytes()[:10])
        mid.close()
        svc.wait_for(lambda: svc.call("status")["clients"] == before - 2, 5.0, "2 dropped")
        good.send(P.MsgType.THREAD_NEW, P.Thread(tid=os.getpid()))
        time.sleep(0.2)
        rows = [c for c in svc.call("clients") if c["session"]]
        assert len(rows) == before - 2 and all(r["state"] == "connected" for r in rows)
        left = [e for e in svc.call("events") if e["event"] == "client-left"]
        assert any("protocol" in e["reason"] or "error" in e["reason"] for e in left), left
    finally:
        for fa in (good, bad, mid):
            fa.close()


def test_map_changed_is_acked_promptly_and_threads_tracked(svc):
    fa = FakeAgent(svc.dir)
    try:
        assert fa.hello().type is P.MsgType.HELLO_ACK
        t0 = time.monotonic()
        fa.send(P.MsgType.MAP_CHANGED, P.MapChanged(req_id=77, kind=P.MapKind.MUNMAP,
                                                    lo=0x1000, hi=0x2000))
        msg = fa.recv_or_eof(2.0)
        assert msg is not None and msg.type is P.MsgType.ACK, msg
        assert msg.body.req_id == 77 and msg.body.result == P.Result.OK
        assert time.monotonic() - t0 < 0.5
        fa.send(P.MsgType.THREAD_NEW, P.Thread(tid=424242))
        svc.wait_for(lambda: any(e["event"] == "map-changed" and e["pid"] == os.getpid()
                                 for e in svc.call("events")), 5.0, "map-changed event")
        mine = [c for c in svc.call("clients") if c["session"] and c["pid"] == os.getpid()]
        assert mine and mine[-1]["threads"] >= 2  # /proc/PID/task plus the announced tid
    finally:
        fa.close()
