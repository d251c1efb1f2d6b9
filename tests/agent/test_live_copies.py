"""Real calls to a live copy of the callee (codegen/calls.py, "Calls to live copies";
installation/install.py, "Calls into live copies").

* Emission: with ``call_target`` a real call (direct or promoted) goes to the copy when
  it is in rel32 reach, else to the original callee; unicorn runs from random states
  match the original, every call entering the copy and returning into the caller's code.
* CodeSpace: a chunk that code still allocated (live or quarantined) calls into is not
  freed, whatever the censuses say; freeing its caller lets it go.
* Installer, against the real agent: the caller's REGION names the copy's
  dependencies; removal (operator, evaluation, map change, a refused resume) takes the
  callers along; suspending suspends them and resuming resumes them; the callee's
  code is reclaimed only after the caller's.
* Batches are installed callees first.
"""

from __future__ import annotations

import mmap
import random
import struct
from types import SimpleNamespace

import pytest
from codegen_util import CS, UREG, Machine, asm
from harness import SITE_INSN, read_mem, stub_gen
from realcall_util import (
    LIB, ORIG, SENTINEL, STACK, STACK_SIZE, DATA_SIZE, NEAR, Program, loop_with_call, same_run,
    select_program, call_state)

from dbr_service.wire import protocol as P
from dbr_service.wire.agentconn import CensusResult, CodeBufferHandle
from dbr_service.codegen.calls import encode_promoted
from dbr_service.codegen.emit import check_generated, emit_region
from dbr_service.codegen.layout import Layout
from dbr_service.codegen.relocate import Relocator
from dbr_service.common.errors import CodegenError
from dbr_service.installation.install import Chunk, CodeSpace, InstallState, Installer
from dbr_service.installation.optimize import EvalPolicy, Evaluator, callees_first


# ---- emission ----------------------------------------------------------------------------

def test_golden_real_call_to_a_copy() -> None:
    sr = loop_with_call()
    base, copy = 0x50_0000, 0x50_2000
    gen = emit_region(sr, base, layout=Layout([0x401000, 0x401005, 0x40100A]),
                      call_target={0x401100: copy}.get)
    call = next(i for i in CS.disasm(gen.code, base) if i.mnemonic == "call")
    assert call.address == base + 5 and call.operands[0].imm == copy
    assert gen.call_copies == {base + 5: copy}
    # the maps are those of a call to the original: same return address, same exits
    plain = emit_region(sr, base, layout=Layout([0x401000, 0x401005, 0x40100A]))
    assert gen.returns == plain.returns == {base + 10: 0x40100A}
    assert gen.exits == plain.exits and (base + 5, 0x401100) in gen.exits
    assert gen.evictions == plain.evictions and gen.addr_map == plain.addr_map
    assert gen.code[:5] == plain.code[:5] and gen.code[10:] == plain.code[10:]
    check_generated(gen)
    # a call to anywhere else is still refused
    gen.call_copies[base + 5] = copy + 16
    with pytest.raises(CodegenError, match="call in replacement code"):
        check_generated(gen)


def test_a_copy_out_of_reach_or_unknown_is_not_called() -> None:
    sr = loop_with_call()
    base = 0x50_0000
    plain = emit_region(sr, base)
    for target in ({0x401100: base + (3 << 30)}.get, {0x401234: base + 0x2000}.get,
                   lambda _t: None):
        gen = emit_region(sr, base, call_target=target)
        assert gen.code == plain.code and gen.call_copies == {}


def test_promoted_calls_go_to_copies() -> None:
    reloc = Relocator()
    call = asm("call rax", 0x1000)
    insn = reloc.decode(call, 0x1000)
    copies = {0x2000: 0x7000, 0x3000: None}
    parts = encode_promoted(reloc, insn, 0x5000, [0x2000, 0x3000], slot_of=lambda t: 0,
                            exit_to=lambda t: t, cont=(0x1002, 0x9000, True),
                            call_to=lambda t: copies[t] or t)
    at, dst = 0x5000, {}
    for p in parts:
        if p.role == "call":
            i = next(CS.disasm(p.code, at))
            dst[p.fixups[0].orig_target] = i.operands[0].imm
        at += len(p.code)
    assert dst == {0x2000: 0x7000, 0x3000: 0x3000}


