"""The control socket under hostile input: multi-frame, oversized and malformed requests
get a fault reply (or, above zmq.MAXMSGSIZE, a dropped connection) and the socket keeps
serving; a zmq error in one request rebinds the socket instead of ending its thread."""

from __future__ import annotations

import dataclasses
import grp
import json
import os
import shutil
import stat
import tempfile
import threading
import time
from collections import deque
from types import SimpleNamespace

import pytest
import zmq
from service_helpers import ServiceProc

from dbr_service.commands import control, control_verbs
from dbr_service.commands.control import MAX_FRAME, ControlServer
from dbr_service.common.events import EventBus
from dbr_service.commands.ctlclient import MAX_REQUEST, Code


@pytest.fixture(scope="module")
def svc():
    s = ServiceProc().wait_ready()
    yield s
    s.stop()


def _socket(path: str, kind: int = zmq.REQ) -> zmq.Socket:
    sock = zmq.Context.instance().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"ipc://{path}")
    return sock


def _control_path(svc) -> str:
    return os.path.join(svc.dir, "control.sock")


def _reply(sock: zmq.Socket, timeout: float = 3.0) -> dict | None:
    """The JSON reply on a REQ socket, None if none came within ``timeout``."""
    if not sock.poll(int(timeout * 1000)):
        return None
    return json.loads(sock.recv_multipart()[-1])


def _ask(path: str, frames: list[bytes], timeout: float = 3.0) -> dict | None:
    """Send ``frames`` as one message on a fresh REQ socket; its reply or None."""
    sock = _socket(path)
    try:
        sock.send_multipart(frames)
        return _reply(sock, timeout)
    finally:
        sock.close(0)


def _fault(reply: dict | None) -> int:
    assert reply is not None, "no reply"
    assert reply["ok"] is False, reply
    assert isinstance(reply["error"]["message"], str) and reply["error"]["message"]
    return reply["error"]["code"]


def _serving(svc) -> None:
    assert svc.proc.poll() is None, svc.output()
    assert svc.call("status")["pid"] == svc.proc.pid


def _padded(size: int) -> bytes:
    """A valid status request padded with JSON whitespace to exactly ``size`` bytes."""
    head, tail = b'{"verb": "status",', b' "args": {}}'
    return head + b" " * (size - len(head) - len(tail)) + tail


# ----------------------------------------------------------------- the exploit
def test_two_frame_request_gets_an_error_and_the_socket_keeps_serving(svc):
    sock = _socket(_control_path(svc))
    try:
        sock.send_multipart([b'{"verb":"status"}', b"x"])
        assert _fault(_reply(sock)) == Code.BAD_REQUEST
        # the same REQ socket goes on: the exchange completed
        sock.send(b'{"verb":"status"}')
        assert _reply(sock)["ok"] is True
    finally:
        sock.close(0)
    _serving(svc)
    assert "control socket failed" not in svc.output()


def test_two_frames_from_a_dealer_and_many_frames(svc):
    path = _control_path(svc)
    d = _socket(path, zmq.DEALER)
    try:
        d.send_multipart([b"", b'{"verb":"status"}', b'{"verb":"status"}'])
        assert _reply(d)["error"]["code"] == Code.BAD_REQUEST
        d.send_multipart([b""] + [b"f"] * 1000)
        err = _reply(d)["error"]
        assert err["code"] == Code.BAD_REQUEST and "1000 frames" in err["message"]
    finally:
        d.close(0)
    _serving(svc)


def test_delimiter_without_payload_is_dropped(svc):
    """A zmq message has at least one frame; one made only of the REQ envelope reaches
    no handler (libzmq drops it) and the next request on that connection is answered."""
    d = _socket(_control_path(svc), zmq.DEALER)
    try:
        d.send(b"")
        assert not d.poll(300)
        d.send_multipart([b"", b'{"verb":"status"}'])
        assert _reply(d)["ok"] is True
    finally:
        d.close(0)


