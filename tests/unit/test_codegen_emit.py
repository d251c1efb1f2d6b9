"""Emission tests: super-regions built from real assembled code, emitted at a distant
base, run against the original in unicorn from the same random states.

Each program is assembled with keystone at an original address (data first, code after);
blocks come from linear disassembly; edge counts from a unicorn trace of the original.
The replacement runs from its entry until control comes back to the sentinel return
address, continuing in original code after an exit exactly as a patched process would;
final GPRs, flags, the program's data and the stack (incl. the red zone) must equal the
original run's.  Also checked: no ``call`` in the output, every exit lands on an original
instruction boundary, the address map covers every replacement instruction, and a
patched original (``jmp rel32`` at the patch site) behaves the same.
"""

from __future__ import annotations

import random
import struct
import zlib
from dataclasses import dataclass

import pytest
from codegen_util import CS, Machine, asm, build_blocks, linear, random_state
from unicorn import UC_HOOK_CODE
from unicorn import x86_const as U

from dbr_service.codegen.emit import (
    GeneratedCode,
    check_generated,
    emit_region,
    nop_bytes,
    perf_map_lines,
)
from dbr_service.codegen.layout import back_edges, compute_layout
from dbr_service.codegen.relocate import jmp_rel32
from dbr_service.common.errors import CodegenError
from dbr_service.region.model import END, START, CloneKey, EdgeKind, SuperRegion, TermKind

DATA_SIZE = 0x100          # data first: counter @0, result @8, table @0x10.., jt @0xc0,
                           # rjt @0xe0 (PC-relative entries, filled in by build())
SENTINEL = 0x7000_0000_0000
STACK, STACK_SIZE = 0x7FFE_0000_0000, 0x4000
RSP = STACK + 0x3000
RUNS = 6

DATA = """
counter: .quad 0
result: .quad 0
table: .space 0xb0
jt: .quad t0, t1, t2, t3
rjt: .space 0x20
"""

# A counted loop with a conditional inside and RIP-relative data.
LOOP_COND = """
main:
    mov r8d, 0
    xor eax, eax
    test rsi, rsi
    je done
top:
    lea r11, [rip + table]
    mov edx, dword ptr [r11 + r8*4]
    test dl, 1
    jne odd
    add eax, edx
    jmp next
odd:
    sub eax, edx
    add dword ptr [rip + counter], 1
next:
    inc r8
    cmp r8, rsi
    jb top
done:
    mov qword ptr [rip + result], rax
    ret
t0:
t1:
t2:
t3:
    ud2
"""

# A loop calling a small function (inlined), with a nested conditional in the callee.
LOOP_CALL = """
main:
    mov r9d, 0
    xor ebx, ebx
top:
    mov edi, r9d
    call sq
    add rbx, rax
    inc r9d
    cmp r9d, esi
    jb top
    mov qword ptr [rip + result], rbx
    ret
sq:
    mov eax, edi
    imul eax, edi
    test eax, 4
    je sq_done
    add dword ptr [rip + counter], 1
    ret 0
sq_done:
    ret
t0:
t1:
t2:
t3:
    ud2
"""

# A jump-table-free switch: a chain of compares and jcc.
SWITCH = """
main:
    mov ecx, 0
    xor eax, eax
    lea rdi, [rip + table]
top:
    mov edx, dword ptr [rdi + rcx*4]
    and edx, 7
    cmp edx, 0
    je c0
    cmp edx, 1
    je c1
    cmp edx, 2
    je c2
    cmp edx, 5
    jae c5
    add eax, 100
    jmp next
c0: add eax, 1
    jmp next
c1: imul eax, eax, 3
    jmp next
c2: xor eax, 0x55
    jmp next
c5: sub eax, edx
next:
    inc ecx
    cmp ecx, esi
    jl top
    mov qword ptr [rip + result], rax
    ret
t0:
t1:
t2:
t3:
    ud2
"""

# loop/jrcxz and an indirect jmp through a table (one target unknown to the region).
INDIRECT = """
main:
    lea r10, [rip + jt]
    mov ecx, esi
    xor eax, eax
    jrcxz done
top:
    mov edx, ecx
    and edx, 3
    jmp qword ptr [r10 + rdx*8]
t0: add eax, 1
    jmp cont
t1: add eax, ecx
    jmp cont
t2: xor eax, 0x1234
    jmp cont
t3: sub eax, 7
cont:
    loop top
done:
    mov qword ptr [rip + result], rax
    ret
"""

# The PIC jump-table shape of gcc/clang (movsxd; add; jmp reg): a dispatch loop whose
# table base was hoisted out of it.  Translated, not left as an exit (codegen/dispatch.py);
# cases are at least 8 bytes apart.
RELTABLE = """
main:
    lea r8, [rip + rjt]
    mov ecx, esi
    xor eax, eax
    test ecx, ecx
    je done
top:
    mov edx, ecx
    and edx, 3
    movsxd rdx, dword ptr [r8 + rdx*4]
    add rdx, r8
    jmp rdx
t0: imul eax, eax, 0x10003
    jmp cont
t1: add eax, ecx
    add eax, 0x11111
    jmp cont
t2: xor eax, 0x12345
    rol eax, 3
    jmp cont
t3: sub eax, 7
cont:
    dec ecx
    jne top
done:
    mov qword ptr [rip + result], rax
    ret
"""
RJT = 0xE0


@dataclass
class Program:
    name: str
    src: str
    inline: bool = True            # inline the calls (else they stay exits)
    known_targets: int = 4         # how many jump-table targets the region knows
    exclude: str | None = None     # leave out the block starting with this instruction
    stop_before_ret: bool = False  # the main function's ret is "unsupported": STOP before it
    lone_ijmp: bool = False        # an indirect jmp alone in its block (as discovery makes it)


