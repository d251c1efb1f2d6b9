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
  ``call``; the emitter does, with :func:`call_rel32`, for a call region selection kept
  as a real call (the callee returns into the buffer).
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

from dbr_service.errors import CodegenError

TargetMap = Callable[[int], "int | None"]
#: Original exit target -> the address the exit branch jumps to (a far-exit stub).
ExitMap = Callable[[int], int]


class CannotRelocate(CodegenError):
    """This instruction cannot be moved (or not to this address)."""


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


# -- hand encodings (each checked against capstone in tests) ------------------------------

_LOOP_IDS = {X.X86_INS_LOOP, X.X86_INS_LOOPE, X.X86_INS_LOOPNE,
             X.X86_INS_JRCXZ, X.X86_INS_JECXZ, X.X86_INS_JCXZ}
_REFUSED_IDS = {X.X86_INS_LJMP, X.X86_INS_LCALL, X.X86_INS_RETF, X.X86_INS_RETFQ,
                X.X86_INS_IRET, X.X86_INS_IRETD, X.X86_INS_IRETQ, X.X86_INS_XBEGIN}
_REG64 = {X.X86_REG_RAX: 0, X.X86_REG_RCX: 1, X.X86_REG_RDX: 2, X.X86_REG_RBX: 3,
          X.X86_REG_RSP: 4, X.X86_REG_RBP: 5, X.X86_REG_RSI: 6, X.X86_REG_RDI: 7,
          X.X86_REG_R8: 8, X.X86_REG_R9: 9, X.X86_REG_R10: 10, X.X86_REG_R11: 11,
          X.X86_REG_R12: 12, X.X86_REG_R13: 13, X.X86_REG_R14: 14, X.X86_REG_R15: 15}

LEA_RSP_MINUS_128 = bytes.fromhex("488d642480")          # lea rsp, [rsp - 0x80]
LEA_RSP_PLUS_128 = bytes.fromhex("488da42480000000")     # lea rsp, [rsp + 0x80]
PUSHFQ = b"\x9c"
POPFQ = b"\x9d"


def rel32(src_end: int, dst: int) -> bytes:
    """The rel32 from the end of an instruction at ``src_end`` to ``dst`` (checked)."""
    d = dst - src_end
    if not -(1 << 31) <= d < (1 << 31):
        raise CannotRelocate(f"rel32 from {src_end:#x} to {dst:#x} out of range")
    return struct.pack("<i", d)


def jmp_rel32(at: int, dst: int) -> bytes:
    """``jmp rel32`` (E9) placed at ``at``."""
    return b"\xe9" + rel32(at + 5, dst)


#: Length of ``call rel32``; its rel32 field starts at byte 1.
CALL_LEN = 5


def call_rel32(at: int, dst: int) -> bytes:
    """``call rel32`` (E8) placed at ``at``: a real call, whose return address is
    ``at + CALL_LEN`` in the buffer."""
    return b"\xe8" + rel32(at + CALL_LEN, dst)


def jcc_rel32(cc: int, at: int, dst: int) -> bytes:
    """``j<cc> rel32`` (0F 80+cc) placed at ``at``."""
    return bytes((0x0F, 0x80 | cc)) + rel32(at + 6, dst)


def push_return(ret: int, at: int | None = None, slot: int | None = None) -> bytes:
    """Push the 64-bit original return address ``ret`` without touching the flags.

    ``push imm32`` sign-extends, so it is used only for ``ret < 2**31``; otherwise, when
    the emitter keeps ``ret`` in an 8-byte ``slot`` of the buffer's data,
    ``push qword [rip+slot]`` (at address ``at``: one instruction, one 8-byte store the
    callee can load back without a store-forwarding stall); else
    ``lea rsp,[rsp-8]; mov dword [rsp], lo; mov dword [rsp+4], hi``.
    """
    if 0 <= ret < (1 << 31):
        return b"\x68" + struct.pack("<I", ret)                     # push imm32
    if slot is not None and at is not None:
        return b"\xff\x35" + rel32(at + PUSH_SLOT_LEN, slot)        # push qword [rip+d]
    return (bytes.fromhex("488d6424f8")                               # lea rsp, [rsp - 8]
            + b"\xc7\x04\x24" + struct.pack("<I", ret & 0xFFFFFFFF)   # mov dword [rsp], lo
            + b"\xc7\x44\x24\x04" + struct.pack("<I", ret >> 32))     # mov dword [rsp+4], hi