COPY = NEAR + 0x10000     # where the test puts a copy of ``work``


def _work_copy(p: Program) -> bytes:
    """``work`` copied byte for byte (its only branch is rel8 inside it)."""
    end = next(i.address + i.size for i in CS.disasm(p.code[p.work - p.main:], p.work)
               if i.mnemonic == "ret")
    return bytes(p.image[p.work - ORIG:end - ORIG])


def _run(p: Program, gen, st, start: int, copy: bytes | None):
    """Run to the sentinel; (the final state, (slot, return address, callee) per call)."""
    ranges = [(ORIG, 0x1000), (LIB, 0x1000), (STACK, STACK_SIZE), (SENTINEL, 0x1000)]
    if gen is not None:
        ranges.append((gen.base, gen.size))
    if copy is not None:
        ranges.append((COPY, len(copy)))
    m = Machine(ranges)
    m.write(SENTINEL, b"\xf4" * 0x1000)
    m.write(ORIG, bytes(p.image))
    m.write(LIB, p.lib)
    if gen is not None:
        m.write(gen.base, gen.code)
    if copy is not None:
        m.write(COPY, copy)
    m.set_state(st)
    seen = []

    def inside(a: int) -> bool:
        if a in (p.work, COPY):
            rsp = m.uc.reg_read(UREG["rsp"])
            seen.append((rsp, struct.unpack("<Q", m.read(rsp, 8))[0], a))
        return a != SENTINEL

    assert m.run(start, inside, limit=200000) == SENTINEL
    state = m.snapshot([(ORIG, DATA_SIZE), (STACK, STACK_SIZE)])
    return SimpleNamespace(state=state, seen=[(s, r) for s, r, _ in seen],
                           callees=[c for _, _, c in seen], rets=[r for _, r, _ in seen])


def test_call_into_a_copy_differential() -> None:
    """The loop's region calling a copy of ``work`` at another address: the same final
    state as the original from random states; every call enters the copy, never the
    original, and returns into the caller's code right after the call."""
    p = Program("work")
    [sr] = select_program(p, real_calls=True)
    gen = emit_region(sr, NEAR, call_target={p.work: COPY}.get)
    check_generated(gen)
    assert list(gen.call_copies.values()) == [COPY]
    copy = _work_copy(p)
    rng = random.Random(36)
    for i in range(6):
        n = rng.choice([1, 3, rng.randrange(4, 40)])
        st = call_state(rng, n)
        a = _run(p, None, st, p.main, None)
        b = _run(p, gen, st, gen.entries[p.main], copy)
        same_run(a, b, f"run {i} n={n}")
        assert b.callees == [COPY] * n and a.callees == [p.work] * n
        assert all(r in gen.returns for r in b.rets), b.rets


# ---- code space ----------------------------------------------------------------------------

def _space():
    clock = SimpleNamespace(t=0.0)
    buf = CodeBufferHandle(1, 0x7F0000000000, 4096, mmap.mmap(-1, 4096))
    space = CodeSpace(SimpleNamespace(buffers={1: buf}), quarantine_s=0.0,
                      clock=lambda: clock.t)
    return space, buf


def _census(space: CodeSpace, refs: dict[int, int] = {}, pcs=()):   # noqa: B006
    ranges = space.census_ranges()
    entries = [P.CensusEntry(tid=100 + k, state=P.CENSUS_OK, pc=0x401000, first_ref=a, refs=n)
               for k, (a, n) in enumerate(refs.items())]
    entries += [P.CensusEntry(tid=200 + k, state=P.CENSUS_OK, pc=pc) for k, pc in enumerate(pcs)]
    return CensusResult(entries, ranges,
                        [sum(n for a, n in refs.items() if lo <= a < hi) for lo, hi in ranges])


