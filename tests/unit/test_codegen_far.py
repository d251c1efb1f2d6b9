"""Far exits: a region spanning two modules more than 2 GiB apart (a PLT call inlined into
a shared library's function) is emitted near the executable; its exits into the library
go through ``jmp [rip+slot]`` stubs.  Differential runs in unicorn compare the original
and the replacement code, patched and unpatched, from random states; the far exit is
taken and lands on the library's original instruction."""

from __future__ import annotations

import random
import struct

import pytest
from codegen_util import Machine, asm, build_blocks, linear, random_state
from test_codegen_emit import RSP, SENTINEL, STACK, STACK_SIZE, make_sr

from dbr_service.codegen.emit import check_generated, emit_region
from dbr_service.codegen.relocate import jmp_rel32
from dbr_service.common.errors import CodegenError

MAIN = 0x40_0000
LIB = MAIN + 0x1_2000_0000          # 4.5 GiB above the executable
BASE = MAIN + 0x10_0000             # the code buffer, near the executable
DATA = 0x100                        # result @0, got @8

MAIN_SRC = """
result: .quad 0
got: .quad {lib}
.space 0xf0
main:
    mov eax, 0x11
    mov r8, rsi
    test r8, r8
    je done
top:
    mov edi, eax
    mov esi, r8d
    call plt
    add eax, 3
    dec r8
    jne top
done:
    mov qword ptr [rip + result], rax
    ret
plt:
    jmp qword ptr [rip + got]
"""

# The library's function: its cold side (1 call in 8) is left out of the region, so the
# region exits there, 4.5 GiB away from its code.
LIB_SRC = """
lib:
    imul eax, edi, 1664525
    add eax, 1013904223
    test esi, 7
    je cold
    xor eax, esi
    ret
cold:
    sub eax, esi
    ret
"""

# Same, touching the library's own data: a disp32 that cannot reach from near the
# executable (no stub can fix a data reference: the region must not be placed there).
LIB_DATA_SRC = """
lib:
    add eax, dword ptr [rip + 0x800]
    ret
"""


class Far:
    def __init__(self, lib_src: str = LIB_SRC) -> None:
        self.main = asm(MAIN_SRC.format(lib=LIB), MAIN)
        self.lib = asm(lib_src, LIB)
        self.entry = MAIN + DATA
        code = self.main[DATA:]
        plt = next(i.address for i in linear(code, self.entry) if i.mnemonic == "jmp"
                   and "rip" in i.op_str)
        blocks = build_blocks(code, self.entry, {plt: [LIB]})
        lib_blocks = build_blocks(self.lib, LIB)
        self.cold = max(lib_blocks) if lib_src == LIB_SRC else None
        if self.cold is not None:
            del lib_blocks[self.cold]
        blocks.update(lib_blocks)
        self.sr = make_sr(blocks, self.entry, [], inline=True)
        self.boundaries = ({i.address for i in linear(code, self.entry)}
                           | {i.address for i in linear(self.lib, LIB)})


def _machine(f: Far, size: int) -> Machine:
    m = Machine([(MAIN, 0x1000), (LIB, 0x1000), (BASE, max(size, 1)),
                 (STACK, STACK_SIZE), (SENTINEL, 0x1000)])
    m.write(SENTINEL, b"\xf4" * 0x1000)
    return m


def _run(m: Machine, st, start: int, base: int, size: int):
    m.set_state(st)
    landings, last_in, steps = [], [False], [0]

    def inside(a: int) -> bool:
        in_buf = base <= a < base + size
        steps[0] += in_buf
        if not in_buf and last_in[0]:
            landings.append(a)
        last_in[0] = in_buf
        return a != SENTINEL

    assert m.run(start, inside, limit=200000) == SENTINEL
    snap = m.snapshot([(MAIN, DATA), (STACK, STACK_SIZE)])
    return snap, landings, steps[0]


#: Dead at the PLT call under the SysV ABI; the inlined stub's guard clobbers them
#: (codegen/relocate.py ``_cascade_abi``).  Everything else must match.
ABI_DEAD = ("r10", "r11")


def _same(a, b, ctx: str) -> None:
    ra = {k: v for k, v in a.regs.items() if k not in ABI_DEAD}
    rb = {k: v for k, v in b.regs.items() if k not in ABI_DEAD}
    assert ra == rb and a.rflags == b.rflags, ctx
    assert a.mem[MAIN] == b.mem[MAIN], ctx
    low = a.regs["rsp"] - 128 - STACK          # the red zone and above must match
    assert a.mem[STACK][low:] == b.mem[STACK][low:], ctx


