"""pprof's profile.proto, written and read by hand (no protobuf dependency): the
format Parca, Pyroscope and AutoFDO-style pipelines exchange.

Written: one sample type ``samples/count``; per module a Mapping (file name, build
id) at a base of its own, ``(index + 1) << 40``; per stored offset a Location at
base + offset, with a Function named from the module's symbols when the caller gives
names; a Sample per Location carrying the count (rounded).  A comment
``dbr.key MAPPING_ID KEY`` per mapping names the store key (modules without a build
id have none that pprof could carry).  Edges and hot text are not written: pprof has
no place for them (the JSON export has).

Read: what was written here, and any profile whose mappings carry a hex build id:
the counts of the sample type ``samples`` (or the only one) summed per mapping and
offset (address - memory_start + file_offset).  Input is bounded: the gzip stream is
inflated to at most MAX_PROFILE_BYTES, and messages beyond the limits are refused.
"""

from __future__ import annotations

import gzip
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field

from dbr_service.common.errors import DbrError
from dbr_service.profiles.modkey import ModuleKeyError, key_for_build_id, valid_key
from dbr_service.profiles.profiledata import MAX_OFFSET, MAX_OFFSETS, ModuleProfile

#: Inflated profile size read at most.
MAX_PROFILE_BYTES = 256 << 20
#: Mappings (modules) per profile read at most.
MAX_MAPPINGS = 100_000
MAPPING_SPAN = 1 << 40


class PprofError(DbrError):
    """A pprof file that is malformed or beyond the limits."""


# ------------------------------------------------------------------------------ writing
def _varint(n: int) -> bytes:
    if n < 0:
        n &= (1 << 64) - 1
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _int(field_no: int, n: int) -> bytes:
    return _varint(field_no << 3) + _varint(n) if n else b""


def _bytes(field_no: int, data: bytes) -> bytes:
    return _varint(field_no << 3 | 2) + _varint(len(data)) + data


class _Strings:
    def __init__(self) -> None:
        self.table: list[str] = [""]
        self.index: dict[str, int] = {"": 0}

    def __call__(self, s: str) -> int:
        if s not in self.index:
            self.index[s] = len(self.table)
            self.table.append(s)
        return self.index[s]


def encode(profiles: list[ModuleProfile],
           names: Mapping[str, Mapping[int, str]] | None = None) -> bytes:
    """The gzipped profile.proto of ``profiles``; ``names``: key -> offset -> function
    name, for the modules whose symbols are known."""
    s = _Strings()
    out = bytearray(_bytes(1, _int(1, s("samples")) + _int(2, s("count"))))
    mappings, locations, functions, comments = [], [], [], []
    loc_id = fn_id = 0
    fn_ids: dict[tuple[int, str], int] = {}
    for i, p in enumerate(profiles):
        mid, base = i + 1, (i + 1) * MAPPING_SPAN
        named = (names or {}).get(p.key, {})
        mappings.append(_bytes(3, _int(1, mid) + _int(2, base) + _int(3, base + MAPPING_SPAN)
                               + _int(5, s(p.path)) + _int(6, s(p.build_id))
                               + _int(7, 1 if named else 0)))
        comments.append(s(f"dbr.key {mid} {p.key}"))
        for off, count in sorted(p.counts.items()):
            value = round(count)
            if value <= 0:
                continue
            loc_id += 1
            line = b""
            if off in named:
                fk = (mid, named[off])
                if fk not in fn_ids:
                    fn_id += 1
                    fn_ids[fk] = fn_id
                    functions.append(_bytes(5, _int(1, fn_id) + _int(2, s(named[off]))
                                            + _int(3, s(named[off])) + _int(4, s(p.path))))
                line = _bytes(4, _int(1, fn_ids[fk]))
            locations.append((loc_id, value, _bytes(4, _int(1, loc_id) + _int(2, mid)
                                                    + _int(3, base + off) + line)))
    for lid, value, _ in locations:
        out += _bytes(2, _bytes(1, _varint(lid)) + _bytes(2, _varint(value)))
    for m in mappings:
        out += m
    for _, _, loc in locations:
        out += loc
    for f in functions:
        out += f
    for text in s.table:
        out += _bytes(6, text.encode())
    last = max((p.last_seen for p in profiles), default=0.0)
    out += _int(9, int(last * 1e9))
    out += _bytes(11, _int(1, s.index["samples"]) + _int(2, s.index["count"]))
    out += _int(12, 1)
    for c in comments:
        out += _int(13, c)
    return gzip.compress(bytes(out), mtime=0)


