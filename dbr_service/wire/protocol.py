"""Python mirror of shared/dbr_protocol.h — keep in sync (tests/unit/test_protocol_layout.py).

Every struct of the header appears here as a ``ctypes.LittleEndianStructure`` with
the same field names, in the same order.  Variable-length messages (PATCH,
UNPATCH, PATCH_RESULT, PC_CENSUS_REQ, PC_CENSUS, TRANSFER, EVICT) are their fixed part
followed by ``n`` array entries; :func:`pack_array_msg` and :func:`unpack` handle them.
"""

from __future__ import annotations

import ctypes
import enum
from dataclasses import dataclass
from typing import Sequence, TypeVar

from dbr_service.common import paths
from dbr_service.common.errors import ProtocolError

__all__ = ["ProtocolError"]

PROTO_MAGIC = 0x31524244
PROTO_VERSION = 5

MSG_MAX = 65536
MAX_SITES = 512
MAX_CENSUS = 1024
MAX_CENSUS_RANGES = 64
MAX_EXITS = 32
MAX_TRANSFER = 2048
EXE_MAX = 256
BUILD_ID_MAX = 32
ERRMSG_MAX = 120
PATCH_LEN = 5
#: CODE_BUFFER_REQ flags: a read-write data buffer (counters), at most DATA_BUFFER_MAX
BUFFER_F_DATA = 1
DATA_BUFFER_MAX = 64 * 1024


class MsgType(enum.IntEnum):
    HELLO = 1
    HELLO_ACK = 2
    THREAD_NEW = 3
    THREAD_EXIT = 4
    MAP_CHANGED = 5
    ACK = 6
    CODE_BUFFER_REQ = 7
    CODE_BUFFER = 8
    CODE_BUFFER_FREE = 9
    REGION = 10
    REGION_FORGET = 11
    PATCH = 12
    UNPATCH = 13
    PATCH_RESULT = 14
    PC_CENSUS_REQ = 15
    PC_CENSUS = 16
    SAMPLER_START = 17
    SAMPLER_RING = 18
    SAMPLER_STOP = 19
    BYE = 20
    ERROR = 21
    TRANSFER = 22
    TRANSFER_RESULT = 23
    NOTICES = 24
    SAMPLER_THREAD = 25
    EVICT = 26
    FRAMES_ADD = 27
    FRAMES_DEL = 28


MSG_TYPE_MAX = 28


class Result(enum.IntEnum):
    OK = 0
    E_MISMATCH = -1
    E_NOT_EXEC = -2
    E_TARGET = -3
    E_BUSY = -4
    E_ALIGN = -5
    E_PROTECT = -6
    E_NOSYNC = -7
    E_INVAL = -8
    E_NOMEM = -9
    E_RANGE = -10
    E_VERSION = -11
    E_PROTO = -12
    E_NOT_PATCHED = -13
    E_TIMEOUT = -14
    E_IN_USE = -15
    E_FORBIDDEN = -16
    E_UNKNOWN = -17
    E_DENIED = -18
    E_LIMIT = -19
    E_INSIDE = -20


class Variant(enum.IntEnum):
    INT3 = 0
    SELF_BRANCH = 1
    SINGLE = 2


class MapKind(enum.IntEnum):
    DLCLOSE = 1
    MUNMAP = 2
    MPROTECT = 3
    DLOPEN = 4
    MMAP_EXEC = 5


HELLO_FORKED = 0x1
HELLO_SYNC_CORE = 0x2
HELLO_INHERITED = 0x4
HELLO_HIDDEN_THREAD = 0x8
HELLO_QUIET_THREADS = 0x10
HELLO_SAMPLER_LISTED = 0x20
HELLO_EVICT = 0x40
HELLO_FRAMES = 0x80
HELLO_ENTRY_SITES = 0x100
HELLO_ATTACHED = 0x200

#: dbr_patch_site.flags
SITE_F_ENTRY = 0x1

