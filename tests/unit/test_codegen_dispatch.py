"""Translated jump-table dispatch (codegen/dispatch.py), differentially with unicorn.

The original ``add R, B; [notrack] jmp R`` and its translation run from the same states;
the complete state where control leaves them must agree: all GPRs, the arithmetic flags,
the stack incl. the red zone, and the destination (a replacement address is mapped back
to the target it stands for).  States cover every way the run-time checks can go: the
analysed table (every target), a B that is not the table base, offsets between entries,
just outside the range, equal in their low 32 bits to an entry's but not in 64, and
random ones; for many (R, B) register pairs incl. r12/r13/rbp (SIB and disp forms),
both ``add`` encodings and the ``notrack`` prefix.
"""

from __future__ import annotations

import random
import struct
from dataclasses import replace

import pytest
from codegen_util import CS, Machine, random_state
from unicorn import UcError
from unicorn.x86_const import UC_X86_REG_RIP

from dbr_service.codegen.dispatch import (
    MAX_SPAN,
    DispatchPlan,
    dispatch_data,
    encode_dispatch,
    plan_dispatch,
    region_dispatch_plan,
)
from dbr_service.codegen.relocate import CannotRelocate, jmp_rel32
from dbr_service.region.model import BasicBlock, TermKind

REGS = ["rax", "rcx", "rdx", "rbx", "rsp", "rbp", "rsi", "rdi",
        "r8", "r9", "r10", "r11", "r12", "r13", "r14", "r15"]
ORIG = 0x5555_5555_4000          # the dispatch block; targets after it, table before
WIN = 0x4000
BASE = ORIG - 0x1000             # the table base (entries are offsets from it)
NEW = ORIG + 0x4000_0000         # replacement code; its copies of targets after it
COPIES = NEW + 0x10000
STACK, STACK_SIZE = 0x7FFE_0000_0000, 0x2000
RSP = STACK + 0x1000


def add_bytes(r: int, b: int, op: int) -> bytes:
    """``add R, B`` as 01 /r (r/m = R) or 03 /r (reg = R)."""
    if op == 0x01:
        return bytes((0x48 | (b >> 3) << 2 | r >> 3, 0x01, 0xC0 | (b & 7) << 3 | r & 7))
    return bytes((0x48 | (r >> 3) << 2 | b >> 3, 0x03, 0xC0 | (r & 7) << 3 | b & 7))


def jmp_bytes(r: int, notrack: bool) -> bytes:
    return (b"\x3e" if notrack else b"") + (b"\x41" if r >= 8 else b"") + \
        bytes((0xFF, 0xE0 | r & 7))


def block(r: int, b: int, op: int, notrack: bool, targets: list[int],
          base: int | None = BASE) -> BasicBlock:
    add, jmp = add_bytes(r, b, op), jmp_bytes(r, notrack)
    data = add + jmp
    return BasicBlock(ORIG, len(data), [(ORIG, len(add)), (ORIG + len(add), len(jmp))],
                      data, TermKind.IJMP, targets, table_base=base)


def _targets(rng: random.Random, n: int) -> list[int]:
    t, out = ORIG + 0x40, []
    for _ in range(n):
        out.append(t)
        t += rng.randrange(8, 40)
    return out


def _states(rng: random.Random, plan: DispatchPlan, r: str, b: str):
    """(R, B) pairs that reach mapped memory: (R + B) lands in the original window."""
    offs = plan.offsets
    entries = set(offs)
    between = [o for o in range(plan.omin, plan.omax) if o not in entries]
    pairs = [(o, BASE) for o in offs]                                   # every target
    pairs += [(o, BASE) for o in rng.sample(between, min(6, len(between)))]
    pairs += [(plan.omin - 1, BASE), (plan.omax + 1, BASE), (plan.omin - 8, BASE)]
    pairs += [(o + (1 << 32), BASE - (1 << 32)) for o in offs[:2]]      # low 32 bits match
    pairs += [(o - 8, BASE + 8) for o in offs[:2]]                      # B is not the base
    pairs += [(o - 1, BASE + 1) for o in offs[:2]]
    # B far from the base with R in range: the target is unmapped, and so would be a
    # look-up through B (the base check must come first)
    pairs += [(offs[0], BASE + (1 << 40)), (offs[-1], BASE - (1 << 36))]
    for _ in range(4):                                                  # anything at all
        x = ORIG + rng.randrange(0, WIN)
        bb = rng.getrandbits(64)
        pairs.append(((x - bb) & (2**64 - 1), bb))
    for rv, bv in pairs:
        st = random_state(rng, RSP, {STACK: STACK_SIZE}, {r: rv & (2**64 - 1),
                                                          b: bv & (2**64 - 1)})
        yield st


