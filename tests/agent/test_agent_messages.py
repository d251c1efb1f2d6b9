"""What the agent answers to every kind of datagram the service may send it
(dbr_agent/messages.c): for every message type, lengths and entry counts at and
around each limit, bad headers, and messages out of order, before HELLO_ACK and
after it.  A datagram the rules refuse gets one ERROR (code, the offending seq, the
text) and the session closes; one they accept gets its reply and the session goes
on.  The rules are written out below from shared/dbr_protocol.h, apart from the
agent's own table, so a change to how the agent checks shows here.

DBR_TEST_AGENT=/path/to/libdbr_agent.so runs the cases against another build of
the agent (an older one: both must answer alike).
"""

from __future__ import annotations

import ctypes
import os
import socket
import struct
import time

import pytest

from dbr_service.wire import protocol as P
from harness import FakeService

T = P.MsgType
HDR = ctypes.sizeof(P.MsgHdr)
BAD_LENGTH = "bad message length for its type"
#: Advisory messages the agent may send at any time.
ADVISORY = {T.THREAD_NEW, T.THREAD_EXIT, T.MAP_CHANGED}

#: What the service may send: the fixed part's class, and for messages with entries
#: their class, how many at most, and the ERROR text for a bad length.
FIXED = {
    T.HELLO_ACK: P.HelloAck, T.ACK: P.Ack, T.CODE_BUFFER_REQ: P.CodeBufferReq,
    T.CODE_BUFFER_FREE: P.CodeBufferFree, T.REGION: P.Region,
    T.REGION_FORGET: P.RegionForget, T.SAMPLER_START: P.SamplerStart,
    T.SAMPLER_STOP: P.Ack, T.SAMPLER_THREAD: P.SamplerThread, T.BYE: P.Bye,
    T.ERROR: P.Error, T.NOTICES: P.Notices, T.FRAMES_ADD: P.Frames, T.FRAMES_DEL: P.Frames,
}
ARRAY = {
    T.PATCH: (P.PatchBatch, P.PatchSite, P.MAX_SITES, "bad PATCH/UNPATCH length"),
    T.UNPATCH: (P.PatchBatch, P.PatchSite, P.MAX_SITES, "bad PATCH/UNPATCH length"),
    T.PC_CENSUS_REQ: (P.CensusReq, P.Range, P.MAX_CENSUS_RANGES, "bad PC_CENSUS_REQ length"),
    T.TRANSFER: (P.Transfer, P.TransferPoint, P.MAX_TRANSFER, "bad TRANSFER/EVICT length"),
    T.EVICT: (P.Transfer, P.TransferPoint, P.MAX_TRANSFER, "bad TRANSFER/EVICT length"),
}
#: Accepted before HELLO_ACK; HELLO_ACK is accepted only then.
IN_HANDSHAKE = {T.HELLO_ACK, T.BYE, T.ERROR}


def fixed_size(mtype: int) -> int:
    cls = FIXED.get(mtype) or ARRAY[mtype][0]
    return ctypes.sizeof(cls)


def expected(raw: bytes, handshake: bool) -> tuple[int, int, str] | None:
    """The ERROR the agent sends for ``raw`` (code, ref_seq, text), or None if it
    accepts it.  First failure wins: header, type, state, length."""
    n = len(raw)
    if n < HDR:
        return (P.Result.E_PROTO, 0, "datagram shorter than the header")
    magic, version, mtype, length, seq = struct.unpack_from("<IHHII", raw)
    if magic != P.PROTO_MAGIC:
        return (P.Result.E_PROTO, seq, "bad magic")
    if version != P.PROTO_VERSION:
        return (P.Result.E_VERSION, seq, "protocol version mismatch")
    if length != n:
        return (P.Result.E_PROTO, seq, "length field differs from datagram size")
    if mtype not in FIXED and mtype not in ARRAY:
        return (P.Result.E_PROTO, seq, "unknown or agent-only message type")
    if handshake and mtype not in IN_HANDSHAKE:
        return (P.Result.E_PROTO, seq, "message before HELLO_ACK")
    if not handshake and mtype == T.HELLO_ACK:
        return (P.Result.E_PROTO, seq, "duplicate HELLO_ACK")
    if mtype in ARRAY:
        cls, item, most, text = ARRAY[mtype]
        fixed = ctypes.sizeof(cls)
        if n < fixed:
            return (P.Result.E_PROTO, seq, text)
        count = struct.unpack_from("<I", raw, cls.n.offset)[0]
        if count > most or n != fixed + count * ctypes.sizeof(item):
            return (P.Result.E_PROTO, seq, text)
        return None
    if n != fixed_size(mtype):
        return (P.Result.E_PROTO, seq, BAD_LENGTH)
    return None