SAMPLER_LISTED = 0x1

NOTICE_THREADS = 0x1

DISCONNECT_KEEP = 0
DISCONNECT_REVERT = 1

BYE_REVERT = 0x1
BYE_DORMANT = 0x2

CENSUS_OK = 0
CENSUS_NO_REPLY = 1
CENSUS_AGENT = 2
CENSUS_GONE = 3
CENSUS_UNKNOWN = 4
CENSUS_F_ALTSTACK = 0x1
CENSUS_F_CAPPED = 0x2
CENSUS_F_NOSTACK = 0x4
CENSUS_F_REG = 0x8
CENSUS_MORE = 0x1

RING_MAGIC = 0x474E5252

u8, u16, u32, u64, i32 = (ctypes.c_uint8, ctypes.c_uint16, ctypes.c_uint32,
                          ctypes.c_uint64, ctypes.c_int32)


class _S(ctypes.LittleEndianStructure):
    """Base of every wire struct: bytes in, bytes out."""

    def to_bytes(self) -> bytes:
        return bytes(self)

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview):
        if len(data) < ctypes.sizeof(cls):
            raise ProtocolError(f"{cls.__name__}: {len(data)} bytes, need {ctypes.sizeof(cls)}")
        return cls.from_buffer_copy(bytes(data[: ctypes.sizeof(cls)]))


class MsgHdr(_S):
    _fields_ = [("magic", u32), ("version", u16), ("type", u16), ("length", u32), ("seq", u32)]


class Hello(_S):
    _fields_ = [("hdr", MsgHdr), ("pid", u32), ("ppid", u32), ("uid", u32), ("flags", u32),
                ("agent_version", u32), ("n_threads", u32), ("page_size", u32),
                ("census_signal", u32), ("build_id_len", u32), ("sampler_signal", u32),
                ("build_id", u8 * BUILD_ID_MAX), ("exe", ctypes.c_char * EXE_MAX)]


class HelloAck(_S):
    _fields_ = [("hdr", MsgHdr), ("service_pid", u32), ("on_disconnect", u32),
                ("session_id", u64), ("map_wait_ms", u32), ("flags", u32)]


class Thread(_S):
    _fields_ = [("hdr", MsgHdr), ("tid", u32), ("reserved", u32)]


class MapChanged(_S):
    _fields_ = [("hdr", MsgHdr), ("req_id", u32), ("kind", u32), ("lo", u64), ("hi", u64),
                ("prot", u32), ("reserved", u32)]


class Notices(_S):
    _fields_ = [("hdr", MsgHdr), ("req_id", u32), ("flags", u32)]


class Ack(_S):
    _fields_ = [("hdr", MsgHdr), ("req_id", u32), ("result", i32)]


class CodeBufferReq(_S):
    _fields_ = [("hdr", MsgHdr), ("req_id", u32), ("flags", u32), ("near", u64), ("size", u64)]


class CodeBuffer(_S):
    _fields_ = [("hdr", MsgHdr), ("req_id", u32), ("result", i32), ("buffer_id", u32),
                ("reserved", u32), ("base", u64), ("size", u64)]


class CodeBufferFree(_S):
    _fields_ = [("hdr", MsgHdr), ("req_id", u32), ("buffer_id", u32)]


class Range(_S):
    _fields_ = [("lo", u64), ("hi", u64)]


class Region(_S):
    _fields_ = [("hdr", MsgHdr), ("req_id", u32), ("region_id", u32), ("code_lo", u64),
                ("code_hi", u64), ("n_exits", u32), ("reserved", u32),
                ("exits", Range * MAX_EXITS)]


class RegionForget(_S):
    _fields_ = [("hdr", MsgHdr), ("req_id", u32), ("region_id", u32)]


class PatchSite(_S):
    _fields_ = [("site", u64), ("target", u64), ("region_id", u32), ("variant", u8),
                ("len", u8), ("flags", u8), ("inner", u8), ("orig", u8 * 8)]