def split(bb: BasicBlock) -> tuple[BasicBlock, BasicBlock]:
    """(the block ending in the add, the lone jmp), as discovery makes them."""
    (aa, an), (ja, jn) = bb.insns
    pred = replace(bb, size=an, insns=[(aa, an)], data=bb.data[:an],
                   term=TermKind.FALLTHROUGH, targets=[], table_base=None)
    return pred, replace(bb, start=ja, size=jn, insns=[(ja, jn)], data=bb.data[an:])


CASES = [(r, b, op, nt, False) for (r, b) in [("rax", "rdx"), ("rdx", "r8"), ("r12", "r13"),
                                              ("r13", "rbp"), ("rcx", "r12"), ("r8", "rax"),
                                              ("rbp", "r15"), ("r15", "rbx")]
         for op in (0x01, 0x03) for nt in (False, True)]
CASES += [(r, b, 0x01, False, True) for (r, b) in [("rax", "rdx"), ("rdx", "r8"),
                                                   ("r12", "r13"), ("r13", "rbp")]]


@pytest.mark.parametrize("r, b, op, notrack, lone", CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[2]:02x}{'-notrack' if c[3] else ''}"
                              f"{'-lone' if c[4] else ''}" for c in CASES])
def test_dispatch_differential(r: str, b: str, op: int, notrack: bool, lone: bool) -> None:
    """``lone``: the jmp has a block of its own and the add ends the one before; the
    translation then runs after the original add (which the block before keeps)."""
    rng = random.Random(f"{r}{b}{op}{notrack}{lone}")
    ri, bi = REGS.index(r), REGS.index(b)
    targets = _targets(rng, rng.randrange(3, 14))
    bb = block(ri, bi, op, notrack, targets)
    if lone:
        pred, jb = split(bb)
        plan = plan_dispatch(jb, pred)
        assert plan_dispatch(jb) is None and plan.split
    else:
        plan = plan_dispatch(bb)
    assert plan is not None and (plan.r, plan.b) == (ri, bi) and plan.notrack == notrack
    # some targets have in-region copies, the others exit through the table
    copied = {t: COPIES + (t - ORIG) for t in targets if rng.random() < 0.6}
    dests = {t: copied.get(t, t) for t in targets}
    data = NEW + 0x800
    dc = encode_dispatch(plan, NEW, data)
    code = link(plan, NEW, dc, dests)
    blob = dispatch_data(plan, NEW + dc.miss_at, {t: NEW + o for t, o in dc.stubs.items()})
    assert all(i.mnemonic not in ("call", "push", "pop", "pushfq", "popfq")
               for i in CS.disasm(code, NEW))
    m = Machine([(ORIG - 0x1000, WIN + 0x1000), (NEW, 0x800 + len(blob)),
                 (COPIES, WIN), (STACK, STACK_SIZE)])
    m.write(ORIG - 0x1000, b"\xf4" * (WIN + 0x1000))
    m.write(ORIG, bb.data)
    m.write(COPIES, b"\xf4" * WIN)
    m.write(NEW, code)
    m.write(data, blob)
    hits = misses = 0
    for i, st in enumerate(_states(rng, plan, r, b)):
        m.set_state(st)
        a_rip = _run(m, ORIG, bb.size)
        a = m.snapshot([(STACK, STACK_SIZE)])
        m.set_state(st)
        if lone:                                 # the block before: the original add
            assert _run(m, ORIG, len(plan.add)) == ORIG + len(plan.add)
        b_rip = _run(m, NEW, len(code))
        bs = m.snapshot([(STACK, STACK_SIZE)])
        ctx = f"state {i}: {r}={st.regs[r]:#x} {b}={st.regs[b]:#x}"
        if isinstance(a_rip, tuple) or isinstance(b_rip, tuple):     # a fault
            assert a_rip == b_rip, f"{ctx}: {b_rip} vs original {a_rip}"
            misses += 1
        elif COPIES <= b_rip < COPIES + WIN:
            b_rip = b_rip - COPIES + ORIG
            assert b_rip in copied, f"{ctx}: entered a copy of {b_rip:#x}, not copied"
            hits += 1
        else:
            assert b_rip not in copied or st.regs[b] != BASE, \
                f"{ctx}: left for {b_rip:#x}, which has a copy"
            hits += b_rip in targets and st.regs[b] == BASE
            misses += b_rip not in targets or st.regs[b] != BASE
        assert b_rip == a_rip, f"{ctx}: went to {b_rip:#x}, original to {a_rip:#x}"
        assert bs.regs == a.regs, ctx
        assert bs.rflags == a.rflags, f"{ctx}: flags {bs.rflags:#x} != {a.rflags:#x}"
        low = RSP - 128 - STACK
        assert bs.mem[STACK][low:] == a.mem[STACK][low:], f"{ctx}: stack/red zone"
    assert hits >= len(targets) and misses >= 8


