"""Indirect-call promotion (codegen/calls.py, region/inline.py) and tail calls.

Encodings: golden bytes of both forms and a capstone round trip of every compare and
load the promoted call emits.  Selection: which targets are promoted, in which order,
and why the others are not.  Unicorn differential runs of programs assembled at their
original address (an IP profile plus the branch records of an LBR, both exact, from a
run of the original; hot-code discovery and the whole region pipeline; emission): the
replacement code, entered through its patch sites, runs as the original from random
states whose call tables also name a target never seen (a miss) and one in another
module (refused); every callee starts with the registers and the stack it has in the
original; promoted calls return into the buffer, the others into original code.  Tail
calls: direct and indirect ones in a callee that the loop calls for real, or inlined.
"""

from __future__ import annotations

import random
import struct
from collections import Counter

import pytest
from codegen_util import CS, GPRS, UREG, Machine, asm, asm_rip, linear, random_state

from dbr_service.codegen.calls import MAX_PROMOTED, encode_promoted, icall_insn
from dbr_service.codegen.emit import check_generated, emit_region, promoted_call_sites
from dbr_service.codegen.relocate import CannotRelocate, Relocator
from dbr_service.region.discovery import hot_code_discovery
from dbr_service.region.inline import promotion
from dbr_service.region.memview import MappedRange, MemoryView
from dbr_service.region.model import END, BasicBlock, CloneKey, EdgeKind, TermKind
from dbr_service.region.pipeline import RegionConfig, run_pipeline

T = TermKind
RELOC = Relocator()
REGS = [r for r in GPRS if r != "rsp"]
DATA = 0x100
SENTINEL = 0x7000_0000_0000
STACK, STACK_SIZE = 0x7FFE_0000_0000, 0x4000
RSP = STACK + 0x3000
LOW, HIGH = 0x40_0000, 0x5555_5555_0000          # imm32 compares / data-slot compares


