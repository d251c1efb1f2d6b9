"""Differential tests of the relocator with unicorn, plus golden bytes of key expansions.

Every instruction is built per class (RIP-relative ops of every operand size and with
immediates after the displacement, SSE, lock cmpxchg, all 16 jcc as rel8/rel32, jmp,
loop family, inlined call/ret, indirect jmp/call with compare cascades, syscall) at an
original address below and above 2**31.  For each, from several seeded random states,
the original bytes run at the original address and the relocated bytes at a new address
~1.3-1.4 GiB away; the complete state at the exit is compared: all GPRs, the arithmetic
flags, xmm0-7, the data referenced RIP-relatively, the stack incl. the red zone below
rsp, and the exit address (translated back to original addresses).

AVX (VEX) and AVX-512 (EVEX) forms are not executable in unicorn 2 (its QEMU lacks
them); those are checked statically: the relocated instruction decodes to the same
instruction with an operand that reaches the same absolute address.
"""

from __future__ import annotations

import random
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import pytest
from codegen_util import CS, Machine, asm, asm_rip, random_state

from dbr_service.codegen.relocate import CannotRelocate, Kind, Relocator, push_return, ret_adjust

R = Relocator()
BASES = [0x6000_0000, 0x9000_0000, 0x5555_5555_0000]   # < 2**31, < 2**32, > 2**32
DELTAS = [0x5800_0000, -0x5000_0000]               # +1.375 GiB, -1.25 GiB
WIN = 0x8000                                       # original window: [ORIG-WIN, ORIG+WIN)
STACK, STACK_SIZE = 0x7FFE_0000_0000, 0x2000
RSP = STACK + 0x1000
STATES = 3


def data_of(orig: int) -> int:
    return orig + 0x10000


@dataclass
class Case:
    """One instruction to relocate and how to set up its states."""

    name: str
    make: Callable[[int], bytes]                   # original address -> bytes
    kind: Kind
    mapped: Callable[[int], set[int]] = lambda o: set()   # targets placed in-buffer
    ret_target: Callable[[int], int | None] = lambda o: None
    ijmp_targets: Callable[[int], list[int]] = lambda o: []
    fixed: Callable[[random.Random, int, int], dict] = lambda rng, o, i: {}
    poke: Callable[[random.Random, int, int], dict[int, bytes]] = lambda rng, o, i: {}
    extra_states: int = 0
    #: Relocated as at a SysV ABI call boundary (a PLT stub's jump): the status flags,
    #: r10 and r11 are dead there and not compared; everything else is.
    abi_entry: bool = False


#: What an ``abi_entry`` relocation may clobber (codegen/relocate.py ``_cascade_abi``).
ABI_DEAD = ("r10", "r11")


# -- the instruction catalogue ---------------------------------------------------------------

RIP_TEMPLATES = []
for sz, regs in (("byte", ("al", "r9b", "sil")), ("word", ("ax", "r10w")),
                 ("dword", ("eax", "r11d")), ("qword", ("rax", "r12", "rsp"))):
    for r in regs:
        RIP_TEMPLATES += [f"mov {r}, {sz} ptr [rip + {{D}}]", f"mov {sz} ptr [rip + {{D}}], {r}",
                          f"cmp {r}, {sz} ptr [rip + {{D}}]", f"add {sz} ptr [rip + {{D}}], {r}"]
    imm = {"byte": "0x7f", "word": "0x1234", "dword": "0x12345678", "qword": "-0x12345678"}[sz]
    RIP_TEMPLATES += [f"mov {sz} ptr [rip + {{D}}], {imm}",
                      f"cmp {sz} ptr [rip + {{D}}], 0x5", f"cmp {sz} ptr [rip + {{D}}], {imm}",
                      f"test {sz} ptr [rip + {{D}}], {imm}", f"neg {sz} ptr [rip + {{D}}]",
                      f"shl {sz} ptr [rip + {{D}}], 3", f"inc {sz} ptr [rip + {{D}}]"]
    for op in ("adc", "sbb", "and", "or", "xor", "sub"):
        RIP_TEMPLATES += [f"{op} {sz} ptr [rip + {{D}}], 0x3",
                          f"{op} {sz} ptr [rip + {{D}}], {imm}"]