def test_a_copy_is_held_while_code_calling_it_is_quarantined():
    space, buf = _space()
    callee, caller = Chunk(buf, buf.base, 64), Chunk(buf, buf.base + 128, 64)
    space.link(caller, callee)
    space.link(caller, callee)                       # once is enough
    assert callee.users == 1 and caller.uses == [callee]
    # the callee removed while its caller is live: held, however clean
    space.release(callee)
    assert [space.census_done(_census(space)) for _ in range(4)] == [0, 0, 0, 0]
    assert space.retained(callee)["callers"] == 1
    assert space.retained(callee)["clean_censuses"] == 4
    # the caller removed too, a thread's return address in it: both held
    space.release(caller)
    assert [space.census_done(_census(space, {caller.addr + 9: 1})) for _ in range(3)] == [0] * 3
    assert space.retained(caller)["stack_refs"] == 1 and space.retained(callee)["stack_refs"] == 0
    # it returned: the caller goes after two clean censuses, and the callee with it
    assert space.census_done(_census(space)) == 0
    assert space.census_done(_census(space)) == 2
    assert callee.users == 0 and caller.uses == []
    assert buf.read(callee.addr, 64) == buf.read(caller.addr, 64) == b"\xcc" * 64


def test_a_freed_caller_lets_a_held_copy_go_only_once_clean():
    """Freeing the caller releases the hold; the callee still needs its own clean
    censuses (a thread inside the copy itself holds it)."""
    space, buf = _space()
    callee, caller = Chunk(buf, buf.base, 64), Chunk(buf, buf.base + 128, 64)
    space.link(caller, callee)
    space.release(callee)
    space.release(caller)
    inside = callee.addr + 4
    assert space.census_done(_census(space, pcs=[inside])) == 0
    assert space.census_done(_census(space, pcs=[inside])) == 1        # the caller
    assert callee.users == 0 and space.retained(callee)["threads_inside"] == 1
    assert space.census_done(_census(space)) == 0
    assert space.census_done(_census(space)) == 1
    assert space.quarantine == []


def test_a_chain_of_copies_goes_in_one_census():
    space, buf = _space()
    a, b, c = (Chunk(buf, buf.base + 64 * k, 64) for k in range(3))
    space.link(a, b)            # a calls b's copy, b calls c's
    space.link(b, c)
    for ch in (c, b, a):
        space.release(ch)
    assert space.census_done(_census(space)) == 0
    assert space.census_done(_census(space)) == 3


# ---- batches ---------------------------------------------------------------------------

def _sr(name: str, entries: list[int], calls: list[int] = (), promoted: list[int] = ()):
    sites = {k: {"decision": "call", "callee": t} for k, t in enumerate(calls)}
    if promoted:
        sites[99] = {"decision": "promoted", "targets": list(promoted)}
    return SimpleNamespace(id=name, entry_points=lambda: entries,
                           info={"inline": {"sites": sites}})


def test_batches_are_installed_callees_first():
    outer = _sr("outer", [0x100], calls=[0x200])
    inner = _sr("inner", [0x200], calls=[0x300])
    leaf = _sr("leaf", [0x300])
    other = _sr("other", [0x400], promoted=[0x200])
    loop_a = _sr("a", [0x500], calls=[0x600])
    loop_b = _sr("b", [0x600], calls=[0x500])
    got = [s.id for s in callees_first([outer, other, loop_a, inner, loop_b, leaf])]
    assert got.index("leaf") < got.index("inner") < got.index("outer")
    assert got.index("inner") < got.index("other")
    assert sorted(got) == sorted(["outer", "other", "a", "inner", "b", "leaf"])
    unrelated = [_sr(str(k), [k]) for k in range(5)]
    assert callees_first(unrelated) == unrelated


# ---- the installer, against the agent -------------------------------------------------------

