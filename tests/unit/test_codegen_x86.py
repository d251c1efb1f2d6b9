"""The x86-64 writer (codegen/x86.py): every encoder against golden bytes, decoded with
capstone and compared with keystone's assembly of the same instruction, over all 16
registers, rel8/rel32/disp32 boundaries, the rsp/rbp/r12/r13 addressing forms and
negative displacements.

Where keystone picks another valid form (an imm8 or rel8 where the writer always uses
imm32/rel32, ``3D`` for ``cmp rax, imm32``), the instructions must decode the same;
where the form is the canonical one, the bytes must be equal too."""

from __future__ import annotations

import pytest
from codegen_util import CS, asm, linear

from dbr_service.codegen import x86
from dbr_service.codegen.x86 import (
    CC_E,
    CC_NE,
    R8,
    R10,
    R11,
    R12,
    R13,
    R15,
    RAX,
    RBP,
    RBX,
    RCX,
    RSP,
    CannotRelocate,
    OutOfRange,
    X86Writer,
)
from dbr_service.common.errors import CodegenError

AT = 0x40_1000
REGS = list(range(16))
NAMES = x86.REG_NAMES
CCS = ["o", "no", "b", "ae", "e", "ne", "be", "a", "s", "ns", "p", "np", "l", "ge", "le", "g"]
INT32_MIN, INT32_MAX = -(1 << 31), (1 << 31) - 1


def put(f, at: int = AT, check: bool = True) -> bytes:
    """The bytes of ``f(writer)`` on a writer placed at ``at``."""
    w = X86Writer(at, check=check)
    f(w)
    return w.finish()


def text(code: bytes, at: int = AT) -> list[str]:
    return [f"{i.mnemonic} {i.op_str}".strip() for i in linear(code, at)]


def same(code: bytes, asm_text: str, at: int = AT, *, exact: bool = True) -> None:
    """``code`` decodes as keystone's ``asm_text``; ``exact``: and is the same bytes."""
    ks = asm(asm_text, at)
    assert text(code, at) == text(ks, at), (code.hex(), ks.hex())
    if exact:
        assert code == ks, (asm_text, code.hex(), ks.hex())


def one(code: bytes, at: int = AT):
    insns = linear(code, at)
    assert len(insns) == 1
    return insns[0]


# ---- golden bytes (the encodings codegen has always emitted) -----------------------------

@pytest.mark.parametrize("f,hexbytes", [
    (lambda w: w.put_lea(RSP, RSP, -0x80), "488d642480"),
    (lambda w: w.put_lea(RSP, RSP, 0x80), "488da42480000000"),
    (lambda w: w.put_lea(RSP, RSP, -8), "488d6424f8"),
    (lambda w: w.put_lea(RSP, RSP, 0x18), "488d642418"),
    (lambda w: w.put_lea(RSP, RSP, 0x108), "488da42408010000"),
    (lambda w: w.put_lea(RCX, RCX, index=R12), "4a8d0c21"),
    (lambda w: w.put_lea(RCX, RCX, index=RAX), "488d0c01"),
    (lambda w: w.put_pushfq(), "9c"),
    (lambda w: w.put_popfq(), "9d"),
    (lambda w: w.put_push_reg(RCX), "51"),
    (lambda w: w.put_push_reg(R11), "4153"),
    (lambda w: w.put_pop_reg(R15), "415f"),
    (lambda w: w.put_push_imm32(0x7FFF_FFFF), "68ffffff7f"),
    (lambda w: w.put_mov_m32_imm32(RSP, 0, 0x5555_6000), "c7042400605555"),
    (lambda w: w.put_mov_m32_imm32(RSP, 4, 0x5555), "c744240455550000"),
    (lambda w: w.put_mov_reg_imm64(RCX, -0x1100 & (1 << 64) - 1), "48b900efffffffffffff"),
    (lambda w: w.put_mov_reg_imm64(R10, 0x5555_5555_1000), "49ba0010555555550000"),
    (lambda w: w.put_mov_reg_reg(R8, RCX), "4989c8"),
    (lambda w: w.put_cmp_reg_reg(R11, R10), "4d39d3"),
    (lambda w: w.put_cmp_reg_imm32(R11, 0x1100), "4981fb00110000"),
    (lambda w: w.put_cmp_reg_imm32(RAX, -1), "4881f8ffffffff"),
    (lambda w: w.put_sub_reg_reg(RAX, R13), "4c29e8"),
    (lambda w: w.put_jmp_reg(R11), "41ffe3"),
    (lambda w: w.put_jmp_reg(RAX), "ffe0"),
    (lambda w: w.put_jmp_mem(RBX, RAX, 8, 0x10, notrack=True, disp32=True), "3effa4c310000000"),
    (lambda w: w.put_jmp_mem(R13, R12, 8, -8, notrack=True, disp32=True), "3e43ffa4e5f8ffffff"),
    (lambda w: w.put_jmp(AT + 0x1000), "e9fb0f0000"),
    (lambda w: w.put_call(AT + 5), "e800000000"),
    (lambda w: w.put_jcc(CC_E, AT + 0x106), "0f8400010000"),
    (lambda w: w.put_push_rip(AT + 6 + 0x10), "ff3510000000"),
    (lambda w: w.put_jmp_rip(AT + 6 - 0x10), "ff25f0ffffff"),
    (lambda w: w.put_cmp_reg_rip(R11, AT + 7), "4c3b1d00000000"),
])
def test_golden(f, hexbytes: str) -> None:
    assert put(f) == bytes.fromhex(hexbytes)