def msg(mtype: int, size: int, *, seq: int = 7, count: int | None = None,
        length: int | None = None, magic: int = P.PROTO_MAGIC,
        version: int = P.PROTO_VERSION, fields: dict | None = None) -> bytes:
    """A datagram of ``size`` bytes: the header, then zeros, with ``count`` at the
    entry count's offset and ``fields`` (name: value) of the fixed part set."""
    body = bytearray(max(size, HDR))
    struct.pack_into("<IHHII", body, 0, magic, version, mtype,
                     size if length is None else length, seq)
    cls = FIXED.get(mtype) or (ARRAY[mtype][0] if mtype in ARRAY else None)
    if count is not None:
        struct.pack_into("<I", body, ARRAY[mtype][0].n.offset, count)
    for name, v in (fields or {}).items():
        f = getattr(cls, name)
        body[f.offset:f.offset + f.size] = int(v).to_bytes(f.size, "little",
                                                            signed=v < 0)
    return bytes(body[:size])


def refused_in_session() -> list[bytes]:
    """Datagrams that end a session, each with its own seq."""
    out = [
        msg(T.ACK, 10),                                   # shorter than the header
        msg(T.ACK, 24, magic=0xDEADBEEF),
        msg(T.ACK, 24, magic=0xDEADBEEF, version=9),      # magic before version
        msg(T.ACK, 24, version=P.PROTO_VERSION + 1),
        msg(T.ACK, 24, version=P.PROTO_VERSION + 1, length=99),  # version before length
        msg(T.ACK, 24, length=25),
        msg(77, 24, length=30),                           # length before type
        msg(T.HELLO_ACK, ctypes.sizeof(P.HelloAck)),
        msg(T.HELLO_ACK, ctypes.sizeof(P.HelloAck) + 1),  # state before length
    ]
    for t in [0, *range(1, P.MSG_TYPE_MAX + 2), 0x7FFF, 0xFFFF]:
        if t not in FIXED and t not in ARRAY:
            out.append(msg(t, 24))
            out.append(msg(t, HDR + 200))
    for t in FIXED:
        if t == T.HELLO_ACK:
            continue
        size = fixed_size(t)
        out += [msg(t, size - 1), msg(t, size + 1), msg(t, size + 8), msg(t, HDR)]
    for t, (cls, item, most, _) in ARRAY.items():
        fixed, isz = ctypes.sizeof(cls), ctypes.sizeof(item)
        over = fixed + (most + 1) * isz
        out += [
            msg(t, fixed - 1),
            msg(t, fixed, count=1),
            msg(t, fixed + isz, count=0),
            msg(t, fixed + isz - 1, count=1),
            msg(t, fixed + 2 * isz, count=1),
            msg(t, over if over <= P.MSG_MAX else fixed, count=most + 1),
            msg(t, fixed, count=0xFFFFFFFF),
            msg(t, fixed + isz, count=0x80000001),
        ]
    return [r[:HDR - 4] + (12345 + k).to_bytes(4, "little") + r[HDR:] if len(r) >= HDR else r
            for k, r in enumerate(out)]


def refused_in_handshake() -> list[bytes]:
    return [
        msg(T.ACK, ctypes.sizeof(P.Ack)),
        msg(T.PATCH, ctypes.sizeof(P.PatchBatch) + 1),    # state before length
        msg(T.HELLO_ACK, ctypes.sizeof(P.HelloAck) - 1),
        msg(T.BYE, ctypes.sizeof(P.Bye) + 1),
        msg(T.ERROR, ctypes.sizeof(P.Error) - 8),
        msg(T.HELLO, ctypes.sizeof(P.Hello)),
        msg(0, 24),
        msg(T.ACK, 24, version=1),
    ]


