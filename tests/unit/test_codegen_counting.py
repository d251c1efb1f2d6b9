"""Counting code for speed checks (dbr_service/codegen/counting.py), run in unicorn.

A counting trampoline is equivalent code plus a counter: from random states, the
original code from a progress point P and the same code with P patched to its
trampoline reach the same exit with the same registers, flags (the ones the code
reads after P are computed anew, so a clobbered flag would show) and memory, and the
counter counts every pass through P exactly.  The flag scan that decides where an
``inc`` may go is checked case by case."""

from __future__ import annotations

import random

import pytest
from codegen_util import CS, Machine, asm, asm_rip, random_state

from dbr_service.codegen.counting import (COUNTER_LEN, counter_bytes, counting_entry,
                                          counting_trampoline, inc_flags_dead)
from dbr_service.installation.progress_points import COUNTING_ENTRY_LEN
from dbr_service.codegen.relocate import CannotRelocate, jmp_rel32

ORIG = 0x400000       # original code; P is its start
BUF = 0x500000        # the code buffer (trampolines)
DATA = 0x600000       # the data buffer (counters)
COUNTER = DATA + 8
VAR = 0x601000        # data the original code addresses RIP-relatively
STACK = 0x700000
END = ORIG + 0x800    # where every case leaves the original code


def _code(lines: list[str], at: int = ORIG) -> bytes:
    """Assemble ``lines`` at ``at``, one by one (``{V}``: a rip displacement to VAR),
    then ``jmp END``."""
    out = b""
    for line in lines:
        pc = at + len(out)
        out += asm_rip(line, pc, VAR) if "{D}" in line else asm(line, pc)
    return out + jmp_rel32(at + len(out), END)


@pytest.mark.parametrize("text,dead", [
    ("sub rsp, 8; mov rax, rbx", True),
    ("mov rax, rbx; xor eax, eax", True),
    ("test eax, eax; jz 0x400100", True),
    ("cmp rdi, rsi; setz al", True),
    ("inc rax", True),                          # writes the same five flags
    ("adc rax, 1", True),                       # reads CF only
    ("popfq", True),
    ("mul rcx", True),                          # leaves them undefined: never read
    ("shl rax, cl; add rax, 1", True),          # the shift is not taken as a write
    ("shl rax, cl; jz 0x400100", False),        # count 0 keeps the flags for the jz
    ("shl rax, 1; sete al", False),
    ("jz 0x400100", False),
    ("sete al; cmp eax, ebx", False),
    ("seto al; add eax, 1", False),
    ("setp al; add eax, 1", False),
    ("cmovs rax, rbx; add eax, 1", False),
    ("pushfq; add eax, 1", False),
    ("lahf; add eax, 1", False),
    ("mov rax, rbx; ret", False),
    ("call 0x400100", False),
    ("syscall", False),
    ("mov rax, rbx; mov rcx, rdx", False),      # code ends before any write
    ("setb al; add eax, 1", True),              # CF is not inc's
    ("and eax, 1; jp 0x400100", True),          # and writes all five first
    ("xor rax, rdx; test rsi, rsi; jle 0x400100", True),   # AF undefined after xor
    ("bsf rax, rbx; jz 0x400100", True),        # OF SF AF PF undefined, ZF written
    ("bt rax, 3; jz 0x400100", False),          # CF only: ZF is still the old one
])
def test_inc_flags_dead(text: str, dead: bool) -> None:
    assert inc_flags_dead(asm(text, ORIG), ORIG) is dead, text


def test_flag_scan_is_bounded() -> None:
    code = asm("; ".join(["mov rax, rbx"] * 40 + ["add eax, 1"]), ORIG)
    assert not inc_flags_dead(code, ORIG)
    assert inc_flags_dead(code, ORIG, max_insns=41)


def test_counter_is_lock_inc_rip() -> None:
    code = counter_bytes(BUF, COUNTER)
    assert len(code) == COUNTER_LEN
    insn = next(CS.disasm(code, BUF))
    assert (insn.mnemonic, insn.op_str) == ("lock inc", f"qword ptr [rip + {COUNTER - BUF - 8:#x}]")