# ---- every register, checked against keystone ----------------------------------------------

def test_flags() -> None:
    same(put(lambda w: w.put_pushfq()), "pushfq")
    same(put(lambda w: w.put_popfq()), "popfq")


@pytest.mark.parametrize("r", REGS)
def test_registers(r: int) -> None:
    n = NAMES[r]
    same(put(lambda w: w.put_push_reg(r)), f"push {n}")
    same(put(lambda w: w.put_pop_reg(r)), f"pop {n}")
    same(put(lambda w: w.put_jmp_reg(r)), f"jmp {n}")
    same(put(lambda w: w.put_mov_reg_imm64(r, 0x1122_3344_5566_7788)),
         f"movabs {n}, 0x1122334455667788")
    same(put(lambda w: w.put_cmp_reg_imm32(r, 0x1234_5678)), f"cmp {n}, 0x12345678",
         exact=r != RAX)                                  # keystone: 48 3D for rax
    same(put(lambda w: w.put_cmp_reg_imm32(r, -2)), f"cmp {n}, -2", exact=False)   # imm8
    for s in REGS:
        m = NAMES[s]
        same(put(lambda w: w.put_mov_reg_reg(r, s)), f"mov {n}, {m}")
        same(put(lambda w: w.put_cmp_reg_reg(r, s)), f"cmp {n}, {m}")
        same(put(lambda w: w.put_sub_reg_reg(r, s)), f"sub {n}, {m}")


@pytest.mark.parametrize("r", REGS)
def test_rip_operands(r: int) -> None:
    """``[rip + disp32]`` forms: the decoded operand reaches the target, forward and
    backward, and the returned field offset is the disp32's."""
    for target in (AT + 0x7000_0000, AT - 0x10, AT):
        w = X86Writer(AT)
        off = w.put_cmp_reg_rip(r, target)
        i = one(bytes(w.code))
        assert i.mnemonic == "cmp" and i.op_str.startswith(NAMES[r] + ", qword ptr [rip")
        assert i.address + i.size + i.disp == target and off == i.disp_offset == 3
    for put_fn, mnemonic in ((X86Writer.put_push_rip, "push"), (X86Writer.put_jmp_rip, "jmp")):
        w = X86Writer(AT)
        off = put_fn(w, AT - 0x1234)
        i = one(bytes(w.code))
        assert i.mnemonic == mnemonic and i.op_str.startswith("qword ptr [rip")
        assert i.address + i.size + i.disp == AT - 0x1234 and off == i.disp_offset == 2


# ---- memory operands ------------------------------------------------------------------------

DISPS = [0, 1, -1, 127, -128, 128, -129, 0x7FFF_FFFF, -0x8000_0000]


def _mem_text(base: int, disp: int, index: int | None = None, scale: int = 1) -> str:
    s = NAMES[base] + (f" + {NAMES[index]}*{scale}" if index is not None else "")
    return f"[{s} {'-' if disp < 0 else '+'} {abs(disp):#x}]"


