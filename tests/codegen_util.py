"""Shared helpers for the codegen tests: assembling at an address, a small unicorn
machine that runs code until control leaves a range, and architectural-state snapshots."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import capstone
import keystone
from unicorn import UC_ARCH_X86, UC_HOOK_CODE, UC_HOOK_INSN, UC_MODE_64, Uc
from unicorn import x86_const as U

KS = keystone.Ks(keystone.KS_ARCH_X86, keystone.KS_MODE_64)
CS = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
CS.detail = True

GPRS = ["rax", "rcx", "rdx", "rbx", "rsp", "rbp", "rsi", "rdi",
        "r8", "r9", "r10", "r11", "r12", "r13", "r14", "r15"]
UREG = {n: getattr(U, f"UC_X86_REG_{n.upper()}") for n in GPRS}
XMMS = [getattr(U, f"UC_X86_REG_XMM{i}") for i in range(8)]
#: CF PF AF ZF SF OF (DF kept 0): the arithmetic flags compared between runs.
FLAG_MASK = 0x8D5
PAGE = 0x1000


def asm(text: str, addr: int) -> bytes:
    """Assemble ``text`` (keystone, Intel syntax) as placed at ``addr``."""
    enc, _ = KS.asm(text, addr)
    return bytes(enc)


def asm_rip(template: str, addr: int, target: int) -> bytes:
    """Assemble an instruction whose ``{D}`` is the rip displacement reaching ``target``.

    Two passes (a rip operand is always disp32, so the length is fixed); the result is
    checked with capstone, since keystone has had rip-relative bugs."""
    size = len(asm(template.format(D="0x1000"), addr))
    code = asm(template.format(D=hex(target - (addr + size))), addr)
    insn = next(CS.disasm(code, addr))
    assert insn.size == len(code) == size, template
    assert addr + insn.size + insn.disp == target, (template, insn.op_str)
    return code


def linear(code: bytes, addr: int) -> list[capstone.CsInsn]:
    """Linear disassembly of all of ``code`` (asserting it decodes completely)."""
    out = list(CS.disasm(code, addr))
    assert sum(i.size for i in out) == len(code), "code did not decode completely"
    return out


@dataclass
class State:
    regs: dict[str, int]
    rflags: int
    xmm: list[int]
    mem: dict[int, bytes]


class Machine:
    """A unicorn x86-64 machine with a handful of mapped ranges."""

    def __init__(self, ranges: list[tuple[int, int]]) -> None:
        self.uc = Uc(UC_ARCH_X86, UC_MODE_64)
        self.uc.ctl_set_cpu_model(U.UC_CPU_X86_HASWELL)   # SSSE3/SSE4 (no AVX in unicorn)
        self.ranges = []
        for a, n in ranges:
            lo, hi = a & ~(PAGE - 1), (a + n + PAGE - 1) & ~(PAGE - 1)
            self.uc.mem_map(lo, hi - lo)
            self.ranges.append((lo, hi - lo))
        self._inside: Callable[[int], bool] = lambda a: False
        self.steps = 0
        self.uc.hook_add(UC_HOOK_CODE, self._on_code)
        self.uc.hook_add(UC_HOOK_INSN, self._on_syscall, None, 1, 0, U.UC_X86_INS_SYSCALL)

    def _on_code(self, uc, address, size, _user) -> None:
        self.steps += 1
        if not self._inside(address) or self.steps > self.limit:
            uc.emu_stop()

    @staticmethod
    def _on_syscall(uc, _user) -> None:
        # A deterministic stand-in for the kernel: rax <- f(rax, rdi), rcx/r11 clobbered
        # the way the CPU does (rcx = next rip, r11 = rflags).
        rax, rdi = uc.reg_read(U.UC_X86_REG_RAX), uc.reg_read(U.UC_X86_REG_RDI)
        uc.reg_write(U.UC_X86_REG_RAX, (rax * 31 + rdi) & (2**64 - 1))
        uc.reg_write(U.UC_X86_REG_R11, uc.reg_read(U.UC_X86_REG_EFLAGS))

    def write(self, addr: int, data: bytes) -> None:
        """Write memory and drop unicorn's translations of it (it does not do so itself:
        re-patched code would otherwise run stale)."""
        self.uc.mem_write(addr, data)
        self.uc.ctl_remove_cache(addr, addr + len(data))

    def read(self, addr: int, n: int) -> bytes:
        return bytes(self.uc.mem_read(addr, n))

    def set_state(self, st: State) -> None:
        for n, v in st.regs.items():
            self.uc.reg_write(UREG[n], v)
        self.uc.reg_write(U.UC_X86_REG_EFLAGS, st.rflags | 0x202)
        for r, v in zip(XMMS, st.xmm):
            self.uc.reg_write(r, v)
        for a, b in st.mem.items():
            self.uc.mem_write(a, b)

    def run(self, start: int, inside: Callable[[int], bool], limit: int = 10000) -> int:
        """Run from ``start`` until the next instruction is outside ``inside``; the rip."""
        self._inside, self.steps, self.limit = inside, 0, limit
        self.uc.emu_start(start, 0)
        assert self.steps <= limit, "instruction limit reached"
        return self.uc.reg_read(U.UC_X86_REG_RIP)

    def snapshot(self, mem_ranges: list[tuple[int, int]]) -> State:
        regs = {n: self.uc.reg_read(UREG[n]) for n in GPRS}
        fl = self.uc.reg_read(U.UC_X86_REG_EFLAGS) & FLAG_MASK
        xmm = [self.uc.reg_read(r) for r in XMMS]
        return State(regs, fl, xmm, {a: self.read(a, n) for a, n in mem_ranges})


def random_state(rng: random.Random, rsp: int, mem: dict[int, int],
                 fixed: dict[str, int] | None = None) -> State:
    """Random GPRs (rsp given), random arithmetic flags, random xmm and memory."""
    regs = {n: rng.getrandbits(64) for n in GPRS}
    regs["rsp"] = rsp
    regs.update(fixed or {})
    fl = rng.getrandbits(12) & FLAG_MASK & ~0x400
    xmm = [rng.getrandbits(128) for _ in XMMS]
    return State(regs, fl, xmm, {a: rng.randbytes(n) for a, n in mem.items()})


# -- super-regions built from real code ---------------------------------------------------

def term_of(insn: capstone.CsInsn):
    """(TermKind, direct target or None) of an instruction that ends a block, else None."""
    from dbr_service.codegen.relocate import Kind, Relocator
    from dbr_service.region.model import TermKind
    if insn.mnemonic in ("hlt", "ud2", "int3"):
        return TermKind.HALT, None
    kind = Relocator().classify(insn)
    imm = insn.operands[0].imm if insn.operands and insn.operands[0].type == 2 else None
    return {Kind.JMP: TermKind.JMP, Kind.JCC: TermKind.JCC, Kind.LOOP: TermKind.JCC,
            Kind.CALL: TermKind.CALL, Kind.ICALL: TermKind.ICALL, Kind.RET: TermKind.RET,
            Kind.IJMP: TermKind.IJMP}.get(kind), imm


def build_blocks(code: bytes, addr: int, indirect: dict[int, list[int]] | None = None):
    """Basic blocks of ``code`` at ``addr`` by linear disassembly (leaders: the start,
    branch targets, known indirect targets, instructions after a control transfer)."""
    from dbr_service.region.model import BasicBlock, TermKind
    insns = linear(code, addr)
    leaders = {addr}
    for tl in (indirect or {}).values():
        leaders |= set(tl)
    for i in insns:
        t, imm = term_of(i)
        if t is not None:
            leaders.add(i.address + i.size)
            if imm is not None:
                leaders.add(imm)
    blocks, cur = {}, []
    end = addr + len(code)
    for n, i in enumerate(insns):
        cur.append(i)
        nxt = i.address + i.size
        t, imm = term_of(i)
        if t is None and nxt not in leaders and nxt < end:
            continue
        s = cur[0].address
        term = t or (TermKind.FALLTHROUGH if nxt < end else TermKind.STOP)
        targets = [imm] if imm is not None else list((indirect or {}).get(i.address, []))
        ft = nxt if term in (TermKind.FALLTHROUGH, TermKind.JCC, TermKind.CALL,
                             TermKind.ICALL) else None
        blocks[s] = BasicBlock(s, nxt - s, [(x.address, x.size) for x in cur],
                               code[s - addr:nxt - addr], term, targets, ft,
                               known_exec=True)
        cur = []
    return blocks


def profile_edges(trace: list[int], blocks: dict) -> dict[tuple[int, int], int]:
    """Counts of block-to-block transitions in an instruction-address trace."""
    counts: dict[tuple[int, int], int] = {}
    prev = None
    for a in trace:
        if a in blocks:
            if prev is not None:
                counts[(prev, a)] = counts.get((prev, a), 0) + 1
            prev = a
        elif not any(b.contains(a) for b in blocks.values()):
            prev = None
    return counts
