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

from dbr_service.codegen.x86 import CC_G, CC_L, CC_NE, JMP_LEN, NOTRACK, X86Writer
from dbr_service.region.model import BasicBlock, EdgeKind, NodeKey, SuperRegion, TermKind

#: Widest range of table offsets translated (the slot table holds 8 bytes per offset).
MAX_SPAN = 1 << 12
#: Bytes of the check sequence before the table jump.
_CHECK_LEN = 7 + 6 + 7 + 6 + 7 + 6
#: Bytes of one target's stub: ``add R, B`` (3) and ``jmp rel32`` (5).
STUB_LEN = 8


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
        w = X86Writer()
        w.put_sub_reg_reg(self.r, self.b)
        return bytes(w.code)

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
        return self.jmp[0] == NOTRACK

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
        w = X86Writer()
        _put_table_jmp(w, self.r, self.b, 0)
        return len(self.sub) + _CHECK_LEN + w.offset + len(self.add) + len(self.jmp)

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
    if raw[:1] == bytes((NOTRACK,)):
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

def _put_table_jmp(w: X86Writer, r: int, b: int, disp: int) -> None:
    """``notrack jmp qword [b + r*8 + disp32]`` (always a disp32: the size is fixed).
    ``notrack``: the stubs it reaches have no ``endbr64`` (a plain prefix where CET is
    off)."""
    w.put_jmp_mem(b, r, 8, disp, notrack=True, disp32=True)


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
    pass): displacements out of range are written as zero.  Stub jumps are ``E9 00000000``
    placeholders: the caller encodes them to each target's destination."""
    r, b = plan.r, plan.b
    w = X86Writer(at, check=check)
    if plan.split:
        w.put_sub_reg_reg(r, b)
    w.put_cmp_reg_rip(b, data)
    w.put_jcc_near_label(CC_NE, "miss")
    w.put_cmp_reg_imm32(r, plan.omin)
    w.put_jcc_near_label(CC_L, "miss")
    w.put_cmp_reg_imm32(r, plan.omax)
    w.put_jcc_near_label(CC_G, "miss")
    table_jmp = w.offset
    _put_table_jmp(w, r, b, data + 8 - plan.base - 8 * plan.omin)
    w.put_label("miss")
    miss = w.offset
    w.put_bytes(plan.add)
    exit_at = w.offset
    w.put_bytes(plan.jmp)
    assert w.offset == plan.head_size
    stubs = {}
    for t in plan.targets if stub_targets is None else stub_targets:
        stubs[t] = w.offset
        w.put_bytes(plan.add)
        w.put_jmp(w.pc + JMP_LEN)                         # placeholder: rel32 0
    assert w.offset == plan.code_size(len(stubs))
    return DispatchCode(w.finish(), table_jmp, miss, exit_at, stubs)


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
