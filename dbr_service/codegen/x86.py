"""x86-64 instruction writer: every instruction codegen writes (rather than copies
from the original) is encoded here.

Modelled on frida-gum's ``gumx86writer``: a byte buffer placed at an address, a
``put_*`` method per encoding codegen emits, labels for branches inside the buffer
(resolved by :meth:`X86Writer.flush`), and range checks: a rel8, rel32, disp32 or
immediate that does not fit its field raises :class:`OutOfRange`, never wraps.

Registers are numbers 0-15 in hardware order (:data:`RAX` .. :data:`R15`); condition
codes are the 4-bit ``cc`` of ``jcc`` (:data:`CC_E` ...).  Each method emits one fixed
form (``cmp r64, imm32`` is never shortened to imm8, ``jmp`` to an address is always
rel32), so a size depends on the operands' values only where a method says so.
Methods whose instruction has a rel32 or disp32 field that callers record (as a
relocation fixup) return that field's offset in the buffer.
"""

from __future__ import annotations

import struct

from dbr_service.common.errors import CodegenError

RAX, RCX, RDX, RBX, RSP, RBP, RSI, RDI = range(8)
R8, R9, R10, R11, R12, R13, R14, R15 = range(8, 16)
REG_NAMES = ("rax", "rcx", "rdx", "rbx", "rsp", "rbp", "rsi", "rdi",
             "r8", "r9", "r10", "r11", "r12", "r13", "r14", "r15")

#: Condition codes (the low nibble of ``0F 8x`` / ``7x``).
CC_O, CC_NO, CC_B, CC_AE, CC_E, CC_NE, CC_BE, CC_A = range(8)
CC_S, CC_NS, CC_P, CC_NP, CC_L, CC_GE, CC_LE, CC_G = range(8, 16)

#: Bytes of ``call rel32`` (its return address is the call's address plus this).
CALL_LEN = 5
#: Bytes of ``jmp rel32``.
JMP_LEN = 5
#: ``notrack`` prefix (CET: an indirect branch whose target needs no ``endbr64``).
NOTRACK = 0x3E

#: Recommended multi-byte NOPs (Intel SDM vol. 2B, NOP), by length.
_NOPS = {1: "90", 2: "6690", 3: "0f1f00", 4: "0f1f4000", 5: "0f1f440000",
         6: "660f1f440000", 7: "0f1f8000000000", 8: "0f1f840000000000",
         9: "660f1f840000000000"}
_SCALE = {1: 0, 2: 1, 4: 2, 8: 3}


class CannotRelocate(CodegenError):
    """Code cannot be placed where asked: an instruction the relocator cannot move, or
    a field that would not reach its target from there."""


class OutOfRange(CannotRelocate):
    """A branch offset, displacement or immediate does not fit its field."""


def _fits(v: int, bits: int) -> bool:
    return -(1 << (bits - 1)) <= v < (1 << (bits - 1))


def _rex(w: bool, r: int = 0, x: int = 0, b: int = 0) -> bytes:
    """The REX prefix for the high bits of ModRM.reg (``r``), SIB.index (``x``) and
    ModRM.rm/SIB.base (``b``); empty when no bit is set."""
    v = 0x40 | (w << 3) | (r >> 3) << 2 | (x >> 3) << 1 | b >> 3
    return b"" if v == 0x40 else bytes((v,))


