"""Streaming x86-64 instruction relocator: one original instruction in, its bytes at a new
address out (frida-gum's ``gumx86relocator`` shape: classify, then a small rewriter per
class; anything without a PC dependence is copied byte for byte).

Pure code generation: bytes in, bytes out, never a process.

Classes and what they become (``Kind``):

* ``COPY``    no PC dependence: copied unchanged (incl. ``syscall``, ``hlt``, ``ud2``).
* ``RIPREL``  any instruction with a ``[rip + disp32]`` operand (GPR, SSE, VEX, EVEX,
  ``lock``, immediates after the displacement): the displacement at capstone's
  ``disp_offset`` is recomputed; it must still fit in int32.
* ``JMP``     ``jmp rel8/rel32``  -> ``E9 rel32`` to the mapped target.
* ``JCC``     ``jcc rel8/rel32``  -> ``0F 8x rel32`` (branch-hint prefixes dropped).
* ``LOOP``    ``loop/loope/loopne/jrcxz/jecxz L`` -> ``<op> +2; jmp short +5; jmp rel32 L``
  (the original short branch only hops over a 2-byte ``jmp``; no flag is touched).
* ``CALL``    direct call, as the inlined pseudo-instruction: push the *original* return
  address (flags preserved) then ``jmp rel32`` to the callee (an in-buffer clone, or the
  original callee, which then returns into original code).  The relocator never emits a
  ``call``; the emitter does, for a call region selection kept as a real call (the
  callee returns into the buffer).
* ``ICALL``   indirect call: the same push, then the ``IJMP`` treatment of its operand.
* ``RET``     inside an inlined callee: ``lea rsp,[rsp+8+imm16]; jmp rel32 continuation``;
  elsewhere copied (a dynamic exit: it returns to its caller's return address, an
  original one unless the caller is a real call in replacement code).
* ``IJMP``    indirect jmp: without in-buffer targets it stays the same indirect jmp (a
  RIP-relative operand is re-displaced); with in-buffer targets it becomes a compare
  cascade that preserves every register, the flags and the red zone (see
  :meth:`Relocator._cascade`), then the original indirect jmp as exit.  At a call
  boundary of the SysV ABI (``abi_entry``: the jump of a PLT stub entered by a call,
  where the status flags, ``r10`` and ``r11`` carry nothing a callee may read) the
  cascade is ``mov r11, [M]; cmp; je`` per case, then ``jmp r11``
  (:meth:`Relocator._cascade_abi`): no flag save, no stack traffic.

Refused (``can_relocate`` stops before them, ``relocate_insn`` raises
:class:`CannotRelocate`): undecodable bytes, far ``jmp``/``call``/``ret``, ``iret``,
``xbegin``, any other PC-relative branch, ``[eip + disp]`` (0x67 prefix), branches with a
0x66 operand-size prefix, indirect calls whose operand uses ``rsp``, and any relocation
whose new rel32/disp32 does not fit.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import capstone
from capstone import x86_const as X

from dbr_service.codegen.x86 import (
    CC_E,
    CC_NE,
    R10,
    R11,
    RCX,
    RSP,
    CannotRelocate,
    OutOfRange,
    X86Writer,
)
# one-instruction encoders, also importable from here
from dbr_service.codegen.x86 import call_rel32 as call_rel32
from dbr_service.codegen.x86 import jmp_rel32 as jmp_rel32
from dbr_service.common.errors import CodegenError

TargetMap = Callable[[int], "int | None"]
#: Original exit target -> the address the exit branch jumps to (a far-exit stub).
ExitMap = Callable[[int], int]


class Kind(str, enum.Enum):
    """Relocation class of one instruction."""

    COPY = "copy"
    RIPREL = "riprel"
    JMP = "jmp"
    JCC = "jcc"
    LOOP = "loop"
    CALL = "call"
    ICALL = "icall"
    RET = "ret"
    IJMP = "ijmp"


@dataclass(frozen=True)
class Fixup:
    """One rel32/disp32 field written by the relocator."""

    #: Offset of the instruction holding the field, in the relocated bytes.
    insn_off: int
    #: Offset of the 4-byte field itself.
    field_off: int
    #: Absolute address the field reaches (in-buffer or original).
    target: int
    #: Original address the transfer stands for (the data address for ``data``).
    orig_target: int
    #: True when ``target`` is original code: an exit from replacement code.
    exit: bool
    #: True for a RIP-relative data reference rather than a control transfer.
    data: bool = False


@dataclass
class Relocated:
    """The relocated form of one instruction."""

    code: bytes
    kind: Kind
    fixups: list[Fixup] = field(default_factory=list)
    #: Offsets of exits whose target is only known at run time (indirect jmp, plain ret).
    dynamic_exits: list[int] = field(default_factory=list)

    @property
    def exits(self) -> list[Fixup]:
        return [f for f in self.fixups if f.exit]


_LOOP_IDS = {X.X86_INS_LOOP, X.X86_INS_LOOPE, X.X86_INS_LOOPNE,
             X.X86_INS_JRCXZ, X.X86_INS_JECXZ, X.X86_INS_JCXZ}
_REFUSED_IDS = {X.X86_INS_LJMP, X.X86_INS_LCALL, X.X86_INS_RETF, X.X86_INS_RETFQ,
                X.X86_INS_IRET, X.X86_INS_IRETD, X.X86_INS_IRETQ, X.X86_INS_XBEGIN}
#: Capstone's 64-bit registers -> their numbers (codegen.x86).
REG64 = {X.X86_REG_RAX: 0, X.X86_REG_RCX: 1, X.X86_REG_RDX: 2, X.X86_REG_RBX: 3,
         X.X86_REG_RSP: 4, X.X86_REG_RBP: 5, X.X86_REG_RSI: 6, X.X86_REG_RDI: 7,
         X.X86_REG_R8: 8, X.X86_REG_R9: 9, X.X86_REG_R10: 10, X.X86_REG_R11: 11,
         X.X86_REG_R12: 12, X.X86_REG_R13: 13, X.X86_REG_R14: 14, X.X86_REG_R15: 15}
#: Bytes below rsp that the code being relocated may use (the SysV red zone).
RED_ZONE = 0x80
_MASK64 = (1 << 64) - 1


def put_push_return(w: X86Writer, ret: int, slot: int | None = None) -> list[Fixup]:
    """Push the 64-bit original return address ``ret`` without touching the flags; the
    data reference of the slot form, if used.

    ``push imm32`` sign-extends, so it is used only for ``ret < 2**31``; otherwise, when
    the emitter keeps ``ret`` in an 8-byte ``slot`` of the buffer's data,
    ``push qword [rip+slot]`` (one instruction, one 8-byte store the callee can load
    back without a store-forwarding stall); else
    ``lea rsp,[rsp-8]; mov dword [rsp], lo; mov dword [rsp+4], hi``.
    """
    if 0 <= ret < (1 << 31):
        w.put_push_imm32(ret)
        return []
    if slot is not None:
        at = w.offset
        return [Fixup(at, w.put_push_rip(slot), slot, slot, False, data=True)]
    w.put_lea(RSP, RSP, -8)
    w.put_mov_m32_imm32(RSP, 0, ret & 0xFFFFFFFF)
    w.put_mov_m32_imm32(RSP, 4, ret >> 32)
    return []


def push_return(ret: int, at: int | None = None, slot: int | None = None) -> bytes:
    """:func:`put_push_return` placed at ``at`` (the slot form needs it)."""
    w = X86Writer(0 if at is None else at)
    put_push_return(w, ret, slot if at is not None else None)
    return bytes(w.code)


def ret_adjust(imm: int) -> bytes:
    """``lea rsp, [rsp + 8 + imm]``: the stack effect of ``ret imm`` without the jump."""
    w = X86Writer()
    w.put_lea(RSP, RSP, 8 + imm)
    return bytes(w.code)


def _operand_regs(op) -> set[int]:
    """Numbers of the 64-bit registers an indirect jump's operand reads."""
    if op.type == X.X86_OP_REG:
        return {REG64[op.reg]}
    return {REG64[r] for r in (op.mem.base, op.mem.index) if r in REG64}