PROGRAMS = [Program("loop_cond", LOOP_COND), Program("loop_call", LOOP_CALL),
            Program("loop_call_not_inlined", LOOP_CALL, inline=False),
            Program("switch", SWITCH), Program("indirect", INDIRECT),
            Program("indirect_partial", INDIRECT, known_targets=3),
            Program("loop_cond_partial", LOOP_COND, exclude="sub eax, edx"),
            Program("switch_stop", SWITCH, exclude="imul eax, eax, 3", stop_before_ret=True),
            Program("reltable", RELTABLE),
            Program("reltable_partial", RELTABLE, known_targets=3),
            Program("reltable_exit", RELTABLE, exclude="xor eax, 0x12345"),
            Program("reltable_lone", RELTABLE, lone_ijmp=True)]
PLACES = [(0x40_0000, 0x5000_0000), (0x5555_5555_4000, -0x5000_0000)]


@dataclass
class Built:
    orig: int
    code: bytes            # the code part
    code_addr: int
    image: bytes           # data + code
    sr: SuperRegion
    boundaries: set[int]
    entry: int


def assemble(p: Program, orig: int) -> tuple[bytes, int]:
    image = bytearray(asm(DATA + p.src, orig))
    for i, t in enumerate(struct.unpack_from("<4Q", image, 0xC0)):
        struct.pack_into("<i", image, RJT + 4 * i, t - (orig + RJT))
    return bytes(image), orig + DATA_SIZE


def build(p: Program, orig: int, trace: list[int] | None,
          rng: random.Random | None = None) -> Built:
    image, code_addr = assemble(p, orig)
    code = image[DATA_SIZE:]
    jt = list(struct.unpack_from("<4Q", image, 0xC0))
    ijmp = {i.address: jt[:p.known_targets] for i in linear(code, code_addr)
            if i.mnemonic == "jmp" and i.op_str in ("qword ptr [r10 + rdx*8]", "rdx")}
    blocks = build_blocks(code, code_addr, ijmp)
    for s, bb in list(blocks.items()):           # what jump-table inference would find
        if bb.term is TermKind.IJMP and bb.data.endswith(b"\xff\xe2"):
            bb.table_base = orig + RJT
            if p.lone_ijmp:
                _split_last(blocks, s)
    boundaries = {i.address for i in linear(code, code_addr)}
    _restrict(blocks, p)
    if rng is not None:                   # a random region: drop up to 2 non-entry blocks
        for s in rng.sample(sorted(set(blocks) - {code_addr}), rng.randrange(3)):
            del blocks[s]
    sr = make_sr(blocks, code_addr, trace or [], p.inline, rng)
    return Built(orig, code, code_addr, image, sr, boundaries, code_addr)


def _split_last(blocks: dict, s: int) -> None:
    """Give the last instruction of block ``s`` a block of its own."""
    from dataclasses import replace
    bb = blocks[s]
    a, n = bb.last_insn
    blocks[s] = replace(bb, size=a - s, insns=bb.insns[:-1], data=bb.data[:a - s],
                        term=TermKind.FALLTHROUGH, targets=[], fallthrough=a,
                        table_base=None)
    blocks[a] = replace(bb, start=a, size=n, insns=[(a, n)], data=bb.data[a - s:])


def _restrict(blocks: dict, p: Program) -> None:
    """Apply the program's exclusion / STOP options to the linear blocks."""
    from dataclasses import replace
    for s, bb in list(blocks.items()):
        first = next(CS.disasm(bb.data, bb.start))
        if p.exclude and f"{first.mnemonic} {first.op_str}" == p.exclude:
            del blocks[s]
    if p.stop_before_ret:
        s, bb = min(((s, bb) for s, bb in blocks.items() if bb.term is TermKind.RET),
                    key=lambda x: x[0])
        a, _n = bb.last_insn
        assert len(bb.insns) > 1
        blocks[s] = replace(bb, size=a - s, insns=bb.insns[:-1], data=bb.data[:a - s],
                            term=TermKind.STOP, fallthrough=None)


def _callee_range(blocks, code_addr) -> set[int]:
    """Blocks of called functions: from a call target to the end of the code."""
    calls = [b.targets[0] for b in blocks.values() if b.term is TermKind.CALL]
    return {s for s in blocks if calls and s >= min(calls)}


