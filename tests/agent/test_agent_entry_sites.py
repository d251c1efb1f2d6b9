"""Entry sites (docs/architecture.md, "Invariants" 3, docs/agent.md "Entry sites"): the
first instructions of a function, together >= 5 bytes, patched with the int3 protocol
once the agent's own census, taken after the CC is in place, finds no thread inside
bytes 1-4 (its PC, or a PC saved on its stack).  tests/agent_progs/entry_sites.c."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import pytest

from dbr_service.wire import protocol as P
from dbr_service.wire.agentconn import jmp_rel32, make_site
from dbr_service.common.errors import CodegenError
from dbr_service.installation.install import InstallState, Installer
from harness import FakeService, assemble, compile_c, fake_service_fixture, read_mem  # noqa: F401

CYCLES = int(os.environ.get("DBR_ENTRY_CYCLES", "400"))
ENTRY_INNER = (1, 4)            # push %rbp (1), mov %rsp,%rbp (3), imul (6)
PARK_INNER = (1, 3, 4)          # nop (1), jmp . (2), nop, nop


@pytest.fixture(scope="module")
def entry_exe():
    return compile_c(["entry_sites.c"])


def start(svc: FakeService, exe, *args: str, env=None):
    client = svc.spawn([exe, *args], env=env)
    fns = [int(w, 16) for w in client.out.expect("fns").split()[1:]]
    client.out.expect("ready")
    conn = svc.accept(pid=client.pid)
    assert conn.hello.flags & P.HELLO_ENTRY_SITES
    return client, conn, fns


def entry_site(pid: int, site: int, target: int, offsets, region_id: int = 0):
    """An entry site record with the original bytes read from the client."""
    return make_site(site, target, read_mem(pid, site, P.PATCH_LEN), region_id=region_id,
                     inner=[site + k for k in offsets])


def finish(client) -> tuple[int, int]:
    rc, rest = client.finish()
    assert rc == 0, (rc, client.err.lines)
    line = next(x for x in rest if x.startswith("ok "))
    kv = dict(w.split("=") for w in line.split()[1:])
    return int(kv["calls"]), int(kv["repl"])


def test_entry_site_record_and_refusals(svc, entry_exe):
    """The wire record: SITE_F_ENTRY and a bit per inner boundary; the agent refuses a
    malformed one (no boundary, a boundary outside 1..4, another variant, inner bits
    without the flag, an unknown flag) with E_INVAL and writes nothing."""
    client, conn, (a, b, park, _, _) = start(svc, entry_exe, "stress", "1")
    buf = conn.code_buffer(near=a, size=4096)
    orig = read_mem(client.pid, a, 16)
    good = entry_site(client.pid, a, buf.base, ENTRY_INNER)
    assert good.flags == P.SITE_F_ENTRY and good.inner == 0b10010
    bad = []
    for flags, inner, variant in [(P.SITE_F_ENTRY, 0, P.Variant.INT3),
                                  (P.SITE_F_ENTRY, 0b100000, P.Variant.INT3),
                                  (P.SITE_F_ENTRY, 0b1, P.Variant.INT3),
                                  (P.SITE_F_ENTRY, 0b10010, P.Variant.SELF_BRANCH),
                                  (0, 0b10010, P.Variant.INT3),
                                  (0x2, 0, P.Variant.INT3)]:
        s = make_site(a, buf.base, orig[:5], variant=variant)
        s.flags, s.inner = flags, inner
        bad.append(s)
    for s in bad:
        assert conn.patch([s]) == [P.Result.E_INVAL]
        assert read_mem(client.pid, a, 16) == orig
    with pytest.raises(Exception):
        make_site(a, buf.base, orig[:5], inner=[a + 5])
    calls, _ = finish(client)
    assert calls > 0


def test_entry_sites_patched_under_callers(svc, entry_exe):
    """Four threads call two functions whose entry sites are patched and restored
    CYCLES times (the replacement counts its runs, computes the same): no wrong
    result, the bytes restored each time, the replacement run, and nearly every
    patch accepted (E_INSIDE only when a thread really was inside)."""
    client, conn, (a, b, _, _, counter) = start(svc, entry_exe, "stress", "4")
    originals = {s: read_mem(client.pid, s, 16) for s in (a, b)}
    buf = conn.code_buffer(near=a, size=4096)
    targets = {}
    for k, s in enumerate((a, b)):
        at = buf.base + 64 * k
        code = assemble(f"push rbp; mov rbp, rsp; imul eax, edi, 1000; add eax, 7; "
                        f"movabs rcx, {counter}; lock inc qword ptr [rcx]; pop rbp; ret", at)
        buf.write(at, code)
        targets[s] = at
    sites = [entry_site(client.pid, s, t, ENTRY_INNER) for s, t in targets.items()]
    ok = inside = 0
    for _ in range(CYCLES):
        res = conn.patch(sites)
        assert set(res) <= {P.Result.OK, P.Result.E_INSIDE}, res
        for s, r in zip(sites, res):
            if r == P.Result.OK:
                assert read_mem(client.pid, s.site, 5) == jmp_rel32(s.site, s.target)
            else:
                assert read_mem(client.pid, s.site, 16) == originals[s.site]
        ok += res.count(P.Result.OK)
        inside += res.count(P.Result.E_INSIDE)
        done = [s for s, r in zip(sites, res) if r == P.Result.OK]
        if done:
            assert conn.unpatch(done) == [P.Result.OK] * len(done)
        for s in sites:
            assert read_mem(client.pid, s.site, 16) == originals[s.site]
    assert client.proc.poll() is None, client.err.lines
    calls, repl = finish(client)
    assert calls > 0 and repl > 0
    print(f"entry sites: {ok} patched, {inside} inside, replacement ran {repl} times")
    # a thread preempted at +1 or +4 really is inside: more so on a loaded machine;
    # a trap frame counted as inside (the census signal not blocked in the SIGTRAP
    # handler) makes it ~75%
    assert ok >= 0.6 * 2 * CYCLES, (ok, inside)


def test_thread_at_inner_boundary_makes_the_site_wait(svc, entry_exe):
    """A thread whose PC is at park_pc+1 (an inner boundary): PATCH answers E_INSIDE
    and leaves the bytes as they were, every time; once TRANSFER has moved the thread
    into replacement code, the same PATCH succeeds."""
    client, conn, (_, _, park, _, _) = start(svc, entry_exe, "park")
    orig = read_mem(client.pid, park, 16)
    buf = conn.code_buffer(near=park, size=4096)
    buf.write(buf.base, assemble("xor eax, eax; ret", buf.base))        # the entry
    buf.write(buf.base + 16, assemble("mov eax, 2; ret", buf.base + 16))  # from park+1
    assert conn.region(5, buf.base, buf.base + 64, []) == P.Result.OK
    site = entry_site(client.pid, park, buf.base, PARK_INNER, region_id=5)
    pcs = [e.pc for e in conn.census(500) if e.state == P.CENSUS_OK]
    assert park + 1 in pcs                      # the premise
    for _ in range(5):
        assert conn.patch([site]) == [P.Result.E_INSIDE]
        assert read_mem(client.pid, park, 16) == orig
    res = conn.transfer(5, {park + 1: buf.base + 16}, timeout_ms=500)
    assert res.result == P.Result.OK and res.moved == 1
    client.out.expect("left 2")
    assert conn.patch([site]) == [P.Result.OK]
    assert read_mem(client.pid, park, 5) == jmp_rel32(park, buf.base)
    assert conn.unpatch([site]) == [P.Result.OK]
    assert read_mem(client.pid, park, 16) == orig
    finish(client)


def test_saved_pc_in_a_signal_frame_makes_the_site_wait(svc, entry_exe):
    """A thread interrupted at park_sig+1 waits in its signal handler: its PC is in
    read(), the PC it resumes at is in the signal frame on its stack.  PATCH answers
    E_INSIDE until the handler has sent it on elsewhere."""
    client, conn, (_, _, _, park, _) = start(svc, entry_exe, "sigpark")
    assert "inhandler" in client.out.lines
    orig = read_mem(client.pid, park, 16)
    buf = conn.code_buffer(near=park, size=4096)
    buf.write(buf.base, assemble("xor eax, eax; ret", buf.base))
    site = entry_site(client.pid, park, buf.base, PARK_INNER)
    census = conn.census(500, ranges=[(park + 1, park + 2)])
    assert census.range_refs[0] >= 1 and park + 1 not in [e.pc for e in census]  # the premise
    for _ in range(5):
        assert conn.patch([site]) == [P.Result.E_INSIDE]
        assert read_mem(client.pid, park, 16) == orig
    client.send("release")
    client.out.expect("left 3")
    assert conn.patch([site]) == [P.Result.OK]
    assert conn.unpatch([site]) == [P.Result.OK]
    assert read_mem(client.pid, park, 16) == orig
    finish(client)


def test_one_busy_entry_site_leaves_the_rest_of_the_batch_alone(svc, entry_exe):
    """In one batch with a thread inside one entry site: that one answers E_INSIDE,
    the others are installed (the callers of entry_a/entry_b keep computing right)."""
    client, conn, (a, b, park, _, _) = start(svc, entry_exe, "park")
    buf = conn.code_buffer(near=a, size=4096)
    for k, s in enumerate((a, b)):
        at = buf.base + 64 * k
        buf.write(at, assemble("push rbp; mov rbp, rsp; imul eax, edi, 1000; add eax, 8; "
                               "pop rbp; ret", at))
    buf.write(buf.base + 128, assemble("xor eax, eax; ret", buf.base + 128))
    sites = [entry_site(client.pid, a, buf.base, ENTRY_INNER),
             entry_site(client.pid, park, buf.base + 128, PARK_INNER),
             entry_site(client.pid, b, buf.base + 64, ENTRY_INNER)]
    assert conn.patch(sites) == [P.Result.OK, P.Result.E_INSIDE, P.Result.OK]
    assert conn.unpatch([sites[0], sites[2]]) == [P.Result.OK, P.Result.OK]
    assert conn.unpatch([sites[1]]) == [P.Result.E_NOT_PATCHED]
    finish(client)


@dataclass
class Gen:
    """What the installer needs of codegen's output (install.Generated)."""

    code: bytes
    base: int
    entries: dict[int, int]
    addr_map: list = field(default_factory=list)
    exits: list = field(default_factory=list)
    transfers: dict[int, int] = field(default_factory=dict)
    evictions: dict[int, int] = field(default_factory=dict)


