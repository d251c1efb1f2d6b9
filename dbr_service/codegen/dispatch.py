"""Jump-table dispatch translated in replacement code.

A switch compiled by gcc or clang as position-independent code ends its dispatch
block with ::

    movsxd R, dword [B + I*4]     ; entry of the table at B (an offset from B)
    add    R, B                   ; R = target address
    jmp    R                      ; (possibly ``notrack jmp R``)

Left alone in replacement code, the ``jmp R`` goes to original code every time (an
exit: an interpreter's dispatch loop then leaves the region at every bytecode), and a
compare cascade over the cases costs every dispatch as many compares plus a flag save
(3-4x slower than native on a 12-way interpreter).  Translated, the last two
instructions become (``base`` = the table's base address that jump-table inference
found, ``omin``/``omax`` the extremes of its entries' offsets)::

        cmp  B, [rip + BASE]          ; B is the table we analysed?
        jne  miss
        cmp  R, omin                  ; R (the loaded offset) in range?  (imm32, signed)
        jl   miss
        cmp  R, omax
        jg   miss
        notrack jmp [B + R*8 + d]     ; slot table: one 8-byte slot per offset in range
    miss:
        add  R, B                     ; the original pair: run-time target, a dynamic exit
        [notrack] jmp R
    stub of target T (one per target):
        add  R, B                     ; the original instruction: R and the flags exact
        jmp  rel32 D(T)               ; T's copy in the region, or T itself (an exit)

The slot of an entry's offset holds the address of its target's stub, every other slot
the address of ``miss``.  Every path ends with the original ``add R, B``, which writes
all six status flags, so the compares' flag writes are dead; nothing else is written
(no register, no stack, no red zone).  The translation does not depend on jump-table
inference being right: with ``B == base`` and ``R`` in range checked at run time, the
slot read is inside the table, and the stub it names is that of ``B + R`` exactly when
``B + R`` is a known target; anything else takes the miss path, i.e. the original jump.

Discovery gives an indirect jump a block of its own (the patent), so the ``add`` usually
ends the block before it.  Then the jump's block is translated when every way into it
in the region is the fall-through from that ``add`` (no entry edge, every predecessor a
copy of the block ending in it; :func:`region_dispatch_plan`): there ``R`` and the flags
are exactly what ``add R, B`` left, and the translation starts with ``sub R, B`` to get
the loaded offset back (each path's closing ``add R, B`` then recomputes the same flags
from the same operands).

Data (after the code, see :func:`~dbr_service.codegen.emit.emit_region`): the 8-byte
``BASE`` slot, then the slot table (8 bytes per offset in ``[omin, omax]``; at most
:data:`MAX_SPAN` offsets).  ``d`` is a disp32 from ``base``: the code buffer must lie
within 2 GiB of the table base.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

from dbr_service.codegen.relocate import CannotRelocate, jcc_rel32
from dbr_service.region.model import BasicBlock, EdgeKind, NodeKey, SuperRegion, TermKind

#: Widest range of table offsets translated (the slot table holds 8 bytes per offset).
MAX_SPAN = 1 << 12
#: Bytes of the check sequence before the table jump.
_CHECK_LEN = 7 + 6 + 7 + 6 + 7 + 6
#: Bytes of one target's stub: ``add R, B`` (3) and ``jmp rel32`` (5).
STUB_LEN = 8
_NOTRACK = 0x3E
_JNE, _JL, _JG = 0x5, 0xC, 0xF


@dataclass(frozen=True)
class DispatchPlan:
    """How one dispatch block's ``add R, B; jmp R`` is translated."""

    r: int                      #: register number of R (0-15)
    b: int                      #: register number of B
    base: int                   #: the table base B must hold
    targets: tuple[int, ...]    #: distinct targets, ascending
    add: bytes                  #: the original ``add R, B``
    jmp: bytes                  #: the original ``[notrack] jmp R``
    add_addr: int
    jmp_addr: int
    #: The ``add`` ends the previous block: the translation first undoes it.
    split: bool = False

    @property
    def sub(self) -> bytes:
        """``sub R, B`` (REX.W 29 /r), or nothing when the ``add`` is in this block."""
        if not self.split:
            return b""
        r, b = self.r, self.b
        return bytes((0x48 | (b >> 3) << 2 | r >> 3, 0x29, 0xC0 | (b & 7) << 3 | r & 7))

    @property
    def offsets(self) -> list[int]:
        return [t - self.base for t in self.targets]

    @property
    def omin(self) -> int:
        return self.targets[0] - self.base

    @property
    def omax(self) -> int:
        return self.targets[-1] - self.base

    @property
    def notrack(self) -> bool:
        return self.jmp[0] == _NOTRACK

    @property
    def span(self) -> int:
        return self.omax - self.omin + 1

    @property
    def data_size(self) -> int:
        """``BASE`` slot and the slot table."""
        return 8 + 8 * self.span

    @property
    def head_size(self) -> int:
        """Bytes before the first stub: [sub], checks, table jump, miss path."""
        return len(self.sub) + _CHECK_LEN + len(_jmp_table(self.r, self.b, 0)) \
            + len(self.add) + len(self.jmp)

    def code_size(self, stubs: int) -> int:
        return self.head_size + STUB_LEN * stubs