def make_sr(blocks, entry: int, trace: list[int], inline: bool,
            rng: random.Random | None = None) -> SuperRegion:
    """The SR over the main function (+ inlined clones of its callees), with counts from
    ``trace`` (addresses of executed instructions of the original)."""
    callee = _callee_range(blocks, entry)
    sr = SuperRegion("test")
    counts = _trace_counts(blocks, trace, callee, inline)

    def node(s: int, ctx: tuple[int, ...]):
        return s if not ctx else CloneKey(ctx, s)

    work = [(entry, ())]
    seen = set()
    while work:
        s, ctx = work.pop()
        if (s, ctx) in seen:
            continue
        seen.add((s, ctx))
        bb = blocks[s]
        k = node(s, ctx)
        if ctx:
            from dataclasses import replace
            bb = replace(bb, clone_of=s, unpatchable=True)
        sr.add_block(bb, k)

        def edge(t: int, kind: EdgeKind, tctx=ctx, k=k) -> None:
            inside = t in blocks and ((t in callee) == bool(tctx))
            c = counts.get((k, node(t, tctx)), 0) if rng is None else rng.randrange(100)
            if inside:
                work.append((t, tctx))
                sr.add_edge(k, node(t, tctx), kind, c)
            else:
                sr.add_edge(k, END, EdgeKind.EXIT, c, target=t)

        last = bb.last_insn[0]
        if bb.term is TermKind.CALL:
            if inline:
                edge(bb.targets[0], EdgeKind.CALL, ctx + (last,))
            else:
                sr.add_edge(k, END, EdgeKind.EXIT, 0, target=bb.targets[0])
                sr.add_edge(START, node(bb.fallthrough, ctx), EdgeKind.ENTRY, 1)
                work.append((bb.fallthrough, ctx))
        elif bb.term is TermKind.RET:
            if ctx:
                cont = ctx[-1] + 5
                edge(cont, EdgeKind.RETURN, ctx[:-1])
            else:
                sr.add_edge(k, END, EdgeKind.EXIT, 0, target=SENTINEL)
        else:
            for t in bb.targets:
                edge(t, EdgeKind.FLOW)
            if bb.fallthrough is not None:
                edge(bb.fallthrough, EdgeKind.FALLTHROUGH)
            if bb.term is TermKind.STOP:
                sr.add_edge(k, END, EdgeKind.EXIT, 0, target=bb.end)
            if bb.term is TermKind.IJMP:
                sr.add_edge(k, END, EdgeKind.EXIT, 0, target=bb.end)   # unknown targets
    sr.add_edge(START, entry, EdgeKind.ENTRY, RUNS)
    sr.verify()
    return sr


def _trace_counts(blocks, trace, callee, inline):
    counts: dict = {}
    prev, ctx = None, ()
    for a in trace:
        if a not in blocks:
            continue
        if prev is not None:
            pb = blocks[prev[0]]
            nctx = prev[1]
            if pb.term is TermKind.CALL and inline:
                nctx = prev[1] + (pb.last_insn[0],)
            elif pb.term is TermKind.RET and prev[1]:
                nctx = prev[1][:-1]
            ctx = nctx
            u = prev[0] if not prev[1] else CloneKey(prev[1], prev[0])
            v = a if not ctx else CloneKey(ctx, a)
            counts[(u, v)] = counts.get((u, v), 0) + 1
        prev = (a, ctx)
    return counts


# -- running ----------------------------------------------------------------------------

class World:
    """Original image, replacement buffer, stack and sentinel in one machine."""

    def __init__(self, b: Built, base: int, size: int) -> None:
        self.b, self.base = b, base
        self.m = Machine([(b.orig, 0x2000), (base, max(size, 1)), (STACK, STACK_SIZE),
                          (SENTINEL, 0x1000)])
        self.m.write(SENTINEL, b"\xf4" * 0x1000)
        self.size = size

    def load(self, gen: GeneratedCode | None, patch: bool = False) -> None:
        img = bytearray(self.b.image)
        if gen is not None:
            self.m.write(self.base, gen.code)
            if patch:
                site = self.b.entry
                off = site - self.b.orig
                img[off:off + 5] = jmp_rel32(site, gen.entries[site])
        self.m.write(self.b.orig, bytes(img))

    def state(self, rng: random.Random):
        st = random_state(rng, RSP, {self.b.orig: DATA_SIZE, STACK: STACK_SIZE})
        st.regs["rsi"] = rng.choice([0, 1, 2, 7, rng.randrange(3, 40)])
        data = bytearray(st.mem[self.b.orig])
        data[0xC0:0xF0] = self.b.image[0xC0:0xF0]          # the jump tables stay
        st.mem[self.b.orig] = bytes(data)
        st.mem[RSP] = struct.pack("<Q", SENTINEL)
        return st

    def run(self, st, start: int):
        """Run to the sentinel; (snapshot, trace of original-code addresses, landings)."""
        self.m.set_state(st)
        trace, landings = [], []
        last_in = [False]
        base, end = self.base, self.base + self.size

        self.buffer_steps = 0

        def inside(a: int) -> bool:
            in_buf = base <= a < end
            self.buffer_steps += in_buf
            if not in_buf:
                if last_in[0]:
                    landings.append(a)
                if a != SENTINEL:
                    trace.append(a)
            last_in[0] = in_buf
            return a != SENTINEL

        rip = self.m.run(start, inside, limit=100000)
        assert rip == SENTINEL
        snap = self.m.snapshot([(self.b.orig, DATA_SIZE), (STACK, STACK_SIZE)])
        return snap, trace, landings


def _compare(a, b, ctx: str) -> None:
    differ = [(k, hex(a.regs[k]), hex(b.regs[k])) for k in a.regs if a.regs[k] != b.regs[k]]
    assert b.regs == a.regs, f"{ctx}: regs {differ}"
    assert b.rflags == a.rflags, ctx
    for k in a.mem:
        if k == STACK:
            low = a.regs["rsp"] - 128 - STACK
            assert b.mem[k][low:] == a.mem[k][low:], f"{ctx}: stack"
        else:
            assert b.mem[k] == a.mem[k], f"{ctx}: data"


def _profile(p: Program, orig: int) -> list[int]:
    b = build(p, orig, None)
    w = World(b, orig + 0x100000, 0x1000)
    w.load(None)
    rng = random.Random(1)
    trace: list[int] = []
    for _ in range(3):
        st = w.state(rng)
        st.regs["rsi"] = 20
        trace += w.run(st, b.entry)[1] + [0]
    return trace