#: Code from P: what the patch covers, then flag writers and readers, so that a flag
#: the trampoline clobbered where it was live would show in the final state.
CASES = {
    "one long insn": ["imul eax, edi, 1000", "add eax, ecx", "setz bl", "seto bh",
                      "setp cl", "sets ch", "setb dl"],
    "rip load": ["mov rax, qword ptr [rip + {D}]", "xor eax, edx", "setz bl", "setp bh"],
    "rip store": ["mov qword ptr [rip + {D}], rsi", "sub rsi, rdi", "seto bl", "sets bh"],
    "short insns": ["xor ecx, ecx", "mov eax, edi", "lea rdx, [rax + rcx*2]", "add edx, 3",
                    "setz bl", "setp bh", "adc rsi, 0"],
    "cf live": ["and eax, edi", "push rbx", "pop rbx", "adc rdx, 0", "sbb rsi, rsi"],
    "jcc covered": ["cmp edi, esi", "jl 0x400700", "imul eax, edi, 7", "setz bl"],
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_trampoline_is_the_original_code_plus_one(name: str) -> None:
    code = _code(CASES[name])
    tr = counting_trampoline(code, ORIG, BUF, COUNTER)
    assert tr.covered >= 5 and tr.code.startswith(counter_bytes(BUF, COUNTER))
    patched = jmp_rel32(ORIG, BUF) + code[5:]
    m = Machine([(ORIG, 0x1000), (BUF, 0x1000), (DATA, 0x2000), (STACK - 0x1000, 0x2000)])

    def inside(a: int) -> bool:
        return ORIG <= a < ORIG + len(code) or BUF <= a < BUF + len(tr.code)

    mem = {VAR: 16, STACK - 0x100: 0x200}
    for seed in range(60):
        rng = random.Random(seed)
        st = random_state(rng, STACK, mem)
        m.write(ORIG, code)
        m.write(DATA, bytes(16))
        m.set_state(st)
        at = m.run(ORIG, inside)
        want = m.snapshot([(VAR, 16), (STACK - 0x100, 0x200), (DATA, 16)])
        m.write(ORIG, patched)
        m.write(BUF, tr.code)
        m.set_state(st)
        m.write(DATA, bytes(16))
        at2 = m.run(ORIG, inside)
        got = m.snapshot([(VAR, 16), (STACK - 0x100, 0x200), (DATA, 16)])
        assert at2 == at in (END, 0x400700), (hex(at), hex(at2))
        assert got.regs == want.regs and got.rflags == want.rflags, (name, seed)
        assert got.xmm == want.xmm
        assert got.mem[VAR] == want.mem[VAR] and got.mem[STACK - 0x100] == want.mem[STACK - 0x100]
        assert want.mem[DATA] == bytes(16)
        assert int.from_bytes(got.mem[DATA][8:], "little") == 1
        assert got.mem[DATA][:8] == bytes(8)


def test_count_is_exact_over_a_loop() -> None:
    """P heads a loop that runs rcx times: the counter ends at rcx, with the loop's own
    result unchanged."""
    body = ["imul eax, edi, 1000", "add rdx, rax", "dec rcx", "jnz 0x400000"]
    code = _code(body)
    tr = counting_trampoline(code, ORIG, BUF, COUNTER)
    m = Machine([(ORIG, 0x1000), (BUF, 0x1000), (DATA, 0x2000), (STACK - 0x1000, 0x2000)])

    def inside(a: int) -> bool:
        return ORIG <= a < ORIG + len(code) or BUF <= a < BUF + len(tr.code)

    for n in (1, 2, 37, 1000):
        results = []
        for patch in (False, True):
            m.write(ORIG, (jmp_rel32(ORIG, BUF) + code[5:]) if patch else code)
            m.write(BUF, tr.code)
            m.write(DATA, bytes(16))
            st = random_state(random.Random(n), STACK, {}, {"rcx": n, "rdx": 0})
            m.set_state(st)
            assert m.run(ORIG, inside, limit=20 * n + 100) == END
            results.append(m.snapshot([(DATA, 16)]))
        plain, counted = results
        assert plain.regs == counted.regs and plain.rflags == counted.rflags
        assert int.from_bytes(counted.mem[DATA][8:], "little") == n
        assert plain.mem[DATA] == bytes(16)


@pytest.mark.parametrize("lines,why", [
    (["sete al", "add eax, 1"], "flags live"),
    (["call 0x400100", "add eax, 1"], "flags live"),     # the scan stops at the call
    (["xor eax, eax", "call 0x400100"], "call"),
    (["xor eax, eax", "jmp rax"], "jmp"),
    (["xor eax, eax", "jz 0x400001", "add eax, 1"], "into the patched bytes"),
])
def test_refused(lines: list[str], why: str) -> None:
    code = _code(lines)
    with pytest.raises(CannotRelocate, match=why):
        counting_trampoline(code, ORIG, BUF, COUNTER)


def test_refused_short_jmp_inside_the_patch() -> None:
    """A 2-byte jmp that ends P's code 4 bytes in: the patch would overwrite the next
    block's first byte."""
    code = asm("xor eax, eax", ORIG) + b"\xeb\x10" + bytes(0x20)
    with pytest.raises(CannotRelocate, match="before the patch"):
        counting_trampoline(code, ORIG, BUF, COUNTER)


def test_counting_entry_counts_and_runs_the_copy() -> None:
    """P patched to a counting entry that jumps to a copy of P's code (placed after it
    in the buffer): the same final state as the original, and one count per pass."""
    body = ["imul eax, edi, 1000", "add rdx, rax", "dec rcx", "jnz 0x400000"]
    code = _code(body)
    copy_at = BUF + 0x100
    # the copy's back edge goes to its own head, as a region's copy does: not P
    copy = _code(body[:-1] + [f"jnz {copy_at:#x}"], at=copy_at)
    entry = counting_entry(BUF, COUNTER, copy_at)
    assert len(entry) == COUNTING_ENTRY_LEN and entry.startswith(counter_bytes(BUF, COUNTER))
    assert inc_flags_dead(code, ORIG)
    m = Machine([(ORIG, 0x1000), (BUF, 0x1000), (DATA, 0x2000), (STACK - 0x1000, 0x2000)])

    def inside(a: int) -> bool:
        return ORIG <= a < ORIG + len(code) or BUF <= a < BUF + 0x200

    for seed in range(20):
        results = []
        for patch in (False, True):
            m.write(ORIG, (jmp_rel32(ORIG, BUF) + code[5:]) if patch else code)
            m.write(BUF, entry)
            m.write(copy_at, copy)
            m.write(DATA, bytes(16))
            m.set_state(random_state(random.Random(seed), STACK, {}, {"rcx": 5 + seed}))
            assert m.run(ORIG, inside, limit=1000) == END
            results.append(m.snapshot([(DATA, 16)]))
        plain, counted = results
        assert plain.regs == counted.regs and plain.rflags == counted.rflags
        assert int.from_bytes(counted.mem[DATA][8:], "little") == 1   # entered once