def _parse_add(raw: bytes) -> tuple[int, int] | None:
    """(dst, src) of a 64-bit register-register ``add``, else None."""
    if len(raw) != 3 or raw[0] & 0xF8 != 0x48 or raw[1] not in (0x01, 0x03) \
            or raw[2] >> 6 != 3:
        return None
    rex, op, m = raw
    reg = ((rex >> 2) & 1) << 3 | (m >> 3) & 7
    rm = (rex & 1) << 3 | m & 7
    return (rm, reg) if op == 0x01 else (reg, rm)


def _parse_jmp_reg(raw: bytes) -> int | None:
    """Register of ``[notrack] jmp r64`` (FF /4, mod 11), else None."""
    if raw[:1] == bytes((_NOTRACK,)):
        raw = raw[1:]
    hi = 0
    if len(raw) == 3 and raw[0] in (0x40, 0x41):
        hi, raw = (raw[0] & 1) << 3, raw[1:]
    if len(raw) != 2 or raw[0] != 0xFF or raw[1] & 0xF8 != 0xE0:
        return None
    return hi | raw[1] & 7


def _insn_bytes(bb: BasicBlock, i: int) -> tuple[int, bytes]:
    a, n = bb.insns[i]
    return a, bb.data[a - bb.start:a - bb.start + n]


def plan_dispatch(bb: BasicBlock, pred: BasicBlock | None = None) -> DispatchPlan | None:
    """The translation of ``bb``'s dispatch, or None when it does not qualify: not an
    indirect jump, no table base known, not ending in ``add R, B; jmp R``, offsets that
    do not fit int32 or span more than :data:`MAX_SPAN`.

    ``bb`` may be a lone ``jmp R`` when ``pred`` is the block before it, ending in the
    ``add`` (the caller vouches that control reaches ``bb`` only from that ``add``)."""
    base = bb.table_base
    if bb.term is not TermKind.IJMP or base is None or not bb.targets:
        return None
    ja, jmp = _insn_bytes(bb, -1)
    if len(bb.insns) >= 2:
        (aa, add), split = _insn_bytes(bb, -2), False
    elif pred is not None and pred.end == bb.start and pred.insns:
        (aa, add), split = _insn_bytes(pred, -1), True
    else:
        return None
    regs, r = _parse_add(add), _parse_jmp_reg(jmp)
    if regs is None or r is None or regs[0] != r or regs[1] == r or 4 in (r, regs[1]):
        return None
    targets = tuple(sorted(set(bb.targets)))
    offs = [t - base for t in targets]
    if not all(-(1 << 31) <= o < (1 << 31) for o in offs) or offs[-1] - offs[0] >= MAX_SPAN:
        return None
    return DispatchPlan(r, regs[1], base, targets, add, jmp, aa, ja, split)


def region_dispatch_plan(sr: SuperRegion, key: NodeKey) -> DispatchPlan | None:
    """:func:`plan_dispatch` for block ``key`` of ``sr``; a lone ``jmp R`` qualifies when
    it has predecessors, none through an entry edge, and each is a block falling through
    into it from an ``add`` that gives the same plan."""
    bb = sr.block(key)
    if bb.term is not TermKind.IJMP or bb.table_base is None:
        return None
    if len(bb.insns) >= 2:
        return plan_dispatch(bb)
    plan = None
    ins = list(sr.g.in_edges(key, data=True))
    if not ins:
        return None
    for u, _, d in ins:
        if d.get("kind") is not EdgeKind.FALLTHROUGH or \
                not isinstance(sr.g.nodes[u].get("bb"), BasicBlock):
            return None
        pb = sr.block(u)
        if pb.term is not TermKind.FALLTHROUGH or pb.end != bb.start:
            return None
        p = plan_dispatch(bb, pb)
        if p is None or (plan is not None and p != plan):
            return None
        plan = p
    return plan


