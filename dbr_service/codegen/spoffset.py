"""How far rsp lies from the original's inside one instruction's translation.

Replacement code keeps the original's stack at every instruction boundary of the
original, but a translation of one original instruction may move rsp on its way:
an indirect jump's or call's dispatch steps over the red zone (``lea rsp,
[rsp-0x80]``) and saves scratch registers (``push``) before it compares targets,
and a probe handler saves the flags.  A thread sampled inside such a sequence has
rsp below the original's, and an unwinder that applies the original instruction's
CFI row to it reads the return address from the wrong slot.

:func:`sp_offset` replays the translation from its start (where rsp is the
original's) to the sampled address, following its jumps inside the translation, and
gives ``rsp - original rsp`` there: 0 before any push, -0x90 after the red-zone
step and two pushes.  Only the instructions replacement code uses to move rsp are
known (``push``/``pop`` of 8 bytes, ``pushfq``/``popfq``, ``lea rsp, [rsp+d]``,
``add``/``sub rsp, imm``); any other write of rsp, or paths that reach the address
with different offsets, give None: the caller must not guess.
"""

from __future__ import annotations

from functools import lru_cache

import capstone
from capstone import x86

_MD = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
_MD.detail = True

_JCC = {x86.X86_INS_JA, x86.X86_INS_JAE, x86.X86_INS_JB, x86.X86_INS_JBE,
        x86.X86_INS_JE, x86.X86_INS_JNE, x86.X86_INS_JG, x86.X86_INS_JGE,
        x86.X86_INS_JL, x86.X86_INS_JLE, x86.X86_INS_JO, x86.X86_INS_JNO,
        x86.X86_INS_JP, x86.X86_INS_JNP, x86.X86_INS_JS, x86.X86_INS_JNS,
        x86.X86_INS_JRCXZ, x86.X86_INS_JECXZ, x86.X86_INS_LOOP, x86.X86_INS_LOOPE,
        x86.X86_INS_LOOPNE}
_STOP = {x86.X86_INS_RET, x86.X86_INS_UD2, x86.X86_INS_INT3, x86.X86_INS_HLT}
#: Most instructions replayed in one translation (a dispatch cascade is far fewer).
MAX_INSNS = 512
_UNKNOWN = object()


def _effect(ins) -> int | object:
    """rsp change of one instruction (0: none), or _UNKNOWN."""
    iid = ins.id
    ops = ins.operands
    if iid == x86.X86_INS_PUSHFQ:
        return -8
    if iid == x86.X86_INS_POPFQ:
        return 8
    if iid == x86.X86_INS_PUSH:
        return -8 if ops and ops[0].size == 8 else _UNKNOWN
    if iid == x86.X86_INS_POP:
        if not ops or ops[0].size != 8 or (ops[0].type == x86.X86_OP_REG
                                           and ops[0].reg == x86.X86_REG_RSP):
            return _UNKNOWN
        return 8
    if iid == x86.X86_INS_CALL:
        return 0            # a real call returns with rsp as it was
    _, written = ins.regs_access()
    if x86.X86_REG_RSP not in written and x86.X86_REG_ESP not in written \
            and x86.X86_REG_SP not in written:
        return 0
    if len(ops) == 2 and ops[0].type == x86.X86_OP_REG and ops[0].reg == x86.X86_REG_RSP:
        src = ops[1]
        if iid == x86.X86_INS_LEA and src.mem.base == x86.X86_REG_RSP \
                and src.mem.index == 0 and src.mem.segment == 0:
            return src.mem.disp
        if iid in (x86.X86_INS_ADD, x86.X86_INS_SUB) and src.type == x86.X86_OP_IMM:
            return src.imm if iid == x86.X86_INS_ADD else -src.imm
    return _UNKNOWN


def sp_offset(code: bytes, base: int, lo: int, hi: int, ip: int) -> int | None:
    """``rsp - original rsp`` at ``ip`` in the translation ``[lo, hi)`` of one original
    instruction, in ``code`` placed at ``base``; None when it cannot be known (see the
    module's text) or ``ip`` is no instruction boundary reached from ``lo``."""
    if not (base <= lo <= ip < hi <= base + len(code)):
        return None
    return _replay(bytes(code[lo - base:hi - base]), lo, ip)


@lru_cache(maxsize=4096)
def _replay(piece: bytes, lo: int, ip: int) -> int | None:
    hi = lo + len(piece)
    seen: dict[int, object] = {}     # address -> offset there (or _UNKNOWN)
    todo = [(lo, 0)]
    steps = 0
    while todo:
        at, off = todo.pop()
        if at in seen:
            if seen[at] != off:
                return None        # paths that meet with different offsets
            continue
        seen[at] = off
        if at == ip or off is _UNKNOWN:
            continue
        steps += 1
        if steps > MAX_INSNS:
            return None
        ins = next(_MD.disasm(piece[at - lo:], at, 1), None)
        if ins is None:
            continue
        d = _effect(ins)
        nxt = _UNKNOWN if d is _UNKNOWN else off + d
        after = at + ins.size
        if ins.id in _STOP:
            continue
        if ins.id == x86.X86_INS_JMP or ins.id in _JCC:
            op = ins.operands[0] if ins.operands else None
            if op is not None and op.type == x86.X86_OP_IMM and lo <= op.imm < hi:
                todo.append((op.imm, nxt))
            if ins.id == x86.X86_INS_JMP:
                continue
        if after < hi:
            todo.append((after, nxt))
    got = seen.get(ip)
    return None if got is None or got is _UNKNOWN else got
