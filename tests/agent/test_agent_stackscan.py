"""The census's stack scan (shared/dbr_protocol.h, PC_CENSUS_REQ with ranges).

Replacement code that makes a real ``call`` leaves a return address into its code
buffer on the caller's stack for as long as the callee runs.  ``stackscan`` threads
call a patched site whose replacement calls ``park()``, a function of the program
that blocks until released.  After the site is unpatched the thread's PC is in
``park`` (not in the buffer): only the scan of its stack shows that the buffer is
still in use.  Then the service side: CodeSpace keeps such code until two censuses
in a row find nothing of it, and ``dbr ctl regions`` says what keeps it.
"""

from __future__ import annotations

import mmap
import re
import time
from types import SimpleNamespace

import pytest

from dbr_service.wire import protocol as P
from dbr_service.wire.agentconn import CensusResult, CodeBufferHandle
from dbr_service.installation.install import Chunk, CodeSpace, InstallState, Installer
from harness import (FakeService, assemble, compile_c, parse_sites, patch_sites,
                     read_mem)


@pytest.fixture(scope="module")
def exe():
    return compile_c(["stackscan.c"])


class Prog(SimpleNamespace):
    """A started stackscan client, its session and a code buffer near its sites."""


def start(svc: FakeService, exe, env=None) -> Prog:
    client = svc.spawn([exe], env=env)
    sites = parse_sites(client.out.expect("sites"))
    park = int(client.out.expect("park").split()[1], 16)
    outer = int(client.out.expect("outer").split()[1], 16)
    client.out.expect("ready")
    conn = svc.accept(pid=client.pid)
    buf = conn.code_buffer(near=sites[0], size=4096)
    return Prog(client=client, conn=conn, sites=sites, park=park, outer=outer, buf=buf)


def caller(p: Prog, at: int, site: int, callee: int) -> int:
    """Write at ``at`` the replacement of ``site`` (sites.h: imul eax, edi, 1000; ...)
    that first makes a real call to ``callee``; returns the return address the call
    pushes (an address inside the buffer)."""
    head = assemble(f"push rdi; call {callee:#x}", at)
    code = head + assemble(f"pop rdi; imul eax, edi, 1000; jmp {site + 6:#x}", at + len(head))
    p.buf.write(at, code)
    return at + len(head)


def enter(p: Prog, site_k: int, callee: int, threads: int,
          cmd: str = "go") -> tuple[int, list[int]]:
    """Patch site ``site_k`` with a caller of ``callee``, have ``threads`` threads call
    it and wait in park(), then unpatch: nothing enters the code any more.  Returns
    the return address and the threads' tids."""
    site = p.sites[site_k]
    ret = caller(p, p.buf.base + 256 * site_k, site, callee)
    ps = patch_sites(p.conn, p.client.pid, {site: p.buf.base + 256 * site_k})
    assert p.conn.patch(ps) == [P.Result.OK]
    p.client.send(f"{cmd} {threads} {site_k}")
    tids = [int(p.client.out.expect("parked").split()[1]) for _ in range(threads)]
    assert p.conn.unpatch(ps) == [P.Result.OK]
    return ret, tids


def release(p: Prog, tids: list[int]) -> None:
    """Let the threads return from park(), and through the replacement code: each
    thread k of a batch computed site(k) = 1000 k + 7."""
    p.client.send(f"release {len(tids)}")
    done = {}
    for _ in tids:
        w = p.client.out.expect("done").split()
        done[int(w[1])] = int(w[2])
    assert sorted(done) == sorted(tids)
    assert sorted(done.values()) == [1000 * k + 7 for k in range(len(tids))]
    # the threads end after saying so: wait until they are gone
    deadline = time.monotonic() + 5
    while any(_alive(p.client.pid, t) for t in tids):
        assert time.monotonic() < deadline, "released threads did not end"
        time.sleep(0.01)


def _alive(pid: int, tid: int) -> bool:
    try:
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def buffer_range(p: Prog) -> list[tuple[int, int]]:
    return [(p.buf.base, p.buf.base + p.buf.size)]


def by_tid(census) -> dict[int, P.CensusEntry]:
    return {e.tid: e for e in census}