def test_far_exit_stub_shape() -> None:
    f = Far()
    gen = emit_region(f.sr, BASE)
    assert set(gen.far_exits) == {f.cold}
    assert gen.data_start is not None and gen.data_start < gen.size
    # the PLT stub's guard is the ABI form (no pushfq/popfq around it)
    assert not any(i.mnemonic in ("pushfq", "popfq")
                   for i in linear(gen.code[:gen.data_start], BASE)), "slow guard"
    stub = gen.far_exits[f.cold]
    insn = next(iter(linear(gen.code[stub - BASE:stub - BASE + 6], stub)))
    assert insn.mnemonic == "jmp" and insn.bytes[:2] == b"\xff\x25"
    slot = stub + 6 + insn.disp
    assert slot % 8 == 0
    assert struct.unpack_from("<Q", gen.code, slot - BASE)[0] == f.cold
    assert gen.orig_of(stub) == f.cold                   # samples there name the target
    assert (f.cold in {t for _a, t in gen.exits})        # still an exit to original code
    check_generated(gen)
    # every near exit is still a plain rel32 jump to the original address
    for a, t in gen.exits:
        if t not in gen.far_exits:
            assert abs(t - a) < 1 << 31


def test_far_exits_differential() -> None:
    f = Far()
    gen = emit_region(f.sr, BASE)
    m = _machine(f, gen.size)
    rng = random.Random(7)
    far_taken = 0
    for i in range(12):
        st = random_state(rng, RSP, {MAIN: DATA, STACK: STACK_SIZE},
                          {"rsi": rng.choice([0, 1, 5, 8, 9, 17, 30])})
        st.mem[MAIN] = bytes(8) + struct.pack("<Q", LIB) + f.main[16:DATA]
        st.mem[RSP] = struct.pack("<Q", SENTINEL)
        m.write(MAIN, f.main)
        m.write(LIB, f.lib)
        m.write(BASE, gen.code)
        a, _, _ = _run(m, st, f.entry, BASE, gen.size)
        r, landings, steps = _run(m, st, gen.entries[f.entry], BASE, gen.size)
        ctx = f"run {i} rsi={st.regs['rsi']}"
        _same(a, r, ctx)
        assert steps > 0
        assert all(x in f.boundaries or x == SENTINEL for x in landings), ctx
        far_taken += f.cold in landings
        # patched: the executable's entry jumps into the buffer
        img = bytearray(f.main)
        off = f.entry - MAIN
        img[off:off + 5] = jmp_rel32(f.entry, gen.entries[f.entry])
        m.write(MAIN, bytes(img))
        p, _, psteps = _run(m, st, f.entry, BASE, gen.size)
        _same(a, p, ctx + " patched")
        assert psteps > 0
    assert far_taken > 0, "the far exit was never taken"


def test_far_exits_off_is_a_reach_error() -> None:
    with pytest.raises(CodegenError, match="out of range"):
        emit_region(Far().sr, BASE, far_exits=False)


def test_library_data_reference_cannot_be_placed_near_the_executable() -> None:
    f = Far(LIB_DATA_SRC)
    with pytest.raises(CodegenError, match="out of range"):
        emit_region(f.sr, BASE)


def test_placement_reaches_only_what_must_be_reached() -> None:
    """The service's placement: a region within 2 GiB keeps the full reach set (as
    before far exits existed); one spanning two modules reaches only its patch sites and
    data operands, and reserves room for a stub per exit target."""
    from types import SimpleNamespace

    from dbr_service.codegen.emit import far_exit_bound
    from dbr_service.installation.install import CodeSpace
    from dbr_service.installation.optimize import placement

    inst = SimpleNamespace(space=CodeSpace(None))
    f = Far()
    size, reach = placement(inst, f.sr)
    assert max(reach) - min(reach) < 1 << 31
    assert f.entry in reach and MAIN in reach            # the patch site, `result`/`got`
    assert not any(r >= LIB for r in reach)              # nothing of the library
    exits = {t for _a, t in emit_region(f.sr, BASE).exits}
    assert size >= emit_region(f.sr, BASE).size
    assert size <= emit_region(f.sr, BASE, far_exits=True).size + far_exit_bound(len(exits))
    # within one module: everything the region touches stays in the reach set (the
    # test builder's `ret` exit names a far sentinel target; real ones have none)
    from test_codegen_emit import PROGRAMS, build
    b = build(PROGRAMS[0], MAIN, None)
    for _v, exits in b.sr.exit_edges():
        exits.pop(SENTINEL, None)
    size2, reach2 = placement(inst, b.sr)
    assert size2 == emit_region(b.sr, MAIN).size
    assert {bb.start for _k, bb in b.sr.blocks()} <= set(reach2)
