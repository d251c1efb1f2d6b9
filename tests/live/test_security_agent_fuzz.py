"""Fuzzing the agent socket of a real service: whatever a local process sends there,
the service stays up, answers `status`, ends the session, and keeps no descriptor and
no session of it.

Each example is one connection to agent.sock: random bytes, headers with wrong sizes,
types and versions, HELLO (mostly with this process's pid, else refused at once) and
then messages of every type with field values chosen to hurt (huge counts, tids of
another process, addresses 0, -1 and in kernel space), some with descriptors attached
(SCM_RIGHTS: /dev/null, a pipe, a memfd, the connection itself), some connections
closed in the middle of the handshake.  The service has one module fixture; it is
stopped (and killed, by pid) at the end.  DBR_FUZZ_EXAMPLES sets the number of
examples of the `make test` variant (2000)."""

from __future__ import annotations

import array
import ctypes
import os
import socket
import subprocess
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from service_helpers import ServiceProc, kill

from dbr_service.wire import protocol as P


class DescriptorLeak(AssertionError):
    """The service kept descriptors of ended connections."""


EXAMPLES = int(os.environ.get("DBR_FUZZ_EXAMPLES", "1000"))
EXAMPLES_LONG = 30000

MY_PID = os.getpid()
INTERESTING = [0, 1, 2, 3, 4, 0x7F, 0xFF, 0x1000, 0xFFFF, 0x10000, 0x7FFFFFFF, 0x80000000,
               0xFFFFFFFF, 1 << 32, (1 << 47) - 0x1000, 1 << 47, 0xFFFF800000000000,
               0xFFFFFFFF81000000, 1 << 63, (1 << 64) - 1, MY_PID]
#: Tids the fuzzer names: its own, another process's (the sleeper's), none.
TIDS: list[int] = [MY_PID]


def _int(ctype) -> st.SearchStrategy[int]:
    bits = ctypes.sizeof(ctype) * 8
    mask = (1 << bits) - 1
    signed = ctype in (ctypes.c_int32, ctypes.c_int64)

    def fit(v: int) -> int:
        v &= mask
        return v - (1 << bits) if signed and v >> (bits - 1) else v
    return st.one_of(st.sampled_from(INTERESTING), st.sampled_from(TIDS),
                     st.integers(0, mask)).map(fit)


def _struct(cls) -> st.SearchStrategy:
    """An instance of a wire struct with every field but hdr drawn (arrays as bytes)."""
    parts = {}
    for name, ctype in cls._fields_:
        if name == "hdr":
            continue
        if issubclass(ctype, (ctypes.Array, ctypes.Structure)):
            parts[name] = st.binary(max_size=ctypes.sizeof(ctype))
        else:
            parts[name] = _int(ctype)

    def build(values: dict) -> ctypes.Structure:
        obj = cls()
        for name, v in values.items():
            if isinstance(v, bytes):
                off = getattr(cls, name).offset
                ctypes.memmove(ctypes.addressof(obj) + off, v, len(v))
            else:
                setattr(obj, name, v)
        return obj
    return st.fixed_dictionaries(parts).map(build)