# ----------------------------------------------------------------- sizes
def test_sizes_around_the_bounds(svc):
    path = _control_path(svc)
    assert _ask(path, [_padded(MAX_REQUEST)])["ok"] is True
    assert _fault(_ask(path, [_padded(MAX_REQUEST + 1)])) == Code.TOO_LARGE
    assert _fault(_ask(path, [_padded(MAX_FRAME)])) == Code.TOO_LARGE
    _serving(svc)


def test_frame_above_maxmsgsize_is_dropped_by_zmq(svc):
    """zmq closes the connection on the frame's header: no reply on it, nothing held,
    and the next client is answered."""
    before = _rss_kib(svc.proc.pid)
    assert _ask(_control_path(svc), [_padded(MAX_FRAME + 1)], timeout=1.0) is None
    assert _ask(_control_path(svc), [b" " * (64 << 20)], timeout=1.0) is None
    _serving(svc)
    assert _rss_kib(svc.proc.pid) - before < 32 << 10, "a 64 MiB frame was buffered"


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


# ----------------------------------------------------------------- malformed
@pytest.mark.parametrize("raw, code", [
    (b"", Code.BAD_REQUEST),
    (b"\xff\xfe", Code.BAD_REQUEST),
    ('{"verb": "status"}'.encode("utf-16"), Code.BAD_REQUEST),      # JSON, not UTF-8
    (b'\xef\xbb\xbf{"verb": "status"}', Code.BAD_REQUEST),          # UTF-8 BOM
    (b'{"verb": "status", "args": {"x": NaN}}', Code.BAD_REQUEST),  # not JSON
    (b'{"verb": "config_set", "args": {"key": "hot_threshold", "value": Infinity}}',
     Code.BAD_REQUEST),
    (b"[" * 60000 + b"]" * 60000, Code.TOO_LARGE),
    (b"[" * 30000 + b"]" * 30000, Code.BAD_REQUEST),                # nesting
    (b'{"verb": "events", "args": {"since": ' + b"9" * 5000 + b"}}",  # digit limit
     Code.BAD_REQUEST),
    (b'{"verb": "events", "args": {"since": ' + b"9" * 4000 + b"}}", None),
    (b'{"verb": "events", "args": {"since": -' + b"9" * 4000 + b"}}", None),
    (b'"status"', Code.BAD_REQUEST),
    (b"null", Code.BAD_REQUEST),
    (b'{"verb": null}', Code.BAD_REQUEST),
    (b'{"verb": "status", "args": 7}', Code.BAD_ARGS),
    (b'{"verb": "\\ud800"}', Code.UNKNOWN_VERB),                     # lone surrogate
    (b'{"verb": "hotspots", "args": {"pid": 1, "top": 100000000}}', Code.BAD_ARGS),
    (b'{"verb": "hotspots", "args": {"pid": 1, "top": -1}}', Code.BAD_ARGS),
    (b'{"verb": "report", "args": {"pids": [1, [2]]}}', Code.BAD_ARGS),
    (b'{"verb": "report", "args": {"pids": [' + b"1," * 20000 + b"1]}}", None),
])
def test_malformed_requests(svc, raw, code):
    reply = _ask(_control_path(svc), [raw])
    if code is None:
        assert reply is not None and reply["ok"] is True, reply
    else:
        assert _fault(reply) == code, reply
    _serving(svc)
    assert "Traceback" not in svc.output()


# ----------------------------------------------------------------- in-process server
@pytest.fixture
def server():
    """A ControlServer on a private path in this process, serving a stand-in service
    (enough for `events` and the verbs registered by the test)."""
    d = tempfile.mkdtemp(prefix="dbr-ctl-")
    ctx = zmq.Context()
    service = SimpleNamespace(stopping=False, events=EventBus(None, None),
                              config=SimpleNamespace(socket_group=""))
    srv = ControlServer(service, ctx, os.path.join(d, "control.sock"))
    srv.start()
    yield srv
    srv.stop()
    assert not srv.thread.is_alive()
    ctx.term()
    shutil.rmtree(d, ignore_errors=True)