def assert_clean(p: Prog, censuses: int = 2) -> None:
    """Censuses find no word of any thread in the buffer, and no thread there."""
    for _ in range(censuses):
        c = p.conn.census(300, ranges=buffer_range(p))
        assert c.result == P.Result.OK and c.range_refs == [0], c.range_refs
        for e in c:
            assert e.state in (P.CENSUS_OK, P.CENSUS_AGENT), (e.tid, e.state, hex(e.flags))
            assert e.refs == 0 and e.first_ref == 0, (e.tid, e.refs, hex(e.first_ref))
            assert not p.buf.contains(e.pc)


# ---- the agent ----------------------------------------------------------------

def test_a_return_address_into_the_buffer_is_found_on_the_stack(svc, exe):
    p = start(svc, exe)
    ret, (tid,) = enter(p, 0, p.park, 1)
    # a PC-only census sees nothing: the thread's PC is in park (its read)
    pcs = p.conn.census(300)
    assert pcs.result == P.Result.OK and pcs.range_refs == []
    assert not any(e.state == P.CENSUS_OK and p.buf.contains(e.pc) for e in pcs)
    assert by_tid(pcs)[tid].refs == 0
    for _ in range(3):
        c = p.conn.census(300, ranges=buffer_range(p))
        e = by_tid(c)[tid]
        assert e.state == P.CENSUS_OK and not p.buf.contains(e.pc)
        assert e.first_ref == ret and e.refs == 1, (hex(e.first_ref), hex(ret), e.refs)
        assert not e.flags & P.CENSUS_F_REG
        assert c.range_refs == [1]
        # nobody else holds it: the main thread and the agent's have no such word
        assert all(x.refs == 0 for x in c if x.tid != tid)
    # a range that does not hold the word finds nothing; one that does, wherever it is
    c = p.conn.census(300, ranges=[(p.buf.base, ret), (ret + 1, p.buf.base + p.buf.size)])
    assert c.range_refs == [0, 0] and by_tid(c)[tid].refs == 0
    below = p.buf.base - 0x10000
    c = p.conn.census(300, ranges=[(below, below + 0x1000), (ret, ret + 1), (ret + 8, ret + 16)])
    assert c.range_refs == [0, 1, 0] and by_tid(c)[tid].first_ref == ret
    release(p, [tid])
    assert_clean(p)
    rc, _ = p.client.finish()
    assert rc == 0, p.client.err.lines


def test_eight_threads_in_the_callee_at_once(svc, exe):
    p = start(svc, exe)
    ret, tids = enter(p, 0, p.park, 8)
    c = p.conn.census(500, ranges=buffer_range(p))
    got = by_tid(c)
    assert c.range_refs == [8]
    for t in tids:
        assert got[t].state == P.CENSUS_OK and got[t].refs == 1 and got[t].first_ref == ret, t
    release(p, tids)
    assert_clean(p)
    rc, _ = p.client.finish()
    assert rc == 0, p.client.err.lines


def test_a_return_address_in_a_deeper_frame(svc, exe):
    """The buffer calls outer(), which calls park(): the word is two frames up."""
    p = start(svc, exe)
    ret, (tid,) = enter(p, 1, p.outer, 1)
    e = by_tid(p.conn.census(300, ranges=buffer_range(p)))[tid]
    assert e.state == P.CENSUS_OK and e.first_ref == ret and e.refs == 1
    release(p, [tid])
    assert_clean(p)
    rc, _ = p.client.finish()
    assert rc == 0, p.client.err.lines