class PatchBatch(_S):
    _fields_ = [("hdr", MsgHdr), ("batch_id", u32), ("n", u32)]


class SiteResult(_S):
    _fields_ = [("site", u64), ("result", i32), ("reserved", u32)]


class PatchResult(_S):
    _fields_ = [("hdr", MsgHdr), ("batch_id", u32), ("n", u32)]


class CensusReq(_S):
    _fields_ = [("hdr", MsgHdr), ("req_id", u32), ("timeout_ms", u32), ("n", u32),
                ("flags", u32)]


class CensusEntry(_S):
    _fields_ = [("tid", u32), ("state", u32), ("pc", u64), ("first_ref", u64), ("refs", u32),
                ("flags", u32)]


class Census(_S):
    _fields_ = [("hdr", MsgHdr), ("req_id", u32), ("n", u32), ("flags", u32), ("n_total", u32),
                ("result", i32), ("n_ranges", u32), ("range_refs", u32 * MAX_CENSUS_RANGES)]


class TransferPoint(_S):
    _fields_ = [("orig", u64), ("repl", u64)]


class Transfer(_S):
    _fields_ = [("hdr", MsgHdr), ("req_id", u32), ("region_id", u32), ("n", u32),
                ("timeout_ms", u32)]


class TransferResult(_S):
    _fields_ = [("hdr", MsgHdr), ("req_id", u32), ("result", i32), ("threads", u32),
                ("moved", u32), ("no_reply", u32), ("left", u32)]


class Frames(_S):
    _fields_ = [("hdr", MsgHdr), ("req_id", u32), ("region_id", u32), ("addr", u64),
                ("len", u64)]


class SamplerStart(_S):
    _fields_ = [("hdr", MsgHdr), ("req_id", u32), ("period_us", u32), ("ring_entries", u32),
                ("flags", u32)]


class SamplerThread(_S):
    _fields_ = [("hdr", MsgHdr), ("req_id", u32), ("tid", i32), ("on", u32), ("reserved", u32)]


class SamplerRing(_S):
    _fields_ = [("hdr", MsgHdr), ("req_id", u32), ("result", i32), ("ring_bytes", u64)]


class Bye(_S):
    _fields_ = [("hdr", MsgHdr), ("reason", u32), ("flags", u32)]


class Error(_S):
    _fields_ = [("hdr", MsgHdr), ("code", i32), ("ref_seq", u32),
                ("msg", ctypes.c_char * ERRMSG_MAX)]


class RingHeader(_S):
    _fields_ = [("magic", u32), ("version", u32), ("capacity", u32), ("entry_size", u32),
                ("head", u64), ("tail", u64), ("dropped", u64), ("in_kernel", u64),
                ("reserved", u64 * 2)]


class RingEntry(_S):
    _fields_ = [("pc", u64), ("tid", u32), ("seq", u32)]


# C struct name -> mirror class; the layout test walks this table.
C_STRUCTS: dict[str, type[_S]] = {
    "dbr_msg_hdr": MsgHdr, "dbr_hello": Hello, "dbr_hello_ack": HelloAck,
    "dbr_thread": Thread, "dbr_map_changed": MapChanged, "dbr_ack": Ack,
    "dbr_code_buffer_req": CodeBufferReq, "dbr_code_buffer": CodeBuffer,
    "dbr_code_buffer_free": CodeBufferFree, "dbr_range": Range, "dbr_region": Region,
    "dbr_region_forget": RegionForget, "dbr_patch_site": PatchSite,
    "dbr_patch_batch": PatchBatch, "dbr_site_result": SiteResult,
    "dbr_patch_result": PatchResult, "dbr_census_req": CensusReq,
    "dbr_census_entry": CensusEntry, "dbr_census": Census,
    "dbr_transfer_point": TransferPoint, "dbr_transfer": Transfer,
    "dbr_transfer_result": TransferResult, "dbr_notices": Notices,
    "dbr_sampler_start": SamplerStart, "dbr_sampler_ring": SamplerRing,
    "dbr_sampler_thread": SamplerThread, "dbr_frames": Frames, "dbr_bye": Bye,
    "dbr_error": Error, "dbr_ring_header": RingHeader, "dbr_ring_entry": RingEntry,
}

