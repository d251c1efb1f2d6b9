"""Data buffers (CODE_BUFFER_REQ with DBR_BUFFER_F_DATA): counters that replacement
code increments and the service reads.  The agent maps them read-write and never
executable within reach of the code they serve, refuses bad sizes and flags, never
takes them for code (patch targets), and refuses to free one while code that may
address it is mapped; the service's view of one goes with the session."""

from __future__ import annotations

import time

import pytest

from dbr_service.wire import protocol as P
from dbr_service.common.errors import AgentError
from harness import SITE_INSN, assemble, compile_c, exit_stub, patch_sites, read_mem


@pytest.fixture(scope="module")
def storm_exe():
    return compile_c(["storm.c"])


def _start(svc, exe, *args: str):
    from harness import parse_sites
    client = svc.spawn([exe, *args])
    sites = parse_sites(client.out.expect("sites"))
    client.out.expect("ready")
    return client, svc.accept(pid=client.pid), sites


def _perms(pid: int, base: int) -> str:
    for line in open(f"/proc/{pid}/maps"):
        if int(line.split("-")[0], 16) == base:
            return line.split()[1]
    return ""


def _own_maps_with(name: str) -> int:
    return sum(name in line for line in open("/proc/self/maps"))


def test_data_buffer_is_rw_near_its_code_and_counts_what_code_runs(svc, storm_exe):
    """A counting stub (lock inc of a data-buffer counter, the site's instruction,
    jmp back) runs in every thread; the service reads the count through its own
    mapping, and it never exceeds the calls the program made through that site."""
    client, conn, sites = _start(svc, storm_exe, "2")
    site = sites[0]
    data = conn.code_buffer(near=site, size=64, flags=P.BUFFER_F_DATA)
    assert data.size == 4096
    assert _perms(client.pid, data.base).startswith("rw-"), _perms(client.pid, data.base)
    assert abs(data.base - site) < 2**31 and abs(data.base + data.size - site) < 2**31
    code = conn.code_buffer(near=site, size=4096)
    assert _perms(client.pid, code.base).startswith("r-x")
    counter = data.base + 8
    stub = assemble(f"lock inc qword ptr [{counter:#x}]", code.base)
    code.write(code.base, stub)
    exit_stub(code, code.base + len(stub), site)
    ps = patch_sites(conn, client.pid, {site: code.base})
    assert conn.patch(ps) == [P.Result.OK]
    seen = []
    deadline = time.monotonic() + 10
    while len(set(seen)) < 3 and time.monotonic() < deadline:
        seen.append(data.read_u64(counter))
        time.sleep(0.05)
    assert len(set(seen)) >= 3 and seen == sorted(seen), seen
    assert conn.unpatch(ps) == [P.Result.OK]
    assert data.read_u64(data.base) == 0           # only its own slot was written
    assert data.read_u64(counter + 1) is None       # unaligned: not a counter
    rc, rest = client.finish()
    assert rc == 0, client.err.lines
    calls = int(rest[-1].split("=")[1])
    assert 0 < data.read_u64(counter) <= calls // 8   # storm calls its 8 sites in turn


def test_data_buffer_is_never_code_and_outlives_no_code_that_may_address_it(svc, storm_exe):
    client, conn, sites = _start(svc, storm_exe, "1")
    originals = {s: read_mem(client.pid, s, 8) for s in sites}
    data = conn.code_buffer(near=sites[0], size=4096, flags=P.BUFFER_F_DATA)
    # a patch into a data buffer is refused: it is not code
    bad = patch_sites(conn, client.pid, {sites[0]: data.base})
    assert conn.patch(bad) == [P.Result.E_TARGET]
    assert read_mem(client.pid, sites[0], 8) == originals[sites[0]]
    code = conn.code_buffer(near=sites[0], size=4096)
    exit_stub(code, code.base, sites[0], SITE_INSN)
    # code within reach may address the counters: the data buffer stays meanwhile
    assert conn.free_buffer(data.buffer_id) == P.Result.E_IN_USE
    assert _perms(client.pid, data.base).startswith("rw-")
    assert conn.free_buffer(code.buffer_id) == P.Result.OK
    assert conn.free_buffer(data.buffer_id) == P.Result.OK
    assert _perms(client.pid, data.base) == ""
    assert data.buffer_id not in conn.data_buffers and data.mem.closed
    rc, _ = client.finish()
    assert rc == 0


@pytest.mark.parametrize("flags,size", [
    (P.BUFFER_F_DATA, 0),
    (P.BUFFER_F_DATA, P.DATA_BUFFER_MAX + 1),
    (P.BUFFER_F_DATA, 1 << 30),
    (2, 4096),
    (P.BUFFER_F_DATA | 0x80000000, 4096),
])
def test_bad_data_buffer_requests_are_refused(svc, storm_exe, flags, size):
    """Refused by the agent with E_INVAL (nothing mapped), and by the service's checked
    connection before it asks."""
    client, conn, sites = _start(svc, storm_exe, "1")
    before = open(f"/proc/{client.pid}/maps").read().count("dbr-data")
    with pytest.raises(AgentError, match="E_INVAL"):
        conn.code_buffer(near=sites[0], size=size, flags=flags)
    assert open(f"/proc/{client.pid}/maps").read().count("dbr-data") == before
    assert not conn.data_buffers and not conn.buffers
    rc, _ = client.finish()
    assert rc == 0


def test_service_mapping_goes_with_the_session(svc, storm_exe):
    """When the client is gone the session's connection closes, and with it the
    service's own mapping of every data buffer (no memfd of an ended client stays
    mapped in the service)."""
    client, conn, sites = _start(svc, storm_exe, "1")
    had = _own_maps_with("dbr-data")
    data = conn.code_buffer(near=sites[0], size=4096, flags=P.BUFFER_F_DATA)
    assert _own_maps_with("dbr-data") == had + 1
    rc, _ = client.finish()
    assert rc == 0
    conn.close()
    assert data.mem.closed and data.read_u64(data.base) is None
    assert _own_maps_with("dbr-data") == had
