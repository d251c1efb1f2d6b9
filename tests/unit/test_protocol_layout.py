"""The Python mirror of shared/dbr_protocol.h has the same sizes, offsets and constants."""

from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

import pytest

from dbr_service.wire import protocol

ROOT = Path(__file__).resolve().parents[2]
HEADER = ROOT / "shared" / "dbr_protocol.h"


def _probe_source() -> str:
    lines = ["#include <stdio.h>", "#include <stddef.h>", f'#include "{HEADER}"',
             "int main(void) {"]
    for cname, cls in protocol.C_STRUCTS.items():
        lines.append(f'printf("size {cname} %zu\\n", sizeof(struct {cname}));')
        for fname, *_ in cls._fields_:
            lines.append(f'printf("off {cname}.{fname} %zu\\n", '
                         f'offsetof(struct {cname}, {fname}));')
    for const in protocol.C_CONSTANTS:
        lines.append(f'printf("const {const} %lld\\n", (long long)({const}));')
    lines += ["return 0;", "}"]
    return "\n".join(lines)


@pytest.fixture(scope="module")
def probe_output(tmp_path_factory) -> dict[str, int]:
    d = tmp_path_factory.mktemp("probe")
    src, exe = d / "probe.c", d / "probe"
    src.write_text(_probe_source())
    subprocess.run(["gcc", "-std=gnu11", "-Wall", "-Werror", "-o", str(exe), str(src)], check=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    result = {}
    for line in out.splitlines():
        kind, key, value = line.split()
        result[f"{kind} {key}"] = int(value)
    return result


@pytest.mark.parametrize("cname", sorted(protocol.C_STRUCTS))
def test_struct_layout(probe_output, cname):
    cls = protocol.C_STRUCTS[cname]
    assert ctypes.sizeof(cls) == probe_output[f"size {cname}"], cname
    for fname, *_ in cls._fields_:
        assert getattr(cls, fname).offset == probe_output[f"off {cname}.{fname}"], (cname, fname)


def test_constants(probe_output):
    for const, value in protocol.C_CONSTANTS.items():
        assert probe_output[f"const {const}"] == value, const


def test_every_header_struct_is_mirrored():
    import re

    names = set(re.findall(r"^struct (dbr_\w+) \{", HEADER.read_text(), re.M))
    assert names == set(protocol.C_STRUCTS), names ^ set(protocol.C_STRUCTS)


def test_roundtrip_array_message():
    sites = [protocol.PatchSite(site=0x401000 + 8 * k, target=0x7F0000000000, region_id=k,
                                variant=protocol.Variant.INT3, len=5) for k in range(3)]
    raw = protocol.pack_array_msg(protocol.PatchBatch(batch_id=7), protocol.MsgType.PATCH,
                                  sites, seq=9)
    msg = protocol.unpack(raw)
    assert msg.type is protocol.MsgType.PATCH and msg.body.batch_id == 7 and msg.seq == 9
    assert [s.site for s in msg.items] == [0x401000, 0x401008, 0x401010]


def test_census_request_carries_ranges_and_entries_report_stack_words():
    """PC_CENSUS_REQ is an array message of ranges (at most MAX_CENSUS_RANGES); a census
    entry reports the words found in them, and a message of MAX_CENSUS entries with its
    per-range totals fits in a datagram."""
    ranges = [protocol.Range(lo=0x7F0000000000 + 0x1000 * k, hi=0x7F0000000800 + 0x1000 * k)
              for k in range(protocol.MAX_CENSUS_RANGES)]
    raw = protocol.pack_array_msg(protocol.CensusReq(req_id=3, timeout_ms=100),
                                  protocol.MsgType.PC_CENSUS_REQ, ranges, seq=1)
    assert len(raw) == 32 + 16 * protocol.MAX_CENSUS_RANGES
    msg = protocol.unpack(raw)
    assert msg.body.n == protocol.MAX_CENSUS_RANGES and msg.body.timeout_ms == 100
    assert [(r.lo, r.hi) for r in msg.items] == [(r.lo, r.hi) for r in ranges]
    too_many = protocol.pack_array_msg(protocol.CensusReq(req_id=3), protocol.MsgType.PC_CENSUS_REQ,
                                       ranges + ranges[:1], seq=2)
    with pytest.raises(protocol.ProtocolError):
        protocol.unpack(too_many)
    assert ctypes.sizeof(protocol.CensusEntry) == 32
    body = protocol.Census(req_id=3, n_total=protocol.MAX_CENSUS, n_ranges=2)
    body.range_refs[1] = 5
    entries = [protocol.CensusEntry(tid=k + 1, state=protocol.CENSUS_OK, pc=0x401000,
                                    first_ref=0x7F0000001010, refs=1)
               for k in range(protocol.MAX_CENSUS)]
    raw = protocol.pack_array_msg(body, protocol.MsgType.PC_CENSUS, entries, seq=4)
    assert len(raw) <= protocol.MSG_MAX
    msg = protocol.unpack(raw)
    assert msg.body.range_refs[1] == 5 and msg.items[-1].first_ref == 0x7F0000001010


@pytest.mark.parametrize("mutate, why", [
    (lambda b: b[:10], "truncated"),
    (lambda b: b"\0\0\0\0" + b[4:], "magic"),
    (lambda b: b[:4] + (protocol.PROTO_VERSION + 1).to_bytes(2, "little") + b[6:], "version"),
    (lambda b: b[:4] + (protocol.PROTO_VERSION - 1).to_bytes(2, "little") + b[6:],
     "older version"),
    (lambda b: b[:6] + b"\x63\x00" + b[8:], "type"),
    (lambda b: b + b"\0" * 8, "length"),
])
def test_unpack_rejects_bad_input(mutate, why):
    raw = protocol.pack(protocol.Ack(req_id=1, result=0), protocol.MsgType.ACK, seq=1)
    with pytest.raises(protocol.ProtocolError):
        protocol.unpack(mutate(raw))


def test_quiet_file_name_and_parsing_match_the_agent(tmp_path):
    """The agent's quiet start (shared/dbr_protocol.h): the hint file's name, and the
    Python reading of DBR_AGENT_QUIET_MS and of the file, as the agent reads them
    (util.c, dbr_parse_ms: digits after blanks, one newline at most, capped)."""
    import os
    import re

    from dbr_service.common import paths

    m = re.search(r'^#define DBR_QUIET_FILE\s+"([^"]+)"', HEADER.read_text(), re.M)
    assert m and m.group(1) == paths.QUIET_FILE
    cases = {"0": 0, "12": 12, " \t7\n": 7, "99999999999999999999": paths.QUIET_MAX_MS,
             "": None, "+3": None, "-1": None, "12x": None, "1 2": None, "0\n\n": None,
             "\n": None}
    assert {k: paths.parse_ms(k) for k in cases} == cases
    env = {"DBR_AGENT_QUIET_MS": "7"}
    assert paths.agent_quiet({}, None)[0] == paths.QUIET_DEFAULT_MS
    assert paths.agent_quiet({}, tmp_path)[0] == paths.QUIET_DEFAULT_MS   # no file
    (tmp_path / paths.QUIET_FILE).write_text("20\n")
    # planned: made at 20 ms, running
    assert paths.agent_quiet({}, tmp_path) == (20, True, False)
    assert paths.agent_quiet(env, tmp_path) == (7, False, False)
    assert paths.agent_quiet({"DBR_AGENT_QUIET_MS": "soon"}, tmp_path)[0] == 20
    (tmp_path / paths.QUIET_FILE).write_text("later\n")
    assert paths.agent_quiet({}, tmp_path)[0] == paths.QUIET_DEFAULT_MS
    assert [paths.quiet_hint_ms(a) for a in (0.0, 0.02, 0.05, 1.0, -1.0, 60.0)] == \
        [0, 20, 50, 1000, 0, paths.QUIET_MAX_MS]
    # a program's later birth (daemon/shortruns.py): the agent forms the name with
    # DBR_QUIET_PROGRAM from stat("/proc/self/exe"), the service with program_key
    m = re.search(r'^#define DBR_QUIET_PROGRAM\s+DBR_QUIET_FILE\s+"([^"]+)"',
                  HEADER.read_text(), re.M)
    assert m and m.group(1) == ".%lx-%lx-%llx"
    def stat(dev, ino, mtime_ns):    # st_mtime_ns is the 15th field (index 14)
        return os.stat_result((0o755, ino, dev, 1, 0, 0, 10, 0, 0, 0,
                               0.0, 0.0, 0.0, 0, mtime_ns, 0))

    st = stat(0xfd01, 0x1234, 1_700_000_000_999_999_999)
    assert st.st_mtime_ns == 1_700_000_000_999_999_999
    assert paths.program_quiet_file(paths.program_key(st)) == \
        paths.QUIET_FILE + ".fd01-1234-%x" % 1_700_000_000
    before_1970 = stat(2, 1, -1)    # 1 ns before: tv_sec -1, tv_nsec 999999999
    assert paths.program_key(before_1970) == "2-1-ffffffffffffffff"   # tv_sec -1 as %llx


def test_entry_site_record():
    """An entry site (SITE_F_ENTRY) names its inner boundaries as bits 1..4 of `inner`,
    in the bytes that were `reserved` before protocol 4; the size is unchanged."""
    from dbr_service.wire.agentconn import make_site, site_inner

    assert ctypes.sizeof(protocol.PatchSite) == 32
    s = make_site(0x401000, 0x7F0000000000, bytes.fromhex("554889e548"),
                  inner=[0x401001, 0x401004])
    assert (s.flags, s.inner) == (protocol.SITE_F_ENTRY, 0b10010)
    assert site_inner(s) == [0x401001, 0x401004]
    raw = protocol.pack_array_msg(protocol.PatchBatch(batch_id=1), protocol.MsgType.PATCH,
                                  [s], seq=1)
    back = protocol.unpack(raw).items[0]
    assert (back.flags, back.inner) == (protocol.SITE_F_ENTRY, 0b10010)
    plain = make_site(0x401000, 0x7F0000000000, bytes(5))
    assert (plain.flags, plain.inner) == (0, 0) and site_inner(plain) == []
    with pytest.raises(Exception):
        make_site(0x401000, 0x7F0000000000, bytes(5), inner=[0x401000])
    with pytest.raises(Exception):
        make_site(0x401000, 0x7F0000000000, bytes(5), variant=protocol.Variant.SELF_BRANCH,
                  inner=[0x401001])
    assert protocol.Result.E_INSIDE == -20 and protocol.PROTO_VERSION >= 4


def test_data_buffer_request():
    """A data buffer is asked for with DBR_BUFFER_F_DATA in the bytes of
    CODE_BUFFER_REQ that were `reserved` before protocol 5; the size is unchanged."""
    assert protocol.PROTO_VERSION >= 5 and ctypes.sizeof(protocol.CodeBufferReq) == 40
    raw = protocol.pack(protocol.CodeBufferReq(req_id=3, flags=protocol.BUFFER_F_DATA,
                                               near=0x401000, size=4096),
                        protocol.MsgType.CODE_BUFFER_REQ, seq=1)
    back = protocol.unpack(raw).body
    assert (back.flags, back.size) == (protocol.BUFFER_F_DATA, 4096)