@st.composite
def well_formed(draw, mtype: P.MsgType | None = None) -> bytes:
    """A message built with wire/protocol.py's builders, its fields drawn."""
    mtype = mtype or draw(st.sampled_from(list(P.MsgType)))
    body = draw(_struct(P.MSG_CLASS[mtype]))
    seq = draw(st.integers(0, 0xFFFFFFFF))
    item_cls = P.MSG_ARRAY.get(mtype)
    if item_cls is None:
        return P.pack(body, mtype, seq)
    isz = ctypes.sizeof(item_cls)
    n = draw(st.one_of(st.integers(0, 4), st.integers(0, (P.MSG_MAX - 64) // isz)))
    raw = draw(st.binary(min_size=n * isz, max_size=n * isz)) if n > 4 else b""
    items = [item_cls.from_buffer_copy(raw[k * isz:(k + 1) * isz]) for k in range(n)] \
        if raw else [draw(_struct(item_cls)) for _ in range(n)]
    out = bytearray(P.pack_array_msg(body, mtype, items, seq))
    if draw(st.integers(0, 7)) == 0:     # an n that does not match the length
        bad_n = draw(_int(ctypes.c_uint32))
        off = P.MSG_CLASS[mtype].n.offset
        out[off:off + 4] = bad_n.to_bytes(4, "little")
    return bytes(out)


@st.composite
def bad_header(draw) -> bytes:
    """A well-formed message with one header field wrong, or random bytes after it."""
    raw = bytearray(draw(well_formed()))
    which = draw(st.sampled_from(["magic", "version", "type", "length", "size"]))
    if which == "size":
        cut = draw(st.integers(0, len(raw) + 64))
        raw = raw[:cut] + bytes(max(0, cut - len(raw)))
    else:
        f = getattr(P.MsgHdr, which)
        v = draw(_int(ctypes.c_uint32 if f.size == 4 else ctypes.c_uint16))
        raw[f.offset:f.offset + f.size] = v.to_bytes(f.size, "little")
    return bytes(raw)


def datagram() -> st.SearchStrategy[bytes]:
    return st.one_of(well_formed(), well_formed(), bad_header(), st.binary(max_size=300),
                     st.integers(P.MSG_MAX - 8, P.MSG_MAX + 64).map(lambda n: bytes(n)))


@st.composite
def hello(draw) -> bytes:
    h = draw(_struct(P.Hello))
    if draw(st.integers(0, 9)):          # mostly the right pid: a session begins
        h.pid = MY_PID
    if draw(st.booleans()):              # sane informational fields, so it is served
        h.page_size, h.build_id_len, h.n_threads = 4096, 20, 1
        h.census_signal = h.sampler_signal = 40
        h.exe = draw(st.binary(max_size=P.EXE_MAX - 1).map(lambda b: b.replace(b"\0", b"")))
    return P.pack(h, P.MsgType.HELLO, 1)


FD_KINDS = ["devnull", "pipe", "memfd", "self", "socket"]


@st.composite
def plan(draw) -> dict:
    """One connection: its datagrams (each with descriptors to attach), and whether
    it closes at once, reads the replies, or closes before sending anything."""
    first = draw(st.one_of(hello(), hello(), hello(), datagram()))
    later = draw(st.lists(datagram(), max_size=8))
    steps = []
    for raw in [first] + later:
        fds = draw(st.lists(st.sampled_from(FD_KINDS), max_size=3)) \
            if draw(st.integers(0, 4)) == 0 else []
        steps.append((raw, fds))
    return {"steps": steps if draw(st.integers(0, 15)) else [],
            "read_s": draw(st.sampled_from([0.0, 0.0, 0.005, 0.03]))}


def _open_fds(kinds: list[str], conn: socket.socket) -> list[int]:
    out = []
    for k in kinds:
        if k == "devnull":
            out.append(os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC))
        elif k == "pipe":
            r, w = os.pipe2(os.O_CLOEXEC)
            os.close(w)
            out.append(r)
        elif k == "memfd":
            fd = os.memfd_create("fuzz", os.MFD_CLOEXEC)
            os.ftruncate(fd, 1 << 20)
            out.append(fd)
        elif k == "self":               # the connection itself: kept, it never reads EOF
            out.append(os.dup(conn.fileno()))
        else:
            out.append(socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM).detach())
    return out


def _run(agent_sock: str, p: dict) -> None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    try:
        s.settimeout(5.0)     # the service accepts (or refuses) every connection at once
        s.connect(agent_sock)
        for raw, kinds in p["steps"]:
            fds = _open_fds(kinds, s)
            try:
                anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] \
                    if fds else []
                s.sendmsg([raw], anc)
            except OSError:
                break           # the service closed the session: fine
            finally:
                for fd in fds:
                    os.close(fd)
        deadline = time.monotonic() + p["read_s"]
        while time.monotonic() < deadline:
            s.settimeout(max(0.001, deadline - time.monotonic()))
            try:
                if not s.recv(P.MSG_MAX):
                    break
            except OSError:
                break
    finally:
        s.close()


def _fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


class Target:
    def __init__(self) -> None:
        self.svc = ServiceProc("--aggressive").wait_ready()
        self.sleeper = subprocess.Popen(["sleep", "3600"])
        TIDS.append(self.sleeper.pid)
        self.agent_sock = os.path.join(self.svc.dir, "agent.sock")

    def settled(self, baseline: int | None, timeout: float = 10.0) -> int:
        """Wait until no session is listed and (if given) the service's descriptors are
        back to ``baseline``; the count then."""
        deadline = time.monotonic() + timeout
        while True:
            n = _fd_count(self.svc.proc.pid)
            idle = self.svc.call("clients") == [] and \
                self.svc.call("status")["clients"] == 0
            if idle and (baseline is None or n == baseline):
                return n
            if time.monotonic() > deadline:
                return n
            time.sleep(0.1)

    def close(self) -> None:
        kill(self.sleeper)
        self.svc.stop()


@pytest.fixture(scope="module")
def target():
    t = Target()
    try:
        # One well-behaved session first: whatever the service opens once (a session
        # thread, the worker pool) is in the baseline.
        _run(t.agent_sock, {"steps": [(P.pack(P.Hello(pid=MY_PID, page_size=4096,
                                                       exe=b"/fuzz"), P.MsgType.HELLO, 1),
                                       [])], "read_s": 0.05})
        time.sleep(0.5)
        t.settled(None)
        yield t
    finally:
        t.close()


def _fuzz(target: Target, examples: int) -> None:
    svc = target.svc
    time.sleep(0.3)
    baseline = target.settled(None)
    seen = [0]

    @settings(max_examples=examples, deadline=None, database=None, derandomize=False,
              print_blob=True,
              suppress_health_check=[HealthCheck.function_scoped_fixture,
                                     HealthCheck.too_slow, HealthCheck.data_too_large,
                                     HealthCheck.large_base_example])
    @given(p=plan())
    def one(p: dict) -> None:
        _run(target.agent_sock, p)
        seen[0] += 1
        assert svc.proc.poll() is None, "the service died:\n" + svc.output()[-3000:]
        assert svc.call("status")["version"]

    one()
    assert seen[0] >= min(examples, 1000)
    n = target.settled(baseline)
    leftover = svc.call("clients")
    assert leftover == [], leftover
    # hostile input is refused, never a bug's traceback (an internal error)
    log = svc.output()
    assert "Traceback" not in log, log[max(0, log.index("Traceback") - 2000):][:6000]
    if n != baseline:
        fds = sorted(os.readlink(f"/proc/{svc.proc.pid}/fd/{f}")
                     for f in os.listdir(f"/proc/{svc.proc.pid}/fd"))
        raise DescriptorLeak(f"descriptors {baseline} -> {n}: {fds}")


def test_agent_socket_fuzz(target):
    _fuzz(target, EXAMPLES)


@pytest.mark.long
@pytest.mark.timeout(3600)
def test_agent_socket_fuzz_long(target):
    _fuzz(target, EXAMPLES_LONG)