# ------------------------------------------------------------------------------ reading
def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    n = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise PprofError("truncated or overlong varint")
        b = data[pos]
        pos += 1
        n |= (b & 0x7F) << shift
        if not b & 0x80:
            return n, pos
        shift += 7


def fields(data: bytes) -> list[tuple[int, int | bytes]]:
    """The (field number, value) pairs of one message: ints for varints, bytes for
    length-delimited values; fixed32/64 are read as ints."""
    out: list[tuple[int, int | bytes]] = []
    pos = 0
    while pos < len(data):
        key, pos = _read_varint(data, pos)
        no, wire = key >> 3, key & 7
        if wire == 0:
            v, pos = _read_varint(data, pos)
            out.append((no, v))
        elif wire == 2:
            n, pos = _read_varint(data, pos)
            if pos + n > len(data):
                raise PprofError(f"field {no}: length {n} beyond the message")
            out.append((no, data[pos:pos + n]))
            pos += n
        elif wire in (1, 5):
            n = 8 if wire == 1 else 4
            if pos + n > len(data):
                raise PprofError(f"field {no}: truncated fixed value")
            out.append((no, int.from_bytes(data[pos:pos + n], "little")))
            pos += n
        else:
            raise PprofError(f"field {no}: wire type {wire} not supported")
    return out


def _ints(v: int | bytes) -> list[int]:
    """A repeated integer field's values, packed or not."""
    if isinstance(v, int):
        return [v]
    out, pos = [], 0
    while pos < len(v):
        n, pos = _read_varint(v, pos)
        out.append(n)
    return out


def _one(msg: bytes) -> dict[int, int | bytes]:
    return dict(fields(msg))


def inflate(data: bytes) -> bytes:
    """``data`` gunzipped (or as it is when not gzip), at most MAX_PROFILE_BYTES."""
    if data[:2] != b"\x1f\x8b":
        return data
    d = zlib.decompressobj(16 + zlib.MAX_WBITS)
    try:
        out = d.decompress(data, MAX_PROFILE_BYTES + 1)
    except zlib.error as exc:
        raise PprofError(f"not a gzip stream: {exc}") from None
    if len(out) > MAX_PROFILE_BYTES:
        raise PprofError(f"inflates to more than {MAX_PROFILE_BYTES} bytes")
    return out


@dataclass
class Decoded:
    """A decoded profile, as far as the store needs it."""

    strings: list[str]
    sample_types: list[tuple[str, str]]
    #: mapping id -> (memory_start, file_offset, filename, build_id)
    mappings: dict[int, tuple[int, int, str, str]]
    #: location id -> (mapping id, address)
    locations: dict[int, tuple[int, int]]
    #: (location ids, values) per sample
    samples: list[tuple[list[int], list[int]]]
    comments: list[str]
    time_nanos: int
    functions: dict[int, str] = field(default_factory=dict)
    #: location id -> function ids of its lines
    location_functions: dict[int, list[int]] = field(default_factory=dict)