@pytest.mark.parametrize("orig,delta", PLACES, ids=["low", "high"])
@pytest.mark.parametrize("p", PROGRAMS, ids=[p.name for p in PROGRAMS])
def test_emit_differential(p: Program, orig: int, delta: int) -> None:
    b = build(p, orig, _profile(p, orig))
    base = orig + delta
    gen = emit_region(b.sr, base)
    _check_static(gen, b)
    w = World(b, base, gen.size)
    rng = random.Random(zlib.crc32(f"{p.name}@{orig:#x}".encode()))
    in_buffer = exits_taken = 0
    for i in range(RUNS):
        st = w.state(rng)
        w.load(None)
        a, _, _ = w.run(st, b.entry)
        w.load(gen)
        r, trace, landings = w.run(st, gen.entries[b.entry])
        ctx = f"{p.name} orig={orig:#x} base={base:#x} run={i} rsi={st.regs['rsi']}"
        _compare(a, r, ctx)
        for x in landings:
            assert x in b.boundaries or x == SENTINEL, f"{ctx}: exit to {x:#x}"
        in_buffer += len(trace) == 0
        exits_taken += any(x != SENTINEL for x in landings)
        w.load(gen, patch=True)
        pa, _, _ = w.run(st, b.entry)
        _compare(a, pa, ctx + " patched")
        assert w.buffer_steps > 0, "the patch did not lead into the replacement code"
    if p.inline and p.known_targets == 4 and not p.exclude and not p.stop_before_ret:
        assert in_buffer == RUNS            # everything ran in replacement code
    else:
        assert exits_taken > 0              # the exits to original code were exercised


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("p", [PROGRAMS[i] for i in (0, 1, 3, 4, 8, 11)],
                         ids=lambda p: p.name)
def test_emit_random_regions(p: Program, seed: int) -> None:
    """Random sub-regions (blocks left out become exits) with random edge counts (which
    shake the layout: chains, inverted jcc, aligned heads) still behave as the original."""
    orig, delta = PLACES[seed % 2]
    rng = random.Random(seed)
    b = build(p, orig, None, rng)
    gen = emit_region(b.sr, orig + delta)
    _check_static(gen, b)
    w = World(b, orig + delta, gen.size)
    for i in range(4):
        _patched_run_matches(w, gen, w.state(rng), f"{p.name} seed={seed} run={i}")
        assert w.buffer_steps > 0


def _patched_run_matches(w: World, gen: GeneratedCode, st, ctx: str) -> list[int]:
    """Run the original, then the patched original from the same state: same final
    state, every exit on an original instruction boundary; the exits' landings."""
    w.load(None)
    a, _, _ = w.run(st, w.b.entry)
    w.load(gen, patch=True)
    r, _, landings = w.run(st, w.b.entry)
    _compare(a, r, ctx)
    assert all(x in w.b.boundaries or x == SENTINEL for x in landings), ctx
    return landings


def _check_static(gen: GeneratedCode, b: Built) -> None:
    insns = linear(gen.code[:gen.data_start], gen.base)
    assert not any(i.mnemonic.startswith("call") for i in insns)
    check_generated(gen)
    for i in insns:
        assert gen.orig_of(i.address) in b.boundaries
    for at, t in gen.exits:
        assert t in b.boundaries or t == SENTINEL, f"exit at {at:#x} to {t:#x}"
        assert gen.base <= at < gen.base + gen.size
    assert set(gen.entries) == set(b.sr.entry_points()) and b.entry in gen.entries
    assert gen.reach_ok and gen.size == len(gen.code)
    starts = [s for s, _, _ in gen.addr_map]
    assert starts == sorted(starts)


def test_layout_hot_chain_and_loop_alignment() -> None:
    """The chains put the loop head right after main's entry block and align it (its
    back edge runs far more often than main falls into it); ext-TSP rotates the loop
    instead, so that the latch falls into the head (the back edge is no jump, padding
    would run every iteration: no alignment), and wins on taken branches."""
    from dbr_service.codegen.layout import _aligned, chain_order, layout_cost

    orig = 0x40_0000
    b = build(PROGRAMS[0], orig, _profile(PROGRAMS[0], orig))
    (latch, top), = back_edges(b.sr)
    assert b.sr.block(top).start == b.entry + 13         # `top:` after 13 bytes of main
    chains = chain_order(b.sr)
    assert chains[0] == b.entry and chains.index(top) == 1   # head first: main falls in
    assert _aligned(b.sr, chains) == {top}               # the loop head, entered once
    # the hottest forward edge is a fall-through in the chain layout
    u, v, _ = max((e for e in b.sr.body_edges() if (e[0], e[1]) != (latch, top)),
                  key=lambda e: e[2]["count"])
    assert chains.index(v) == chains.index(u) + 1
    lay = compute_layout(b.sr)
    assert lay.kind == "ext-tsp" and lay.order[0] == b.entry
    assert lay.order.index(top) == lay.order.index(latch) + 1
    assert layout_cost(b.sr, lay.order) < layout_cost(b.sr, chains)
    assert lay.aligned == set()
    gen = emit_region(b.sr, orig + 0x5000_0000)
    assert gen.layout_kind == "ext-tsp" and gen.layout == lay.order
    assert gen.block_addr[latch] < gen.block_addr[top]


def test_clone_blocks_and_inlined_return() -> None:
    orig = 0x40_0000
    b = build(PROGRAMS[1], orig, _profile(PROGRAMS[1], orig))
    clones = [k for k in b.sr.body_nodes() if isinstance(k, CloneKey)]
    assert clones and all(b.sr.block(k).is_clone for k in clones)
    gen = emit_region(b.sr, orig + 0x5000_0000)
    # no exit to the callee or into the continuation: the call stays in the buffer
    callee = min(k.start for k in clones)
    assert callee not in {t for _, t in gen.exits}
    assert not gen.dynamic_exits or all(
        gen.orig_of(a) is not None for a in gen.dynamic_exits)
    text = [f"{i.mnemonic} {i.op_str}" for i in linear(gen.code, gen.base)]
    assert any(t.startswith("push 0x") for t in text)     # the pseudo-call
    assert any(t.startswith("lea rsp, [rsp + 8]") for t in text)   # the inlined ret


