"""A program with real calls, assembled at its original address for unicorn runs: its
memory view, one run to the sentinel, random start states, the comparison of two runs,
its exact IP profile and region selection over it, and a hand-made loop region with a
kept call.  Shared by the codegen tests of real calls and the live-copy tests."""

from __future__ import annotations

import random
import struct
from collections import Counter

from codegen_util import UREG, Machine, asm, linear, random_state
from region_graphs import Builder

from dbr_service.region.discovery import hot_code_discovery
from dbr_service.region.memview import MappedRange, MemoryView
from dbr_service.region.model import BasicBlock, SuperRegion, TermKind
from dbr_service.region.pipeline import RegionConfig, run_pipeline

T = TermKind
ORIG = 0x40_0000                 # the program: data (rw-) then code (r-x), module "prog"
DATA_SIZE = 0x100
LIB = ORIG + 0x2_0000            # another module ("lib"), in rel32 reach of the program
SENTINEL = 0x7000_0000_0000
STACK, STACK_SIZE = 0x7FFE_0000_0000, 0x4000
RSP = STACK + 0x3000
NEAR, FAR = ORIG + 0x4000_0000, ORIG + 0x10_0000_0000     # buffer bases (FAR: > 2 GiB away)

# Outer loop: an inner loop without calls, then a call, each iteration.  ``work`` is in
# the program; ``plt_work`` is its PLT stub to ``lib_work`` in the other module.
SRC = """
result: .quad 0
got: .quad 0
.space 0xf0
main:
    mov r9d, 0
    xor ebx, ebx
top:
    mov edi, r9d
    mov ecx, 4
inner:
    add ebx, ecx
    rol ebx, 3
    dec ecx
    jne inner
    call {target}
    add rbx, rax
    inc r9d
    cmp r9d, esi
    jb top
    mov rax, rbx
    ret
work:
    lea eax, [rdi + rdi*2]
    imul eax, edi
    test al, 4
    je w1
    add eax, 7
w1:
    xor eax, 0x55
    ret
plt_work:
    jmp qword ptr [rip + got]
"""
# The loop calls ``work`` (inlined), which calls ``leaf`` one time in eight (cold: kept as
# a real call inside the clone of ``work``).
NESTED_SRC = """
result: .quad 0
got: .quad 0
.space 0xf0
main:
    mov r9d, 0
    xor ebx, ebx
top:
    mov edi, r9d
    call {target}
    add rbx, rax
    inc r9d
    cmp r9d, esi
    jb top
    mov rax, rbx
    ret
work:
    lea eax, [rdi + rdi*2]
    test dil, 7
    jne w1
    push rax
    call leaf
    pop rdx
    add eax, edx
w1:
    xor eax, 0x55
    ret
leaf:
    imul eax, edi, 13
    ret
"""
LIB_SRC = """
lib_work:
    lea eax, [rdi + 11]
    ret
"""


class Program:
    """The program assembled at ORIG calling ``target``, with the other module at LIB."""

    def __init__(self, target: str, src: str = SRC) -> None:
        lib_code = asm(LIB_SRC, LIB)
        if target == "lib_work":
            target = hex(LIB)
        self.image = bytearray(asm(src.format(target=target), ORIG))
        struct.pack_into("<Q", self.image, 8, LIB)                  # got -> lib_work
        self.lib = lib_code
        self.code = bytes(self.image[DATA_SIZE:])
        insns = linear(self.code, ORIG + DATA_SIZE)
        self.main = ORIG + DATA_SIZE
        self.call = next(i for i in insns if i.mnemonic == "call")
        self.callee = self.call.operands[0].imm
        self.cont = self.call.address + self.call.size
        self.work = next(i.address for i in insns if i.mnemonic == "lea"
                         and i.op_str == "eax, [rdi + rdi*2]")
        self.boundaries = {i.address for i in insns} | {i.address for i in linear(lib_code, LIB)}
        self.view = ProgramView(bytes(self.image), lib_code)


class ProgramView(MemoryView):
    """The program's data (rw-) and code (r-x) as module "prog", the library as "lib"."""

    def __init__(self, image: bytes, lib: bytes) -> None:
        super().__init__()
        self.image, self.lib = image.ljust(0x1000, b"\xcc"), lib.ljust(0x1000, b"\xcc")

    def ranges(self):
        return [MappedRange(ORIG, ORIG + DATA_SIZE, "rw-", "prog"),
                MappedRange(ORIG + DATA_SIZE, ORIG + 0x1000, "r-x", "prog"),
                MappedRange(LIB, LIB + 0x1000, "r-x", "lib")]

    def _read_range(self, rng, addr, n):
        src, base = (self.lib, LIB) if rng.start == LIB else (self.image, ORIG)
        return src[addr - base:addr - base + n]


# -- running ------------------------------------------------------------------------------