def decode(data: bytes) -> Decoded:
    """Parse a (gzipped) profile.proto; PprofError if malformed."""
    top = fields(inflate(data))
    strings = []
    for no, v in top:
        if no == 6:
            if not isinstance(v, bytes):
                raise PprofError("string_table entry is not a string")
            strings.append(v.decode("utf-8", "replace"))

    def st(i: object) -> str:
        if not isinstance(i, int) or not 0 <= i < len(strings):
            raise PprofError(f"string index {i!r} out of range")
        return strings[i]

    out = Decoded(strings, [], {}, {}, [], [], 0)
    for no, v in top:
        if no in (1, 2, 3, 4, 5) and not isinstance(v, bytes):
            raise PprofError(f"field {no} is not a message")
        if no == 1:
            m = _one(v)
            out.sample_types.append((st(m.get(1, 0)), st(m.get(2, 0))))
        elif no == 2:
            locs: list[int] = []
            vals: list[int] = []
            for f, x in fields(v):
                (locs if f == 1 else vals if f == 2 else []).extend(_ints(x))
            out.samples.append((locs, [x - (1 << 64) if x >= 1 << 63 else x for x in vals]))
        elif no == 3:
            m = _one(v)
            if len(out.mappings) >= MAX_MAPPINGS:
                raise PprofError(f"more than {MAX_MAPPINGS} mappings")
            out.mappings[int(m.get(1, 0))] = (int(m.get(2, 0)), int(m.get(4, 0)),
                                              st(m.get(5, 0)), st(m.get(6, 0)))
        elif no == 4:
            fs = fields(v)
            m = dict(fs)
            out.locations[int(m.get(1, 0))] = (int(m.get(2, 0)), int(m.get(3, 0)))
            out.location_functions[int(m.get(1, 0))] = [
                int(_one(x).get(1, 0)) for f, x in fs if f == 4 and isinstance(x, bytes)]
        elif no == 5:
            m = _one(v)
            out.functions[int(m.get(1, 0))] = st(m.get(2, 0))
        elif no == 9 and isinstance(v, int):
            out.time_nanos = v
        elif no == 13:
            out.comments.extend(st(i) for i in _ints(v))
    return out


def to_profiles(d: Decoded, now: float) -> tuple[list[ModuleProfile], int]:
    """The module profiles (counts only) of a decoded profile, and how many mappings
    were left out (no build id, no dbr.key comment)."""
    if not d.sample_types:
        raise PprofError("no sample type")
    names = [t for t, _u in d.sample_types]
    vi = names.index("samples") if "samples" in names else 0 if len(names) == 1 else -1
    if vi < 0:
        raise PprofError(f"no sample type 'samples' among {names}")
    keys: dict[int, str] = {}
    for c in d.comments:
        parts = c.split()
        if len(parts) == 3 and parts[0] == "dbr.key" and parts[1].isdigit() \
                and valid_key(parts[2]):
            keys[int(parts[1])] = parts[2]
    skipped = 0
    for mid, (_start, _off, _name, build_id) in d.mappings.items():
        if mid not in keys:
            try:
                keys[mid] = key_for_build_id(build_id)
            except ModuleKeyError:
                skipped += 1
    counts: dict[int, dict[int, float]] = {}
    for locs, vals in d.samples:
        if not locs or vi >= len(vals) or vals[vi] <= 0:
            continue
        loc = d.locations.get(locs[0])
        if loc is None:
            raise PprofError(f"sample at unknown location {locs[0]}")
        mid, addr = loc
        if mid not in keys or mid not in d.mappings:
            continue
        start, file_off, _name, _bid = d.mappings[mid]
        off = addr - start + file_off
        if not 0 <= off < MAX_OFFSET:
            raise PprofError(f"location {locs[0]}: address {addr:#x} outside its mapping")
        per = counts.setdefault(mid, {})
        per[off] = per.get(off, 0.0) + vals[vi]
        if len(per) > MAX_OFFSETS:
            raise PprofError(f"mapping {mid}: more than {MAX_OFFSETS} offsets")
    when = min(d.time_nanos / 1e9, now) if d.time_nanos else now
    out = []
    for mid, per in counts.items():
        key = keys[mid]
        _s, _o, name, _bid = d.mappings[mid]
        out.append(ModuleProfile(key=key, path=name[:4096].replace("\0", ""),
                                 build_id=key if not key.startswith("path-") else "",
                                 runs=1, first_seen=when, last_seen=when, counts=per,
                                 edges={}, hot_text=[]))
    return out, skipped