@pytest.mark.parametrize("base", REGS)
def test_lea_base_disp(base: int) -> None:
    """No displacement, disp8 and disp32, both signs; rsp/r12 need a SIB byte, rbp/r13
    a disp8 even for 0."""
    for dst in (RAX, RSP, R8, R15):
        for d in DISPS:
            same(put(lambda w: w.put_lea(dst, base, d)),
                 f"lea {NAMES[dst]}, {_mem_text(base, d)}")
    sizes = {d: len(put(lambda w: w.put_lea(RAX, base, d))) for d in (0, -128, 128)}
    sib = base & 7 == RSP
    assert sizes[0] == 3 + sib + (base & 7 == RBP)
    assert sizes[-128] == 4 + sib and sizes[128] == 7 + sib


@pytest.mark.parametrize("base", REGS)
def test_lea_base_index(base: int) -> None:
    for index in REGS:
        if index == RSP:
            with pytest.raises(CodegenError, match="index"):
                put(lambda w: w.put_lea(RCX, base, index=index))
            continue
        for scale in (1, 2, 4, 8):
            for d in (0, -8, 0x200):
                same(put(lambda w: w.put_lea(RCX, base, d, index, scale)),
                     f"lea rcx, {_mem_text(base, d, index, scale)}")


@pytest.mark.parametrize("base", REGS)
def test_mov_m32_imm32(base: int) -> None:
    for d in (0, 4, -4, 0x1000, -0x1000):
        for v in (0, 0x7FFF_FFFF, 0x8000_0000, 0xFFFF_FFFF, -1):
            same(put(lambda w: w.put_mov_m32_imm32(base, d, v)),
                 f"mov dword ptr {_mem_text(base, d)}, {v & 0xFFFF_FFFF:#x}")
    for v in (1 << 32, -(1 << 31) - 1):
        with pytest.raises(OutOfRange):
            put(lambda w: w.put_mov_m32_imm32(base, 0, v))


@pytest.mark.parametrize("base", REGS)
def test_jmp_mem(base: int) -> None:
    """``jmp [base + disp]`` and the table form ``notrack jmp [base + index*8 + disp32]``
    (always a disp32, so its size does not depend on the displacement)."""
    for d in (0, 8, -8, 0x1000):
        same(put(lambda w: w.put_jmp_mem(base, disp=d)), f"jmp qword ptr {_mem_text(base, d)}")
    for index in (RAX, RCX, R12, R13, R15):
        for d in (0, 0x10, -0x10, 0x1234_5678, -0x1234_5678):
            code = put(lambda w: w.put_jmp_mem(base, index, 8, d, notrack=True, disp32=True))
            ks = asm(f"jmp qword ptr {_mem_text(base, d, index, 8)}", AT)
            assert code[0] == x86.NOTRACK
            i = one(code)
            assert i.mnemonic.endswith("jmp") and i.disp == d and i.disp_size == 4
            assert text(code[1:]) == text(ks)
            if not -128 <= d < 128:
                assert code[1:] == ks
            assert len(code) == 1 + 3 + 4 + ((base | index) >= 8)


def test_disp32_range() -> None:
    for d in (1 << 31, -(1 << 31) - 1):
        with pytest.raises(OutOfRange, match="disp32"):
            put(lambda w: w.put_lea(RAX, RBP, d))
        with pytest.raises(OutOfRange, match="disp32"):
            put(lambda w: w.put_jmp_mem(RAX, RCX, 8, d, disp32=True))
        # the sizing pass writes zero, same length
        assert put(lambda w: w.put_jmp_mem(RAX, RCX, 8, d, disp32=True), check=False) \
            == put(lambda w: w.put_jmp_mem(RAX, RCX, 8, 0, disp32=True))
    with pytest.raises(CodegenError, match="scale"):
        put(lambda w: w.put_lea(RAX, RAX, index=RCX, scale=3))


# ---- immediates --------------------------------------------------------------------------

def test_push_imm32() -> None:
    for v in (0, 0x7FFF_FFFF, -1, INT32_MIN, 0x1234_5678):
        same(put(lambda w: w.put_push_imm32(v)), f"push {v:#x}",
             exact=not -128 <= v < 128)                    # keystone: 6A ib
    for v in (1 << 31, INT32_MIN - 1):
        with pytest.raises(OutOfRange, match="imm32"):
            put(lambda w: w.put_push_imm32(v))