# ---- encoding -------------------------------------------------------------------------

def _i32(v: int, check: bool) -> bytes:
    if check and not -(1 << 31) <= v < (1 << 31):
        raise CannotRelocate(f"dispatch table displacement {v:#x} out of range")
    return struct.pack("<I", v & 0xFFFFFFFF)


def _cmp_rip(reg: int, at: int, slot: int, check: bool) -> bytes:
    """``cmp reg64, [rip + slot]`` (REX.W 3B /r), 7 bytes, placed at ``at``."""
    return bytes((0x48 | (reg >> 3) << 2, 0x3B, (reg & 7) << 3 | 5)) + _i32(slot - (at + 7),
                                                                             check)


def _cmp_imm(reg: int, v: int) -> bytes:
    """``cmp reg64, imm32`` (REX.W 81 /7), 7 bytes."""
    return bytes((0x48 | reg >> 3, 0x81, 0xF8 | reg & 7)) + struct.pack("<i", v)


def _jmp_table(r: int, b: int, disp: int, check: bool = False) -> bytes:
    """``notrack jmp qword [b + r*8 + disp32]`` (FF /4, mod 10, SIB).  ``notrack``: the
    stubs it reaches have no ``endbr64`` (a plain prefix where CET is off)."""
    out = bytes((_NOTRACK,))
    rex = 0x40 | (r >> 3) << 1 | b >> 3
    if rex != 0x40:
        out += bytes((rex,))
    return out + bytes((0xFF, 0xA4, 0xC0 | (r & 7) << 3 | b & 7)) + _i32(disp, check)


@dataclass
class DispatchCode:
    """The translated pair: code, and where its parts are (offsets into ``code``)."""

    code: bytes
    table_jmp: int      #: the ``jmp [B + R*8 + d]``
    miss_at: int        #: the miss path's ``add R, B``
    exit_at: int        #: the miss path's ``jmp R`` (a dynamic exit)
    #: Offset of each target's stub (its ``add``; the ``jmp rel32`` is 3 bytes on);
    #: the stubs' jumps are left for the caller to encode (``jmp rel32`` placeholders).
    stubs: dict[int, int]


def encode_dispatch(plan: DispatchPlan, at: int, data: int,
                    stub_targets: Sequence[int] | None = None, check: bool = True) \
        -> DispatchCode:
    """The translated ``add R, B; jmp R`` placed at ``at``, its data at ``data``, with a
    stub for each of ``stub_targets`` (default: every target; a target left out must
    get its ``add R, B`` elsewhere, at the start of its copy).  ``check=False`` (sizing
    pass): displacements are not range-checked.  Stub jumps are ``E9 00000000``
    placeholders: the caller encodes them to each target's destination."""
    r, b = plan.r, plan.b
    out = bytearray(plan.sub)
    jumps = []                                            # offsets of jcc rel32 to miss

    def jcc(cc: int) -> None:
        jumps.append((len(out), cc))
        out.extend(b"\x0f\x80\0\0\0\0")

    out += _cmp_rip(b, at + len(out), data, check)
    jcc(_JNE)
    out += _cmp_imm(r, plan.omin)
    jcc(_JL)
    out += _cmp_imm(r, plan.omax)
    jcc(_JG)
    table_jmp = len(out)
    out += _jmp_table(r, b, data + 8 - plan.base - 8 * plan.omin, check)
    miss = len(out)
    for off, cc in jumps:
        out[off:off + 6] = jcc_rel32(cc, at + off, at + miss)
    out += plan.add
    exit_at = len(out)
    out += plan.jmp
    assert len(out) == plan.head_size
    stubs = {}
    for t in plan.targets if stub_targets is None else stub_targets:
        stubs[t] = len(out)
        out += plan.add + b"\xe9\0\0\0\0"
    assert len(out) == plan.code_size(len(stubs))
    return DispatchCode(bytes(out), table_jmp, miss, exit_at, stubs)


def dispatch_data(plan: DispatchPlan, miss: int, slots: dict[int, int]) -> bytes:
    """The ``BASE`` slot and the slot table: the offset of each target in ``slots``
    names the address given there (its stub, or its copy starting with ``add R, B``),
    every other offset ``miss``."""
    out = bytearray(plan.data_size)
    struct.pack_into("<Q", out, 0, plan.base)
    struct.pack_into(f"<{plan.span}Q", out, 8, *([miss] * plan.span))
    for t, a in slots.items():
        struct.pack_into("<Q", out, 8 + 8 * (t - plan.base - plan.omin), a)
    return bytes(out)