def _dis(code: bytes, at: int) -> list[tuple[str, str]]:
    out = [(i.bytes.hex(), f"{i.mnemonic} {i.op_str}".strip()) for i in CS.disasm(code, at)]
    assert sum(len(h) // 2 for h, _ in out) == len(code), "did not decode completely"
    return out


def _encode(call: bytes, at: int, targets, slots=None, cont=0x9000):
    insn = RELOC.decode(call, 0x1000)
    slots = slots or {}
    return encode_promoted(RELOC, insn, at, targets, slot_of=slots.__getitem__,
                           exit_to=lambda t: t, cont=(0x1000 + len(call), cont, True))


# -- encodings -------------------------------------------------------------------------------

def test_golden_register_form() -> None:
    """``call rax``: one immediate and one slot compare, hottest first; the hits in
    reverse order, so the hottest call comes last (it falls into the continuation)."""
    at, hi = 0x4000_2000, 0x8000_0100                   # hi >= 2**31: through a slot
    parts = _encode(b"\xff\xd0", at, [0x1100, hi], {hi: at + 0x100})
    assert [p.role for p in parts] == ["check", "miss", "call", "cont", "call"]
    assert _dis(b"".join(p.code for p in parts), at) == [
        ("4881f800110000", "cmp rax, 0x1100"),
        ("7418", "je 0x40002021"),                                   # hit 0x1100: last
        ("483b05f0000000", "cmp rax, qword ptr [rip + 0xf0]"),       # the slot, at + 0x100
        ("7405", "je 0x40002017"),
        ("e9e9efffbf", "jmp 0x1000"),                                # miss: the call insn
        ("e8e4e0ff3f", "call 0x80000100"),
        ("e9df6f00c0", "jmp 0x9000"),                                # the continuation
        ("e8daf0ffbf", "call 0x1100"),
    ]
    # the slot compare's data reference, the exits of the miss and the calls, the jump
    # to the continuation (an exit here: ``cont`` says so)
    fx = [(p.role, f.target, f.orig_target, f.exit, f.data) for p in parts for f in p.fixups]
    assert fx == [("check", at + 0x100, at + 0x100, False, True),
                  ("miss", 0x1000, 0x1000, True, False), ("call", hi, hi, True, False),
                  ("cont", 0x9000, 0x1002, True, False), ("call", 0x1100, 0x1100, True, False)]


def test_golden_memory_form() -> None:
    """``call [rip + d]``: rax saved below the red zone, the pointer loaded into it
    (re-displaced to the same address), restored on every path before it leaves."""
    call = asm_rip("call qword ptr [rip + {D}]", 0x1000, 0x3000)
    parts = _encode(call, 0x2000, [0x1100])
    assert [p.role for p in parts] == ["check", "miss", "restore", "call"]
    assert _dis(b"".join(p.code for p in parts), 0x2000) == [
        ("488d642480", "lea rsp, [rsp - 0x80]"),
        ("50", "push rax"),
        ("488b05f30f0000", "mov rax, qword ptr [rip + 0xff3]"),       # still 0x3000
        ("4881f800110000", "cmp rax, 0x1100"),
        ("740e", "je 0x2024"),
        ("58", "pop rax"),
        ("488da42480000000", "lea rsp, [rsp + 0x80]"),
        ("e9dcefffff", "jmp 0x1000"),
        ("58", "pop rax"),
        ("488da42480000000", "lea rsp, [rsp + 0x80]"),
        ("e8cef0ffff", "call 0x1100"),
    ]
    assert parts[0].fixups[0].target == 0x3000 and parts[0].fixups[0].data


@pytest.mark.parametrize("reg", REGS)
def test_compare_encodings_round_trip(reg: str) -> None:
    """Every register, an immediate and a slot compare: capstone reads back the register
    and the target (or the slot's address)."""
    call = asm(f"call {reg}", 0x1000)
    at, hi = 0x7000_0000, 0x8000_0000                  # the buffer in reach of everything
    parts = _encode(call, at, [0x7FFF_FFF0, hi], {hi: at + 0x400})
    ins = linear(parts[0].code, at)
    assert [i.mnemonic for i in ins] == ["cmp", "je", "cmp", "je"]
    assert ins[0].op_str == f"{reg}, 0x7ffffff0"
    assert ins[2].op_str.startswith(f"{reg}, qword ptr [rip + ")
    assert ins[2].address + ins[2].size + ins[2].disp == at + 0x400
    assert [p.role for p in parts] == ["check", "miss", "call", "cont", "call"]


MEM_OPERANDS = ["[rax + 8]", "[rdx + rax*8]", "[rax + rcx*8 + 0x10]", "[r11]", "[r12]",
                "[r13]", "[rbp]", "[rbp + 0x12345]", "[r15 + r14*4 - 0x80]", "[rax]",
                "[rcx*8 + 0x601000]", "fs:[rax + 8]"]


@pytest.mark.parametrize("operand", MEM_OPERANDS)
def test_load_encoding_round_trip(operand: str) -> None:
    """``mov rax, <the call's memory operand>``: capstone reads back the operand."""
    call = asm(f"call qword ptr {operand}", 0x1000)
    orig = RELOC.decode(call, 0x1000)
    parts = _encode(call, 0x5000, [0x1100])
    ins = linear(parts[0].code, 0x5000)
    assert [i.mnemonic for i in ins] == ["lea", "push", "mov", "cmp", "je"]
    assert ins[1].op_str == "rax" and ins[2].op_str == f"rax, {orig.op_str}"
    assert ins[2].size == orig.size + (orig.rex == 0)     # a REX.W prefix, where none was
    assert not parts[0].fixups                          # nothing rip-relative


def test_rip_load_round_trip_far_away() -> None:
    """A rip-relative operand re-displaced to the buffer: same effective address."""
    target = 0x1000 + 0x7000_0000
    call = b"\x3e" + asm_rip("call qword ptr [rip + {D}]", 0x1001, target)     # notrack
    parts = _encode(call, 0x1000 + 0x1000_0000, [0x1100])
    mov = linear(parts[0].code, 0x1000 + 0x1000_0000)[2]
    assert mov.bytes[0] == 0x48 and mov.address + mov.size + mov.disp == target
    assert parts[0].fixups[0].target == target and parts[0].fixups[0].data
    with pytest.raises(CannotRelocate):               # out of disp32 reach of the buffer
        _encode(call, 0x1000 - 0x2000_0000, [0x1100])


@pytest.mark.parametrize("text,why", [("call rsp", "operand-uses-rsp"),
                                      ("call qword ptr [rsp + 8]", "operand-uses-rsp"),
                                      ("call qword ptr [rsp + rax*2]", "operand-uses-rsp"),
                                      ("call 0x1100", "not-an-indirect-call"),
                                      ("jmp rax", "not-an-indirect-call"),
                                      ("lcall [rax]", "not-relocatable")])
def test_operands_refused(text: str, why: str) -> None:
    with pytest.raises(CannotRelocate, match=why):
        icall_insn(RELOC, asm(text, 0x1000), 0x1000)


def test_too_many_targets_for_the_encoder() -> None:
    with pytest.raises(CannotRelocate):
        _encode(b"\xff\xd0", 0x2000, [0x1100 + i for i in range(MAX_PROMOTED + 1)])
    with pytest.raises(CannotRelocate):
        _encode(b"\xff\xd0", 0x2000, [0x1100, 0x1100])


# -- programs ------------------------------------------------------------------------------

# A loop calls through a table (``table[sel[i & 7]]``: f0 four times in eight, f1 twice, f2
# and t3 once each); the call is ``{call}``.  f3 is never in the profile's table.
LOOP = """
table: .quad 0, 0, 0, 0
fptr: .quad 0
sel: .byte 0, 0, 0, 0, 1, 1, 2, 3
.space 0xd0
main:
    xor ebx, ebx
    xor r9d, r9d
top:
    mov edi, r9d
    mov eax, r9d
    and eax, 7
    movabs rdx, {sel}
    movzx eax, byte ptr [rdx + rax]
    movabs rdx, {table}
    {call}
    add rbx, rax
    inc r9d
    cmp r9d, esi
    jb top
    mov rax, rbx
    ret
f0:
    lea eax, [rdi + rdi*2]
    xor eax, 0x55
    ret
f1:
    imul eax, edi, 7
    add eax, 3
    ret
f2:
    mov eax, edi
    not eax
    ret
f3:
    lea eax, [rdi + 100]
    ret
{extra}
"""
CALLS = {"reg": "mov rax, qword ptr [rdx + rax*8]\n    call rax",
         "mem": "call qword ptr [rdx + rax*8]",
         "rip": "mov rax, qword ptr [rdx + rax*8]\n    mov qword ptr [rip + fptr], rax\n"
                "    call qword ptr [rip + fptr]",
         # tail calls: the loop calls ``disp``, which jumps on through the table
         "tail": "call disp",
         # a direct tail call: ``dtail`` adds and jumps to f1
         "dtail": "call dtail",
         # ``work`` makes the indirect call one time in eight, through table[(i >> 3) & 3]
         "nested": "mov eax, r9d\n    shr eax, 3\n    and eax, 3\n    call work"}
EXTRA = {"tail": "disp:\n    mov rax, qword ptr [rdx + rax*8]\n    jmp rax\n",
         "dtail": "dtail:\n    add edi, 5\n    jmp f1\n",
         "nested": "work:\n    test dil, 7\n    jne w1\n    mov rax, qword ptr [rdx + rax*8]\n"
                   "    call rax\n    add eax, 1\n    ret\nw1:\n    lea eax, [rdi + 1]\n"
                   "    ret\n"}
LIB_SRC = "lib_f:\n    lea eax, [rdi + 11]\n    ret\n"


class Program:
    """The loop program at ``orig`` (data rw-, code r-x: module "prog"), the library
    ("lib") right after it."""

    def __init__(self, form: str, orig: int) -> None:
        self.form, self.orig, self.lib_at = form, orig, orig + 0x2_0000
        src = LOOP.format(call=CALLS[form], extra=EXTRA.get(form, ""), sel=hex(orig + 0x28),
                          table=hex(orig))
        self.image = bytearray(asm(src, orig))
        self.lib = asm(LIB_SRC, self.lib_at)
        insns = linear(bytes(self.image[DATA:]), orig + DATA)
        self.main = orig + DATA
        rets = [i for i in insns if i.mnemonic == "ret"]
        self.f = [r.address + 1 for r in rets[:4]]            # f0..f3
        self.call = next(i for i in insns if i.mnemonic == "call")
        self.cont = self.call.address + self.call.size
        self.loop_exit = next(i.address + i.size for i in insns if i.mnemonic == "jb")
        self.view = _View(self)
        self.image[:32] = self.table([0, 1, 2, "lib"])

    def table(self, which) -> bytes:
        return struct.pack("<4Q", *(self.lib_at if w == "lib" else self.f[w] for w in which))

    def callees(self) -> set[int]:
        return set(self.f) | {self.lib_at}


class _View(MemoryView):
    def __init__(self, p: Program) -> None:
        super().__init__()
        self.p = p

    def ranges(self):
        o, lib = self.p.orig, self.p.lib_at
        return [MappedRange(o, o + DATA, "rw-", "prog"),
                MappedRange(o + DATA, o + 0x1000, "r-x", "prog"),
                MappedRange(lib, lib + 0x1000, "r-x", "lib")]

    def _read_range(self, rng, addr, n):
        p = self.p
        src, base = (p.lib, p.lib_at) if rng.start == p.lib_at else (p.image, p.orig)
        return bytes(src).ljust(0x1000, b"\xcc")[addr - base:addr - base + n]


def _state(p: Program, rng: random.Random, n: int, table=None):
    st = random_state(rng, RSP, {STACK: STACK_SIZE})
    st.regs["rsi"] = n
    st.mem[p.orig] = table if table is not None else bytes(p.image[:32])
    st.mem[RSP] = struct.pack("<Q", SENTINEL)
    return st


class Run:
    """One run to the sentinel.  ``entries``: the register file and the stack (from
    rsp - 128) at each callee's entry, with the return address apart; ``landings``:
    where control left the buffer for original code."""

    def __init__(self, p: Program, gen, st, evict_at: int | None = None) -> None:
        ranges = [(p.orig, 0x1000), (p.lib_at, 0x1000), (STACK, STACK_SIZE), (SENTINEL, 0x1000)]
        m = Machine(ranges + ([(gen.base, gen.size)] if gen else []))
        m.write(SENTINEL, b"\xf4" * 0x1000)
        m.write(p.orig, bytes(p.image))
        m.write(p.lib_at, p.lib)
        if gen:
            m.write(gen.base, gen.code)
        m.set_state(st)
        self.entries: list[tuple[int, dict, bytes, int]] = []
        self.landings: list[int] = []
        self.evicted: list[int] = []
        self.ret_slots: list[int] = []
        inbuf = (lambda a: gen.base <= a < gen.base + gen.size) if gen else (lambda a: False)
        last, rets = [False], [0]
        callees = p.callees()

        def inside(a: int) -> bool:
            if evict_at is not None and a in gen.returns:
                rets[0] += 1
                if rets[0] == evict_at:
                    self.evicted.append(a)
                    return False
            b = inbuf(a)
            if gen is not None and not b and a in gen.entries:
                return False                    # a patch site: on into the buffer
            if last[0] and not b:
                self.landings.append(a)
            last[0] = b
            if a in callees:
                regs = {r: m.uc.reg_read(UREG[r]) for r in GPRS}
                rsp = regs["rsp"]
                ret = struct.unpack("<Q", m.read(rsp, 8))[0]
                self.entries.append((a, regs, m.read(rsp - 120, 120) + m.read(rsp + 8, 64), ret))
                self.ret_slots.append(rsp)
            return a != SENTINEL

        rip = m.run(p.main, inside, limit=200000)
        while rip != SENTINEL:
            if self.evicted and rip == self.evicted[-1]:
                rip = m.run(gen.evictions[rip], inside, limit=200000)
                evict_at = None
            else:
                rip = m.run(gen.entries[rip], inside, limit=200000)
        self.state = m.snapshot([(p.orig, DATA), (STACK, STACK_SIZE)])


def _profile(p: Program):
    """Exact IP counts and LBR-style branch records of one run of the original."""
    m = Machine([(p.orig, 0x1000), (p.lib_at, 0x1000), (STACK, STACK_SIZE), (SENTINEL, 0x1000)])
    m.write(SENTINEL, b"\xf4" * 0x1000)
    m.write(p.orig, bytes(p.image))
    m.write(p.lib_at, p.lib)
    m.set_state(_state(p, random.Random(7), 64))
    trace: list[int] = []
    m.run(p.main, lambda a: trace.append(a) is None and a != SENTINEL, limit=200000)
    ips = Counter(trace[:-1])
    branches: dict[int, Counter] = {}
    for a, b in zip(trace, trace[1:]):
        lo, src = (p.lib_at, p.lib) if a >= p.lib_at else (p.orig, bytes(p.image))
        i = next(CS.disasm(src[a - lo:a - lo + 15], a, 1))
        if i.group(1) or i.group(2) or i.group(3) or i.group(7):     # jump call ret relative
            branches.setdefault(a, Counter())[b] += 1
    return dict(ips), branches


CFG = dict(hot_threshold=2.0, min_loop_trip_count=4, min_region_size=8, inline_budget=0.0,
           inline_min_budget_bytes=0, fail_fast=True, real_calls=True)


def _select(p: Program, **kw):
    ips, branches = _profile(p)
    first = hot_code_discovery(ips, p.view, jumps_from_hot_limit=2, branch_samples=branches)
    res = run_pipeline(first, p.view, RegionConfig(**{**CFG, **kw}))
    return res


def _loop_region(p: Program, res):
    [sr] = [r for r in res.regions if any(bb.contains(p.call.address) for _, bb in r.blocks())]
    return sr


def _same(a: Run, b: Run, ctx: str) -> None:
    """Same registers, flags, data and stack from rsp - 128 up, but for the slots that
    held return addresses (dead once returned)."""
    assert b.state.regs == a.state.regs, ctx
    assert b.state.rflags == a.state.rflags, ctx
    assert set(a.state.mem) == set(b.state.mem)
    assert all(b.state.mem[k] == v for k, v in a.state.mem.items() if k != STACK), ctx
    sa, sb = bytearray(a.state.mem[STACK]), bytearray(b.state.mem[STACK])
    for slot in set(a.ret_slots) | set(b.ret_slots):
        o = slot - STACK
        sa[o:o + 8] = sb[o:o + 8] = b"\0" * 8
    low = a.state.regs["rsp"] - 128 - STACK
    assert sb[low:] == sa[low:], f"{ctx}: stack"


def _same_entries(p: Program, gen, a: Run, b: Run, ctx: str) -> None:
    """Each callee starts as in the original: the same callee, registers and stack
    (below and above the return address); the return address is the original
    continuation, or for a promoted call one in the buffer that stands for it."""
    assert [e[0] for e in b.entries] == [e[0] for e in a.entries], ctx
    for (t, ra, sa, reta), (_, rb, sb, retb) in zip(a.entries, b.entries):
        assert rb == ra and sb == sa, f"{ctx}: entry of {t:#x}"
        assert reta == p.cont, ctx
        assert retb == p.cont or gen.returns.get(retb) == p.cont, ctx


# -- selection -------------------------------------------------------------------------------

@pytest.mark.parametrize("form", ["reg", "mem", "rip"])
def test_selection_promotes_hot_targets_of_the_module(form: str) -> None:
    p = Program(form, LOW)
    res = _select(p)
    sr = _loop_region(p, res)
    [(c, site)] = [(k, s) for k, s in sr.info["inline"]["sites"].items()
                   if s["call_insn"] == p.call.address]
    assert site["decision"] == "promoted"
    assert site["targets"] == p.f[:3]                                # hottest first
    assert site["refused"] == {p.lib_at: "other-module"}
    assert site["fallback_exit"] == p.call.address and site["continuation"] == p.cont
    assert promoted_call_sites(sr) == {c: tuple(p.f[:3])}
    exits = sr.g.edges[c, END]["exits"]
    assert set(exits) == set(p.f[:3]) | {p.call.address}            # the miss, no lib
    assert sr.g.edges[c, END]["promoted"] == p.f[:3]
    assert sr.g.edges[c, p.cont]["kind"] == EdgeKind.FALLTHROUGH
    cnt = res.counters["inline-hot-calls"]
    assert cnt["icp-sites-promoted"] == 1 and cnt["icp-targets-promoted"] == 3
    assert cnt["icp-target-refused-other-module"] == 1
    # the loop is whole: the call block and its continuation are in it
    outer = max(sr.info["loops"].loops(), key=lambda lp: len(lp.blocks))
    assert c in outer.blocks and p.cont in outer.blocks


def test_selection_limits_and_switches() -> None:
    p = Program("reg", LOW)
    one = _loop_region(p, r := _select(p, icp_max_targets=1))
    [site] = [s for s in one.info["inline"]["sites"].values() if s["decision"] == "promoted"]
    assert site["targets"] == [p.f[0]]
    assert site["refused"] == {p.lib_at: "other-module", p.f[1]: "too-many-targets",
                               p.f[2]: "too-many-targets"}
    assert r.counters["inline-hot-calls"]["icp-target-refused-too-many-targets"] == 2
    for kw, why in ((dict(icp_max_targets=0), "indirect"), (dict(real_calls=False), None)):
        res = _select(p, **kw)
        for sr in res.regions:
            assert not promoted_call_sites(sr)
            assert all(not bb.contains(p.call.address) for _, bb in sr.blocks())
        if why:
            assert res.counters["inline-hot-calls"][f"icp-refused-{why}"] == 1


def test_promotion_refusals() -> None:
    p = Program("reg", LOW)
    a = p.call.address

    def blk(**kw) -> BasicBlock:
        d = dict(start=a, size=p.call.size, insns=[(a, p.call.size)], data=bytes(p.call.bytes),
                 term=T.ICALL, targets=[p.f[1], p.f[0], p.lib_at], fallthrough=p.cont,
                 module="prog", unknown_target=True)
        d.update(kw)
        return BasicBlock(**d)

    got = promotion(blk(), p.view, exits={p.f[0]: 5.0, p.f[1]: 2.0})
    assert got == ([p.f[0], p.f[1]], {p.lib_at: "other-module"}, None)
    got = promotion(blk(), p.view, weight=lambda t: {p.f[1]: 9.0}.get(t, 0.0))  # no counts
    assert got[0] == [p.f[1], p.f[0]]
    assert promotion(blk(), p.view, weight=lambda t: {p.f[0]: 9.0}.get(t, 0.0))[0] == \
        [p.f[0], p.f[1]]
    assert promotion(blk(fallthrough=None), p.view)[2] == "never-returns"
    assert promotion(blk(targets=[]), p.view)[2] == "unknown-target"
    assert promotion(blk(targets=[p.lib_at]), p.view) == ([], {p.lib_at: "other-module"},
                                                         "other-module")
    assert promotion(blk(targets=[p.cont]), p.view)[2] == "reads-return-address"
    assert promotion(blk(), None)[2] == "no-memory-view"
    assert promotion(blk(term=T.CALL), p.view)[2] == "not-indirect"
    rsp = asm("call qword ptr [rsp + 8]", a)
    assert promotion(blk(data=rsp, size=len(rsp), insns=[(a, len(rsp))]),
                     p.view)[2] == "operand-uses-rsp"
    # a target that is a PLT stub of the module (jmp [rip+d]) is not promoted
    image = bytearray(p.image)
    o = p.f[2] - p.orig
    image[o:o + 6] = asm_rip("jmp qword ptr [rip + {D}]", p.f[2], p.orig + 8)
    p.image = image
    assert promotion(blk(targets=[p.f[2], p.f[0]]), p.view) == \
        ([p.f[0]], {p.f[2]: "plt-stub"}, None)


# -- unicorn ----------------------------------------------------------------------------------

def _tables(p: Program, rng: random.Random):
    """The profile's table, one with f3 (never seen: a miss), one all other-module, and
    random ones."""
    yield [0, 1, 2, "lib"]
    yield [0, 3, 2, 1]
    yield ["lib", "lib", "lib", "lib"]
    for _ in range(3):
        yield [rng.choice([0, 1, 2, 3, "lib"]) for _ in range(4)]


@pytest.mark.parametrize("orig", [LOW, HIGH], ids=["imm", "slot"])
@pytest.mark.parametrize("form", ["reg", "mem", "rip"])
def test_promoted_call_differential(form: str, orig: int) -> None:
    p = Program(form, orig)
    sr = _loop_region(p, _select(p))
    gen = emit_region(sr, orig + 0x4000_0000)
    check_generated(gen)
    assert len(gen.calls) == 3 and set(gen.returns.values()) == {p.cont}
    assert sorted(t for a, t in gen.exits if a in gen.calls) == sorted(p.f[:3])
    assert (orig >= 1 << 31) == (gen.data_start is not None)     # slots only when needed
    rng = random.Random(f"{form}{orig}")
    hits = misses = 0
    for i, which in enumerate(_tables(p, rng)):
        n = rng.choice([1, 3, 8, rng.randrange(9, 40)])
        st = _state(p, rng, n, p.table(which))
        ctx = f"{form} run {i} table={which} n={n}"
        a = Run(p, None, st)
        b = Run(p, gen, st)
        _same(a, b, ctx)
        _same_entries(p, gen, a, b, ctx)
        for t, _, _, ret in b.entries:
            if ret in gen.returns:                     # promoted: a hit, back into the buffer
                assert t in p.f[:3], ctx
                hits += 1
            else:                                      # a miss: the original call ran it
                misses += 1
        # every way out of the buffer: a promoted callee, the call instruction (a miss)
        # or the loop's exit
        assert set(b.landings) <= set(p.f[:3]) | {p.call.address, p.loop_exit}, ctx
        assert b.landings.count(p.call.address) == sum(
            1 for t, _, _, ret in b.entries if ret == p.cont), ctx
    assert hits > 0 and misses > 0


@pytest.mark.parametrize("form", ["reg", "mem"])
def test_promoted_call_far_buffer_and_eviction(form: str) -> None:
    """A buffer beyond rel32 reach: the calls go through far-exit stubs and still return
    into the buffer; a thread evicted at a return address finishes in original code."""
    p = Program(form, LOW)
    sr = _loop_region(p, _select(p))
    gen = emit_region(sr, LOW + 0x10_0000_0000)
    check_generated(gen)
    assert set(p.f[:3]) <= set(gen.far_exits)
    rng = random.Random(5)
    for i in range(3):
        n = rng.randrange(6, 30)
        st = _state(p, rng, n)
        a = Run(p, None, st)
        b = Run(p, gen, st)
        _same(a, b, f"far run {i}")
        _same_entries(p, gen, a, b, f"far run {i}")
        assert any(ret in gen.returns for *_, ret in b.entries)
        e = Run(p, gen, st, evict_at=rng.randrange(1, 4))
        assert len(e.evicted) == 1 and gen.evictions[e.evicted[0]] == p.cont
        _same(a, e, f"far run {i} evicted")


def test_without_real_calls_the_promoted_block_pushes_and_jumps() -> None:
    """``emit_region(real_calls=False)`` (no CFI for the region): the kept indirect call
    becomes the pseudo-call (original return address pushed, the indirect jump): no
    ``call`` in the code, every callee returns into original code, same results."""
    p = Program("mem", LOW)
    sr = _loop_region(p, _select(p))
    gen = emit_region(sr, LOW + 0x4000_0000, real_calls=False)
    check_generated(gen)
    assert not gen.calls and not gen.returns
    assert all(i.mnemonic != "call" for i in CS.disasm(gen.code, gen.base))
    rng = random.Random(9)
    for i in range(3):
        st = _state(p, rng, rng.randrange(4, 20))
        a, b = Run(p, None, st), Run(p, gen, st)
        _same(a, b, f"run {i}")
        assert [e[1:] for e in b.entries] == [e[1:] for e in a.entries]


# -- tail calls --------------------------------------------------------------------------------

@pytest.mark.parametrize("form", ["tail", "dtail"])
def test_tail_call_in_a_real_callee_returns_into_the_buffer(form: str) -> None:
    """The loop calls ``disp``/``dtail`` for real; it tail-calls on (``jmp rax`` through
    the table, or ``jmp f1``), and the function it reaches returns into the buffer,
    right after the real call: the tail call kept the caller's return address."""
    p = Program(form, LOW)
    sr = _loop_region(p, _select(p))
    [site] = [s for s in sr.info["inline"]["sites"].values() if s["decision"] == "call"]
    assert site["call_insn"] == p.call.address
    gen = emit_region(sr, LOW + 0x4000_0000)
    check_generated(gen)
    rng = random.Random(form)
    for i, which in enumerate(_tables(p, rng)):
        st = _state(p, rng, rng.randrange(2, 30), p.table(which))
        a, b = Run(p, None, st), Run(p, gen, st)
        _same(a, b, f"{form} run {i}")
        _same_entries(p, gen, a, b, f"{form} run {i}")
        assert b.entries and all(ret in gen.returns for *_, ret in b.entries)


def test_indirect_tail_call_in_an_inlined_callee() -> None:
    """``disp`` inlined into the loop: its ``jmp rax`` (a tail call) in the clone is a
    cascade over the targets cloned with it, each clone's ``ret`` going on at the
    continuation; a target not cloned is reached by the original indirect jump with the
    original return address pushed, so it returns into original code."""
    p = Program("tail", LOW)
    sr = _loop_region(p, _select(p, inline_budget=8.0, inline_min_budget_bytes=4096))
    site = sr.info["inline"]["sites"][next(k for k, s in sr.info["inline"]["sites"].items()
                                             if s["call_insn"] == p.call.address)]
    assert site["decision"] == "inlined"
    ijmp = [k for k, bb in sr.blocks() if bb.term is T.IJMP]
    assert ijmp and all(isinstance(k, CloneKey) for k in ijmp)
    cloned = {bb.clone_of for _, bb in sr.blocks() if bb.is_clone}
    assert set(p.f[:3]) <= cloned
    gen = emit_region(sr, LOW + 0x4000_0000)
    check_generated(gen)
    assert not gen.calls
    rng = random.Random(17)
    for i, which in enumerate(_tables(p, rng)):
        st = _state(p, rng, rng.randrange(2, 30), p.table(which))
        a, b = Run(p, None, st), Run(p, gen, st)
        _same(a, b, f"inlined tail run {i}")
        # only targets not cloned run in original code, called by the original's address
        assert all(t not in p.f[:3] for t, *_ in b.entries), which
        assert all(ret == p.cont for *_, ret in b.entries)


def test_promoted_call_inside_an_inlined_clone() -> None:
    """``work`` inlined into the loop; its cold indirect call stays, promoted, in the
    clone: a hit returns into the buffer with the original return address the inlined
    call pushed right above, a miss runs the call instruction in original code, whose
    ``work`` then returns to the loop's original continuation."""
    p = Program("nested", LOW)
    res = _select(p, hot_threshold=10.0, inline_budget=8.0, inline_min_budget_bytes=4096)
    sr = _loop_region(p, res)
    work_call = next(s for s in sr.info["inline"]["sites"].values()
                     if s["call_insn"] == p.call.address)
    assert work_call["decision"] == "inlined"
    [(k, site)] = [(k, s) for k, s in sr.info["inline"]["sites"].items()
                   if s["decision"] == "promoted"]
    assert isinstance(k, CloneKey) and k.path == (p.call.address,)
    assert set(site["targets"]) == set(p.f[:3]) and site["refused"] == {p.lib_at: "other-module"}
    icall = sr.block(k).last_insn
    gen = emit_region(sr, LOW + 0x4000_0000)
    check_generated(gen)
    assert len(gen.calls) == 3 and set(gen.returns.values()) == {sum(icall)}
    rng = random.Random(23)
    hits = 0
    for i, which in enumerate(_tables(p, rng)):
        n = rng.randrange(9, 60)
        st = _state(p, rng, n, p.table(which))
        a, b = Run(p, None, st), Run(p, gen, st)
        _same(a, b, f"nested run {i}")
        assert [e[:3] for e in b.entries] == [e[:3] for e in a.entries]
        for (t, _, _, reta), (_, rb, _, retb), slot in zip(a.entries, b.entries, b.ret_slots):
            assert reta == sum(icall)
            if retb in gen.returns:
                hits += 1
                assert t in p.f[:3] and gen.returns[retb] == sum(icall)
            else:
                assert retb == reta
    assert hits > 0