RIP_TEMPLATES += [
    "lea rax, [rip + {D}]", "lea r13d, [rip + {D}]", "lea rbp, [rip + {D}]",
    "movzx eax, byte ptr [rip + {D}]", "movsx r8, word ptr [rip + {D}]",
    "movsxd rcx, dword ptr [rip + {D}]", "imul edx, dword ptr [rip + {D}], 0x12345",
    "imul r9, qword ptr [rip + {D}], 7", "cmovne rax, qword ptr [rip + {D}]",
    "setb byte ptr [rip + {D}]", "xchg qword ptr [rip + {D}], rbx",
    "lock cmpxchg qword ptr [rip + {D}], rcx", "lock cmpxchg dword ptr [rip + {D}], r8d",
    "lock xadd qword ptr [rip + {D}], rdx", "lock add dword ptr [rip + {D}], 0x1000",
    "lock or byte ptr [rip + {D}], 0x40", "bt dword ptr [rip + {D}], 5",
    "lock bts qword ptr [rip + {D}], 0x21", "push qword ptr [rip + {D}]",
    "pop qword ptr [rip + {D}]", "ror word ptr [rip + {D}], 0x5",
    "movdqu xmm1, xmmword ptr [rip + {D}]", "movdqu xmmword ptr [rip + {D}], xmm2",
    "movaps xmm3, xmmword ptr [rip + {D}]", "movaps xmmword ptr [rip + {D}], xmm4",
    "addsd xmm0, qword ptr [rip + {D}]", "movq xmm5, qword ptr [rip + {D}]",
    "pshufd xmm1, xmmword ptr [rip + {D}], 0x1b", "cmpps xmm2, xmmword ptr [rip + {D}], 2",
    "pinsrd xmm6, dword ptr [rip + {D}], 2", "roundsd xmm7, qword ptr [rip + {D}], 1",
    "pextrw word ptr [rip + {D}], xmm3, 5", "shufps xmm0, xmmword ptr [rip + {D}], 0x4e",
    "ucomisd xmm1, qword ptr [rip + {D}]", "cvtsi2sd xmm2, dword ptr [rip + {D}]",
    "crc32 eax, byte ptr [rip + {D}]",
]
STATIC_ONLY = [
    "vmovdqu ymm0, ymmword ptr [rip + {D}]", "vmovdqu ymmword ptr [rip + {D}], ymm9",
    "vpaddd xmm1, xmm2, xmmword ptr [rip + {D}]", "vpshufd ymm3, ymmword ptr [rip + {D}], 0x1b",
    "vpblendd ymm1, ymm2, ymmword ptr [rip + {D}], 0x5a",
    "vaddps zmm1, zmm2, zmmword ptr [rip + {D}]", "vmovdqu64 zmm3, zmmword ptr [rip + {D}]",
    "vfmadd231ps zmm1, zmm2, zmmword ptr [rip + {D}]",
    "vaddpd zmm1 {{k1}}, zmm2, qword ptr [rip + {D}]{{1to8}}",
]

JCC = ["jo", "jno", "jb", "jae", "je", "jne", "jbe", "ja",
       "js", "jns", "jp", "jnp", "jl", "jge", "jle", "jg"]


def _target_off(i: int) -> int:
    return 0x100 + 0x40 * (i % 32)