class X86Writer:
    """Instructions written one after the other into a buffer placed at ``pc``.

    ``check=False`` is for sizing passes, whose bytes are only measured: a field out of
    range is written as zero instead of raising (label distances are checked always,
    they do not depend on the placement)."""

    def __init__(self, pc: int = 0, *, check: bool = True) -> None:
        self.base = pc
        self.check = check
        self.code = bytearray()
        self._labels: dict[str, int] = {}
        #: (label, offset of the field, field size in bytes), resolved by flush().
        self._refs: list[tuple[str, int, int]] = []

    # ---- buffer ------------------------------------------------------------------------
    @property
    def pc(self) -> int:
        """Address of the next instruction."""
        return self.base + len(self.code)

    @property
    def offset(self) -> int:
        """Offset of the next instruction in the buffer."""
        return len(self.code)

    def put_bytes(self, b: bytes) -> None:
        self.code += b

    def put_label(self, label: str) -> None:
        """Define ``label`` at the current offset."""
        if label in self._labels:
            raise CodegenError(f"label {label!r} defined twice")
        self._labels[label] = len(self.code)

    def flush(self) -> None:
        """Resolve every label reference (OutOfRange when a distance does not fit)."""
        for label, off, size in self._refs:
            if label not in self._labels:
                raise CodegenError(f"label {label!r} not defined")
            rel = self._labels[label] - (off + size)
            if not _fits(rel, 8 * size):
                raise OutOfRange(f"rel{8 * size} to label {label!r} out of range ({rel:+d})")
            self.code[off:off + size] = rel.to_bytes(size, "little", signed=True)
        self._refs.clear()

    def finish(self) -> bytes:
        """The code with every label resolved."""
        self.flush()
        return bytes(self.code)

    # ---- fields ------------------------------------------------------------------------
    def _value(self, v: int, bits: int, what: str) -> int:
        if _fits(v, bits):
            return v
        if not self.check:
            return 0
        raise OutOfRange(f"{what} {v:#x} out of range")

    def _rel(self, end: int, dst: int, bits: int = 32) -> bytes:
        """The rel field of an instruction ending at address ``end`` reaching ``dst``."""
        d = dst - end
        if not _fits(d, bits):
            if self.check:
                raise OutOfRange(f"rel{bits} from {end:#x} to {dst:#x} out of range")
            d = 0
        return d.to_bytes(bits // 8, "little", signed=True)

    def _put_rel32(self, head: bytes, dst: int) -> int:
        """``head`` then the rel32 to ``dst``; the field's offset."""
        off = len(self.code) + len(head)
        self.code += head + self._rel(self.pc + len(head) + 4, dst)
        return off

    def _put_label_ref(self, head: bytes, label: str, size: int) -> None:
        self.code += head
        self._refs.append((label, len(self.code), size))
        self.code += bytes(size)

    def _put_rip(self, head: bytes, reg: int, target: int, tail: bytes = b"") -> int:
        """``head`` (prefixes, opcode), ModRM ``[rip + disp32]`` with ModRM.reg = ``reg``
        (low 3 bits; REX is the caller's), ``tail`` (an immediate); the disp32's offset."""
        off = len(self.code) + len(head) + 1
        end = self.pc + len(head) + 1 + 4 + len(tail)
        self.code += head + bytes(((reg & 7) << 3 | 5,)) + self._rel(end, target) + tail
        return off

    def _mem(self, reg: int, base: int, index: int | None, scale: int, disp: int,
             disp32: bool = False) -> bytes:
        """ModRM, SIB and displacement of ``[base + index*scale + disp]`` with ModRM.reg =
        ``reg`` (low 3 bits; REX is the caller's).  The shortest displacement unless
        ``disp32``: none when 0 (not with an rbp/r13 base), else disp8, else disp32."""
        if index == RSP:
            raise CodegenError("rsp cannot be an index register")
        if scale not in _SCALE:
            raise CodegenError(f"scale {scale} is not 1, 2, 4 or 8")
        if disp32 or not _fits(disp, 8):
            mod, d = 2, struct.pack("<i", self._value(disp, 32, "disp32"))
        elif disp == 0 and base & 7 != RBP:
            mod, d = 0, b""
        else:
            mod, d = 1, struct.pack("<b", disp)
        if index is None and base & 7 != RSP:
            return bytes((mod << 6 | (reg & 7) << 3 | base & 7,)) + d
        sib = _SCALE[scale] << 6 | (RSP if index is None else index & 7) << 3 | base & 7
        return bytes((mod << 6 | (reg & 7) << 3 | RSP, sib)) + d

    # ---- direct branches -----------------------------------------------------------------
    def put_jmp(self, dst: int) -> int:
        """``jmp rel32`` (E9) to ``dst``."""
        return self._put_rel32(b"\xe9", dst)

    def put_call(self, dst: int) -> int:
        """``call rel32`` (E8) to ``dst``: returns to ``pc + CALL_LEN``."""
        return self._put_rel32(b"\xe8", dst)

    def put_jcc(self, cc: int, dst: int) -> int:
        """``j<cc> rel32`` (0F 80+cc) to ``dst``."""
        return self._put_rel32(bytes((0x0F, 0x80 | cc)), dst)

    def put_jcc_near_label(self, cc: int, label: str) -> None:
        """``j<cc> rel32`` to ``label``."""
        self._put_label_ref(bytes((0x0F, 0x80 | cc)), label, 4)

    def put_jcc_short_label(self, cc: int, label: str) -> None:
        """``j<cc> rel8`` (70+cc) to ``label``."""
        self._put_label_ref(bytes((0x70 | cc,)), label, 1)

    def put_jmp_short_label(self, label: str) -> None:
        """``jmp rel8`` (EB) to ``label``."""
        self._put_label_ref(b"\xeb", label, 1)

    def put_jrcxz_label(self, label: str) -> None:
        """``jrcxz rel8`` (E3) to ``label``: reads and writes no flag."""
        self._put_label_ref(b"\xe3", label, 1)

    def put_branch8_label(self, opcode: bytes, label: str) -> None:
        """A rel8 branch given by its opcode bytes, prefixes included (``loop``,
        ``loope``, ``loopne``, ``jrcxz``, ``67 E3`` ``jecxz``, a ``jcc rel8``), to
        ``label``."""
        self._put_label_ref(opcode, label, 1)

    # ---- indirect branches -----------------------------------------------------------------
    def put_jmp_reg(self, r: int) -> None:
        """``jmp r64`` (FF /4)."""
        self.code += _rex(False, b=r) + bytes((0xFF, 0xE0 | r & 7))

    def put_jmp_rip(self, target: int) -> int:
        """``jmp qword [rip + disp32]`` (FF /4) through the 8 bytes at ``target``."""
        return self._put_rip(b"\xff", 4, target)

    def put_jmp_mem(self, base: int, index: int | None = None, scale: int = 1,
                    disp: int = 0, *, notrack: bool = False, disp32: bool = False) -> None:
        """``[notrack] jmp qword [base + index*scale + disp]`` (FF /4); ``disp32``:
        always a 4-byte displacement (a size that does not depend on ``disp``)."""
        pre = bytes((NOTRACK,)) if notrack else b""
        self.code += pre + _rex(False, 0, index or 0, base) + b"\xff" \
            + self._mem(4, base, index, scale, disp, disp32)

    # ---- stack -------------------------------------------------------------------------------
    def put_push_reg(self, r: int) -> None:
        """``push r64`` (50+r)."""
        self.code += _rex(False, b=r) + bytes((0x50 | r & 7,))

    def put_pop_reg(self, r: int) -> None:
        """``pop r64`` (58+r)."""
        self.code += _rex(False, b=r) + bytes((0x58 | r & 7,))

    def put_pushfq(self) -> None:
        self.code += b"\x9c"

    def put_popfq(self) -> None:
        self.code += b"\x9d"

    def put_push_imm32(self, v: int) -> None:
        """``push imm32`` (68): pushes ``v`` sign-extended to 64 bits."""
        self.code += b"\x68" + struct.pack("<i", self._value(v, 32, "imm32"))

    def put_push_rip(self, target: int) -> int:
        """``push qword [rip + disp32]`` (FF /6): pushes the 8 bytes at ``target``."""
        return self._put_rip(b"\xff", 6, target)

    def put_lock_inc_rip(self, target: int) -> int:
        """``lock inc qword [rip + disp32]`` (F0 REX.W FF /0): a counter at ``target``,
        8 bytes; writes OF SF ZF AF PF (not CF)."""
        return self._put_rip(b"\xf0\x48\xff", 0, target)

    # ---- data movement and arithmetic -------------------------------------------------------
    def put_lea(self, dst: int, base: int, disp: int = 0, index: int | None = None,
                scale: int = 1) -> None:
        """``lea dst, [base + index*scale + disp]`` (REX.W 8D /r): writes no flag."""
        self.code += _rex(True, dst, index or 0, base) + b"\x8d" \
            + self._mem(dst, base, index, scale, disp)

    def put_mov_reg_reg(self, dst: int, src: int) -> None:
        """``mov dst, src`` (REX.W 89 /r)."""
        self.code += _rex(True, src, 0, dst) + bytes((0x89, 0xC0 | (src & 7) << 3 | dst & 7))

    def put_mov_reg_imm64(self, r: int, v: int) -> None:
        """``mov r64, imm64`` (REX.W B8+r, 10 bytes); ``v`` signed or unsigned 64-bit."""
        if not -(1 << 63) <= v < (1 << 64):
            raise OutOfRange(f"imm64 {v:#x} out of range")
        self.code += _rex(True, b=r) + bytes((0xB8 | r & 7,)) \
            + struct.pack("<Q", v & 0xFFFF_FFFF_FFFF_FFFF)

    def put_mov_m32_imm32(self, base: int, disp: int, v: int) -> None:
        """``mov dword [base + disp], imm32`` (C7 /0); ``v`` signed or unsigned 32-bit."""
        if not -(1 << 31) <= v < (1 << 32):
            raise OutOfRange(f"imm32 {v:#x} out of range")
        self.code += _rex(False, b=base) + b"\xc7" + self._mem(0, base, None, 1, disp) \
            + struct.pack("<I", v & 0xFFFF_FFFF)

    def put_cmp_reg_reg(self, a: int, b: int) -> None:
        """``cmp a, b`` (REX.W 39 /r: r/m = a, reg = b)."""
        self.code += _rex(True, b, 0, a) + bytes((0x39, 0xC0 | (b & 7) << 3 | a & 7))

    def put_cmp_reg_imm32(self, r: int, v: int) -> None:
        """``cmp r64, imm32`` (REX.W 81 /7, 7 bytes): ``v`` sign-extended."""
        self.code += _rex(True, b=r) + bytes((0x81, 0xF8 | r & 7)) \
            + struct.pack("<i", self._value(v, 32, "imm32"))

    def put_cmp_reg_rip(self, r: int, target: int) -> int:
        """``cmp r64, qword [rip + disp32]`` (REX.W 3B /r, 7 bytes)."""
        return self._put_rip(_rex(True, r) + b"\x3b", r, target)

    def put_sub_reg_reg(self, dst: int, src: int) -> None:
        """``sub dst, src`` (REX.W 29 /r)."""
        self.code += _rex(True, src, 0, dst) + bytes((0x29, 0xC0 | (src & 7) << 3 | dst & 7))

    # ---- padding and copied instructions -----------------------------------------------
    def put_nop_padding(self, n: int) -> None:
        """``n`` bytes of the recommended multi-byte NOPs (at most 9 bytes each)."""
        while n > 0:
            k = min(n, 9)
            self.code += bytes.fromhex(_NOPS[k])
            n -= k

    def put_insn_rip(self, raw: bytes, disp_off: int, target: int) -> int:
        """Instruction ``raw`` whose disp32 at ``disp_off`` is RIP-relative, re-displaced
        to reach ``target`` from where it is written; the field's offset."""
        off = len(self.code) + disp_off
        self.code += raw[:disp_off] + self._rel(self.pc + len(raw), target) \
            + raw[disp_off + 4:]
        return off

    def put_insn_disp32(self, raw: bytes, disp_off: int, value: int) -> int:
        """Instruction ``raw`` with its disp32 at ``disp_off`` replaced by ``value`` (an
        absolute, sign-extended displacement); the field's offset."""
        off = len(self.code) + disp_off
        self.code += raw[:disp_off] + struct.pack("<i", self._value(value, 32, "disp32")) \
            + raw[disp_off + 4:]
        return off


# ---- single instructions -----------------------------------------------------------------

def jmp_rel32(at: int, dst: int) -> bytes:
    """``jmp rel32`` placed at ``at`` to ``dst``."""
    w = X86Writer(at)
    w.put_jmp(dst)
    return bytes(w.code)


def call_rel32(at: int, dst: int) -> bytes:
    """``call rel32`` placed at ``at`` to ``dst``: a real call, whose return address is
    ``at + CALL_LEN``."""
    w = X86Writer(at)
    w.put_call(dst)
    return bytes(w.code)


def nop_bytes(n: int) -> bytes:
    """``n`` bytes of multi-byte NOPs."""
    w = X86Writer()
    w.put_nop_padding(n)
    return bytes(w.code)