def accepted_in_session() -> list[tuple[bytes, T | None]]:
    """Datagrams a session goes on after, each with the type of its reply (None: no
    reply).  Their fields change nothing in the client: region 0, buffer 0, sites of
    length 0, empty ranges, no notices (CODE_BUFFER_REQ and SAMPLER_START, which
    would, are left out)."""
    def arr(t, count, **fields):
        cls, item, _, _ = ARRAY[t]
        return msg(t, ctypes.sizeof(cls) + count * ctypes.sizeof(item), count=count,
                   fields=fields)
    fixed = {t: msg(t, fixed_size(t), fields={"req_id": 40 + t}) for t in
             (T.CODE_BUFFER_FREE, T.REGION, T.REGION_FORGET, T.SAMPLER_STOP,
              T.FRAMES_ADD, T.FRAMES_DEL)}
    return [
        (msg(T.ACK, ctypes.sizeof(P.Ack)), None),
        (fixed[T.CODE_BUFFER_FREE], T.ACK),
        (fixed[T.REGION], T.ACK),
        (fixed[T.REGION_FORGET], T.ACK),
        (fixed[T.FRAMES_ADD], T.ACK),
        (fixed[T.FRAMES_DEL], T.ACK),
        (msg(T.SAMPLER_THREAD, ctypes.sizeof(P.SamplerThread),
             fields={"req_id": 5, "on": 2}), T.ACK),
        (msg(T.NOTICES, ctypes.sizeof(P.Notices), fields={"req_id": 6, "flags": 2}), T.ACK),
        (msg(T.NOTICES, ctypes.sizeof(P.Notices), fields={"req_id": 7}), T.ACK),
        (fixed[T.SAMPLER_STOP], T.ACK),
        (arr(T.PATCH, 0, batch_id=1), T.PATCH_RESULT),
        (arr(T.PATCH, 1, batch_id=2), T.PATCH_RESULT),
        (arr(T.PATCH, P.MAX_SITES, batch_id=3), T.PATCH_RESULT),
        (arr(T.UNPATCH, 0, batch_id=4), T.PATCH_RESULT),
        (arr(T.UNPATCH, P.MAX_SITES, batch_id=5), T.PATCH_RESULT),
        (arr(T.PC_CENSUS_REQ, 0, req_id=8, timeout_ms=100), T.PC_CENSUS),
        (arr(T.PC_CENSUS_REQ, P.MAX_CENSUS_RANGES, req_id=9), T.PC_CENSUS),
        (arr(T.TRANSFER, 0, req_id=10), T.TRANSFER_RESULT),
        (arr(T.TRANSFER, P.MAX_TRANSFER, req_id=11), T.TRANSFER_RESULT),
        (arr(T.EVICT, 1, req_id=12), T.TRANSFER_RESULT),
        (arr(T.EVICT, P.MAX_TRANSFER, req_id=13), T.TRANSFER_RESULT),
    ]


# ---- talking to the agent -----------------------------------------------------------

def answers(conn, until_eof: bool, timeout: float = 3.0) -> tuple[list[bytes], bool]:
    """The agent's datagrams (advisory ones and HELLO left out) until EOF, or (not
    until_eof) until the first; and whether the session closed."""
    sock: socket.socket = conn.sock
    got: list[bytes] = []
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            d = sock.recv(P.MSG_MAX + 1)
        except socket.timeout:
            break
        except OSError:
            return got, True
        if not d:
            return got, True
        mtype = struct.unpack_from("<H", d, 6)[0] if len(d) >= HDR else 0
        if mtype in ADVISORY or mtype == T.HELLO:
            continue
        got.append(d)
        if not until_eof:
            break
    return got, False


def error_of(d: bytes) -> tuple[int, int, str]:
    code, ref_seq = struct.unpack_from("<iI", d, HDR)
    text = d[HDR + 8:HDR + 8 + P.ERRMSG_MAX].split(b"\0")[0].decode()
    return (code, ref_seq, text)