#: Length of ``push qword [rip+disp32]``; its disp32 field starts at byte 2.
PUSH_SLOT_LEN = 6


def push_return_fixups(ret: int, slot: int | None) -> list[Fixup]:
    """The data reference of :func:`push_return`'s slot form (none for the others)."""
    if 0 <= ret < (1 << 31) or slot is None:
        return []
    return [Fixup(0, 2, slot, slot, False, data=True)]


def ret_adjust(imm: int) -> bytes:
    """``lea rsp, [rsp + 8 + imm]``: the stack effect of ``ret imm`` without the jump."""
    n = 8 + imm
    if n < 0x80:
        return bytes.fromhex("488d6424") + bytes((n,))
    return bytes.fromhex("488da424") + struct.pack("<I", n)


def _push(r: int) -> bytes:
    return (b"\x41" if r >= 8 else b"") + bytes((0x50 + (r & 7),))


def _pop(r: int) -> bytes:
    return (b"\x41" if r >= 8 else b"") + bytes((0x58 + (r & 7),))


def _mov_imm64(r: int, v: int) -> bytes:
    return bytes((0x48 | (r >> 3), 0xB8 + (r & 7))) + struct.pack("<Q", v)


def _cmp_reg_reg(a: int, b: int) -> bytes:
    """``cmp a, b`` (64-bit, 39 /r with r/m = a, reg = b)."""
    return bytes((0x48 | ((b >> 3) << 2) | (a >> 3), 0x39, 0xC0 | ((b & 7) << 3) | (a & 7)))


def _lea_rcx_plus(v: int) -> bytes:
    """``lea rcx, [rcx + v]`` (no flags; v is never rsp)."""
    return bytes((0x48 | ((v >> 3) << 1), 0x8D, 0x0C, ((v & 7) << 3) | 1))


def _operand_regs(op) -> set[int]:
    """Numbers of the 64-bit registers an indirect jump's operand reads."""
    if op.type == X.X86_OP_REG:
        return {_REG64[op.reg]}
    return {_REG64[r] for r in (op.mem.base, op.mem.index) if r in _REG64}


def _mov_reg_reg(dst: int, src: int) -> bytes:
    """``mov dst, src`` (64-bit, 89 /r)."""
    return bytes((0x48 | ((src >> 3) << 2) | (dst >> 3), 0x89, 0xC0 | ((src & 7) << 3) | (dst & 7)))