def link(plan: DispatchPlan, at: int, dc, dests: dict[int, int]) -> bytes:
    """``dc``'s code with each stub's ``jmp rel32`` aimed at its target's destination
    (what the emitter does)."""
    out = bytearray(dc.code)
    for t, off in dc.stubs.items():
        assert out[off:off + 3] == plan.add and out[off + 3] == 0xE9
        out[off + 3:off + 8] = jmp_rel32(at + off + 3, dests[t])
    return bytes(out)


def _run(m: Machine, start: int, size: int):
    """Where control leaves [start, start + size), or ("fault", errno, rip)."""
    try:
        return m.run(start, lambda x: start <= x < start + size)
    except UcError as e:
        return ("fault", e.errno, m.uc.reg_read(UC_X86_REG_RIP))


def test_plan_refusals() -> None:
    rax, rdx, rsp = 0, 2, 4
    ok = block(rax, rdx, 0x01, False, [ORIG + 0x40, ORIG + 0x48])
    assert plan_dispatch(ok) is not None
    assert plan_dispatch(replace(ok, table_base=None)) is None           # no table known
    assert plan_dispatch(replace(ok, targets=[])) is None
    assert plan_dispatch(replace(ok, term=TermKind.ICALL)) is None
    # targets closer than any slot: fine (one slot per offset, one stub per target)
    assert plan_dispatch(replace(ok, targets=[ORIG + 0x40, ORIG + 0x41])) is not None
    # offsets spanning more than MAX_SPAN
    assert plan_dispatch(replace(ok, targets=[ORIG, ORIG + MAX_SPAN])) is None
    assert plan_dispatch(replace(ok, targets=[ORIG, ORIG + MAX_SPAN - 1])) is not None
    # offsets beyond int32
    assert plan_dispatch(replace(ok, table_base=ORIG - (1 << 32))) is None
    # the jump must go through the register the add wrote, and not rsp
    assert plan_dispatch(block(rax, rdx, 0x03, False, ok.targets)) is not None
    other = replace(ok, data=add_bytes(rax, rdx, 0x01) + jmp_bytes(rdx, False))
    assert plan_dispatch(other) is None
    assert plan_dispatch(block(rsp, rdx, 0x01, False, ok.targets)) is None
    assert plan_dispatch(block(rax, rsp, 0x01, False, ok.targets)) is None
    assert plan_dispatch(block(rax, rax, 0x01, False, ok.targets)) is None
    # 32-bit add, memory jmp, a lone jmp
    add32 = bytes((0x01, 0xD0))
    assert plan_dispatch(replace(ok, data=add32 + b"\xff\xe0", size=4,
                                 insns=[(ORIG, 2), (ORIG + 2, 2)])) is None
    jmpm = b"\xff\x20"                                                   # jmp [rax]
    assert plan_dispatch(replace(ok, data=add_bytes(rax, rdx, 1) + jmpm)) is None
    assert plan_dispatch(replace(ok, data=b"\xff\xe0", size=2, insns=[(ORIG, 2)])) is None