class Run:
    """One run to the sentinel: final state, the return addresses the callees saw (and
    the stack slots holding them), and where control left the buffer for original code.
    With ``evict_at``: at the ``evict_at``-th return into the buffer the thread is moved
    to original code by the eviction map (as the agent's EVICT would) and finishes there."""

    def __init__(self, p: Program, gen, st, start: int, callees: set[int],
                 image: bytes | None = None, evict_at: int | None = None) -> None:
        base = gen.base if gen else 0
        size = gen.size if gen else 0
        ranges = [(ORIG, 0x1000), (LIB, 0x1000), (STACK, STACK_SIZE), (SENTINEL, 0x1000)]
        m = Machine(ranges + ([(base, size)] if gen else []))
        m.write(SENTINEL, b"\xf4" * 0x1000)
        m.write(ORIG, bytes(image or p.image))
        m.write(LIB, p.lib)
        if gen:
            m.write(base, gen.code)
        m.set_state(st)
        self.seen: list[tuple[int, int]] = []        # (stack slot, return address)
        self.landings: list[int] = []
        self.buffer_steps = 0
        self.evicted: list[int] = []
        last_in = [False]
        returns = [0]

        def inside(a: int) -> bool:
            if evict_at is not None and a in gen.returns:
                returns[0] += 1
                if returns[0] == evict_at:
                    self.evicted.append(a)
                    return False
            in_buf = gen is not None and base <= a < base + size
            self.buffer_steps += in_buf
            if not in_buf and last_in[0]:
                self.landings.append(a)
            last_in[0] = in_buf
            if a in callees:
                rsp = m.uc.reg_read(UREG["rsp"])
                self.seen.append((rsp, struct.unpack("<Q", m.read(rsp, 8))[0]))
            return a != SENTINEL

        rip = m.run(start, inside, limit=200000)
        if self.evicted:
            assert rip == self.evicted[0]
            rip = m.run(gen.evictions[rip], inside, limit=200000)
        assert rip == SENTINEL
        self.state = m.snapshot([(ORIG, DATA_SIZE), (STACK, STACK_SIZE)])


def call_state(rng: random.Random, n: int):
    st = random_state(rng, RSP, {ORIG: DATA_SIZE, STACK: STACK_SIZE})
    st.regs["rsi"] = n
    data = bytearray(st.mem[ORIG])
    data[8:16] = struct.pack("<Q", LIB)                             # the GOT stays
    st.mem[ORIG] = bytes(data)
    st.mem[RSP] = struct.pack("<Q", SENTINEL)
    return st


def same_run(a: Run, b: Run, ctx: str) -> None:
    """Same registers, flags and data; the same stack but for the slots that held the
    return addresses of real calls (dead once they returned)."""
    assert b.state.regs == a.state.regs, ctx
    assert b.state.rflags == a.state.rflags, ctx
    assert b.state.mem[ORIG] == a.state.mem[ORIG], ctx
    sa, sb = bytearray(a.state.mem[STACK]), bytearray(b.state.mem[STACK])
    for slot, _ in b.seen:
        o = slot - STACK
        sa[o:o + 8] = sb[o:o + 8] = b"\0" * 8
    low = a.state.regs["rsp"] - 128 - STACK
    assert sb[low:] == sa[low:], f"{ctx}: stack"


def ip_samples(p: Program) -> dict[int, float]:
    """Instruction addresses of the original's run, counted: an exact IP profile."""
    counts: Counter = Counter()
    m = Machine([(ORIG, 0x1000), (LIB, 0x1000), (STACK, STACK_SIZE), (SENTINEL, 0x1000)])
    m.write(SENTINEL, b"\xf4" * 0x1000)
    m.write(ORIG, bytes(p.image))
    m.write(LIB, p.lib)
    m.set_state(call_state(random.Random(7), 40))

    def inside(a: int) -> bool:
        counts[a] += 1
        return a != SENTINEL

    m.run(p.main, inside, limit=200000)
    del counts[SENTINEL]
    return dict(counts)


CFG = dict(hot_threshold=2.0, min_loop_trip_count=4, min_region_size=8, inline_budget=0.0,
           inline_min_budget_bytes=0, fail_fast=True)


def select_program(p: Program, real_calls: bool, **kw) -> list[SuperRegion]:
    first = hot_code_discovery(ip_samples(p), p.view, jumps_from_hot_limit=2)
    return run_pipeline(first, p.view, RegionConfig(real_calls=real_calls, **{**CFG, **kw})).regions


def call_block(sr: SuperRegion, p: Program):
    return next((k for k, bb in sr.blocks() if bb.term is T.CALL
                 and bb.last_insn[0] == p.call.address), None)


def loop_with_call(callee: int = 0x401100, cont_in_region: bool = True) -> SuperRegion:
    """0x401000: mov ecx,3 | 0x401005: call callee | 0x40100a: dec ecx; jne 0x401005 |
    0x40100e: ret; the call kept as a real call."""
    code = {0x401000: bytes.fromhex("b903000000"),
            0x401005: b"\xe8" + struct.pack("<i", callee - 0x40100A),
            0x40100A: bytes.fromhex("ffc975f7"), 0x40100E: b"\xc3"}
    b = Builder("golden")
    sr = b.sr
    sr.add_block(BasicBlock(0x401000, 5, [(0x401000, 5)], code[0x401000], T.FALLTHROUGH,
                            fallthrough=0x401005, known_exec=True))
    sr.add_block(BasicBlock(0x401005, 5, [(0x401005, 5)], code[0x401005], T.CALL, [callee],
                            fallthrough=0x40100A, known_exec=True, count=3))
    b.entry(0x401000, 1)
    b.ft(0x401000, 0x401005, 1)
    b.exit(0x401005, callee, 3)
    if cont_in_region:
        sr.add_block(BasicBlock(0x40100A, 4, [(0x40100A, 2), (0x40100C, 2)], code[0x40100A],
                                T.JCC, [0x401005], fallthrough=0x40100E, known_exec=True))
        b.ft(0x401005, 0x40100A, 3)
        b.flow(0x40100A, 0x401005, 2)
        b.exit(0x40100A, 0x40100E, 1)
    else:
        b.exit(0x401005, 0x40100A, 3)
    sr.info["inline"] = {"budget": 0, "growth": 0, "sites": {0x401005: {
        "call_insn": 0x401005, "decision": "call", "callee": callee}}}
    sr.verify()
    return sr