def test_reach_error() -> None:
    orig = 0x40_0000
    b = build(PROGRAMS[0], orig, None)
    with pytest.raises(CodegenError):
        emit_region(b.sr, orig + 0x9000_0000)


def test_check_generated_rejects_call() -> None:
    gen = GeneratedCode(bytes.fromhex("e800000000"), 0x1000, {}, [(0x1000, 0x1005, 0x10)], [])
    with pytest.raises(CodegenError):
        check_generated(gen)
    gen = GeneratedCode(bytes.fromhex("90c3"), 0x1000, {}, [(0x1000, 0x1001, 0x10)], [])
    with pytest.raises(CodegenError):                     # ret not covered by the map
        check_generated(gen)


def test_perf_map_and_nops() -> None:
    orig = 0x40_0000
    b = build(PROGRAMS[3], orig, None)
    gen = emit_region(b.sr, orig + 0x5000_0000)
    lines = perf_map_lines(gen, "dbr:test")
    assert lines and all(len(x.split()) == 3 for x in lines)
    total = sum(int(x.split()[1], 16) for x in lines)
    assert total == gen.size
    for n in range(1, 16):
        ins = list(CS.disasm(nop_bytes(n), 0))
        assert sum(i.size for i in ins) == n and all(i.mnemonic == "nop" for i in ins)


def asm_commented(src: str, at: int) -> bytes:
    """Assemble ``src`` at ``at``, each line's ``; comment`` dropped."""
    return asm("\n".join(line.split(";")[0] for line in src.splitlines()), at)


def _small_loop_sr(entry_count: float = 1) -> SuperRegion:
    src = """
    main: mov ecx, 0x10          ; 0x400000  b9 10 00 00 00
    top:  add eax, ecx           ; 0x400005  01 c8
          cmp eax, 0x100         ; 0x400007  3d 00 01 00 00
          jae out                ; 0x40000c  73 05
          dec ecx                ; 0x40000e  ff c9
          jne top                ; 0x400010  75 f3
          ret                    ; 0x400012  c3   (not in the region)
    out:  mov eax, 1             ; 0x400013        (not in the region)
          jmp main
    """
    o = 0x40_0000
    code = asm_commented(src, o)
    assert code.hex() == "b91000000001c83d000100007305ffc975f3c3b801000000ebe6"
    bl = build_blocks(code, o)
    sr = SuperRegion("golden")
    for a in (0x400000, 0x400005, 0x40000E):
        sr.add_block(bl[a])
    sr.add_edge(START, 0x400000, EdgeKind.ENTRY, entry_count)
    sr.add_edge(0x400000, 0x400005, EdgeKind.FALLTHROUGH, entry_count)
    sr.add_edge(0x400005, 0x40000E, EdgeKind.FALLTHROUGH, 100)
    sr.add_edge(0x40000E, 0x400005, EdgeKind.FLOW, 99)
    sr.add_edge(0x400005, END, EdgeKind.EXIT, 0, target=0x400013)
    sr.add_edge(0x40000E, END, EdgeKind.EXIT, 1, target=0x400012)
    sr.verify()
    return sr


def test_golden_small_loop() -> None:
    """A hand-built SR over a counted loop, emitted at 0x10000000: golden bytes."""
    gen = emit_region(_small_loop_sr(), 0x1000_0000)
    got = [(i.bytes.hex(), f"{i.mnemonic} {i.op_str}".strip(), gen.orig_of(i.address))
           for i in CS.disasm(gen.code, gen.base)]
    assert got == [
        ("b910000000", "mov ecx, 0x10", 0x400000),
        ("660f1f840000000000", "nop word ptr [rax + rax]", 0x400005),   # align the
        ("6690", "nop", 0x400005),                                      # loop head
        ("01c8", "add eax, ecx", 0x400005),                   # 0x10000010: top
        ("3d00010000", "cmp eax, 0x100", 0x400007),
        ("0f83f6ff3ff0", "jae 0x400013", 0x40000C),           # exit (rel8 widened)
        ("ffc9", "dec ecx", 0x40000E),                        # fallen into
        ("0f85ebffffff", "jne 0x10000010", 0x400010),         # back edge in-buffer
        ("e9e8ff3ff0", "jmp 0x400012", 0x400010),             # fall-through exit
    ]
    assert gen.entries == {0x400000: 0x1000_0000}
    assert gen.exits == [(0x1000_0017, 0x400013), (0x1000_0025, 0x400012)]
    assert gen.size == len(gen.code) == 0x2A


def test_alignment_pays_only_when_fall_in_is_rare() -> None:
    from dbr_service.codegen.layout import Layout, _aligned
    sr = _small_loop_sr()
    assert compute_layout(sr).aligned == {0x400005}            # back 99 vs fall-in 1
    # the latch laid out right before the head: padding would run every iteration
    assert _aligned(sr, [0x400000, 0x40000E, 0x400005]) == set()
    # entered about as often as it loops: not worth it either
    assert compute_layout(_small_loop_sr(entry_count=50)).aligned == set()
    gen = emit_region(_small_loop_sr(entry_count=50), 0x1000_0000)
    assert gen.block_addr[0x400005] == 0x1000_0005              # no padding
    # a forced layout is honoured
    lay = Layout([0x400000, 0x40000E, 0x400005], set())
    gen = emit_region(sr, 0x1000_0000, layout=lay)
    assert gen.layout == lay.order