def _fail_next_send(server: ControlServer) -> None:
    """Make the server's next reply fail as a zmq error would."""
    real_send = server._send_reply

    def send(data: bytes) -> None:
        server._send_reply = real_send
        raise zmq.ZMQError(zmq.EFSM)

    server._send_reply = send


def _wait_rebinds(server: ControlServer, n: int) -> None:
    deadline = time.monotonic() + 5
    while server.rebinds < n and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.rebinds == n and server.thread.is_alive()


def test_a_failed_send_rebinds_the_socket(server):
    """A REP socket whose reply could not be sent owes it forever; the server closes it
    and binds a fresh one with the same mode and group."""
    gid = grp.getgrnam("daemon").gr_gid if _group_exists("daemon") else os.getgid()
    os.chown(server.path, -1, gid)
    os.chmod(server.path, 0o660)
    _fail_next_send(server)
    assert _ask(server.path, [b'{"verb": "events"}'], timeout=0.5) is None
    _wait_rebinds(server, 1)
    time.sleep(0.2)  # the old listener is gone for good: the file must still answer
    assert _ask(server.path, [b'{"verb": "events"}'])["ok"] is True
    st = os.stat(server.path)
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o660
    assert st.st_gid == gid


def _group_exists(name: str) -> bool:
    try:
        grp.getgrnam(name)
    except KeyError:
        return False
    return True


def test_rebind_without_a_file_is_0600(server):
    sock = _socket(server.path)
    try:
        sock.send(b'{"verb": "events"}')
        assert _reply(sock)["ok"] is True   # connected: the file may go now
        os.unlink(server.path)
        _fail_next_send(server)
        sock.send(b'{"verb": "events"}')
        assert _reply(sock, timeout=0.5) is None
    finally:
        sock.close(0)
    _wait_rebinds(server, 1)
    assert _ask(server.path, [b'{"verb": "events"}'])["ok"] is True
    assert stat.S_IMODE(os.stat(server.path).st_mode) == 0o600


def test_unencodable_reply_is_internal(server, monkeypatch):
    cycle: list = []
    cycle.append(cycle)
    monkeypatch.setitem(control_verbs.VERBS, "test_cycle", (lambda s, a: cycle, {}))
    monkeypatch.setitem(control_verbs.VERBS, "test_huge_int", (lambda s, a: 10 ** 5000, {}))
    monkeypatch.setitem(control_verbs.VERBS, "test_raises", (lambda s, a: 1 / 0, {}))
    for name in ("test_cycle", "test_huge_int", "test_raises"):
        assert _fault(_ask(server.path, [json.dumps({"verb": name}).encode()])) \
            == Code.INTERNAL
        assert _ask(server.path, [b'{"verb": "events"}'])["ok"] is True
    assert server.rebinds == 0


def test_report_follows_forks_in_linear_time():
    """`report` of the root of a 2000-deep fork chain (2000 remembered sessions) reads
    each session's parent once (the work is linear; it used to rescan every session
    for each pid found, 2000 x 2000)."""
    reads = [0]

    class Session:
        def __init__(self, pid: int, ppid: int) -> None:
            self.pid, self._ppid, self.exe = pid, ppid, "/x"

        @property
        def ppid(self) -> int:
            reads[0] += 1
            return self._ppid

        def report(self) -> dict:
            return {"pid": self.pid}

    chain = [Session(1000 + i, 999 + i) for i in range(2000)]
    service = SimpleNamespace(lock=threading.Lock(), history=chain[::-1], sessions={})
    out = control.verb_report(service, {"pids": [999]})
    assert len(out) == 2000
    assert reads[0] <= 2 * len(chain), reads[0]