def test_a_buffer_address_kept_in_a_register_across_the_call(svc, exe):
    """Replacement code that keeps an address of its buffer in a callee-saved register
    across the call: the census finds it where the callee left it (in the register
    at the interruption, or saved in the callee's frame), besides the return address."""
    p = start(svc, exe)
    site, at = p.sites[4], p.buf.base + 256 * 4
    marker = p.buf.base + 0x800
    head = assemble(f"push rbx; push rdi; sub rsp, 8; mov rbx, {marker:#x}; call {p.park:#x}", at)
    code = head + assemble(f"add rsp, 8; pop rdi; pop rbx; imul eax, edi, 1000; "
                           f"jmp {site + 6:#x}", at + len(head))
    p.buf.write(at, code)
    ps = patch_sites(p.conn, p.client.pid, {site: at})
    assert p.conn.patch(ps) == [P.Result.OK]
    p.client.send("go 1 4")
    tid = int(p.client.out.expect("parked").split()[1])
    assert p.conn.unpatch(ps) == [P.Result.OK]
    c = p.conn.census(300, ranges=buffer_range(p))
    e = by_tid(c)[tid]
    assert e.state == P.CENSUS_OK and e.refs >= 2 and c.range_refs == [e.refs]
    assert e.first_ref in (marker, at + len(head)), hex(e.first_ref)
    # only the marker's word: found, in a register or a saved slot
    c = p.conn.census(300, ranges=[(marker, marker + 1)])
    e = by_tid(c)[tid]
    assert e.refs >= 1 and e.first_ref == marker
    assert c.range_refs == [e.refs]
    release(p, [tid])
    assert_clean(p)
    rc, _ = p.client.finish()
    assert rc == 0, p.client.err.lines


def test_a_thread_on_its_sigaltstack_is_unknown_until_it_leaves_it(svc, exe):
    """A signal handler running on the alternate stack interrupted the thread inside
    park(): the scan reads the alternate stack, which has no such word, and cannot
    find the normal stack (UNKNOWN: the service assumes it holds everything).  Back
    on its normal stack, the word is found again."""
    p = start(svc, exe)
    ret, (tid,) = enter(p, 0, p.park, 1, cmd="alt")
    e = by_tid(p.conn.census(300, ranges=buffer_range(p)))[tid]
    assert e.state == P.CENSUS_OK and e.first_ref == ret      # on its normal stack
    p.client.send("sig")
    assert int(p.client.out.expect("inhandler").split()[1]) == tid
    for _ in range(2):
        e = by_tid(p.conn.census(300, ranges=buffer_range(p)))[tid]
        assert (e.state == P.CENSUS_UNKNOWN and e.flags & P.CENSUS_F_ALTSTACK) or \
            e.first_ref == ret, (e.state, hex(e.flags))
        assert e.state == P.CENSUS_UNKNOWN, "the alternate stack has no return address"
    p.client.send("unhold")
    deadline = time.monotonic() + 5
    while True:     # the handler returns, park's read restarts
        e = by_tid(p.conn.census(300, ranges=buffer_range(p)))[tid]
        if e.state == P.CENSUS_OK:
            break
        assert time.monotonic() < deadline, "the thread stayed on its alternate stack"
        time.sleep(0.01)
    assert e.first_ref == ret and e.refs == 1
    release(p, [tid])
    assert_clean(p)
    rc, _ = p.client.finish()
    assert rc == 0, p.client.err.lines


def test_a_stack_in_no_candidate_mapping_is_unknown(svc, exe):
    """A thread running on a stack in a shared mapping (makecontext): no private
    anonymous mapping holds its stack pointer, even with maps read again: UNKNOWN."""
    p = start(svc, exe, env={"DBR_AGENT_DEBUG": "1"})
    p.client.send("ctx 1")
    tid = int(p.client.out.expect("parked").split()[1])
    e = by_tid(p.conn.census(300, ranges=buffer_range(p)))[tid]
    assert e.state == P.CENSUS_UNKNOWN and e.flags & P.CENSUS_F_NOSTACK, (e.state, e.flags)
    line = p.client.err.expect(f"dbr-agent[{p.client.pid}]: census:", timeout=5)
    assert "1 unknown, 1 again" in line, line
    p.client.send("release 1")
    p.client.out.expect("done")
    rc, _ = p.client.finish()
    assert rc == 0, p.client.err.lines


def test_bad_ranges_are_refused_and_the_session_goes_on(svc, exe):
    p = start(svc, exe)
    b = p.buf.base
    for bad in ([(b + 64, b + 128), (b, b + 32)],      # not ascending
                [(b, b + 64), (b + 32, b + 96)],       # overlapping
                [(b + 64, b + 64)]):                   # empty
        items = [P.Range(lo=lo, hi=hi) for lo, hi in bad]
        rec = p.conn.request(P.MsgType.PC_CENSUS_REQ,
                             P.CensusReq(req_id=p.conn.next_id(), timeout_ms=100), items=items)
        assert rec.msg.body.result == P.Result.E_INVAL and rec.msg.body.n == 0
        assert rec.msg.body.n_total == 0 and rec.msg.body.n_ranges == len(bad)
    c = p.conn.census(200, ranges=[(b, b + 64)])
    assert c.result == P.Result.OK and len(c) >= 2
    rc, _ = p.client.finish()
    assert rc == 0, p.client.err.lines