def _pair(inst: Installer, sites: list[int], callee_site: int, caller_site: int):
    """A callee region at ``callee_site`` and a caller region at ``caller_site`` whose
    (recorded) real call goes to the callee's copy."""
    c1 = inst.reserve(32, reach=[callee_site])
    callee = inst.install(c1, stub_gen(c1.addr, [callee_site]), name="callee",
                          orig_ranges=[(callee_site, callee_site + 6)])
    c2 = inst.reserve(32, reach=[caller_site])
    gen = stub_gen(c2.addr, [caller_site])
    gen.call_copies = {c2.addr: callee.gen.entries[callee_site]}
    caller = inst.install(c2, gen, name="caller", calls_into=[callee])
    assert callee.state is caller.state is InstallState.INSTALLED
    return callee, caller


def _patched(pid: int, site: int) -> bool:
    return read_mem(pid, site, 1) == b"\xe9"


def test_caller_depends_on_the_copy_and_goes_with_it(client_conn):
    _, client, conn, sites = client_conn
    inst = Installer(conn, lambda a, n: read_mem(client.pid, a, n),
                     space=CodeSpace(conn, quarantine_s=0.0))
    callee, caller = _pair(inst, sites, sites[0], sites[3])
    assert caller.calls_into == [callee.region_id] and callee.chunk.users == 1
    assert caller.chunk.uses == [callee.chunk]
    assert all(any(lo <= a and b <= hi for lo, hi in caller.depends) for a, b in callee.depends)
    assert inst.affected_by(sites[0], sites[0] + 1) == [callee, caller]
    assert inst.affected_by(sites[3], sites[3] + 1) == [caller]
    assert inst.copy_entries()[sites[0]] == (callee.gen.entries[sites[0]], callee)
    # a second caller, and the operator unpatches the callee: both callers go first
    c3 = inst.reserve(32, reach=[sites[5]])
    gen = stub_gen(c3.addr, [sites[5]])
    gen.call_copies = {c3.addr: callee.gen.entries[sites[0]]}
    other = inst.install(c3, gen, name="other", calls_into=[callee])
    inst.uninstall(callee.region_id, "operator", evict=True)
    assert [r.state for r in (callee, caller, other)] == [InstallState.REMOVED] * 3
    assert caller.why_removed == "calls the copy of callee, removed: operator"
    assert inst.pop_cascaded() == [caller, other] and inst.pop_cascaded() == []
    assert not any(_patched(client.pid, s) for s in (sites[0], sites[3], sites[5]))
    # removing again changes nothing
    assert inst.uninstall(caller.region_id, "again") is caller and inst.pop_cascaded() == []
    assert inst.patches_removed == 3
    # reclaimed callers first: never the callee while a caller's chunk is held
    for _ in range(60):
        inst.reclaim()
        q = [x.chunk for x in inst.space.quarantine]
        if callee.chunk not in q:
            assert caller.chunk not in q and other.chunk not in q
        if not q:
            break
    assert inst.space.quarantine == []


def test_code_calling_a_missing_copy_is_refused(client_conn):
    _, client, conn, sites = client_conn
    inst = Installer(conn, lambda a, n: read_mem(client.pid, a, n))
    callee, _ = _pair(inst, sites, sites[0], sites[3])
    c = inst.reserve(32, reach=[sites[6]])
    gen = stub_gen(c.addr, [sites[6]])
    gen.call_copies = {c.addr: callee.gen.entries[sites[0]]}
    with pytest.raises(CodegenError, match="no live region"):
        inst.install(c, gen, calls_into=[])
    assert not _patched(client.pid, sites[6])
    inst.uninstall_all("done")


