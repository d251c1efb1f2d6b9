"""dbr_service.installation.install against the real agent: install, unpatch, quarantine and
census-gated reuse, invalidation on map changes, refusal handling."""

from __future__ import annotations

import time

import pytest

from dbr_service.wire import protocol as P
from dbr_service.wire.agentconn import jmp_rel32
from dbr_service.common.errors import CodegenError
from dbr_service.installation.install import CodeSpace, InstallState, Installer
from harness import SITE_INSN, read_mem, stub_gen




class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_install_uninstall_and_census_gated_reuse(client_conn):
    _, client, conn, sites = client_conn
    clock = Clock()
    space = CodeSpace(conn, buffer_size=65536, quarantine_s=0.5, clock=clock)
    inst = Installer(conn, lambda a, n: read_mem(client.pid, a, n), space=space)
    chunk = inst.reserve(64, reach=sites[:2])
    reg = inst.install(chunk, stub_gen(chunk.addr, sites[:2]), name="loop")
    assert reg.state is InstallState.INSTALLED and inst.patches_installed == 2
    for s in sites[:2]:
        assert read_mem(client.pid, s, 5) == jmp_rel32(s, reg.gen.entries[s])
    # Attribution maps replacement PCs back to original addresses.
    assert inst.attribute(reg.gen.entries[sites[1]] + 2) == (sites[1], reg)
    assert inst.perf_map_lines()
    inst.uninstall(reg.region_id, "test")
    assert reg.state is InstallState.REMOVED and inst.patches_removed == 2
    for s in sites[:2]:
        assert read_mem(client.pid, s, 6) == SITE_INSN
    # Quarantine: not reusable before the period and two clean censuses.
    assert inst.reclaim() == 0
    clock.t += 1.0
    # A census finds a storm thread still inside the buffer when it was preempted
    # there, or times out under load: not clean, so the service tries again at its
    # next snapshot.  Here: again, a bounded number of times.
    freed = []
    for _ in range(40):
        freed.append(inst.reclaim())
        if freed[-1]:
            break
        time.sleep(0.02)
    assert sum(freed) == 1 and freed[-1] == 1, freed
    again = inst.reserve(64, reach=sites[:2])
    assert again.addr == chunk.addr
    # Reused space was int3-filled before reuse.
    assert again.buffer.read(again.addr, 16) == b"\xcc" * 16


def test_thread_inside_quarantined_code_blocks_reuse(client_conn):
    _, client, conn, sites = client_conn
    clock = Clock()
    space = CodeSpace(conn, quarantine_s=0.0, clock=clock)
    inst = Installer(conn, lambda a, n: read_mem(client.pid, a, n), space=space)
    chunk = inst.reserve(32, reach=[sites[0]])
    inst.install(chunk, stub_gen(chunk.addr, [sites[0]]))
    inst.uninstall(1)
    # The client's threads really ran through the stub.  Before the fake censuses below
    # end in the int3 fill, real ones must show them gone (as the service requires): a
    # thread still inside when the fill lands dies of SIGTRAP (it did, once in ~30 runs).
    lo, hi, clean_real = chunk.addr, chunk.addr + chunk.size, 0
    for _ in range(100):
        pcs = conn.census(200)
        ok = not any(e.state == P.CENSUS_NO_REPLY or e.state == P.CENSUS_OK and lo <= e.pc < hi
                     for e in pcs)
        clean_real = clean_real + 1 if ok else 0
        if clean_real >= 2:
            break
    assert clean_real >= 2, "threads never left the removed stub"
    fake_inside = [P.CensusEntry(tid=1, state=P.CENSUS_OK, pc=chunk.addr + 3)]
    no_reply = [P.CensusEntry(tid=1, state=P.CENSUS_NO_REPLY, pc=0)]
    clean = [P.CensusEntry(tid=1, state=P.CENSUS_OK, pc=sites[0])]
    assert space.census_done(clean) == 0       # one clean census
    assert space.census_done(fake_inside) == 0  # resets the count
    assert space.census_done(clean) == 0
    assert space.census_done(no_reply) == 0     # unknown PC counts as inside
    assert space.census_done(clean) == 0
    assert space.census_done(clean) == 1


def test_chunks_start_on_64_byte_lines(client_conn):
    """Same code, same place within cache lines: every chunk starts a 64-byte line,
    whatever the sizes asked before it (and after space is freed and reused)."""
    _, client, conn, sites = client_conn
    space = CodeSpace(conn, quarantine_s=0.0, clock=Clock())
    chunks = [space.allocate(n, [sites[0]]) for n in (17, 100, 1, 64, 65)]
    assert all(c.addr % 64 == 0 and c.size % 64 == 0 for c in chunks), chunks
    assert len({c.addr for c in chunks}) == len(chunks)


