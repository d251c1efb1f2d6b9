"""FRAMES_ADD / FRAMES_DEL: unwinders go through replacement code (shared/dbr_protocol.h).

``frames`` (tests/agent_progs/frames.cpp) has caller() -> copyme() -> thrower(), which
backtraces and throws an int that caller catches.  The test copies copyme into a code
buffer (codegen/cfi.translate makes the copy's .eh_frame blob, written after the code),
patches copyme's entry with a jump to the copy and names the blob with FRAMES_ADD: the
throw passes through the copy's frame, and the backtrace goes on past it to caller.
Withdrawn (FRAMES_DEL), the same throw finds no frame for the copy and the C++ runtime
aborts: each throw is run in a fork child, which keeps the parent's
registrations as the test shows first.
"""

from __future__ import annotations

import signal

import pytest

from dbr_service.wire import protocol as P
from dbr_service.codegen.cfi import load_eh_frame, translate
from dbr_service.codegen.frames import records_len
from harness import FakeService, compile_c, patch_sites, read_mem, relocate_copy, symbols

REGION = 7


@pytest.fixture(scope="module")
def exe():
    return compile_c(["frames.cpp"], cc="g++")


def start(svc: FakeService, exe):
    client = svc.spawn([exe])
    copyme = int(client.out.expect("copyme").split()[1], 16)
    client.out.expect("ready")
    conn = svc.accept(pid=client.pid)
    syms = symbols(exe)
    bias = copyme - syms["copyme"][0]
    fde = load_eh_frame(str(exe)).find(syms["copyme"][0])
    buf = conn.code_buffer(near=copyme, size=8192)
    at = buf.base + 0x100
    layout = [(at, at + fde.end - fde.start, fde.start)]
    code = relocate_copy(fde, layout, bias)
    blob_at = (at + len(code) + 7) & ~7
    blob = translate(fde, layout, blob_at, bias=bias)
    buf.write(at, code)
    buf.write(blob_at, blob.data)
    length = records_len(blob.data)      # translate puts LSDAs after the terminator
    caller = tuple(a + bias for a in syms["caller"])
    return client, conn, buf, at, len(code), blob_at, length, copyme, caller


def call(client, cmd: str) -> tuple[list[int], str]:
    client.send(cmd)
    frames = []
    while True:
        line = client.out.expect("")
        if line.startswith("frame "):
            frames.append(int(line.split()[1], 16))
        elif line.startswith(("result", "child")):
            return frames, line


def test_throw_and_backtrace_go_through_a_registered_copy(svc, exe):
    client, conn, buf, at, n, blob_at, length, copyme, (clo, chi) = start(svc, exe)
    assert conn.region(REGION, at, at + n, []) == P.Result.OK
    site = patch_sites(conn, client.pid, {copyme: at})
    assert conn.patch(site) == [P.Result.OK]

    # registered: the throw reaches caller's catch through the copy's frame
    assert conn.frames(True, REGION, blob_at, length) == P.Result.OK
    for x, want in ((5, -5), (1, -4)):
        frames, res = call(client, f"call {x}")
        assert res == f"result {want}", (frames, res)
        assert any(at <= f <= at + n for f in frames), [hex(f) for f in frames]
        assert any(clo <= f < chi for f in frames), [hex(f) for f in frames]
    # a fork child keeps the registration
    frames, res = call(client, "fork 5")
    assert res == "result -5" and any(clo <= f < chi for f in frames)
    assert client.out.expect("child") == "child 0"

    # withdrawn: no frame for the copy, the runtime aborts the throw
    assert conn.frames(False, REGION + 1, blob_at, length) == P.Result.E_UNKNOWN
    assert conn.frames(False, REGION, blob_at, length) == P.Result.OK
    assert conn.frames(False, REGION, blob_at, length) == P.Result.E_UNKNOWN
    frames, res = call(client, "fork 5")
    assert res == f"child {-signal.SIGABRT}", (frames, res)
    assert any(at <= f <= at + n for f in frames) and not any(clo <= f < chi for f in frames)

    # again; forgetting the region keeps it (threads may still return into its code)
    assert conn.frames(True, REGION, blob_at, length) == P.Result.OK
    assert conn.region_forget(REGION) == P.Result.OK
    assert call(client, "fork 5")[1] == "result -5"
    assert client.out.expect("child") == "child 0"

    # freeing the buffer withdraws what is in it
    assert conn.unpatch(site) == [P.Result.OK]
    assert call(client, "call 5")[1] == "result -5"       # the original again
    assert conn.free_buffer(buf.buffer_id) == P.Result.OK
    assert conn.frames(False, REGION, blob_at, length) == P.Result.E_UNKNOWN
    assert client.finish()[0] == 0