FAR_DISPATCH = [Program("reltable_exit", RELTABLE, exclude="xor eax, 0x12345"),
                Program("reltable_lone_exit", RELTABLE, exclude="xor eax, 0x12345",
                        lone_ijmp=True),
                Program("reltable_partial_exit", RELTABLE, known_targets=3,
                        exclude="imul eax, eax, 0x10003")]


@pytest.mark.parametrize("p", FAR_DISPATCH, ids=[p.name for p in FAR_DISPATCH])
def test_dispatch_with_far_exit_stubs(p: Program, monkeypatch) -> None:
    """A translated dispatch in a region whose exits go through far-exit stubs (forced
    here: every exit treated as out of rel32 reach): the code, the stubs' address
    table and the dispatch's slot table share the buffer, and the region still
    behaves as the original."""
    import dbr_service.codegen.emit as emit_mod

    monkeypatch.setattr(emit_mod, "_near", lambda t, lo, hi: False)
    name = p.name
    orig, delta = PLACES[0]
    b = build(p, orig, _profile(p, orig))
    gen = emit_region(b.sr, orig + delta)
    assert gen.far_exits, "no exit went through a stub"
    _check_static(gen, b)
    w = World(b, orig + delta, gen.size)
    rng = random.Random(name)
    exits = 0
    for i in range(RUNS):
        landings = _patched_run_matches(w, gen, w.state(rng), f"{name} run={i}")
        exits += any(x != SENTINEL for x in landings)
    assert exits > 0


def _latch_entry_sr() -> tuple[SuperRegion, bytes, int, int]:
    """A bottom-tested loop entered at its latch (the shape of a region whose patch
    point is the loop's `cmp`): the body falls into the latch, the latch's jne goes
    back to the body and its fall-through leaves.  (SR, code, body, latch)"""
    src = """
           jmp latch                         ; 0x400000 (not in the region)
    body:  movzx ecx, byte ptr [rdi + rdx]
           xor rax, rcx
           imul rax, rax, 0x1b3
           add rdx, 1
    latch: cmp rdx, 0x40
           jne body
           ret
    """
    o = 0x40_0000
    code = asm_commented(src, o)
    bl = build_blocks(code, o)
    body, latch = sorted(a for a in bl if a != o)[:2]
    assert bl[latch].term is TermKind.JCC and bl[body].term is TermKind.FALLTHROUGH
    sr = SuperRegion("latch-entry")
    sr.add_block(bl[body])
    sr.add_block(bl[latch])
    sr.add_edge(START, latch, EdgeKind.ENTRY, 1)
    sr.add_edge(latch, body, EdgeKind.FLOW, 63)
    sr.add_edge(body, latch, EdgeKind.FALLTHROUGH, 64)
    sr.add_edge(latch, END, EdgeKind.EXIT, 1, target=bl[latch].end)
    sr.verify()
    return sr, code, body, latch


def test_loop_entered_at_its_exit_test_is_rotated() -> None:
    """The latch is laid out after the body: the body falls into it and its jne jumps
    back, one branch an iteration as in the original (was: jne inverted to je over the
    body plus a jmp back).  The entry lands mid-code; a unicorn run from the entry
    gives the original's state."""
    sr, code, body, latch = _latch_entry_sr()
    assert compute_layout(sr).order == [body, latch]
    base = 0x1000_0000
    gen = emit_region(sr, base)
    insns = linear(gen.code[:gen.data_start], gen.base)
    branches = [i for i in insns if i.mnemonic.startswith("j")]
    assert [i.mnemonic for i in branches] == ["jne", "jmp"], [str(i) for i in insns]
    assert int(branches[0].op_str, 16) == gen.block_addr[body]     # back to the body
    assert int(branches[1].op_str, 16) == sr.block(latch).end      # the exit
    assert gen.entries == {latch: gen.block_addr[latch]} and gen.block_addr[latch] > base
    exit_at = sr.block(latch).end
    rng = random.Random(7)
    for _ in range(5):
        st = random_state(rng, 0x50_0800, {0x50_0000: 0x40},
                          {"rdi": 0x50_0000, "rdx": rng.randrange(0, 0x40)})
        _same_exit_state(code, gen, st, latch, (body, exit_at))


def _same_exit_state(code: bytes, gen, st, entry: int, orig: tuple[int, int]) -> None:
    """Run the original code at 0x400000 from ``entry`` while the PC stays in ``orig``
    ([lo, hi), hi the exit), and the replacement from ``entry``'s patch site while it
    stays in the buffer, both from state ``st``: same exit, same registers and flags."""
    base = gen.base
    runs = []
    for start, inside in ((entry, lambda a: orig[0] <= a < orig[1]),
                          (gen.entries[entry], lambda a: base <= a < base + gen.size)):
        m = Machine([(0x40_0000, len(code)), (base, gen.size), (0x50_0000, 0x1000)])
        m.write(0x40_0000, code)
        m.write(base, gen.code)
        m.set_state(st)
        runs.append((m.run(start, inside), m.snapshot([])))
    (end_a, sa), (end_b, sb) = runs
    assert end_a == end_b == orig[1]
    assert sa.regs == sb.regs and sa.rflags == sb.rflags