def build_cases() -> list[Case]:
    cases: list[Case] = []
    for i, t in enumerate(RIP_TEMPLATES):
        off = _target_off(i)
        cases.append(Case(f"rip:{t}", lambda o, t=t, off=off: asm_rip(t, o, data_of(o) + off),
                          Kind.RIPREL))
    for cc_i, cc in enumerate(JCC):
        for far, d in ((False, 0x40), (False, -0x30), (True, 0x4000), (True, -0x3000)):
            mapped = (cc_i + d) % 2 == 0
            name = f"{cc} {'rel32' if far else 'rel8'} {d:+#x}{' mapped' if mapped else ''}"
            cases.append(Case(name,
                              lambda o, cc=cc, d=d: asm(f"{cc} {o + d:#x}", o), Kind.JCC,
                              mapped=(lambda o, d=d: {o + d}) if mapped else (lambda o: set()),
                              extra_states=3))
    for d, mapped in ((0x50, False), (-0x60, True), (0x5000, True), (-0x6000, False)):
        cases.append(Case(f"jmp {d:+#x}{' mapped' if mapped else ''}",
                          lambda o, d=d: asm(f"jmp {o + d:#x}", o), Kind.JMP,
                          mapped=(lambda o, d=d: {o + d}) if mapped else (lambda o: set())))
    # prefixed forms: branch hints (2E/3E) and bnd (F2) are dropped by the widening
    for raw, d, kind in ((b"\x3e\x74", 0x40, Kind.JCC), (b"\x2e\x0f\x8c", -0x3000, Kind.JCC),
                         (b"\xf2\xe9", 0x2000, Kind.JMP), (b"\xf2\x75", -0x20, Kind.JCC)):
        n = len(raw) + (1 if raw[-1] in (0x74, 0x75) else 4)
        fmt = "<b" if n - len(raw) == 1 else "<i"
        cases.append(Case(f"prefixed {raw.hex()} {d:+#x}",
                          lambda o, raw=raw, d=d, n=n, fmt=fmt: raw + struct.pack(fmt, d - n),
                          kind, extra_states=3))
    rcx_values = [0, 1, 2, 1 << 32, (1 << 32) + 1, 0xFFFFFFFF]
    loops = [("loop", None), ("loope", None), ("loopne", None), ("jrcxz", None),
             ("jecxz", None), ("addr32 loop", b"\x67\xe2"), ("addr32 loopne", b"\x67\xe0")]
    for name, raw in loops:
        for d, mapped in ((-0x20, False), (0x30, True)):
            def make(o, name=name, raw=raw, d=d):
                if raw:
                    return raw + struct.pack("<b", d - len(raw) - 1)
                return asm(f"{name} {o + d:#x}", o)
            cases.append(Case(f"{name} {d:+#x}{' mapped' if mapped else ''}", make, Kind.LOOP,
                              mapped=(lambda o, d=d: {o + d}) if mapped else (lambda o: set()),
                              fixed=lambda rng, o, i: {"rcx": rcx_values[i % 6]},
                              extra_states=5))
    for d, mapped in ((0x2000, True), (-0x5000, False)):
        cases.append(Case(f"call {d:+#x}{' mapped' if mapped else ''}",
                          lambda o, d=d: asm(f"call {o + d:#x}", o), Kind.CALL,
                          mapped=(lambda o, d=d: {o + d}) if mapped else (lambda o: set())))
    for text in ("ret", "ret 0x10", "ret 0x100", "rep ret"):
        for inlined, mapped in ((True, True), (True, False), (False, False)):
            cases.append(Case(f"{text}{' inlined' if inlined else ''}{' mapped' if mapped else ''}",
                              lambda o, text=text: asm(text, o), Kind.RET,
                              mapped=(lambda o: {o + 0x300}) if mapped else (lambda o: set()),
                              ret_target=(lambda o: o + 0x300) if inlined else (lambda o: None),
                              poke=lambda rng, o, i: {RSP: struct.pack("<Q", o + 0x300)}))
    cases += _indirect_cases()
    cases.append(Case("syscall", lambda o: b"\x0f\x05", Kind.COPY))
    for text in ("add rax, rbx", "push rbx", "pop r15", "imul rcx, rdx, 0x77", "bswap r9",
                 "lea rax, [rbx + rcx*4 - 8]", "cqo", "adc r8, -1"):
        cases.append(Case(text, lambda o, text=text: asm(text, o), Kind.COPY))
    return cases