def test_a_census_of_more_threads_than_one_message_holds(svc, exe):
    """1100 threads: the reply takes two messages, both with the census's totals."""
    p = start(svc, exe)
    ret, tids = enter(p, 3, p.park, 1)
    p.client.send("deep 1099 1")
    for _ in range(1099):
        p.client.out.expect("parked", timeout=60)
    c = p.conn.census(1000, ranges=buffer_range(p))
    assert c.result == P.Result.OK and len(c) > P.MAX_CENSUS
    assert len({e.tid for e in c}) == len(c) >= 1101
    assert sum(e.state == P.CENSUS_OK for e in c) >= 1100
    assert c.range_refs == [1] and by_tid(c)[tids[0]].first_ref == ret
    p.client.send("release 1100")
    for _ in range(1100):
        p.client.out.expect("done", timeout=60)
    rc, _ = p.client.finish()
    assert rc == 0, p.client.err.lines


def test_census_cost_with_deep_stacks(svc, exe, capsys):
    """Not a timed assertion: how long a census of 100 threads with 64 KiB and 1 MiB
    of stack in use takes, as the test measures it and as the agent logs it."""
    p = start(svc, exe, env={"DBR_AGENT_DEBUG": "1"})
    rows = []
    for kib in (64, 1024):
        p.client.send(f"deep 100 {kib}")
        for _ in range(100):
            p.client.out.expect("parked", timeout=30)
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            c = p.conn.census(1000, ranges=buffer_range(p))
            times.append(time.perf_counter() - t0)
            assert c.result == P.Result.OK and c.range_refs == [0]
            assert sum(e.state == P.CENSUS_OK for e in c) >= 101
        logs = []
        for _ in range(5):
            logs.append(p.client.err.expect(f"dbr-agent[{p.client.pid}]: census:", timeout=5))
        m = [re.search(r"(\d+) words read.*maps (\d+) us, signals to answers (\d+) us", x)
             for x in logs]
        words = int(m[-1].group(1))
        assert words >= 100 * kib * 1024 // 8
        rows.append(f"{kib:5d} KiB x 100 threads: census {min(times) * 1e3:6.1f} ms "
                    f"(median {sorted(times)[2] * 1e3:6.1f}), agent: maps "
                    f"{min(int(x.group(2)) for x in m)} us, signals to answers "
                    f"{min(int(x.group(3)) for x in m) / 1e3:.1f} ms, {words} words read")
        p.client.send("release 100")
        for _ in range(100):
            p.client.out.expect("done", timeout=30)
    with capsys.disabled():
        print("\n" + "\n".join(rows))
    rc, _ = p.client.finish()
    assert rc == 0, p.client.err.lines


# ---- the service ---------------------------------------------------------------

def _space(quarantine_s: float = 0.0):
    clock = SimpleNamespace(t=0.0)
    buf = CodeBufferHandle(1, 0x7F0000000000, 4096, mmap.mmap(-1, 4096))
    space = CodeSpace(SimpleNamespace(buffers={1: buf}), quarantine_s=quarantine_s,
                      clock=lambda: clock.t)
    return space, buf, clock


def _census(space: CodeSpace, refs: dict[int, int], pcs=(), unknown: bool = False):
    """A recorded census of the quarantined chunks: ``refs`` maps an address to the
    stack words found there (one thread each)."""
    ranges = space.census_ranges()
    entries = [P.CensusEntry(tid=100 + k, state=P.CENSUS_OK, pc=0x401000, first_ref=a, refs=n)
               for k, (a, n) in enumerate(refs.items())]
    entries += [P.CensusEntry(tid=200 + k, state=P.CENSUS_OK, pc=pc) for k, pc in enumerate(pcs)]
    if unknown:
        entries.append(P.CensusEntry(tid=300, state=P.CENSUS_UNKNOWN, pc=0x401000,
                                     flags=P.CENSUS_F_ALTSTACK))
    totals = [sum(n for a, n in refs.items() if lo <= a < hi) for lo, hi in ranges]
    return CensusResult(entries, ranges, totals)