def _tree_walk_sr(to_a: float, to_b: float) -> tuple[SuperRegion, bytes, dict[str, int]]:
    """The shape of xz's binary-tree match finder (liblzma bt_find_func): a loop whose
    body branches two ways that meet again at the exit test.  The compiler's layout
    ``A T H B`` takes one branch an iteration on either side (``jb A`` or ``jmp T``).
    Entered at its head H, ``to_a``/``to_b`` iterations going each way."""
    src = """
           jmp head                          ; 0x400000 (not in the region)
    a:     mov r13d, eax
           lea r11, [rbx + 4]
    t:     mov ecx, r9d
           sub ecx, esi
           cmp ecx, r14d
           jb out
    head:  movzx r10d, byte ptr [rdi + rcx]
           add esi, 3
           cmp r10b, r8b
           jb a
    b:     mov r12d, eax
           add rbx, 8
           jmp t
    out:   ret
    """
    o = 0x40_0000
    code = asm_commented(src, o)
    bl = build_blocks(code, o)
    a, t, head, b = sorted(k for k in bl if k != o)[:4]
    assert bl[a].term is TermKind.FALLTHROUGH and bl[t].term is TermKind.JCC
    assert bl[head].term is TermKind.JCC and bl[b].term is TermKind.JMP
    sr = SuperRegion("tree-walk")
    for k in (a, t, head, b):
        sr.add_block(bl[k])
    n = to_a + to_b
    sr.add_edge(START, head, EdgeKind.ENTRY, 1)
    sr.add_edge(head, a, EdgeKind.FLOW, to_a)
    sr.add_edge(head, b, EdgeKind.FALLTHROUGH, to_b)
    sr.add_edge(a, t, EdgeKind.FALLTHROUGH, to_a)
    sr.add_edge(b, t, EdgeKind.FLOW, to_b)
    sr.add_edge(t, head, EdgeKind.FALLTHROUGH, n - 1)
    sr.add_edge(t, END, EdgeKind.EXIT, 1, target=bl[t].targets[0])
    sr.verify()
    return sr, code, {"a": a, "t": t, "head": head, "b": b}


def test_the_compilers_layout_is_kept_when_chains_do_not_beat_it() -> None:
    """The chains glue the hotter side (b) between head and exit test and leave a
    behind: the back edge and both of a's edges become jumps (1.9 taken branches an
    iteration here).  The compiler's order costs one, so it is the one emitted, and
    the region still runs like the original."""
    from dbr_service.codegen.layout import chain_order, layout_cost, original_order

    sr, code, k = _tree_walk_sr(45, 55)
    assert original_order(sr) == [k["a"], k["t"], k["head"], k["b"]]
    assert layout_cost(sr, original_order(sr)) == 45 + 55          # jb a / jmp t
    assert layout_cost(sr, chain_order(sr)) > 1.5 * 100
    lay = compute_layout(sr)
    assert lay.kind == "original" and lay.order == original_order(sr)
    base = 0x1000_0000
    gen = emit_region(sr, base)
    assert gen.layout_kind == "original"
    insns = linear(gen.code[:gen.data_start], gen.base)
    jumps = [i.mnemonic for i in insns if i.mnemonic.startswith("j")]
    assert jumps == ["jb", "jb", "jmp"], jumps                  # as the compiler had it
    out = sr.block(k["t"]).targets[0]
    rng = random.Random(11)
    for _ in range(6):
        st = random_state(rng, 0x50_0800, {0x50_0000: 0x100},
                          {"rdi": 0x50_0000, "rcx": rng.randrange(0, 0x40),
                           "r9": rng.randrange(0x40, 0x60), "rsi": rng.randrange(0, 8),
                           "r14": rng.randrange(1, 0x10)})
        _same_exit_state(code, gen, st, k["head"], (k["a"], out))


def test_chains_win_where_the_compiler_put_a_rare_block_in_the_hot_path() -> None:
    """``head: ...; jnz latch`` taken 99 times in 100 with the rare block as its
    fall-through (a -O0 or profile-less layout): the orders made from the counts let
    head fall into latch (the jcc inverted), one taken branch an iteration instead of two;
    ext-TSP and the chains agree, and ext-TSP takes a tie."""
    from dbr_service.codegen.layout import layout_cost, original_order

    src = """
    head:  add eax, 1
           test eax, 0xff
           jnz latch
    rare:  xor ebx, eax
    latch: dec ecx
           jnz head
           ret
    """
    o = 0x40_0000
    code = asm_commented(src, o)
    bl = build_blocks(code, o)
    head, rare, latch = sorted(bl)[:3]
    sr = SuperRegion("rare-fallthrough")
    for x in (head, rare, latch):
        sr.add_block(bl[x])
    sr.add_edge(START, head, EdgeKind.ENTRY, 1)
    sr.add_edge(head, latch, EdgeKind.FLOW, 99)
    sr.add_edge(head, rare, EdgeKind.FALLTHROUGH, 1)
    sr.add_edge(rare, latch, EdgeKind.FALLTHROUGH, 1)
    sr.add_edge(latch, head, EdgeKind.FLOW, 99)
    sr.add_edge(latch, END, EdgeKind.EXIT, 1, target=bl[latch].end)
    sr.verify()
    from dbr_service.codegen.layout import chain_order

    lay = compute_layout(sr)
    assert lay.kind == "ext-tsp" and lay.order == [head, latch, rare] == chain_order(sr)
    assert layout_cost(sr, lay.order) == 99 + 1 + 1 < layout_cost(sr, original_order(sr))
    gen = emit_region(sr, 0x1000_0000)
    assert gen.layout_kind == "ext-tsp"


HEAD_FIRST_SRC = """
  mov rdx, rax
  and edx, 0xfff
  mov ecx, dword ptr [rdi + rdx*4]
  test al, 0x3f
  jne hot
  lea edx, [rcx*8]
  sub edx, ecx
  add r8, rdx
latch:
  add rax, 1
  cmp rsi, rax
  jne 0x400000
  ret
hot:
  add r10, rcx
  xor r9, rcx
  jmp latch
"""