def _indirect_cases() -> list[Case]:
    """jmp/call through a register or memory with targets in and out of the buffer."""
    def targets(o):
        return [o + 0x100, o - 0x200, o + 0x3000]

    def mapped(o):
        return {o + 0x100, o - 0x200}

    def choose(rng, o, i):
        return (targets(o) + [o + 0x500])[i % 4]

    def slot(o):
        return data_of(o) + 0x80

    forms = [
        ("rax", lambda o: "rax", lambda rng, o, i: {"rax": choose(rng, o, i)}, None),
        ("r11", lambda o: "r11", lambda rng, o, i: {"r11": choose(rng, o, i)}, None),
        # rcx is the cascade's own register (jrcxz): copied first / kept through a load
        ("rcx", lambda o: "rcx", lambda rng, o, i: {"rcx": choose(rng, o, i)}, None),
        ("[rcx+8]", lambda o: "qword ptr [rcx + 8]", lambda rng, o, i: {"rcx": slot(o) - 8},
         lambda rng, o, i: {slot(o): struct.pack("<Q", choose(rng, o, i))}),
        ("[rip]", "rip", lambda rng, o, i: {},
         lambda rng, o, i: {slot(o): struct.pack("<Q", choose(rng, o, i))}),
        ("[rbx+8]", lambda o: "qword ptr [rbx + 8]", lambda rng, o, i: {"rbx": slot(o) - 8},
         lambda rng, o, i: {slot(o): struct.pack("<Q", choose(rng, o, i))}),
        ("[r12+rax*8+0x10]", lambda o: "qword ptr [r12 + rax*8 + 0x10]",
         lambda rng, o, i: {"r12": slot(o) - 0x28, "rax": 3},
         lambda rng, o, i: {slot(o): struct.pack("<Q", choose(rng, o, i))}),
        # rsp-based memory: no cascade (the pushes would move the operand); plain exit
        ("[rsp+8]", lambda o: "qword ptr [rsp + 8]", lambda rng, o, i: {},
         lambda rng, o, i: {RSP + 8: struct.pack("<Q", choose(rng, o, i))}),
    ]
    out = []
    for op in ("jmp", "call"):
        for name, operand, fixed, poke in forms:
            if op == "call" and "rsp" in name:
                continue
            if operand == "rip":
                def make(o, op=op):
                    return asm_rip(f"{op} qword ptr [rip + {{D}}]", o, slot(o))
            else:
                def make(o, op=op, operand=operand):
                    return asm(f"{op} {operand(o)}", o)
            out.append(Case(f"{op} {name}", make, Kind.IJMP if op == "jmp" else Kind.ICALL,
                            mapped=(lambda o: set()) if "rsp" in name else mapped,
                            ijmp_targets=targets, fixed=fixed,
                            poke=poke or (lambda rng, o, i: {}), extra_states=5))
    # Many targets: the jrcxz cascade's rel8 runs out, the flag-saving one is used.
    def many(o):
        return [o + 0x100 + 0x40 * k for k in range(16)]

    out.append(Case("jmp r9 (16 targets)", lambda o: asm("jmp r9", o), Kind.IJMP,
                    mapped=lambda o: set(many(o)[:-1]), ijmp_targets=many,
                    fixed=lambda rng, o, i: {"r9": many(o)[i % 16]}, extra_states=15))
    # A PLT stub's jump at a call boundary: ``[bnd] jmp [rip+got]``, targets below and
    # above 2**31 (imm32 compare and the r10 form), in and out of the buffer.
    for pre in (b"", b"\xf2"):            # keystone has no bnd: the prefix by hand
        out.append(Case(f"abi {'bnd ' if pre else ''}jmp [rip]",
                        lambda o, pre=pre: pre + asm_rip("jmp qword ptr [rip + {D}]",
                                                         o + len(pre), slot(o)),
                        Kind.IJMP, mapped=mapped, ijmp_targets=targets,
                        poke=lambda rng, o, i: {slot(o): struct.pack("<Q", choose(rng, o, i))},
                        extra_states=5, abi_entry=True))
    return out


CASES = build_cases()


# -- the differential runner ------------------------------------------------------------------

def _machine(orig: int, new: int) -> Machine:
    return Machine([(orig - WIN, 2 * WIN), (data_of(orig), 0x1000), (new, 0x1000),
                    (stub_base(new), 2 * WIN), (STACK, STACK_SIZE)])


def stub_base(new: int) -> int:
    return new + 0x10000


