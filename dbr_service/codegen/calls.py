"""Indirect-call promotion (ICP, BOLT's model) in replacement code.

An indirect call that region selection kept with *promoted targets* (its site's
``decision`` is "promoted", region/inline.py) compares its run-time target with each
promoted target, hottest first; a hit makes a direct ``call rel32`` to the original
target (a real call: the callee returns into the buffer, right before a jump to the
continuation), a miss exits to the original call instruction, which then runs in
original code.  The miss is no real indirect call on purpose: a target nobody checked
may belong to another module, which may judge its caller by the return address
(``dlsym(RTLD_NEXT)``; region/inline.py refuses such direct calls for that reason).

Register operand ``call R`` (T0 the hottest of k targets)::

        cmp  R, T0              ; REX.W 81 /7 id when T < 2**31, else
        je   hit0               ;   REX.W 3B /r: cmp R, [rip + slot(T)] (8-byte data slot)
        ...                     ; (one cmp/je per target)
        jmp  <call insn>        ; miss: exit
  hit(k-1):                     ; the hits in reverse order, so that the hottest...
        call T(k-1)
        jmp  <continuation>
        ...
  hit0:
        call T0                 ; ...falls into the continuation (the emitter's jump)

Memory operand ``call [M]`` (M not using rsp): the target is loaded into rax, saved
below the red zone (as the compare cascades of indirect jumps do, codegen/relocate.py)::

        lea  rsp, [rsp - 0x80]
        push rax
        mov  rax, [M]           ; M as in the call (a rip-relative M is re-displaced)
        cmp  rax, T0 ; je hit0  ; per target, as above
        pop  rax ; lea rsp, [rsp + 0x80] ; jmp <call insn>            ; miss
  hit(i):
        pop  rax ; lea rsp, [rsp + 0x80] ; call Ti [; jmp <continuation>]

``M`` is read once on a hit (the call reads it once); a miss reads it again in original
code (plain memory: the later read is the one the original made).  ``pop``, ``lea``,
``jmp`` and ``call`` write no flag, so every ``je`` sees its ``cmp``.

Flags: ``cmp`` writes the six status flags, which the original ``call`` leaves alone,
so the callee starts with other status flags than in the original.  This relies on the
SysV x86-64 ABI: the status flags have no role in the calling sequence and are not
preserved across calls (psABI 3.2.1: only DF is specified, clear at entry and return),
so no callee may read them before writing them and no caller after a call; compilers
compile every function that can be called indirectly that way.  DF is never written.
Every register, the stack and the red zone are as in the original at the ``call``.

Calls to live copies: a real call (direct or promoted) whose callee is the entry of
another live region's copy may go straight to that copy instead of through the
callee's patch (:func:`call_resolver`; the lookup is the installer's).  The copy is
entered with the state the original callee has at its first instruction, the return
address stays in this region's code, so the maps, ``returns`` and the unwind
information of both regions are unchanged; ``exits`` still name the original callee
(the region depends on the code the copy copies).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import capstone
from capstone import x86_const as X

from dbr_service.codegen.relocate import REG64, RED_ZONE, CannotRelocate, Fixup, Kind, Relocator
from dbr_service.codegen.x86 import CC_E, RAX, RSP, X86Writer

#: Most targets promoted at one call site (each costs every miss a compare).
MAX_PROMOTED = 3
#: The register a memory operand's target is loaded into (saved around the compares).
SCRATCH = RAX


def needs_slot(t: int) -> bool:
    """Whether target ``t`` is compared through an 8-byte data slot (``cmp imm32``
    sign-extends, so only targets below 2**31 are immediates)."""
    return not 0 <= t < (1 << 31)


def icall_insn(reloc: Relocator, data: bytes, addr: int) -> capstone.CsInsn:
    """The indirect call at ``addr`` if its target can be promoted, else
    CannotRelocate with the reason ("operand-uses-rsp": ``call [rsp+d]`` would read a
    moved stack; "not-relocatable": anything the relocator refuses)."""
    insn = reloc.decode(data, addr)
    if insn.id != X.X86_INS_CALL or not insn.operands or \
            insn.operands[0].type == X.X86_OP_IMM:
        raise CannotRelocate("not-an-indirect-call")
    op = insn.operands[0]
    regs = {op.reg} if op.type == X.X86_OP_REG else {op.mem.base, op.mem.index}
    if X.X86_REG_RSP in regs:
        raise CannotRelocate("operand-uses-rsp")
    try:
        kind = reloc.classify(insn)
    except CannotRelocate as e:
        raise CannotRelocate("not-relocatable") from e
    if kind is not Kind.ICALL or (op.type == X.X86_OP_REG and op.reg not in REG64):
        raise CannotRelocate("not-relocatable")
    return insn


@dataclass
class Part:
    """One run of a promoted call's code, standing for one thing of the original."""

    code: bytes
    #: "check" (compares, loads), "miss" (the exit to the call instruction), "restore"
    #: (memory form: rax and rsp back), "call" (a ``call rel32``), "cont" (the jump to
    #: the continuation after a call that does not fall into it).
    role: str
    fixups: list[Fixup] = field(default_factory=list)