@pytest.fixture(scope="module")
def agent():
    svc = FakeService()
    env = {"LD_PRELOAD": os.environ["DBR_TEST_AGENT"]} if os.environ.get("DBR_TEST_AGENT") \
        else None
    client = svc.spawn(["cat"], env=env)
    try:
        yield svc, client
    finally:
        svc.close()


def _refused(svc, client, raw: bytes, handshake: bool) -> None:
    want = expected(raw, handshake)
    assert want is not None
    conn = svc.accept(pid=client.pid, handshake=not handshake)
    try:
        conn.send_raw(raw)
        got, closed = answers(conn, until_eof=True)
    finally:
        conn.close()
    assert closed, f"session not closed after {raw[:32].hex()}"
    types = [struct.unpack_from("<H", d, 6)[0] for d in got]
    assert types == [T.ERROR], f"{raw[:32].hex()}: {types}"
    assert error_of(got[0]) == (int(want[0]), want[1], want[2]), raw[:32].hex()


def test_every_refusal_in_a_session(agent):
    svc, client = agent
    cases = refused_in_session()
    assert len(cases) > 80
    for raw in cases:
        _refused(svc, client, raw, handshake=False)
    assert client.proc.poll() is None


def test_refusals_before_hello_ack(agent):
    svc, client = agent
    session_case = refused_in_session()[0]
    for raw in refused_in_handshake():
        _refused(svc, client, raw, handshake=True)
        # a session that was established resets the agent's reconnect backoff
        _refused(svc, client, session_case, handshake=False)


@pytest.mark.parametrize("mtype", [T.BYE, T.ERROR])
def test_bye_or_error_before_hello_ack_ends_quietly(agent, mtype):
    svc, client = agent
    raw = msg(mtype, fixed_size(mtype))
    assert expected(raw, handshake=True) is None
    conn = svc.accept(pid=client.pid, handshake=False)
    try:
        conn.send_raw(raw)
        got, closed = answers(conn, until_eof=True)
    finally:
        conn.close()
    assert closed and got == []


def test_accepted_messages_get_their_reply(agent):
    svc, client = agent
    conn = svc.accept(pid=client.pid)
    try:
        for raw, reply in accepted_in_session():
            assert expected(raw, handshake=False) is None
            conn.send_raw(raw)
            got, closed = answers(conn, until_eof=False, timeout=0.3 if reply is None else 3)
            assert not closed, raw[:32].hex()
            types = [struct.unpack_from("<H", d, 6)[0] for d in got]
            assert types == ([] if reply is None else [reply]), (raw[:32].hex(), types)
        raw = msg(T.BYE, fixed_size(T.BYE))
        assert expected(raw, handshake=False) is None
        conn.send_raw(raw)
        got, closed = answers(conn, until_eof=True)
        assert closed and got == []
    finally:
        conn.close()
    assert client.proc.poll() is None


@pytest.mark.parametrize("flags,size", [(P.BUFFER_F_DATA, 0),
                                        (P.BUFFER_F_DATA, P.DATA_BUFFER_MAX + 1),
                                        (2, 4096), (0xFFFFFFFF, 4096)])
def test_code_buffer_req_flags_and_data_sizes_are_checked(agent, flags, size):
    """CODE_BUFFER_REQ's length rule is the table's; its flags and a data buffer's size
    are the handler's: an unknown flag or a data buffer of 0 or more than
    DATA_BUFFER_MAX bytes gets CODE_BUFFER with E_INVAL and no fd, and the session
    goes on."""
    svc, client = agent
    conn = svc.accept(pid=client.pid)
    try:
        raw = msg(T.CODE_BUFFER_REQ, fixed_size(T.CODE_BUFFER_REQ),
                  fields={"req_id": 77, "flags": flags, "near": 0x400000, "size": size})
        assert expected(raw, handshake=False) is None
        conn.send_raw(raw)
        got, closed = answers(conn, until_eof=False)
        assert not closed and len(got) == 1
        rep = P.CodeBuffer.from_buffer_copy(got[0])
        assert (rep.hdr.type, rep.req_id, rep.result) == (T.CODE_BUFFER, 77, P.Result.E_INVAL)
        assert "dbr-data" not in open(f"/proc/{client.pid}/maps").read()
    finally:
        conn.close()
    assert client.proc.poll() is None