def run_case(case: Case, orig: int, delta: int, seed: int) -> int:
    """Run every state of ``case`` at ``orig`` and relocated by ``delta``; the number of
    states compared."""
    new = orig + delta
    code = case.make(orig)
    mapped = case.mapped(orig)
    stub = stub_base(new)

    def tmap(t: int) -> int | None:
        return stub + (t - orig + WIN) if t in mapped else None

    rel = R.relocate_insn(code, orig, new, target_map=tmap, ret_target=case.ret_target(orig),
                          ijmp_targets=case.ijmp_targets(orig), abi_entry=case.abi_entry)
    if case.abi_entry and mapped:      # the fast form: no flag save, no stack traffic
        assert not any(i.mnemonic in ("pushfq", "popfq", "push", "pop", "lea")
                       for i in CS.disasm(rel.code, new))
    assert rel.kind is case.kind
    assert all(i.mnemonic != "call" for i in CS.disasm(rel.code, new))
    m = _machine(orig, new)
    m.write(orig - WIN, b"\xf4" * (2 * WIN))
    m.write(orig, code)
    m.write(new, rel.code)
    data = data_of(orig)
    rng = random.Random(seed)
    n = STATES + case.extra_states
    for i in range(n):
        st = random_state(rng, RSP, {data: 0x1000, STACK: STACK_SIZE}, case.fixed(rng, orig, i))
        st.mem.update(case.poke(rng, orig, i))
        m.set_state(st)
        rip_a = m.run(orig, lambda a: orig <= a < orig + len(code))
        a = m.snapshot([(data, 0x1000), (STACK, STACK_SIZE)])
        m.set_state(st)
        rip_b = m.run(new, lambda a: new <= a < new + len(rel.code))
        b = m.snapshot([(data, 0x1000), (STACK, STACK_SIZE)])
        if rip_b == new + len(rel.code):                       # fell through
            rip_b = orig + len(code)
        elif stub <= rip_b < stub + 2 * WIN:
            rip_b = rip_b - stub + orig - WIN
            assert rip_b in mapped, f"{case.name}: entered the buffer for unmapped {rip_b:#x}"
        else:
            assert rip_b not in mapped, f"{case.name}: exited to mapped target {rip_b:#x}"
        ctx = f"{case.name} orig={orig:#x} new={new:#x} state={i}"
        assert rip_b == rip_a, f"{ctx}: exit {rip_b:#x} != {rip_a:#x}"
        if case.abi_entry:
            for r in ABI_DEAD:
                a.regs.pop(r), b.regs.pop(r)
            b.rflags = a.rflags
        assert b.regs == a.regs, f"{ctx}: {_diff(a.regs, b.regs)}"
        assert b.rflags == a.rflags, f"{ctx}: flags {b.rflags:#x} != {a.rflags:#x}"
        assert b.xmm == a.xmm, ctx
        assert b.mem[data] == a.mem[data], f"{ctx}: data differs"
        low = min(a.regs["rsp"], RSP) - 128 - STACK          # red zone of either rsp
        assert b.mem[STACK][low:] == a.mem[STACK][low:], f"{ctx}: stack/red zone differs"
    return n


def _diff(a: dict, b: dict) -> str:
    return ", ".join(f"{k}: {a[k]:#x} vs {b[k]:#x}" for k in a if a[k] != b[k])


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_differential(case: Case) -> None:
    for bi, orig in enumerate(BASES):
        for di, delta in enumerate(DELTAS):
            run_case(case, orig, delta, seed=zlib.crc32(f"{case.name}@{bi}.{di}".encode()))


def test_catalogue_is_systematic() -> None:
    kinds = {c.kind for c in CASES}
    assert kinds == set(Kind), kinds ^ set(Kind)
    assert sum(c.kind is Kind.JCC and c.name[:1] == "j" for c in CASES) == 64   # 16 cc x 4
    assert sum(c.kind is Kind.RIPREL for c in CASES) > 100


@pytest.mark.parametrize("template", RIP_TEMPLATES + STATIC_ONLY)
def test_rip_operand_static(template: str) -> None:
    """Relocated RIP-relative instructions decode to the same instruction reaching the same
    absolute address (covers VEX/EVEX forms unicorn cannot run)."""
    for orig in BASES:
        for delta in DELTAS:
            target = data_of(orig) + 0x2C0
            code = asm_rip(template, orig, target)
            rel = R.relocate_insn(code, orig, orig + delta)
            a = next(CS.disasm(code, orig))
            b = next(CS.disasm(rel.code, orig + delta))
            assert b.size == a.size == len(rel.code)
            assert b.mnemonic == a.mnemonic
            assert b.address + b.size + b.disp == target
            assert rel.fixups[0].orig_target == target and rel.fixups[0].data
            def strip(s):
                return s.split("[")[0] + s.split("]")[1]
            assert strip(b.op_str) == strip(a.op_str)
            assert b.bytes[:a.disp_offset] == a.bytes[:a.disp_offset]
            assert b.bytes[a.disp_offset + 4:] == a.bytes[a.disp_offset + 4:]


# -- limits ----------------------------------------------------------------------------------