def test_code_space_keeps_a_chunk_while_a_stack_refers_to_it():
    space, buf, clock = _space(quarantine_s=1.0)
    held, other = Chunk(buf, buf.base, 64), Chunk(buf, buf.base + 128, 64)
    space.release(held)
    space.release(other)
    assert space.census_ranges() == [(buf.base, buf.base + 64), (buf.base + 128, buf.base + 192)]
    clock.t = 5.0
    ret = buf.base + 6
    # a thread that never returns keeps its chunk for good; the other goes after two
    freed = [space.census_done(_census(space, {ret: 1})) for _ in range(50)]
    assert freed[:2] == [0, 1] and sum(freed) == 1, freed
    assert other in space.free and held not in space.free
    assert space.retained(held)["stack_refs"] == 1
    assert space.retained(other) is None
    # the ref is gone: free two censuses later, int3-filled
    buf.write(held.addr, b"\x90" * 64)
    assert space.census_done(_census(space, {})) == 0
    assert space.retained(held)["stack_refs"] == 0 and space.retained(held)["clean_censuses"] == 1
    assert space.census_done(_census(space, {})) == 1
    assert held in space.free and buf.read(held.addr, 64) == b"\xcc" * 64


def test_code_space_holds_on_unknown_uncovered_and_failed_censuses():
    space, buf, clock = _space()
    chunk = Chunk(buf, buf.base, 64)
    space.release(chunk)
    clean = _census(space, {})
    held_by = {
        "a PC inside": _census(space, {}, pcs=[buf.base + 8]),
        "a thread on its alternate stack": _census(space, {}, unknown=True),
        "no reply": CensusResult([P.CensusEntry(tid=1, state=P.CENSUS_NO_REPLY)],
                                 clean.ranges, [0]),
        "the census did not ask about it": CensusResult([], [(buf.base + 64, buf.base + 128)],
                                                        [0]),
        "the agent refused the census": CensusResult([], clean.ranges, [0],
                                                     result=P.Result.E_INVAL),
        "a recorded entry with refs in two places": [
            P.CensusEntry(tid=1, state=P.CENSUS_OK, pc=0, first_ref=0x1000, refs=2)],
        "a recorded entry whose first ref is inside": [
            P.CensusEntry(tid=1, state=P.CENSUS_OK, pc=0, first_ref=buf.base, refs=1)],
    }
    for why, census in held_by.items():
        assert space.census_done(clean) == 0, why
        assert space.census_done(census) == 0, why
        assert space.quarantine[0].clean_censuses == 0, why
    assert space.census_done(clean) == 0
    assert space.census_done(clean) == 1


def test_census_ranges_are_grouped_beyond_the_limit():
    """More chunks than a request holds: the smallest gaps are closed, so a covering
    range never spans the distance between two far buffers."""
    space, buf, _ = _space()
    far = CodeBufferHandle(2, 0x7E0000000000, 4096, mmap.mmap(-1, 4096))
    chunks = [Chunk(buf, buf.base + 32 * k, 16) for k in range(100)]
    chunks += [Chunk(far, far.base + 64 * k, 16) for k in range(30)]
    for c in chunks:
        space.release(c)
    ranges = space.census_ranges()
    assert len(ranges) == P.MAX_CENSUS_RANGES
    assert all(a[1] <= b[0] for a, b in zip(ranges, ranges[1:]))
    assert all(any(lo <= c.addr and c.addr + c.size <= hi for lo, hi in ranges) for c in chunks)
    assert not any(lo < buf.base and hi > far.base + far.size for lo, hi in ranges)
    # a census with a word in a covering range holds every chunk inside it
    assert space.census_done(_census(space, {buf.base + 40: 1})) == 0
    held = [c for c in chunks if space.retained(c)["stack_refs"]]
    assert chunks[1] in held and len(held) < len(chunks)
    # adjacent chunks stay apart: a word in one holds only that one
    space2, buf2, _ = _space()
    adjacent = [Chunk(buf2, buf2.base + 16 * k, 16) for k in range(4)]
    for c in adjacent:
        space2.release(c)
    assert space2.census_ranges() == [(buf2.base + 16 * k, buf2.base + 16 * k + 16)
                                      for k in range(4)]
    assert space2.census_done(_census(space2, {buf2.base + 40: 1})) == 0
    assert [bool(space2.retained(c)["stack_refs"]) for c in adjacent] == \
        [False, False, True, False]