def test_evaluation_and_map_changes_take_callers_along(client_conn):
    _, client, conn, sites = client_conn
    inst = Installer(conn, lambda a, n: read_mem(client.pid, a, n))
    callee, caller = _pair(inst, sites, sites[0], sites[3])
    ev = Evaluator(inst, EvalPolicy(grace_s=0.0, min_samples=10))
    # the callee's samples stay in its original code: not effective; the caller too
    ev.snapshot({sites[0]: 20, caller.gen.entries[sites[3]]: 30})
    done = ev.apply()
    assert [(r.name, why) for r, why in done] == [
        ("callee", "not effective"), ("caller", "calls the copy of callee, removed: not effective")]
    assert caller.state is InstallState.REMOVED and ev.apply() == []
    # a map change over the callee's code takes the caller along; only the callee's
    # original code is gone
    callee, caller = _pair(inst, sites, sites[5], sites[7])
    hit = inst.on_map_changed(sites[5], sites[5] + 1)
    assert hit == [callee, caller] and inst.pop_cascaded() == []
    assert callee.original_changed and not caller.original_changed
    assert not _patched(client.pid, sites[5]) and not _patched(client.pid, sites[7])


def test_suspending_a_copy_suspends_its_callers(client_conn):
    _, client, conn, sites = client_conn
    inst = Installer(conn, lambda a, n: read_mem(client.pid, a, n))
    callee, caller = _pair(inst, sites, sites[0], sites[3])
    for _ in range(2):
        inst.suspend(callee.region_id)
        assert callee.state is caller.state is InstallState.SUSPENDED
        assert caller.suspended_for == callee.region_id
        assert not _patched(client.pid, sites[0]) and not _patched(client.pid, sites[3])
        assert inst.copy_entries() == {}
        inst.resume(callee.region_id)
        assert callee.state is caller.state is InstallState.INSTALLED
        assert caller.suspended_for is None
        assert _patched(client.pid, sites[0]) and _patched(client.pid, sites[3])
    # a check of both: the caller suspended first stays with the check, not the callee
    inst.suspend(caller.region_id)
    inst.suspend(callee.region_id)
    assert caller.suspended_for is None
    inst.resume(callee.region_id)
    assert caller.state is InstallState.SUSPENDED
    inst.resume(caller.region_id)
    # a resume the agent refuses retires the callee, and with it its suspended caller
    inst.suspend(callee.region_id)
    wrong = P.PatchSite.from_buffer_copy(bytes(callee.suspended_sites[0]))
    wrong.orig[0] ^= 0xFF
    callee.suspended_sites[0] = wrong
    inst.resume(callee.region_id)
    assert callee.state is caller.state is InstallState.REMOVED
    assert inst.pop_cascaded() == [caller]
    for s in (sites[0], sites[3]):
        assert read_mem(client.pid, s, 6) == SITE_INSN


def test_session_records_the_regions_removed_with_a_callee():
    """The client session marks as removed the records of regions the installer took
    out with the copy they called, once, with the installer's reason."""
    from types import SimpleNamespace

    from dbr_service.session.clients import ClientSession
    from dbr_service.session.session_regions import RegionState

    caller = SimpleNamespace(region_id=7, why_removed="callee r2 removed: operator")
    rec = SimpleNamespace(id="r7", state=RegionState.INSTALLED)
    gone = SimpleNamespace(id="r9", state=RegionState.REMOVED)
    removed = []
    pending = [caller, SimpleNamespace(region_id=9, why_removed="x")]
    fake = SimpleNamespace(
        installer=SimpleNamespace(pop_cascaded=lambda: [pending.pop(0) for _ in list(pending)]),
        region_book=SimpleNamespace(record_of=lambda iid: {7: rec, 9: gone}.get(iid)),
        _region_removed=lambda r, why: removed.append((r.id, why)))
    ClientSession._cascaded_removed(fake)
    ClientSession._cascaded_removed(fake)
    assert removed == [("r7", "callee r2 removed: operator")]


def test_regions_table_says_callers_hold_a_removed_copy():
    from dbr_service.commands.cmd_ctl import _state

    held = {"stack_refs": 0, "threads_inside": 0, "threads_unknown": 0, "callers": 2}
    assert _state({"state": "removed", "retained": held}) == "removed (retained: 2 callers)"