def test_rip_displacement_out_of_range() -> None:
    orig = 0x6000_0000
    code = asm_rip("mov rax, qword ptr [rip + {D}]", orig, orig + 0x7000_0000)
    R.relocate_insn(code, orig, orig + 0x1000_0000)
    with pytest.raises(CannotRelocate):
        R.relocate_insn(code, orig, orig - 0x2000_0000)
    with pytest.raises(CannotRelocate):
        R.relocate_insn(asm("jmp 0x60000100", orig), orig, orig + 0x9000_0000)


@pytest.mark.parametrize("raw,why", [
    (bytes.fromhex("c7f800000000"), "xbegin"),
    (bytes.fromhex("ea"), "undecodable in 64-bit mode"),
    (bytes.fromhex("ff2c25 00100000".replace(" ", "")), "far jmp"),
    (bytes.fromhex("cb"), "retf"),
    (bytes.fromhex("48cf"), "iretq"),
    (bytes.fromhex("678b0510000000"), "eip-relative"),
    (bytes.fromhex("66e90000"), "jmp rel16"),
    (bytes.fromhex("ff542408"), "call [rsp+8]"),
])
def test_refused(raw: bytes, why: str) -> None:
    with pytest.raises(CannotRelocate):
        R.relocate_insn(raw + b"\x90" * 8, 0x6000_0000, 0x7000_0000)
    assert R.can_relocate(raw + b"\x90" * 8, 0x6000_0000, 1) == 0, why


def test_can_relocate() -> None:
    o = 0x6000_0000
    code = (asm_rip("mov rax, qword ptr [rip + {D}]", o, o + 0x100)          # 7
            + asm("add rax, 1", o + 7)                                        # 4
            + bytes.fromhex("c7f800000000"))                                  # xbegin
    assert R.can_relocate(code, o, 5) == 7
    assert R.can_relocate(code, o, 8) == 11
    assert R.can_relocate(code, o, 12) == 11                                  # < 12: cannot
    code2 = asm("jmp 0x60000100", o) + b"\x90" * 8
    assert R.can_relocate(code2, o, 8) == 5                                   # stops after jmp


# -- golden bytes of the key expansions ------------------------------------------------------