def test_map_change_invalidates_affected_regions_only(client_conn):
    _, client, conn, sites = client_conn
    inst = Installer(conn, lambda a, n: read_mem(client.pid, a, n))
    c1 = inst.reserve(32, reach=[sites[0]])
    r1 = inst.install(c1, stub_gen(c1.addr, [sites[0]]))
    c2 = inst.reserve(32, reach=[sites[5]])
    r2 = inst.install(c2, stub_gen(c2.addr, [sites[5]]))
    hit = inst.on_map_changed(sites[5], sites[5] + 1)
    assert hit == [r2]
    assert r2.state is InstallState.REMOVED and r1.state is InstallState.INSTALLED
    assert read_mem(client.pid, sites[5], 6) == SITE_INSN
    assert read_mem(client.pid, sites[0], 1) == b"\xe9"
    inst.uninstall_all("done")
    assert read_mem(client.pid, sites[0], 6) == SITE_INSN


def test_refused_sites_leave_region_failed_and_space_released(client_conn):
    _, client, conn, sites = client_conn
    # wrong original bytes (one 5-byte instruction: the installer sends it as a site)
    inst = Installer(conn, lambda a, n: (b"\xb8\0\0\0\0" + b"\x90" * n)[:n])
    chunk = inst.reserve(32, reach=[sites[0]])
    reg = inst.install(chunk, stub_gen(chunk.addr, [sites[0]]))
    assert reg.state is InstallState.FAILED
    assert reg.results == {sites[0]: P.Result.E_MISMATCH}
    assert "E_MISMATCH" in reg.why_removed
    assert read_mem(client.pid, sites[0], 6) == SITE_INSN
    assert len(inst.space.quarantine) == 1


def test_code_that_does_not_fit_its_chunk_is_refused(client_conn):
    _, client, conn, sites = client_conn
    inst = Installer(conn, lambda a, n: read_mem(client.pid, a, n))
    chunk = inst.reserve(16, reach=[sites[0]])       # rounded up to a 64-byte line
    n = chunk.size // 16 + 1                          # stub_gen: 16 bytes a site
    assert len(sites) >= n
    with pytest.raises(CodegenError):
        inst.install(chunk, stub_gen(chunk.addr, sites[:n]))
    with pytest.raises(CodegenError):
        inst.reserve(64, reach=[sites[0], sites[0] + (3 << 30)])
    assert read_mem(client.pid, sites[0], 6) == SITE_INSN


def test_suspend_restores_sites_keeps_code_and_resume_patches_again(client_conn):
    """A speed check's phases: suspend() restores a live region's sites while its code
    and REGION stay (no quarantine, attribution still maps its code), resume() patches
    the same sites again; neither counts as a patch removed or installed.  The storm
    threads keep running through the sites all along (the fixture checks they exit
    cleanly)."""
    _, client, conn, sites = client_conn
    inst = Installer(conn, lambda a, n: read_mem(client.pid, a, n))
    chunk = inst.reserve(64, reach=sites[:2])
    reg = inst.install(chunk, stub_gen(chunk.addr, sites[:2]))
    for _ in range(3):
        inst.suspend(reg.region_id)
        assert reg.state is InstallState.SUSPENDED and not reg.patched_sites
        assert [s.site for s in reg.suspended_sites] == sites[:2]
        for s in sites[:2]:
            assert read_mem(client.pid, s, 6) == SITE_INSN
        assert not inst.space.quarantine and inst.patched_ranges() == []
        assert inst.attribute(reg.gen.entries[sites[1]] + 2) == (sites[1], reg)
        with pytest.raises(Exception, match="not installed"):
            inst.suspend(reg.region_id)
        inst.resume(reg.region_id)
        assert reg.state is InstallState.INSTALLED and not reg.suspended_sites
        for s in sites[:2]:
            assert read_mem(client.pid, s, 5) == jmp_rel32(s, reg.gen.entries[s])
        time.sleep(0.02)
    assert inst.patches_installed == 2 and inst.patches_removed == 0
    with pytest.raises(Exception, match="not suspended"):
        inst.resume(reg.region_id)
    inst.uninstall(reg.region_id, "done")
    assert inst.patches_removed == 2


def test_suspended_region_is_retired_by_map_change_and_uninstall(client_conn):
    """A suspended region still depends on the original code: a map change over one of
    its (restored) sites retires it, as does uninstall, without an unpatch; a resume
    the agent refuses (original bytes changed meanwhile) retires it too."""
    _, client, conn, sites = client_conn
    inst = Installer(conn, lambda a, n: read_mem(client.pid, a, n))
    regs = []
    for s in (sites[0], sites[3], sites[6]):
        c = inst.reserve(32, reach=[s])
        regs.append(inst.install(c, stub_gen(c.addr, [s])))
        inst.suspend(regs[-1].region_id)
    assert inst.on_map_changed(sites[0], sites[0] + 1) == [regs[0]]
    assert regs[0].state is InstallState.REMOVED and len(inst.space.quarantine) == 1
    inst.uninstall(regs[1].region_id, "operator")
    assert regs[1].state is InstallState.REMOVED and inst.patches_removed == 0
    wrong = P.PatchSite.from_buffer_copy(bytes(regs[2].suspended_sites[0]))
    wrong.orig[0] ^= 0xFF
    regs[2].suspended_sites[0] = wrong
    inst.resume(regs[2].region_id)
    assert regs[2].state is InstallState.REMOVED
    assert "E_MISMATCH" in regs[2].why_removed
    for s in (sites[0], sites[3], sites[6]):
        assert read_mem(client.pid, s, 6) == SITE_INSN