def _cmp_reg_imm32(a: int, v: int) -> bytes:
    return bytes((0x48 | (a >> 3), 0x81, 0xF8 | (a & 7))) + struct.pack("<i", v)


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
        address ``ret`` of a call (see :func:`push_return`), or None.
        """
        insn = self.decode(insn_bytes, old_addr)
        kind = self.classify(insn)
        b = bytes(insn.bytes)
        if kind is Kind.COPY:
            return Relocated(b, kind)
        if kind is Kind.RIPREL:
            code, fx = self._redisplace(insn, b, new_addr, 0)
            return Relocated(code, kind, [fx])
        if kind is Kind.JMP:
            return self._direct(b"", insn.operands[0].imm, new_addr, target_map, kind,
                                exit_map)
        if kind is Kind.JCC:
            t = insn.operands[0].imm
            dst, ex = _dest(t, target_map, exit_map)
            code = jcc_rel32(jcc_condition(insn), new_addr, dst)
            return Relocated(code, kind, [Fixup(0, 2, dst, t, ex)])
        if kind is Kind.LOOP:
            return self._loop(insn, b, new_addr, target_map, exit_map)
        ret = insn.address + insn.size
        slot = ret_slot(ret) if ret_slot is not None and kind in (Kind.CALL, Kind.ICALL) \
            else None
        if kind is Kind.CALL:
            r = self._direct(push_return(ret, new_addr, slot), insn.operands[0].imm,
                             new_addr, target_map, kind, exit_map)
            r.fixups[:0] = push_return_fixups(ret, slot)
            return r
        if kind is Kind.RET:
            imm = insn.operands[0].imm if insn.operands else 0
            if ret_target is None:
                return Relocated(b, kind, dynamic_exits=[0])
            return self._direct(ret_adjust(imm), ret_target, new_addr, target_map, kind,
                                exit_map)
        push = push_return(ret, new_addr, slot) if kind is Kind.ICALL else b""
        r = self._indirect(insn, b, new_addr + len(push), target_map, ijmp_targets,
                           abi_entry and kind is Kind.IJMP)
        r = _shift(r, push, kind)
        if push:
            r.fixups[:0] = push_return_fixups(ret, slot)
        return r

    def _direct(self, head: bytes, t: int, new_addr: int, target_map: TargetMap,
                kind: Kind, exit_map: ExitMap | None = None) -> Relocated:
        """``head`` then ``jmp rel32`` to the mapped ``t``."""
        dst, ex = _dest(t, target_map, exit_map)
        at = new_addr + len(head)
        return Relocated(head + jmp_rel32(at, dst), kind,
                         [Fixup(len(head), len(head) + 1, dst, t, ex)])

    def _redisplace(self, insn, b: bytes, new_addr: int, offset: int) -> tuple[bytes, Fixup]:
        """``b`` (the instruction, possibly re-encoded with the same tail) with its
        rip displacement recomputed for placement at ``new_addr``; ``insn`` gives the
        original target.  ``offset`` is where ``b`` lands in the caller's output."""
        target = insn.address + insn.size + insn.disp
        do = insn.disp_offset - (insn.size - len(b))
        if struct.unpack_from("<i", b, do)[0] != insn.disp:
            raise CannotRelocate(f"displacement not found at {insn.address:#x}")
        code = b[:do] + rel32(new_addr + len(b), target) + b[do + 4:]
        return code, Fixup(offset, offset + do, target, target, False, data=True)

    def _loop(self, insn, b: bytes, new_addr: int, target_map: TargetMap,
              exit_map: ExitMap | None = None) -> Relocated:
        """``<op> +2; jmp short +5; jmp rel32 L`` (flags untouched on every path)."""
        t = insn.operands[0].imm
        dst, ex = _dest(t, target_map, exit_map)
        head = b[:-1] + b"\x02" + b"\xeb\x05"
        at = new_addr + len(head)
        return Relocated(head + jmp_rel32(at, dst), Kind.LOOP,
                         [Fixup(len(head), len(head) + 1, dst, t, ex)])

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
        return self._ijmp_exit(insn, b, new_addr, 0)

    def _ijmp_exit(self, insn, b: bytes, at: int, offset: int) -> Relocated:
        """The indirect jmp itself (an exit with a run-time target).  A call operand
        ``FF /2`` becomes ``FF /4``; a rip operand is re-displaced."""
        if insn.id == X.X86_INS_CALL:
            m = insn.modrm_offset
            b = b[:m] + bytes(((b[m] & 0xC7) | (4 << 3),)) + b[m + 1:]
        fixups = []
        if insn.operands[0].type == X.X86_OP_MEM and insn.operands[0].mem.base == X.X86_REG_RIP:
            b, fx = self._redisplace(insn, b, at, offset)
            fixups.append(fx)
        return Relocated(b, Kind.IJMP, fixups, dynamic_exits=[offset])

    def load_target(self, insn, b: bytes, reg: int, at: int, offset: int):
        """``mov reg, <the jmp/call memory operand>`` (same prefixes, ModRM tail)."""
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
            return self._redisplace(insn, out, at, offset)
        return out, None

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
        out = bytearray(LEA_RSP_MINUS_128 + _push(1))
        fixups: list[Fixup] = []
        loaded = None
        if op.type == X.X86_OP_REG and _REG64[op.reg] != 1:
            v = _REG64[op.reg]
        else:
            loaded = next(r for r in range(16) if r not in used and r not in (1, 4))
            out += _push(loaded)
            if op.type == X.X86_OP_REG:                      # jmp rcx: copy it first
                out += _mov_reg_reg(loaded, 1)
            else:
                code, fx = self.load_target(insn, b, loaded, new_addr + len(out), len(out))
                if fx:
                    fixups.append(fx)
                out += code
            v = loaded
        leave = (_pop(loaded) if loaded is not None else b"") + _pop(1) + LEA_RSP_PLUS_128
        jrcxz_at = []
        for t, _dst in cases:
            out += _mov_imm64(1, (-t) & 0xFFFFFFFFFFFFFFFF) + _lea_rcx_plus(v)
            jrcxz_at.append(len(out))
            out += b"\xe3\x00"                               # jrcxz hit_k (patched below)
        out += leave
        tail = self._ijmp_exit(insn, b, new_addr + len(out), len(out))
        out += tail.code
        for k, (t, dst) in enumerate(cases):
            rel = len(out) - (jrcxz_at[k] + 2)
            if rel > 127:
                return self._cascade_pushf(insn, b, new_addr, cases)
            out[jrcxz_at[k] + 1] = rel
            out += leave
            at = len(out)
            out += jmp_rel32(new_addr + at, dst)
            fixups.append(Fixup(at, at + 1, dst, t, False))
        return Relocated(bytes(out), Kind.IJMP, fixups + tail.fixups, tail.dynamic_exits)

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
        free = [r for r in range(16) if r not in used and r != 4]
        out = bytearray(LEA_RSP_MINUS_128 + PUSHFQ)
        fixups: list[Fixup] = []
        if op.type == X.X86_OP_REG:
            reg, loaded = _REG64[op.reg], False
        else:
            reg, loaded = free.pop(0), True
            out += _push(reg)
            code, fx = self.load_target(insn, b, reg, new_addr + len(out), len(out))
            if fx:
                fixups.append(fx)
            out += code
        scratch = free[0]
        leave = (_pop(reg) if loaded else b"") + POPFQ + LEA_RSP_PLUS_128
        for t, dst in cases:
            if t < (1 << 31):
                out += _cmp_reg_imm32(reg, t)
            else:
                out += _push(scratch) + _mov_imm64(scratch, t) + _cmp_reg_reg(reg, scratch) \
                    + _pop(scratch)
            body_at = len(out) + 2
            body = leave + jmp_rel32(new_addr + body_at + len(leave), dst)
            out += bytes((0x75, len(body))) + body
            fixups.append(Fixup(body_at + len(leave), body_at + len(leave) + 1, dst, t, False))
        out += leave
        tail = self._ijmp_exit(insn, b, new_addr + len(out), len(out))
        return Relocated(bytes(out) + tail.code, Kind.IJMP, fixups + tail.fixups,
                         tail.dynamic_exits)


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
        out = bytearray()
        fixups: list[Fixup] = []
        code, fx = self.load_target(insn, b, 11, new_addr, 0)
        if fx:
            fixups.append(fx)
        out += code
        for t, dst in cases:
            if t < (1 << 31):
                out += _cmp_reg_imm32(11, t)
            else:
                out += _mov_imm64(10, t) + _cmp_reg_reg(11, 10)
            at = len(out)
            out += jcc_rel32(0x4, new_addr + at, dst)          # je
            fixups.append(Fixup(at, at + 2, dst, t, False))
        exit_at = len(out)
        out += b"\x41\xff\xe3"                                  # jmp r11
        return Relocated(bytes(out), Kind.IJMP, fixups, [exit_at])


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