def test_frames_add_checks(svc, exe):
    client, conn, buf, at, n, blob_at, length, copyme, _ = start(svc, exe)
    data = buf.read(blob_at, length)
    assert conn.frames(True, REGION, blob_at, length) == P.Result.E_UNKNOWN
    assert conn.region(REGION, at, at + n, []) == P.Result.OK
    assert conn.frames(True, REGION, blob_at + 4, length) == P.Result.E_ALIGN
    assert conn.frames(True, REGION, copyme & ~7, length) == P.Result.E_TARGET
    assert conn.frames(True, REGION, buf.base + buf.size - 8, 16) == P.Result.E_TARGET
    # the last 4 bytes must be the terminator
    assert conn.frames(True, REGION, blob_at, length - 4) == P.Result.E_INVAL
    assert conn.frames(True, REGION, blob_at, length + 8) == P.Result.E_INVAL
    # an FDE whose CIE pointer leads nowhere
    bad = buf.base + 0x1000
    cie_len = int.from_bytes(data[:4], "little")
    mangled = bytearray(data)
    mangled[cie_len + 8:cie_len + 12] = (0x4000).to_bytes(4, "little")
    buf.write(bad, bytes(mangled))
    assert conn.frames(True, REGION, bad, length) == P.Result.E_INVAL
    # an FDE for code outside every code buffer (absolute pc_begin would do; pc-relative
    # from far away: the same records 1 GiB off cannot be placed, so shift pc_begin)
    mangled = bytearray(data)
    pcb = int.from_bytes(mangled[cie_len + 12:cie_len + 16], "little", signed=True)
    mangled[cie_len + 12:cie_len + 16] = (pcb - (1 << 30)).to_bytes(4, "little", signed=True)
    buf.write(bad, bytes(mangled))
    assert conn.frames(True, REGION, bad, length) == P.Result.E_TARGET
    assert conn.frames(True, REGION, blob_at, length) == P.Result.OK
    assert conn.frames(True, REGION, blob_at, length) == P.Result.E_BUSY
    # the same FDE again from another blob: overlaps
    other = buf.base + 0x1800
    mangled = bytearray(data)
    mangled[cie_len + 12:cie_len + 16] = (pcb + blob_at - other).to_bytes(4, "little", signed=True)
    buf.write(other, bytes(mangled))
    assert conn.frames(True, REGION, other, length) == P.Result.E_BUSY
    assert client.finish()[0] == 0


class Recording:
    """The connection, with the requests the installer makes listed in order."""

    def __init__(self, conn) -> None:
        self._conn, self.log = conn, []

    def __getattr__(self, name):
        attr = getattr(self._conn, name)
        if name in ("region", "frames", "patch", "unpatch", "region_forget"):
            def logged(*a, **kw):
                rc = attr(*a, **kw)
                self.log.append((name, a[0] if name == "frames" else None, rc))
                return rc
            return logged
        return attr


def test_installer_names_frames_before_the_patch_and_withdraws_them_with_the_chunk(svc, exe):
    """Installer.install writes the blob after the code and says FRAMES_ADD before the
    PATCH; unpatching keeps it (threads may return into the code); the census that
    frees the chunk withdraws it (FRAMES_DEL)."""
    from types import SimpleNamespace

    from dbr_service.installation.entry_sites import decode_inner
    from dbr_service.installation.install import CodeSpace, InstallState, Installer

    client = svc.spawn([exe])
    copyme = int(client.out.expect("copyme").split()[1], 16)
    client.out.expect("ready")
    conn = Recording(svc.accept(pid=client.pid))
    syms = symbols(exe)
    bias = copyme - syms["copyme"][0]
    fde = load_eh_frame(str(exe)).find(syms["copyme"][0])
    size = fde.end - fde.start
    space = CodeSpace(conn, buffer_size=65536, quarantine_s=0.0)
    inst = Installer(conn, lambda a, n: read_mem(client.pid, a, n), space=space, frames=True)
    chunk = inst.reserve(size + 512, reach=[copyme])
    layout = [(chunk.addr, chunk.addr + size, fde.start)]
    code = relocate_copy(fde, layout, bias)
    blob = translate(fde, layout, (chunk.addr + size + 7) & ~7, bias=bias)
    gen = SimpleNamespace(code=code, base=chunk.addr, entries={copyme: chunk.addr},
                          addr_map=[(chunk.addr, chunk.addr + size, copyme)], exits=[],
                          transfers={}, evictions={}, calls={}, returns={})
    # the function's entry: an entry site when its first instruction is short
    inner = decode_inner(read_mem(client.pid, copyme, 32), copyme)
    reg = inst.install(chunk, gen, name="copy", frames=[blob], entry_sites={copyme: inner})
    assert reg.state is InstallState.INSTALLED and reg.frames == 1
    assert [e[0] for e in conn.log] == ["region", "frames", "patch"]
    assert conn.log[1] == ("frames", True, P.Result.OK)
    frames, res = call(client, "fork 5")
    assert res == "result -5" and any(chunk.addr <= f < chunk.addr + size for f in frames)
    assert client.out.expect("child") == "child 0"
    inst.uninstall(reg.region_id, "test")
    assert not any(e[0] == "frames" and e[1] is False for e in conn.log)
    for _ in range(50):
        if inst.reclaim():
            break
    else:
        pytest.fail("the chunk was never freed")
    assert ("frames", False, P.Result.OK) in conn.log
    assert conn.frames(False, reg.region_id, blob.register_at,
                       records_len(blob.data)) == P.Result.E_UNKNOWN
    assert client.finish()[0] == 0