def call_resolver(exit_to: Callable[[int], int], call_target: Callable[[int], int | None] | None,
                  near: Callable[[int], bool]) -> Callable[[int], int]:
    """Where a real call to original ``callee`` goes: ``call_target(callee)`` (the entry
    of a live copy of it, or None) when that is in rel32 reach (``near``), else where an
    exit to the callee goes (``exit_to``: the callee or its far-exit stub)."""
    def call_to(callee: int) -> int:
        copy = call_target(callee) if call_target is not None else None
        return copy if copy is not None and near(copy) else exit_to(callee)
    return call_to


def encode_promoted(reloc: Relocator, insn: capstone.CsInsn, at: int, targets: Sequence[int],
                    *, slot_of: Callable[[int], int], exit_to: Callable[[int], int],
                    cont: tuple[int, int, bool],
                    call_to: Callable[[int], int] | None = None) -> list[Part]:
    """The promoted call of ``insn`` (see the module docstring) placed at ``at``:
    ``targets`` hottest first; ``slot_of(t)``: the data slot holding ``t`` (targets
    :func:`needs_slot`); ``exit_to(orig)``: where an exit to ``orig`` jumps (a far-exit
    stub or ``orig``); ``cont``: (continuation address, where the jump to it goes, whether
    that is an exit); ``call_to(t)``: where the call to ``t`` goes (default ``exit_to``;
    :func:`call_resolver`).  The code after the last part must continue at the
    continuation."""
    if not 1 <= len(targets) <= MAX_PROMOTED or len(set(targets)) != len(targets):
        raise CannotRelocate(f"promoted targets {list(map(hex, targets))}")
    op = insn.operands[0]
    mem = op.type == X.X86_OP_MEM
    call_at = insn.address
    w = X86Writer(at)
    #: (offset, role, fixups relative to the part) of each part, in order.
    marks: list[tuple[int, str, list[Fixup]]] = []

    def part(role: str) -> None:
        marks.append((w.offset, role, []))

    def fixup(insn_off: int, field_off: int, target: int, orig: int, exit: bool,
              data: bool = False) -> None:
        start = marks[-1][0]
        marks[-1][2].append(Fixup(insn_off - start, field_off - start, target, orig, exit,
                                  data))

    def restore() -> None:
        if mem:
            w.put_pop_reg(SCRATCH)
            w.put_lea(RSP, RSP, RED_ZONE)

    part("check")
    if mem:
        w.put_lea(RSP, RSP, -RED_ZONE)
        w.put_push_reg(SCRATCH)
        f = reloc.put_load_target(w, insn, bytes(insn.bytes), SCRATCH)
        if f is not None:
            marks[-1][2].append(f)
        reg = SCRATCH
    else:
        reg = REG64[op.reg]
    for i, t in enumerate(targets):
        if needs_slot(t):
            slot = slot_of(t)
            cmp_at = w.offset
            fixup(cmp_at, w.put_cmp_reg_rip(reg, slot), slot, slot, False, data=True)
        else:
            w.put_cmp_reg_imm32(reg, t)
        w.put_jcc_short_label(CC_E, f"hit{i}")
    part("miss")
    restore()
    miss_dst = exit_to(call_at)
    jmp_at = w.offset
    fixup(jmp_at, w.put_jmp(miss_dst), miss_dst, call_at, True)
    c_orig, c_dst, c_exit = cont
    for i in reversed(range(len(targets))):
        # the hits in reverse order: the hottest falls into the continuation
        t = targets[i]
        w.put_label(f"hit{i}")
        if mem:
            part("restore")
            restore()
        part("call")
        dst = (call_to or exit_to)(t)
        call_off = w.offset
        fixup(call_off, w.put_call(dst), dst, t, True)
        if i:
            part("cont")
            jmp_at = w.offset
            fixup(jmp_at, w.put_jmp(c_dst), c_dst, c_orig, c_exit)
    code = w.finish()
    ends = [m[0] for m in marks[1:]] + [len(code)]
    return [Part(code[start:end], role, fx) for (start, role, fx), end in zip(marks, ends)]


def slot_table(slots: dict[int, int]) -> bytes:
    """The 8-byte target slots, consecutive from the lowest address."""
    order = sorted(slots.items(), key=lambda kv: kv[1])
    assert all(a == order[0][1] + 8 * i for i, (_, a) in enumerate(order))
    return b"".join(struct.pack("<Q", t) for t, _ in order)