def test_imm_ranges() -> None:
    for v in (INT32_MIN, INT32_MAX):
        same(put(lambda w: w.put_cmp_reg_imm32(R8, v)), f"cmp r8, {v:#x}")
    for v in (INT32_MAX + 1, INT32_MIN - 1, 0xFFFF_FFFF):
        with pytest.raises(OutOfRange, match="imm32"):
            put(lambda w: w.put_cmp_reg_imm32(R8, v))
    for v in (-1, (1 << 64) - 1, -(1 << 63), 0):
        same(put(lambda w: w.put_mov_reg_imm64(RAX, v)), f"movabs rax, {v & (1 << 64) - 1:#x}")
    for v in (1 << 64, -(1 << 63) - 1):
        with pytest.raises(OutOfRange, match="imm64"):
            put(lambda w: w.put_mov_reg_imm64(RAX, v))


# ---- direct branches --------------------------------------------------------------------------

@pytest.mark.parametrize("at", [0x1_0040_1000, 0x5555_5555_0000, 0x7FFF_0000_0000])
def test_rel32_branches(at: int) -> None:
    """rel32 at its limits: ``dst - end`` in [-2**31, 2**31) is encoded (keystone agrees
    byte for byte, rel32 being its form this far away), one beyond raises."""
    for d in (INT32_MAX, INT32_MIN, 0x1000, -0x1000):
        same(put(lambda w: w.put_jmp(at + 5 + d), at), f"jmp {at + 5 + d:#x}", at)
        same(put(lambda w: w.put_call(at + 5 + d), at), f"call {at + 5 + d:#x}", at)
        for cc, name in enumerate(CCS):
            same(put(lambda w: w.put_jcc(cc, at + 6 + d), at), f"j{name} {at + 6 + d:#x}", at)
    for d in (INT32_MAX + 1, INT32_MIN - 1):
        for f in (lambda w: w.put_jmp(at + 5 + d), lambda w: w.put_call(at + 5 + d),
                  lambda w: w.put_jcc(CC_NE, at + 6 + d), lambda w: w.put_push_rip(at + 6 + d),
                  lambda w: w.put_jmp_rip(at + 6 + d),
                  lambda w: w.put_cmp_reg_rip(R12, at + 7 + d)):
            with pytest.raises(OutOfRange, match="rel32 .* out of range"):
                put(f, at)
            assert put(f, at, check=False)[-4:] == bytes(4)    # sizing: zero, never wrapped
    assert issubclass(OutOfRange, CannotRelocate) and issubclass(OutOfRange, CodegenError)


def test_near_branches_keep_rel32() -> None:
    """A target in rel8 reach still gets rel32: sizes do not depend on addresses."""
    for d in (0, 2, -2, 127, -128):
        assert len(put(lambda w: w.put_jmp(AT + 5 + d))) == 5
        same(put(lambda w: w.put_jmp(AT + 5 + d)), f"jmp {AT + 5 + d:#x}", exact=False)
        same(put(lambda w: w.put_jcc(CC_E, AT + 6 + d)), f"je {AT + 6 + d:#x}", exact=False)
    w = X86Writer(AT)
    assert w.put_jmp(AT) == 1 and w.put_call(AT) == 6 and w.put_jcc(CC_E, AT) == 12
    assert x86.jmp_rel32(AT, AT + 0x100) == put(lambda w: w.put_jmp(AT + 0x100))
    assert x86.call_rel32(AT, AT + 0x100) == put(lambda w: w.put_call(AT + 0x100))


# ---- labels ------------------------------------------------------------------------------------

SHORT = [
    ("jmp", lambda w, lab: w.put_jmp_short_label(lab), 2),
    ("jrcxz", lambda w, lab: w.put_jrcxz_label(lab), 2),
    ("loop", lambda w, lab: w.put_branch8_label(b"\xe2", lab), 2),
    ("loopne", lambda w, lab: w.put_branch8_label(b"\xe0", lab), 2),
    ("jecxz", lambda w, lab: w.put_branch8_label(b"\x67\xe3", lab), 3),
] + [(f"j{n}", lambda w, lab, cc=cc: w.put_jcc_short_label(cc, lab), 2)
     for cc, n in enumerate(CCS)]