# ----------------------------------------------------------------- fuzzing
# Hypothesis: random messages on one live service.  Every well-framed message whose
# frames are within MAXMSGSIZE gets a JSON reply with "ok"; the service stays up,
# `status` answers at the end and its descriptor count comes back.  `config_set` may
# change settings on the way (allowed); `shutdown` is left out.
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from dbr_service.common.config import Config  # noqa: E402

FUZZ_VERBS = sorted(v for v in control_verbs.VERBS if v != "shutdown")
WORDS = [*Config.keys(), *control_verbs.VERBS, "json", "dot", "svg", "r1", "", "verb", "args"]


def _valid_settings() -> list[tuple[str, object]]:
    """(key, value) pairs config_set accepts on their own: each key's default, bounds
    and choices (runtime_dir and socket_group are refused whatever the value)."""
    out = []
    for f in dataclasses.fields(Config):
        values = [getattr(Config(), f.name), *f.metadata.get("choices", ())]
        values += [f.metadata[b] for b in ("min", "max") if b in f.metadata]
        out += [(f.name, v) for v in values if v is not None]
    return out


VALID_SETTINGS = _valid_settings()

_ints = st.one_of(st.integers(-2**70, 2**70),
                  st.sampled_from([0, 1, -1, 2**31, 2**63, -2**63 - 1, 10**4000,
                                   -(10**4000), control.MAX_TOP, control.MAX_TOP + 1]))
_strings = st.one_of(st.text(max_size=24), st.sampled_from(WORDS))
_scalars = st.one_of(st.none(), st.booleans(), _ints, _strings,
                     st.floats(allow_nan=False, allow_infinity=False))
_json = st.recursive(_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(_strings, inner, max_size=4)),
    max_leaves=12)

_TYPED = {int: _ints, str: _strings, bool: st.booleans(), list: st.lists(_ints, max_size=6),
          float: st.floats(allow_nan=False, allow_infinity=False)}


@st.composite
def _requests(draw) -> object:
    """A request object: a registered verb, arguments named in its spec or not, values
    of the right type or not; sometimes a wrong shape around them."""
    name = draw(st.sampled_from(FUZZ_VERBS))
    spec = control_verbs.VERBS[name][1]
    args = {}
    for key in draw(st.lists(st.sampled_from(sorted(spec) or ["x"]), max_size=4)):
        typed = [_TYPED[t] for t in spec[key].types] if key in spec else [_ints]
        args[key] = draw(st.one_of(*typed, _json))
    if draw(st.integers(0, 9)) == 0:
        args[draw(_strings)] = draw(_json)
    if name == "config_set" and draw(st.booleans()):
        args = dict(zip(("key", "value"), draw(st.sampled_from(VALID_SETTINGS))))
    req: dict = {"verb": name, "args": args}
    shape = draw(st.integers(0, 19))
    if shape == 0:
        del req["args"]
    elif shape == 1:
        req["args"] = draw(_json)
    elif shape == 2:
        req[draw(_strings)] = draw(_json)
    return req


@st.composite
def _messages(draw) -> tuple[str, list[bytes], int]:
    """(how it is framed, payload frames, size the one frame is padded to with JSON
    whitespace or 0): "single", "multi", "undelimited" (no empty delimiter frame: REP
    drops it) or "giant" (a frame above MAXMSGSIZE).  Padding is applied when sent,
    so that a failing example prints short."""
    def payload() -> bytes:
        kind = draw(st.integers(0, 3))
        if kind == 0:
            return draw(st.binary(max_size=200))
        if kind == 1:
            return json.dumps(draw(_json)).encode()
        return json.dumps(draw(_requests())).encode()

    framing = draw(st.integers(0, 99))
    if framing == 0:
        return "giant", [b""], MAX_FRAME + 1 + draw(st.integers(0, 1 << 20))
    if framing < 5:  # at the size bounds
        return "single", [payload()], draw(st.sampled_from([MAX_REQUEST, MAX_REQUEST + 1,
                                                            MAX_FRAME]))
    if framing < 15:
        return "undelimited", [payload() or b"x" for _ in range(draw(st.integers(1, 3)))], 0
    if framing < 30:
        return "multi", [payload() for _ in range(draw(st.integers(2, 4)))], 0
    return "single", [payload()], 0