# C #define / enum constant -> Python value; the layout test checks each one too.
C_CONSTANTS: dict[str, int] = {
    "DBR_PROTO_MAGIC": PROTO_MAGIC, "DBR_PROTO_VERSION": PROTO_VERSION,
    "DBR_MSG_MAX": MSG_MAX, "DBR_MAX_SITES": MAX_SITES, "DBR_MAX_CENSUS": MAX_CENSUS,
    "DBR_MAX_CENSUS_RANGES": MAX_CENSUS_RANGES,
    "DBR_MAX_EXITS": MAX_EXITS, "DBR_MAX_TRANSFER": MAX_TRANSFER, "DBR_EXE_MAX": EXE_MAX,
    "DBR_BUILD_ID_MAX": BUILD_ID_MAX,
    "DBR_ERRMSG_MAX": ERRMSG_MAX, "DBR_PATCH_LEN": PATCH_LEN,
    "DBR_BUFFER_F_DATA": BUFFER_F_DATA, "DBR_DATA_BUFFER_MAX": DATA_BUFFER_MAX,
    "DBR_MSG_TYPE_MAX": MSG_TYPE_MAX,
    "DBR_HELLO_FORKED": HELLO_FORKED, "DBR_HELLO_SYNC_CORE": HELLO_SYNC_CORE,
    "DBR_HELLO_INHERITED": HELLO_INHERITED, "DBR_HELLO_HIDDEN_THREAD": HELLO_HIDDEN_THREAD,
    "DBR_HELLO_QUIET_THREADS": HELLO_QUIET_THREADS, "DBR_NOTICE_THREADS": NOTICE_THREADS,
    "DBR_HELLO_SAMPLER_LISTED": HELLO_SAMPLER_LISTED, "DBR_SAMPLER_LISTED": SAMPLER_LISTED,
    "DBR_HELLO_EVICT": HELLO_EVICT, "DBR_HELLO_FRAMES": HELLO_FRAMES,
    "DBR_HELLO_ENTRY_SITES": HELLO_ENTRY_SITES, "DBR_SITE_F_ENTRY": SITE_F_ENTRY,
    "DBR_HELLO_ATTACHED": HELLO_ATTACHED,
    "DBR_DISCONNECT_KEEP": DISCONNECT_KEEP,
    "DBR_DISCONNECT_REVERT": DISCONNECT_REVERT, "DBR_BYE_REVERT": BYE_REVERT,
    "DBR_BYE_DORMANT": BYE_DORMANT,
    "DBR_CENSUS_OK": CENSUS_OK, "DBR_CENSUS_NO_REPLY": CENSUS_NO_REPLY,
    "DBR_CENSUS_AGENT": CENSUS_AGENT, "DBR_CENSUS_GONE": CENSUS_GONE,
    "DBR_CENSUS_UNKNOWN": CENSUS_UNKNOWN, "DBR_CENSUS_F_ALTSTACK": CENSUS_F_ALTSTACK,
    "DBR_CENSUS_F_CAPPED": CENSUS_F_CAPPED, "DBR_CENSUS_F_NOSTACK": CENSUS_F_NOSTACK,
    "DBR_CENSUS_F_REG": CENSUS_F_REG,
    "DBR_CENSUS_MORE": CENSUS_MORE, "DBR_RING_MAGIC": RING_MAGIC,
    "DBR_QUIET_DEFAULT_MS": paths.QUIET_DEFAULT_MS, "DBR_QUIET_MAX_MS": paths.QUIET_MAX_MS,
    **{f"DBR_MSG_{m.name}": m.value for m in MsgType},
    **{f"DBR_{r.name}": r.value for r in Result},
    **{f"DBR_VARIANT_{v.name}": v.value for v in Variant},
    **{f"DBR_MAP_{k.name}": k.value for k in MapKind},
}