@pytest.mark.parametrize("name,f,size", SHORT, ids=[s[0] for s in SHORT])
def test_rel8_labels(name: str, f, size: int) -> None:
    """rel8 to a label: +127 forward and -128 backward resolve (keystone's encoding of
    the same branch), +128 and -129 raise."""
    for gap in (0, 127, 128):
        w = X86Writer(AT)
        f(w, "L")
        w.put_bytes(b"\x90" * gap)
        w.put_label("L")
        if gap > 127:
            with pytest.raises(OutOfRange, match="rel8 to label 'L'"):
                w.flush()
            continue
        code = w.finish()
        same(code[:size], f"{name} {AT + size + gap:#x}")
    for gap in (0, 128 - size, 129 - size):
        w = X86Writer(AT)
        w.put_label("L")
        w.put_bytes(b"\x90" * gap)
        f(w, "L")
        if gap + size > 128:
            with pytest.raises(OutOfRange):
                w.flush()
            continue
        code = w.finish()
        same(code[gap:], f"{name} {AT:#x}", AT + gap)


def test_rel32_labels() -> None:
    for cc, n in enumerate(CCS):
        w = X86Writer(AT)
        w.put_jcc_near_label(cc, "miss")
        w.put_bytes(b"\x90" * 3)
        w.put_jcc_near_label(cc, "miss")
        w.put_label("miss")
        code = w.finish()
        assert text(code) == [f"j{n} {AT + 15:#x}", "nop", "nop", "nop", f"j{n} {AT + 15:#x}"]
        assert code[:6] == bytes((0x0F, 0x80 | cc)) + (9).to_bytes(4, "little")


def test_label_errors() -> None:
    w = X86Writer(AT)
    w.put_label("a")
    with pytest.raises(CodegenError, match="defined twice"):
        w.put_label("a")
    w.put_jmp_short_label("nowhere")
    with pytest.raises(CodegenError, match="not defined"):
        w.flush()


# ---- copied instructions and padding ------------------------------------------------------------

@pytest.mark.parametrize("asm_text,disp_off", [
    ("mov rax, qword ptr [rip + 0x100]", 3),
    ("movaps xmm9, xmmword ptr [rip - 0x100]", 4),
    ("cmp dword ptr [rip + 0x100], 0x12345678", 2),        # an immediate after the disp32
    ("jmp qword ptr [rip + 0x100]", 2),
])
def test_insn_rip(asm_text: str, disp_off: int) -> None:
    raw = asm(asm_text, 0)
    orig = next(CS.disasm(raw, 0))
    assert orig.disp_offset == disp_off
    for at, target in ((AT, AT + 0x7000_0000), (0x7FFF_0000_0000, 0x7FFF_0000_0000 - 0x1000)):
        w = X86Writer(at)
        assert w.put_insn_rip(raw, disp_off, target) == disp_off
        i = one(bytes(w.code), at)
        assert i.address + i.size + i.disp == target and i.size == len(raw)
        assert bytes(w.code)[:disp_off] == raw[:disp_off]
        assert bytes(w.code)[disp_off + 4:] == raw[disp_off + 4:]
    with pytest.raises(OutOfRange):
        put(lambda w: w.put_insn_rip(raw, disp_off, AT + (1 << 31) + len(raw)))


def test_insn_disp32() -> None:
    raw = asm("jmp qword ptr [rax*8 + 0x1000]", 0)
    for v in (0, INT32_MAX, 0x60_0000):
        code = put(lambda w: w.put_insn_disp32(raw, 3, v))
        same(code, f"jmp qword ptr [rax*8 + {v:#x}]")
    with pytest.raises(OutOfRange, match="disp32"):
        put(lambda w: w.put_insn_disp32(raw, 3, 1 << 31))


@pytest.mark.parametrize("n", range(0, 21))
def test_nop_padding(n: int) -> None:
    code = put(lambda w: w.put_nop_padding(n))
    assert len(code) == n == len(x86.nop_bytes(n))
    insns = linear(code, AT)
    assert all(i.mnemonic == "nop" for i in insns) and len(insns) == -(-n // 9)


def test_writer_state() -> None:
    w = X86Writer(AT)
    assert w.pc == AT and w.offset == 0
    w.put_push_reg(R8)
    w.put_jmp(AT)
    assert w.offset == 7 and w.pc == AT + 7 and w.base == AT