def test_region_plan_needs_every_way_in_through_the_add() -> None:
    from dbr_service.region.model import END, START, EdgeKind, SuperRegion
    targets = [ORIG + 0x40, ORIG + 0x60]
    pred, jb = split(block(0, 2, 0x01, False, targets))

    def sr_with(*edges):
        sr = SuperRegion("t")
        sr.add_block(pred)
        sr.add_block(jb)
        for u, v, k in edges:
            sr.add_edge(u, v, k, 1.0)
        sr.add_edge(jb.start, END, EdgeKind.EXIT, 1.0, target=targets[0])
        return sr

    ok = sr_with((START, pred.start, EdgeKind.ENTRY),
                 (pred.start, jb.start, EdgeKind.FALLTHROUGH))
    assert region_dispatch_plan(ok, jb.start).split
    # a patch point at the jump, or no predecessor at all: flags and R unknown there
    assert region_dispatch_plan(sr_with((START, jb.start, EdgeKind.ENTRY)), jb.start) is None
    both = sr_with((START, pred.start, EdgeKind.ENTRY), (START, jb.start, EdgeKind.ENTRY),
                   (pred.start, jb.start, EdgeKind.FALLTHROUGH))
    assert region_dispatch_plan(both, jb.start) is None
    # a predecessor that jumps to it (not the fall-through from the add)
    other = replace(pred, start=ORIG - 0x100, insns=[(ORIG - 0x100, 3)])
    sr = sr_with((START, pred.start, EdgeKind.ENTRY),
                 (pred.start, jb.start, EdgeKind.FALLTHROUGH))
    sr.add_block(other)
    sr.add_edge(START, other.start, EdgeKind.ENTRY, 1.0)
    sr.add_edge(other.start, jb.start, EdgeKind.FLOW, 1.0)
    assert region_dispatch_plan(sr, jb.start) is None


def test_displacement_out_of_reach() -> None:
    plan = plan_dispatch(block(0, 2, 0x01, False, [ORIG + 0x40, ORIG + 0x60]))
    with pytest.raises(CannotRelocate):
        encode_dispatch(plan, NEW, BASE + (3 << 30))
    # the sizing pass does not check, and sizes never depend on addresses
    far = encode_dispatch(plan, NEW, BASE + (3 << 30), check=False)
    assert len(far.code) == len(encode_dispatch(plan, NEW, NEW + 0x100).code) \
        == plan.code_size(len(plan.targets))


def test_golden_rax_rdx() -> None:
    """The -O0 gcc shape (``add rax, rdx; jmp rax``), byte for byte."""
    G = 0x800                                    # a table base near the code
    plan = plan_dispatch(replace(block(0, 2, 0x01, False, [G + 0x10, G + 0x30]), table_base=G))
    dc = encode_dispatch(plan, 0x1000, 0x2000)
    text = [f"{i.mnemonic} {i.op_str}" for i in CS.disasm(dc.code, 0x1000)]
    miss = f"{0x1000 + dc.miss_at:#x}"
    assert text == [
        "cmp rdx, qword ptr [rip + 0xff9]",        # 0x2000: the BASE slot
        f"jne {miss}",
        "cmp rax, 0x10",
        f"jl {miss}",
        "cmp rax, 0x30",
        f"jg {miss}",
        f"notrack jmp qword ptr ds:[rdx + rax*8 + {0x2008 - G - 0x80:#x}]",
        "add rax, rdx",                            # miss: the original pair
        "jmp rax",
        "add rax, rdx",                            # stub of G + 0x10
        f"jmp {0x1000 + dc.stubs[G + 0x10] + 8:#x}",   # (placeholder: the caller aims it)
        "add rax, rdx",                            # stub of G + 0x30
        f"jmp {0x1000 + dc.stubs[G + 0x30] + 8:#x}",
    ]
    blob = dispatch_data(plan, 0x1000 + dc.miss_at, {t: 0x1000 + o for t, o in dc.stubs.items()})
    slots = struct.unpack_from(f"<{1 + 0x21}Q", blob, 0)
    assert slots[0] == G and len(blob) == 8 * (1 + 0x21)
    assert slots[1] == 0x1000 + dc.stubs[G + 0x10] and slots[-1] == 0x1000 + dc.stubs[G + 0x30]
    assert set(slots[2:-1]) == {0x1000 + dc.miss_at}