def test_installer_reclaims_only_after_the_callee_returns(svc, exe):
    """The whole path: a region whose code calls park() is installed and removed while
    a thread waits in park(); reclaim (census with the quarantined ranges) keeps its
    code, says why, and frees it two censuses after the thread returned."""
    p = start(svc, exe)
    space = CodeSpace(p.conn, quarantine_s=0.0)
    inst = Installer(p.conn, lambda a, n: read_mem(p.client.pid, a, n), space=space)
    site = p.sites[2]
    chunk = inst.reserve(64, reach=[site])
    head = assemble(f"push rdi; call {p.park:#x}", chunk.addr)
    code = head + assemble(f"pop rdi; imul eax, edi, 1000; jmp {site + 6:#x}",
                           chunk.addr + len(head))
    gen = SimpleNamespace(code=code, base=chunk.addr, entries={site: chunk.addr},
                          addr_map=[(chunk.addr, chunk.addr + len(code), site)],
                          exits=[(chunk.addr + len(code) - 5, site + 6)], transfers={})
    reg = inst.install(chunk, gen, name="calls-park")
    assert reg.state is InstallState.INSTALLED
    p.client.send("go 1 2")
    tid = int(p.client.out.expect("parked").split()[1])
    inst.uninstall(reg.region_id, "test")
    for _ in range(6):
        assert inst.reclaim() == 0
    held = inst.retained()[reg.region_id]
    assert held["stack_refs"] == 1 and held["threads_inside"] == 0 and held["censuses"] == 6
    release(p, [tid])
    freed = [inst.reclaim() for _ in range(2)]
    assert freed == [0, 1], freed
    assert inst.retained() == {}
    rc, _ = p.client.finish()
    assert rc == 0, p.client.err.lines


def test_regions_listing_says_what_retains_removed_code():
    """`dbr ctl regions PID`: a removed region whose code is still kept has `retained`
    (JSON), and the table says what keeps it."""
    import threading
    from dbr_service.session.session_regions import RegionBook, RegionRecord, RegionState
    from dbr_service.commands.cmd_ctl import render
    from dbr_service.commands.control import verb_regions

    held = {"stack_refs": 2, "threads_inside": 0, "threads_unknown": 0, "clean_censuses": 0,
            "censuses": 9, "quarantined_s": 3.2}
    recs = {"r1": RegionRecord("r1", "/bin/x", [0x401000], 3, 64, RegionState.REMOVED,
                               info={"install_id": 1}),
            "r2": RegionRecord("r2", "/bin/x", [0x402000], 1, 32, RegionState.REMOVED,
                               info={"install_id": 2}),
            "r3": RegionRecord("r3", "/bin/x", [0x403000], 1, 32, RegionState.INSTALLED,
                               info={"install_id": 3})}
    book = RegionBook(threading.RLock())
    book.regions.update(recs)
    session = SimpleNamespace(pid=5, region_status="3 region(s)", region_book=book, maps=[],
                              installer=SimpleNamespace(retained=lambda: {1: held}))
    out = verb_regions(SimpleNamespace(find_client=lambda pid: session), {"pid": 5})
    assert [r.get("retained") for r in out["regions"]] == [held, None, None]
    assert "removed (retained: 2 stack refs)" in render("regions", out)

    held = {"stack_refs": 2, "threads_inside": 0, "threads_unknown": 0, "clean_censuses": 0,
            "censuses": 9, "quarantined_s": 3.2}
    result = {"pid": 5, "status": "1 region(s)", "regions": [
        {"id": "r1", "state": "removed", "blocks": 3, "code_bytes": 64, "entries": [0x401000],
         "module": "/bin/x", "info": {}, "retained": held},
        {"id": "r2", "state": "installed", "blocks": 1, "code_bytes": 32, "entries": [0x402000],
         "module": "/bin/x", "info": {}}]}
    text = render("regions", result)
    assert "removed (retained: 2 stack refs)" in text
    held.update(stack_refs=0, threads_unknown=1)
    assert "removed (retained: 1 threads unknown)" in render("regions", result)