def _golden(rel_code: bytes, expected: list[tuple[str, str]], at: int) -> None:
    got = [(i.bytes.hex(), f"{i.mnemonic} {i.op_str}".strip()) for i in CS.disasm(rel_code, at)]
    assert got == expected
    assert sum(len(h) // 2 for h, _ in got) == len(rel_code)


def test_golden_loop() -> None:
    # original at 0x1000: e2 fe             loop 0x1000
    rel = R.relocate_insn(bytes.fromhex("e2fe"), 0x1000, 0x2000)
    _golden(rel.code, [
        ("e202", "loop 0x2004"),            # taken -> the rel32 jmp
        ("eb05", "jmp 0x2009"),             # not taken -> after the expansion
        ("e9f7efffff", "jmp 0x1000"),       # the original target
    ], 0x2000)


def test_golden_jecxz() -> None:
    # original at 0x1000: 67 e3 0d           jecxz 0x1010
    rel = R.relocate_insn(bytes.fromhex("67e30d"), 0x1000, 0x2000)
    _golden(rel.code, [("67e302", "jecxz 0x2005"), ("eb05", "jmp 0x200a"),
                       ("e906f0ffff", "jmp 0x1010")], 0x2000)


def test_golden_jcc_rel8_widened() -> None:
    # original at 0x1000: 74 10              je 0x1012
    rel = R.relocate_insn(bytes.fromhex("7410"), 0x1000, 0x2000)
    _golden(rel.code, [("0f840cf0ffff", "je 0x1012")], 0x2000)


def test_golden_call_pseudo_low_and_high() -> None:
    # original at 0x1000: e8 fb 0f 00 00     call 0x2000
    rel = R.relocate_insn(bytes.fromhex("e8fb0f0000"), 0x1000, 0x3000)
    _golden(rel.code, [("6805100000", "push 0x1005"), ("e9f6efffff", "jmp 0x2000")], 0x3000)
    # the same call at 0x555555554000: the return address needs 64 bits
    hi = 0x5555_5555_4000
    rel = R.relocate_insn(bytes.fromhex("e8fb0f0000"), hi, hi + 0x10000)
    _golden(rel.code, [
        ("488d6424f8", "lea rsp, [rsp - 8]"),
        ("c7042405405555", "mov dword ptr [rsp], 0x55554005"),
        ("c744240455550000", "mov dword ptr [rsp + 4], 0x5555"),
        ("e9e70fffff", "jmp 0x555555555000"),
    ], hi + 0x10000)
    assert push_return(0x7FFF_FFFF) == bytes.fromhex("68ffffff7f")


def test_golden_inlined_ret() -> None:
    # original at 0x1000: c2 10 00           ret 0x10  (continuation 0x4000)
    rel = R.relocate_insn(bytes.fromhex("c21000"), 0x1000, 0x2000, ret_target=0x4000)
    _golden(rel.code, [("488d642418", "lea rsp, [rsp + 0x18]"), ("e9f61f0000", "jmp 0x4000")],
            0x2000)
    assert ret_adjust(0x100) == bytes.fromhex("488da42408010000")   # lea rsp,[rsp+0x108]


def test_golden_cascade_jmp_rax() -> None:
    # original at 0x1000: ff e0              jmp rax   (targets 0x1100 -> 0x9100)
    rel = R.relocate_insn(bytes.fromhex("ffe0"), 0x1000, 0x2000, ijmp_targets=[0x1100],
                          target_map=lambda t: t + 0x8000 if t == 0x1100 else None)
    _golden(rel.code, [
        ("488d642480", "lea rsp, [rsp - 0x80]"),
        ("51", "push rcx"),
        ("48b900efffffffffffff", "movabs rcx, 0xffffffffffffef00"),
        ("488d0c01", "lea rcx, [rcx + rax]"),
        ("e30b", "jrcxz 0x2021"),
        ("59", "pop rcx"),
        ("488da42480000000", "lea rsp, [rsp + 0x80]"),
        ("ffe0", "jmp rax"),
        ("59", "pop rcx"),
        ("488da42480000000", "lea rsp, [rsp + 0x80]"),
        ("e9d1700000", "jmp 0x9100"),
    ], 0x2000)
    assert rel.dynamic_exits == [31]
    # too many cases for jrcxz's rel8: the flag-saving cascade
    many = R.relocate_insn(bytes.fromhex("ffe0"), 0x1000, 0x2000,
                           ijmp_targets=[0x1100 + 16 * k for k in range(16)],
                           target_map=lambda t: t + 0x8000)
    assert [i.mnemonic for i in CS.disasm(many.code, 0x2000)][:3] == ["lea", "pushfq", "cmp"]


def test_golden_cascade_abi_plt_jump() -> None:
    # original at 0x1000: f2 ff 25 fa 0f 00 00   bnd jmp [rip+0xffa] (the GOT slot 0x2001);
    # targets 0x1100 -> 0x9100 (imm32 compare) and 0x7f0000001000 -> 0x9200 (via r10)
    rel = R.relocate_insn(bytes.fromhex("f2ff25fa0f0000"), 0x1000, 0x3000,
                          ijmp_targets=[0x1100, 0x7F0000001000], abi_entry=True,
                          target_map={0x1100: 0x9100, 0x7F0000001000: 0x9200}.get)
    _golden(rel.code, [
        ("4c8b1dfaefffff", "mov r11, qword ptr [rip - 0x1006]"),
        ("4981fb00110000", "cmp r11, 0x1100"),
        ("0f84ec600000", "je 0x9100"),
        ("49ba00100000007f0000", "movabs r10, 0x7f0000001000"),
        ("4d39d3", "cmp r11, r10"),
        ("0f84d9610000", "je 0x9200"),
        ("41ffe3", "jmp r11"),
    ], 0x3000)
    assert rel.dynamic_exits == [len(rel.code) - 3]
    # the GOT slot is read at its original address, once; bnd is not carried onto the mov
    mov = next(CS.disasm(rel.code, 0x3000))
    assert mov.address + mov.size + mov.disp == 0x2001


def test_golden_rip_cmp_imm_after_disp() -> None:
    # original at 0x1000: 81 3d 00 01 00 00 45 23 01 00   cmp dword [rip+0x100], 0x12345
    rel = R.relocate_insn(bytes.fromhex("813d0001000045230100"), 0x1000, 0x2000)
    _golden(rel.code, [("813d00f1ffff45230100", "cmp dword ptr [rip - 0xf00], 0x12345")], 0x2000)