def _fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _settled_fd_count(pid: int, timeout: float = 10.0) -> int:
    """The service's descriptor count once it stays the same for a second."""
    deadline = time.monotonic() + timeout
    last, same_since = _fd_count(pid), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.1)
        n = _fd_count(pid)
        if n != last:
            last, same_since = n, time.monotonic()
        elif time.monotonic() - same_since >= 1.0:
            break
    return last


class _Fuzzer:
    """One DEALER for the examples; each message carries a tag frame before the empty
    delimiter, which REP sends back, so a late reply is never taken for another's."""

    def __init__(self, svc) -> None:
        self.svc = svc
        self.path = _control_path(svc)
        self.dealer = _socket(self.path, zmq.DEALER)
        self.sent = 0
        self.replies = 0
        # The service is shared by all examples: a failure may come from an earlier
        # message, so the last ones are quoted, and once one went unanswered the
        # following fail at once (hypothesis then calls the failure flaky).
        self.recent: deque[str] = deque(maxlen=6)
        self.unanswered: str | None = None

    def close(self) -> None:
        self.dealer.close(0)

    def run(self, framing: str, frames: list[bytes], pad_to: int) -> None:
        assert self.unanswered is None, f"no reply since {self.unanswered}"
        self.sent += 1
        self.recent.append(f"{framing} {frames!r:.200} pad_to={pad_to}")
        if pad_to:
            frames = [frames[0][:pad_to].ljust(pad_to, b" ")]
        tag = self.sent.to_bytes(8, "little")
        if framing == "giant":
            assert _ask(self.path, frames, timeout=0.1) is None
        elif framing == "undelimited":
            self.dealer.send_multipart([tag, *frames])
        else:
            self.dealer.send_multipart([tag, b"", *frames])
            if not self.dealer.poll(10_000):
                self.unanswered = "\n".join(self.recent)
                raise AssertionError(f"no reply; messages up to it:\n{self.unanswered}")
            got = self.dealer.recv_multipart()
            assert got[0] == tag and got[1] == b"" and len(got) == 3, got[:3]
            reply = json.loads(got[2])
            assert reply["ok"] in (True, False), reply
            if not reply["ok"]:
                assert reply["error"]["code"] in Code._value2member_map_, reply
            if framing == "multi":
                assert reply["error"]["code"] == Code.BAD_REQUEST, reply
            elif len(frames[0]) > MAX_REQUEST:
                assert reply["error"]["code"] == Code.TOO_LARGE, reply
            self.replies += 1
        assert self.svc.proc.poll() is None, self.svc.output()[-3000:]


def _fuzz(svc, examples: int, derandomize: bool) -> None:
    pid = svc.proc.pid
    fds = _settled_fd_count(pid)
    fuzzer = _Fuzzer(svc)
    try:
        @settings(max_examples=examples, deadline=None, derandomize=derandomize,
                  database=None, print_blob=True,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                         HealthCheck.large_base_example])
        @given(msg=_messages())
        def one(msg):
            fuzzer.run(*msg)

        one()
    finally:
        fuzzer.close()
    assert fuzzer.sent >= examples and fuzzer.replies > examples // 2, \
        (fuzzer.sent, fuzzer.replies)
    svc.call("resume")  # a random `pause` may have stopped snapshots
    _serving(svc)
    deadline = time.monotonic() + 10
    while _fd_count(pid) != fds and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _fd_count(pid) == fds, (fds, sorted(os.listdir(f"/proc/{pid}/fd")))


def test_fuzz_control_socket(svc):
    _fuzz(svc, 1000, derandomize=True)


@pytest.mark.long
@pytest.mark.timeout(3600)
def test_fuzz_control_socket_long(svc):
    _fuzz(svc, 30_000, derandomize=False)