def test_a_loop_head_split_off_before_the_entry_is_laid_out_first() -> None:
    """A loop whose head `mov rdx, rax` is split off before the patch site (the
    region's entry): the copy starts with the head and its latch jumps back with one
    jcc, as the compiler lays out a bottom-tested loop, not `je exit; mov; jmp top`.
    The copy computes what the original computes from random states."""
    from dbr_service.codegen.layout import Layout, head_first, layout_cost

    orig = 0x40_0000
    code = asm(HEAD_FIRST_SRC, orig)
    # the entry `and edx, 0xfff` a leader, as patch-point selection splits it off
    bl = build_blocks(code, orig, indirect={0: [orig + 3]})
    m, e, c, latch, _ret, hot = sorted(bl)
    assert (bl[m].size, bl[e].term, bl[latch].term, bl[hot].term) == (
        3, TermKind.JCC, TermKind.JCC, TermKind.JMP)
    sr = SuperRegion("head-first")
    for a in (m, e, c, latch, hot):
        sr.add_block(bl[a])
    sr.add_edge(START, e, EdgeKind.ENTRY, 1)
    sr.add_edge(m, e, EdgeKind.FALLTHROUGH, 1000)
    sr.add_edge(e, c, EdgeKind.FALLTHROUGH, 16)
    sr.add_edge(e, hot, EdgeKind.FLOW, 984)
    sr.add_edge(c, latch, EdgeKind.FALLTHROUGH, 16)
    sr.add_edge(hot, latch, EdgeKind.FLOW, 984)
    sr.add_edge(latch, m, EdgeKind.FLOW, 999)
    sr.add_edge(latch, END, EdgeKind.EXIT, 1, target=latch + bl[latch].size)
    sr.verify()
    # ext-TSP keeps the entry first: [e, hot, latch, m, c] ends the loop `je exit;
    # mov; jmp e`; head_first starts with m instead, at the same modelled cost
    ext = [e, hot, latch, m, c]
    assert head_first(sr, ext) == [m, e, hot, latch, c]
    assert layout_cost(sr, [m, e, hot, latch, c]) <= layout_cost(sr, ext)
    assert head_first(sr, [m, e, hot, latch, c]) == [m, e, hot, latch, c]   # once
    # whatever compute_layout picks costs no more than either
    assert layout_cost(sr, compute_layout(sr).order) <= layout_cost(sr, ext)
    base = orig + 0x5000_0000
    gen = emit_region(sr, base, layout=Layout([m, e, hot, latch, c], set()))
    insns = linear(gen.code[:gen.data_start], gen.base)
    # the latch's jcc goes back to the head, the first instruction of the copy
    back = [i for i in insns if i.mnemonic == "jne" and int(i.op_str, 16) == base]
    text = [f"{i.mnemonic} {i.op_str}" for i in insns]
    assert len(back) == 1 and insns[0].mnemonic == "mov", text
    # differential: from random states (rax below rsi so the loop ends), the copy
    # entered at the entry ends where the original ends, with the same registers
    rng = random.Random(7)
    table = 0x70_0000
    for _ in range(20):
        n = rng.randrange(1, 200)
        st = random_state(rng, 0x80_0000, {table: 0x4000, 0x7f_f000: 0x2000},
                          {"rdi": table, "rax": 0, "rsi": n})
        outs = []
        for where, start in (("original", e), ("copy", gen.entries[e])):
            mc = Machine([(orig, 0x1000), (base, 0x1000), (table, 0x4000),
                          (0x7f_f000, 0x2000)])
            mc.write(orig, code)
            mc.write(base, gen.code)
            mc.set_state(st)
            stop = mc.run(start, lambda a: orig <= a < orig + len(code) - 0 and
                          a != latch + bl[latch].size or base <= a < base + gen.size,
                          limit=20000)
            outs.append((stop, mc.snapshot([]).regs))
        (so, ro), (sc, rc) = outs
        assert so == sc == latch + bl[latch].size and ro == rc, (n, hex(so), hex(sc))


def test_sp_offset_matches_execution() -> None:
    """codegen/spoffset.py against the CPU: at every replacement instruction run, rsp
    less rsp at the start of its translation (where it is the original's) is what
    the replay says.  Dispatches save scratch registers below the red zone, so some
    instructions must have rsp moved for the check to mean anything."""
    from dbr_service.codegen.spoffset import sp_offset

    moved = checked = 0
    for p in PROGRAMS:
        orig, delta = PLACES[0]
        b = build(p, orig, _profile(p, orig))
        gen = emit_region(b.sr, orig + delta)
        w = World(b, orig + delta, gen.size)
        pieces = sorted(gen.addr_map)
        start_rsp: dict[tuple[int, int], int] = {}
        seen: list[tuple[int, int]] = []
        hook = w.m.uc.hook_add(UC_HOOK_CODE, lambda uc, a, _n, _u: seen.append(
            (a, uc.reg_read(U.UC_X86_REG_RSP))))
        rng = random.Random(zlib.crc32(p.name.encode()))
        for _ in range(8):
            seen.clear()
            w.load(gen)
            w.run(w.state(rng), gen.entries[b.entry])
            for a, rsp in seen:
                piece = next(((lo, hi) for lo, hi, _o in pieces if lo <= a < hi), None)
                if piece is None:
                    continue
                if a == piece[0]:
                    start_rsp[piece] = rsp
                    continue
                want = rsp - start_rsp[piece]
                assert sp_offset(gen.code, gen.base, *piece, a) == want, (p.name, hex(a))
                checked += 1
                moved += want != 0
        w.m.uc.hook_del(hook)
    assert checked > 100 and moved > 10, (checked, moved)