# Fixed-part class of each message type, for decoding.
MSG_CLASS: dict[MsgType, type[_S]] = {
    MsgType.HELLO: Hello, MsgType.HELLO_ACK: HelloAck, MsgType.THREAD_NEW: Thread,
    MsgType.THREAD_EXIT: Thread, MsgType.MAP_CHANGED: MapChanged, MsgType.ACK: Ack,
    MsgType.CODE_BUFFER_REQ: CodeBufferReq, MsgType.CODE_BUFFER: CodeBuffer,
    MsgType.CODE_BUFFER_FREE: CodeBufferFree, MsgType.REGION: Region,
    MsgType.REGION_FORGET: RegionForget, MsgType.PATCH: PatchBatch,
    MsgType.UNPATCH: PatchBatch, MsgType.PATCH_RESULT: PatchResult,
    MsgType.PC_CENSUS_REQ: CensusReq, MsgType.PC_CENSUS: Census,
    MsgType.SAMPLER_START: SamplerStart, MsgType.SAMPLER_RING: SamplerRing,
    MsgType.SAMPLER_STOP: Ack, MsgType.BYE: Bye, MsgType.ERROR: Error,
    MsgType.TRANSFER: Transfer, MsgType.TRANSFER_RESULT: TransferResult, MsgType.EVICT: Transfer,
    MsgType.NOTICES: Notices, MsgType.SAMPLER_THREAD: SamplerThread,
    MsgType.FRAMES_ADD: Frames, MsgType.FRAMES_DEL: Frames,
}

# Array element class of the variable-length messages.
MSG_ARRAY: dict[MsgType, type[_S]] = {
    MsgType.PATCH: PatchSite, MsgType.UNPATCH: PatchSite,
    MsgType.PATCH_RESULT: SiteResult, MsgType.PC_CENSUS: CensusEntry,
    MsgType.PC_CENSUS_REQ: Range, MsgType.TRANSFER: TransferPoint,
    MsgType.EVICT: TransferPoint,
}

# Most array entries a message of each variable-length type may carry.
MSG_ARRAY_MAX: dict[MsgType, int] = {
    MsgType.PATCH: MAX_SITES, MsgType.UNPATCH: MAX_SITES, MsgType.PATCH_RESULT: MAX_SITES,
    MsgType.PC_CENSUS: MAX_CENSUS, MsgType.PC_CENSUS_REQ: MAX_CENSUS_RANGES,
    MsgType.TRANSFER: MAX_TRANSFER,
    MsgType.EVICT: MAX_TRANSFER,
}

#: Bounds of HELLO's informational fields (hello_problem).
SIGNAL_MAX = 64          # SIGRTMAX on Linux
THREADS_MAX = 1 << 22    # PID_MAX_LIMIT
PAGE_SIZE_MAX = 1 << 30

T = TypeVar("T", bound=_S)


def make_hdr(msg_type: MsgType, length: int, seq: int) -> MsgHdr:
    return MsgHdr(magic=PROTO_MAGIC, version=PROTO_VERSION, type=int(msg_type),
                  length=length, seq=seq)


def pack(msg: _S, msg_type: MsgType, seq: int) -> bytes:
    """Fill in ``msg.hdr`` for a fixed-size message and return its bytes."""
    msg.hdr = make_hdr(msg_type, ctypes.sizeof(msg), seq)
    return bytes(msg)


def pack_array_msg(fixed: _S, msg_type: MsgType, items: Sequence[_S], seq: int) -> bytes:
    """A variable-length message: the fixed part (its ``n`` set here) then the items."""
    fixed.n = len(items)
    length = ctypes.sizeof(fixed) + sum(ctypes.sizeof(i) for i in items)
    fixed.hdr = make_hdr(msg_type, length, seq)
    return bytes(fixed) + b"".join(bytes(i) for i in items)