def jcc_condition(insn: capstone.CsInsn) -> int:
    """The 4-bit condition code of a ``jcc rel8``/``jcc rel32``."""
    op = insn.opcode
    if 0x70 <= op[0] <= 0x7F:
        return op[0] & 0xF
    if op[0] == 0x0F and 0x80 <= op[1] <= 0x8F:
        return op[1] & 0xF
    raise CannotRelocate(f"not a jcc: {insn.mnemonic}")


# -- the relocator -------------------------------------------------------------------------

class Relocator:
    """Moves x86-64 instructions one at a time; see the module docstring for the classes."""

    def __init__(self, mode: int = capstone.CS_MODE_64) -> None:
        if mode != capstone.CS_MODE_64:
            raise CodegenError("only x86-64 is supported")
        self.md = capstone.Cs(capstone.CS_ARCH_X86, mode)
        self.md.detail = True

    # ---- decoding and classification ----------------------------------------------------
    def decode(self, code: bytes, addr: int) -> capstone.CsInsn:
        """The first instruction of ``code`` at ``addr``; CannotRelocate if undecodable."""
        for insn in self.md.disasm(code[:15], addr, 1):
            return insn
        raise CannotRelocate(f"undecodable bytes at {addr:#x}")

    @staticmethod
    def _mem_operand(insn: capstone.CsInsn):
        for op in insn.operands:
            if op.type == X.X86_OP_MEM:
                return op
        return None

    def classify(self, insn: capstone.CsInsn) -> Kind:
        """The relocation class, or CannotRelocate with the reason."""
        iid = insn.id
        if iid in _REFUSED_IDS:
            raise CannotRelocate(f"{insn.mnemonic} at {insn.address:#x} is not relocatable")
        mem = self._mem_operand(insn)
        if mem is not None and mem.mem.base in (X.X86_REG_EIP,) or \
                mem is not None and mem.mem.index in (X.X86_REG_RIP, X.X86_REG_EIP):
            raise CannotRelocate(f"eip-relative operand at {insn.address:#x}")
        is_rel = capstone.CS_GRP_BRANCH_RELATIVE in insn.groups
        if (is_rel or iid in (X.X86_INS_JMP, X.X86_INS_CALL, X.X86_INS_RET)) \
                and 0x66 in insn.prefix:
            raise CannotRelocate(f"operand-size prefix on branch at {insn.address:#x}")
        if iid in (X.X86_INS_JMP, X.X86_INS_CALL) and insn.operands[0].type == X.X86_OP_MEM \
                and (insn.bytes[insn.modrm_offset] >> 3) & 7 in (3, 5):
            raise CannotRelocate(f"far {insn.mnemonic} at {insn.address:#x}")   # FF /3, FF /5
        if iid in _LOOP_IDS:
            return Kind.LOOP
        if iid == X.X86_INS_JMP:
            return Kind.JMP if insn.operands[0].type == X.X86_OP_IMM else Kind.IJMP
        if iid == X.X86_INS_CALL:
            if insn.operands[0].type == X.X86_OP_IMM:
                return Kind.CALL
            if self._uses_rsp(insn.operands[0]):
                raise CannotRelocate(f"indirect call through rsp at {insn.address:#x}")
            return Kind.ICALL
        if iid == X.X86_INS_RET:
            return Kind.RET
        if is_rel:
            jcc_condition(insn)             # raises for any other PC-relative branch
            return Kind.JCC
        if mem is not None and mem.mem.base == X.X86_REG_RIP:
            # mod=00 rm=101 always carries a disp32 (capstone's disp_size says 2 under a
            # 0x66 prefix, so it is not consulted; _redisplace checks the bytes instead).
            return Kind.RIPREL
        return Kind.COPY

    @staticmethod
    def _uses_rsp(op) -> bool:
        if op.type == X.X86_OP_REG:
            return op.reg == X.X86_REG_RSP
        return op.type == X.X86_OP_MEM and X.X86_REG_RSP in (op.mem.base, op.mem.index)

    def can_relocate(self, code: bytes, addr: int, min_bytes: int) -> int:
        """Bytes of whole relocatable instructions from ``addr``, stopping once ``min_bytes``
        are covered, at the first instruction that cannot be relocated, or after an
        unconditional transfer (jmp/ret).  A result ``< min_bytes`` means "cannot"."""
        n = 0
        while n < min_bytes and n < len(code):
            try:
                insn = self.decode(code[n:], addr + n)
                kind = self.classify(insn)
            except CannotRelocate:
                break
            n += insn.size
            if kind in (Kind.JMP, Kind.IJMP, Kind.RET):
                break
        return n

    # ---- relocation -------------------------------------------------------------------
    def relocate_insn(self, insn_bytes: bytes, old_addr: int, new_addr: int, *,
                      target_map: TargetMap = lambda _t: None,
                      ret_target: int | None = None,
                      ijmp_targets: Sequence[int] = (),
                      exit_map: ExitMap | None = None,
                      abi_entry: bool = False,
                      ret_slot: Callable[[int], int | None] | None = None) -> Relocated:
        """Relocate the instruction at the start of ``insn_bytes`` from ``old_addr`` to
        ``new_addr``.

        ``target_map(orig)`` gives the in-buffer address for an original branch target, or
        None to exit to the original address.  ``ret_target`` is the original continuation
        when a ``ret`` belongs to an inlined callee.  ``ijmp_targets`` are the known original
        targets of an indirect jmp/call (those mapped in-buffer get a compare case).
        ``exit_map(orig)`` is where a branch exiting to ``orig`` jumps (default: ``orig``
        itself; the emitter maps targets beyond rel32 reach to far-exit stubs).  The
        fixup of such an exit keeps ``orig`` as its original target.  ``abi_entry`` says
        the instruction is an indirect ``jmp`` at a function's entry under the SysV ABI
        (status flags, ``r10`` and ``r11`` dead): its cascade may clobber them.
        ``ret_slot(ret)`` is the address of an 8-byte data slot holding the return
        address ``ret`` of a call (see :func:`put_push_return`), or None.
        """
        insn = self.decode(insn_bytes, old_addr)
        kind = self.classify(insn)
        b = bytes(insn.bytes)
        if kind is Kind.COPY:
            return Relocated(b, kind)
        w = X86Writer(new_addr)
        if kind is Kind.RIPREL:
            fx = self._put_redisplaced(w, insn, b)
            return Relocated(bytes(w.code), kind, [fx])
        if kind is Kind.JMP:
            return self._direct(w, insn.operands[0].imm, target_map, kind, exit_map)
        if kind is Kind.JCC:
            t = insn.operands[0].imm
            dst, ex = _dest(t, target_map, exit_map)
            f = w.put_jcc(jcc_condition(insn), dst)
            return Relocated(bytes(w.code), kind, [Fixup(0, f, dst, t, ex)])
        if kind is Kind.LOOP:
            return self._loop(w, insn, b, target_map, exit_map)
        ret = insn.address + insn.size
        slot = ret_slot(ret) if ret_slot is not None and kind in (Kind.CALL, Kind.ICALL) \
            else None
        if kind is Kind.CALL:
            push_fx = put_push_return(w, ret, slot)
            return self._direct(w, insn.operands[0].imm, target_map, kind, exit_map, push_fx)
        if kind is Kind.RET:
            imm = insn.operands[0].imm if insn.operands else 0
            if ret_target is None:
                return Relocated(b, kind, dynamic_exits=[0])
            w.put_lea(RSP, RSP, 8 + imm)
            return self._direct(w, ret_target, target_map, kind, exit_map)
        push_fx = put_push_return(w, ret, slot) if kind is Kind.ICALL else []
        push = bytes(w.code)
        r = self._indirect(insn, b, new_addr + len(push), target_map, ijmp_targets,
                           abi_entry and kind is Kind.IJMP)
        r = _shift(r, push, kind)
        r.fixups[:0] = push_fx
        return r

    def _direct(self, w: X86Writer, t: int, target_map: TargetMap, kind: Kind,
                exit_map: ExitMap | None = None, fixups: Sequence[Fixup] = ()) -> Relocated:
        """What ``w`` holds, then ``jmp rel32`` to the mapped ``t``."""
        dst, ex = _dest(t, target_map, exit_map)
        at = w.offset
        f = w.put_jmp(dst)
        return Relocated(bytes(w.code), kind, [*fixups, Fixup(at, f, dst, t, ex)])

    @staticmethod
    def _put_redisplaced(w: X86Writer, insn, b: bytes) -> Fixup:
        """``b`` (the instruction, possibly re-encoded with the same tail) with its
        rip displacement recomputed for where ``w`` writes it; ``insn`` gives the
        original target."""
        target = insn.address + insn.size + insn.disp
        do = insn.disp_offset - (insn.size - len(b))
        if struct.unpack_from("<i", b, do)[0] != insn.disp:
            raise CannotRelocate(f"displacement not found at {insn.address:#x}")
        at = w.offset
        return Fixup(at, w.put_insn_rip(b, do, target), target, target, False, data=True)

    def _loop(self, w: X86Writer, insn, b: bytes, target_map: TargetMap,
              exit_map: ExitMap | None = None) -> Relocated:
        """``<op> +2; jmp short +5; jmp rel32 L`` (flags untouched on every path)."""
        t = insn.operands[0].imm
        dst, ex = _dest(t, target_map, exit_map)
        w.put_branch8_label(b[:-1], "taken")
        w.put_jmp_short_label("not_taken")
        w.put_label("taken")
        at = w.offset
        f = w.put_jmp(dst)
        w.put_label("not_taken")
        return Relocated(w.finish(), Kind.LOOP, [Fixup(at, f, dst, t, ex)])

    # ---- indirect jumps -----------------------------------------------------------------
    def _indirect(self, insn, b: bytes, new_addr: int, target_map: TargetMap,
                  ijmp_targets: Sequence[int], abi_entry: bool = False) -> Relocated:
        op = insn.operands[0]
        cases = []
        for t in dict.fromkeys(ijmp_targets):
            dst = target_map(t)
            if dst is not None:
                cases.append((t, dst))
        if cases and abi_entry and op.type == X.X86_OP_MEM and not self._uses_rsp(op):
            return self._cascade_abi(insn, b, new_addr, cases)
        if cases and not self._uses_rsp(op):
            return self._cascade(insn, b, new_addr, cases)
        w = X86Writer(new_addr)
        fixups, exit_at = self._put_ijmp_exit(w, insn, b)
        return Relocated(bytes(w.code), Kind.IJMP, fixups, [exit_at])

    def _put_ijmp_exit(self, w: X86Writer, insn, b: bytes) -> tuple[list[Fixup], int]:
        """The indirect jmp itself (an exit with a run-time target): its fixups and
        offset.  A call operand ``FF /2`` becomes ``FF /4``; a rip operand is
        re-displaced."""
        if insn.id == X.X86_INS_CALL:
            m = insn.modrm_offset
            b = b[:m] + bytes(((b[m] & 0xC7) | (4 << 3),)) + b[m + 1:]
        at = w.offset
        if insn.operands[0].type == X.X86_OP_MEM and insn.operands[0].mem.base == X.X86_REG_RIP:
            return [self._put_redisplaced(w, insn, b)], at
        w.put_bytes(b)
        return [], at

    def put_load_target(self, w: X86Writer, insn, b: bytes, reg: int) -> Fixup | None:
        """``mov reg, <the jmp/call memory operand>``: the operand's prefixes and ModRM
        tail copied, ModRM.reg and REX.R/W set; the fixup of a rip operand."""
        m = insn.modrm_offset
        pre = b[:m - 1]
        # Only the prefixes that shape the memory operand (fs/gs, address size) carry
        # over: bnd (F2, MPX-era PLTs), rep or a branch hint on a mov is reserved.
        legacy = bytes(x for x in pre if x in (0x64, 0x65, 0x67))
        rex = pre[-1] if pre and 0x40 <= pre[-1] <= 0x4F else 0x40
        rex = 0x48 | (rex & 0x3) | ((reg >> 3) << 2)
        modrm = (b[m] & 0xC7) | ((reg & 7) << 3)
        out = legacy + bytes((rex, 0x8B, modrm)) + b[m + 1:]
        if insn.operands[0].mem.base == X.X86_REG_RIP:
            return self._put_redisplaced(w, insn, out)
        w.put_bytes(out)
        return None

    def _cascade(self, insn, b: bytes, new_addr: int, cases) -> Relocated:
        """Compare cascade for an indirect jmp with in-buffer targets, without touching
        the flags: each case computes ``rcx = V - T`` with ``mov``/``lea`` and tests it
        with ``jrcxz``, which reads no flag and writes none::

            lea rsp,[rsp-0x80]          ; step over the red zone
            push rcx
            [push L; mov L, <V>]        ; V in rcx (register form jmp rcx) or in memory:
                                        ; L = a register the operand does not use
          per case k (T -> D):
            mov rcx, -T
            lea rcx, [rcx + V]
            jrcxz hit_k
            [pop L]; pop rcx; lea rsp,[rsp+0x80]
            <the original jmp>          ; unknown target: exit, every register as before
          hit_k:
            [pop L]; pop rcx; lea rsp,[rsp+0x80]
            jmp D

        Cheaper than saving the flags (``pushfq``/``popfq`` is microcoded) and, with
        64-bit targets (every PIE), than a push/mov/cmp/pop per case.  When a ``jrcxz``
        cannot reach its trampoline (rel8), :meth:`_cascade_pushf` is used instead."""
        op = insn.operands[0]
        used = _operand_regs(op)
        w = X86Writer(new_addr)
        w.put_lea(RSP, RSP, -RED_ZONE)
        w.put_push_reg(RCX)
        fixups: list[Fixup] = []
        loaded = None
        if op.type == X.X86_OP_REG and REG64[op.reg] != RCX:
            v = REG64[op.reg]
        else:
            loaded = next(r for r in range(16) if r not in used and r not in (RCX, RSP))
            w.put_push_reg(loaded)
            if op.type == X.X86_OP_REG:                      # jmp rcx: copy it first
                w.put_mov_reg_reg(loaded, RCX)
            else:
                fx = self.put_load_target(w, insn, b, loaded)
                if fx:
                    fixups.append(fx)
            v = loaded

        def leave() -> None:
            if loaded is not None:
                w.put_pop_reg(loaded)
            w.put_pop_reg(RCX)
            w.put_lea(RSP, RSP, RED_ZONE)

        for k, (t, _dst) in enumerate(cases):
            w.put_mov_reg_imm64(RCX, (-t) & _MASK64)
            w.put_lea(RCX, RCX, index=v)
            w.put_jrcxz_label(f"hit{k}")
        leave()
        exit_fixups, exit_at = self._put_ijmp_exit(w, insn, b)
        for k, (t, dst) in enumerate(cases):
            w.put_label(f"hit{k}")
            leave()
            at = w.offset
            fixups.append(Fixup(at, w.put_jmp(dst), dst, t, False))
        try:
            w.flush()
        except OutOfRange:
            return self._cascade_pushf(insn, b, new_addr, cases)
        return Relocated(bytes(w.code), Kind.IJMP, fixups + exit_fixups, [exit_at])

    def _cascade_pushf(self, insn, b: bytes, new_addr: int, cases) -> Relocated:
        """Compare cascade for an indirect jmp with in-buffer targets, flags saved.

        Register form (``jmp R``), S = a scratch register other than R::

            lea rsp,[rsp-0x80]          ; step over the red zone
            pushfq
          per case (T -> D):
            cmp R, imm32                ; when T < 2**31, else:
              push S; mov S, T; cmp R, S; pop S
            jne next
            popfq
            lea rsp,[rsp+0x80]
            jmp D
          next: ...
            popfq
            lea rsp,[rsp+0x80]
            jmp R                       ; unknown target: exit

        Memory form (``jmp [M]``): after pushfq, ``push L; mov L, [M]`` (L not used by M)
        and R = L; every path pops L before its popfq; the final exit is the original
        ``jmp [M]``.  Everything written lies below rsp-0x80; registers, flags and the
        red zone are as before on every path.
        """
        op = insn.operands[0]
        used = _operand_regs(op)
        free = [r for r in range(16) if r not in used and r != RSP]
        w = X86Writer(new_addr)
        w.put_lea(RSP, RSP, -RED_ZONE)
        w.put_pushfq()
        fixups: list[Fixup] = []
        if op.type == X.X86_OP_REG:
            reg, loaded = REG64[op.reg], False
        else:
            reg, loaded = free.pop(0), True
            w.put_push_reg(reg)
            fx = self.put_load_target(w, insn, b, reg)
            if fx:
                fixups.append(fx)
        scratch = free[0]

        def leave() -> None:
            if loaded:
                w.put_pop_reg(reg)
            w.put_popfq()
            w.put_lea(RSP, RSP, RED_ZONE)

        for k, (t, dst) in enumerate(cases):
            if t < (1 << 31):
                w.put_cmp_reg_imm32(reg, t)
            else:
                w.put_push_reg(scratch)
                w.put_mov_reg_imm64(scratch, t)
                w.put_cmp_reg_reg(reg, scratch)
                w.put_pop_reg(scratch)
            w.put_jcc_short_label(CC_NE, f"next{k}")
            leave()
            at = w.offset
            fixups.append(Fixup(at, w.put_jmp(dst), dst, t, False))
            w.put_label(f"next{k}")
        leave()
        exit_fixups, exit_at = self._put_ijmp_exit(w, insn, b)
        return Relocated(w.finish(), Kind.IJMP, fixups + exit_fixups, [exit_at])

    def _cascade_abi(self, insn, b: bytes, new_addr: int, cases) -> Relocated:
        """Compare cascade for ``jmp [M]`` at a SysV ABI function entry (a PLT stub
        entered by a call), where the status flags, ``r10`` and ``r11`` are dead: the ABI
        gives flags no role at a call and makes r10 (static chain, unused by calls to
        other modules) and r11 scratch, so no callee may read them::

            mov r11, [M]
          per case (T -> D):
            cmp r11, imm32              ; when T < 2**31, else:
              mov r10, T; cmp r11, r10
            je D
            jmp r11                     ; unknown target: exit to it

        ``M`` is read once, like the original; every other register, the stack and the
        red zone are untouched.  (The general :meth:`_cascade` saves the flags with
        pushfq/popfq, which made a hot loop with three inlined PLT calls 1.7x slower.)
        """
        w = X86Writer(new_addr)
        fixups: list[Fixup] = []
        fx = self.put_load_target(w, insn, b, R11)
        if fx:
            fixups.append(fx)
        for t, dst in cases:
            if t < (1 << 31):
                w.put_cmp_reg_imm32(R11, t)
            else:
                w.put_mov_reg_imm64(R10, t)
                w.put_cmp_reg_reg(R11, R10)
            at = w.offset
            fixups.append(Fixup(at, w.put_jcc(CC_E, dst), dst, t, False))
        exit_at = w.offset
        w.put_jmp_reg(R11)
        return Relocated(bytes(w.code), Kind.IJMP, fixups, [exit_at])


def _dest(t: int, target_map: TargetMap, exit_map: ExitMap | None = None) -> tuple[int, bool]:
    dst = target_map(t)
    if dst is not None:
        return dst, False
    return (t if exit_map is None else exit_map(t)), True


def _shift(r: Relocated, head: bytes, kind: Kind) -> Relocated:
    n = len(head)
    return Relocated(head + r.code, kind,
                     [Fixup(f.insn_off + n, f.field_off + n, f.target, f.orig_target, f.exit,
                            f.data) for f in r.fixups],
                     [o + n for o in r.dynamic_exits])