def test_installer_sends_entry_sites_and_retries_after_transfer(svc, entry_exe):
    """Installer: an entry site region selection named goes out as SITE_F_ENTRY; one it
    did not name (or whose bytes decode otherwise) is refused without asking the
    agent; eviction points into its own bytes do not refuse it; E_INSIDE leads to a
    TRANSFER and the site is patched in the same install; a region exiting into an
    installed entry site's bytes is not installed."""
    client, conn, (a, _, park, _, _) = start(svc, entry_exe, "park")
    inst = Installer(conn, lambda addr, n: read_mem(client.pid, addr, n))
    chunk = inst.reserve(64, reach=[park])
    entry = chunk.addr
    code = assemble("xor eax, eax; ret", entry)
    back = chunk.addr + 16                       # a thread moved from park+1 returns 2
    code += b"\xcc" * (16 - len(code)) + assemble("mov eax, 2; ret", back)
    gen = Gen(code, chunk.addr, {park: entry}, addr_map=[(entry, back + 6, park)])
    # not named an entry site: refused here, nothing sent (no transfer map: nobody
    # moved in either)
    reg = inst.install(chunk, gen, entry_sites={})
    assert reg.state is InstallState.FAILED and reg.sites == []
    assert "not a chosen entry site" in reg.refused_sites[park]
    # named, with the bytes' own boundaries: E_INSIDE, TRANSFER, patched
    chunk = inst.reserve(64, reach=[park])
    gen.base = chunk.addr
    gen.code = assemble("xor eax, eax; ret", chunk.addr) + b"\xcc" * 13 + \
        assemble("mov eax, 2; ret", chunk.addr + 16)
    gen.entries = {park: chunk.addr}
    gen.transfers = {park + 1: chunk.addr + 16}
    # the copy of the site's own inner instruction is an eviction point into its bytes
    # (as in every copy of a function's first instructions): that does not stop the
    # install, and EVICT never sends it while the site is patched
    gen.evictions = {chunk.addr + 16: park + 1}
    reg = inst.install(chunk, gen, entry_sites={park: [park + k for k in PARK_INNER]})
    assert reg.state is InstallState.INSTALLED, (reg.results, reg.why_removed)
    assert inst.evict(reg) == (0, 0)
    assert reg.entry_sites == {park: [park + k for k in PARK_INNER]}
    assert reg.results[park] == P.Result.OK and reg.transferred == 1
    client.out.expect("left 2")
    assert read_mem(client.pid, park, 5) == jmp_rel32(park, chunk.addr)
    # code exiting into bytes 1..4 of the installed entry site is not installed
    other = inst.reserve(64, reach=[a])
    bad = Gen(b"\xcc" * 16, other.addr, {}, exits=[(other.addr, park + 3)])
    with pytest.raises(CodegenError, match="entry site"):
        inst.install(other, bad)
    inst.uninstall(reg.region_id, "done")
    assert read_mem(client.pid, park, 5) == bytes.fromhex("90ebfe9090")
    finish(client)