@dataclass
class Message:
    """A decoded message: its type, fixed part, and array entries (if any)."""

    type: MsgType
    seq: int
    body: _S
    items: list[_S]
    raw: bytes


def parse_hdr(data: bytes) -> MsgHdr:
    """Check magic, version, length and type; raise ProtocolError otherwise."""
    if len(data) < ctypes.sizeof(MsgHdr):
        raise ProtocolError(f"truncated message: {len(data)} bytes")
    if len(data) > MSG_MAX:
        raise ProtocolError(f"datagram of {len(data)} bytes > {MSG_MAX}")
    hdr = MsgHdr.from_bytes(data)
    if hdr.magic != PROTO_MAGIC:
        raise ProtocolError(f"bad magic {hdr.magic:#x}")
    if hdr.version != PROTO_VERSION:
        raise ProtocolError(f"protocol version {hdr.version}, expected {PROTO_VERSION}")
    if hdr.length != len(data):
        raise ProtocolError(f"length field {hdr.length} != datagram size {len(data)}")
    if not 1 <= hdr.type <= MSG_TYPE_MAX:
        raise ProtocolError(f"unknown message type {hdr.type}")
    return hdr


def unpack(data: bytes) -> Message:
    """Decode one datagram into a Message, validating every length."""
    hdr = parse_hdr(data)
    mtype = MsgType(hdr.type)
    cls = MSG_CLASS[mtype]
    fixed = ctypes.sizeof(cls)
    item_cls = MSG_ARRAY.get(mtype)
    if item_cls is None:
        if len(data) != fixed:
            raise ProtocolError(f"{mtype.name}: {len(data)} bytes, expected {fixed}")
        body = cls.from_bytes(data)
        if mtype is MsgType.REGION and body.n_exits > MAX_EXITS:
            raise ProtocolError(f"REGION: n_exits={body.n_exits} > {MAX_EXITS}")
        return Message(mtype, hdr.seq, body, [], bytes(data))
    if len(data) < fixed:
        raise ProtocolError(f"{mtype.name}: truncated fixed part")
    body = cls.from_bytes(data)
    isz = ctypes.sizeof(item_cls)
    if body.n > MSG_ARRAY_MAX[mtype]:
        raise ProtocolError(f"{mtype.name}: n={body.n} > {MSG_ARRAY_MAX[mtype]}")
    if len(data) != fixed + body.n * isz:
        raise ProtocolError(f"{mtype.name}: n={body.n} does not match {len(data)} bytes")
    items = [item_cls.from_bytes(data[fixed + k * isz: fixed + (k + 1) * isz])
             for k in range(body.n)]
    return Message(mtype, hdr.seq, body, items, bytes(data))


def hello_problem(h: Hello) -> str | None:
    """Why a HELLO's fields are out of bounds (a hostile or broken agent), None if
    they are not.  The exe must be NUL-terminated within EXE_MAX."""
    if h.build_id_len > BUILD_ID_MAX:
        return f"build_id_len {h.build_id_len} > {BUILD_ID_MAX}"
    if h.page_size & (h.page_size - 1) or not 4096 <= h.page_size <= PAGE_SIZE_MAX:
        return f"page_size {h.page_size}"
    if h.n_threads > THREADS_MAX:
        return f"n_threads {h.n_threads} > {THREADS_MAX}"
    for name in ("census_signal", "sampler_signal"):
        if getattr(h, name) > SIGNAL_MAX:
            return f"{name} {getattr(h, name)} > {SIGNAL_MAX}"
    if b"\0" not in bytes(h)[Hello.exe.offset:Hello.exe.offset + EXE_MAX]:
        return "exe is not NUL-terminated"
    return None
