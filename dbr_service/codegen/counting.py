"""Counting code: a counter increment at a progress point of a speed check
(docs/decisions/0028-speed-checks.md) or at a block entry of a region in its counting
phase (docs/decisions/0041-exact-counts.md), and the counting trampoline that puts
one at a point of original code.

A progress point P counts the program's work in both phases of a check: in the
replacement phase the copy's entry for P starts with :func:`counter_bytes`; in the
original phase P is patched (a 5-byte ``jmp``, like any region entry) to a
trampoline: the same increment, P's own instructions relocated, and a ``jmp`` back
to the first instruction after them.

The increment is ``lock inc qword [rip+disp32]``: exact when several threads pass P
at once (a plain ``inc`` loses counts under contention, and contention differs
between the phases), and the same instruction in both phases, so its cost falls on
both sides of every pair.  ``inc`` writes OF, SF, ZF, AF and PF (not CF), so it is
placed only where :func:`inc_flags_dead` proves those flags dead; a counting region
saves them around it elsewhere (:func:`saved_counter_bytes`), so every block counts.
"""

from __future__ import annotations

from dataclasses import dataclass

import capstone
from capstone import x86_const as X

from dbr_service.codegen.relocate import CannotRelocate, Kind, Relocator
from dbr_service.codegen.x86 import JMP_LEN, X86Writer

#: Bytes of ``lock inc qword [rip+disp32]``.
COUNTER_LEN = 8
#: Instructions scanned forward for a write of every flag ``inc`` writes.
FLAG_SCAN_MAX = 32

_FLAGS = ("OF", "SF", "ZF", "AF", "PF")
_READS = {f: getattr(X, f"X86_EFLAGS_TEST_{f}") for f in _FLAGS}
_WRITES = {f: getattr(X, f"X86_EFLAGS_MODIFY_{f}") | getattr(X, f"X86_EFLAGS_RESET_{f}")
           | getattr(X, f"X86_EFLAGS_SET_{f}") | getattr(X, f"X86_EFLAGS_UNDEFINED_{f}")
           for f in _FLAGS}
#: Read every flag, though capstone gives them no flag detail.
_READ_ALL = {X.X86_INS_PUSHF, X.X86_INS_PUSHFD, X.X86_INS_PUSHFQ, X.X86_INS_LAHF}
#: Shifts and rotates leave every flag as it was when their count is 0 (a count in cl
#: may be): they are never taken as writing one.
_COUNTED_SHIFTS = {X.X86_INS_SHL, X.X86_INS_SAL, X.X86_INS_SHR, X.X86_INS_SAR,
                   X.X86_INS_ROL, X.X86_INS_ROR, X.X86_INS_RCL, X.X86_INS_RCR,
                   X.X86_INS_SHLD, X.X86_INS_SHRD}
#: Control leaves the straight line here (or the kernel sees rflags): the scan stops.
_STOP_GROUPS = {capstone.CS_GRP_JUMP, capstone.CS_GRP_CALL, capstone.CS_GRP_RET,
                capstone.CS_GRP_INT, capstone.CS_GRP_IRET, capstone.CS_GRP_BRANCH_RELATIVE}
_STOP_IDS = {X.X86_INS_SYSCALL, X.X86_INS_SYSENTER, X.X86_INS_UD2, X.X86_INS_HLT}

_MD = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
_MD.detail = True


def inc_flags_dead(code: bytes, addr: int, max_insns: int = FLAG_SCAN_MAX) -> bool:
    """Whether OF, SF, ZF, AF and PF are dead at ``addr``, the start of ``code``: in
    the straight line of instructions from there, each of them is written before any
    instruction reads it.  A control transfer, a system call, undecodable bytes, the
    end of ``code`` or ``max_insns`` instructions before that is proven: False."""
    pending = set(_FLAGS)
    n = 0
    for insn in _MD.disasm(code, addr):
        n += 1
        if n > max_insns or insn.id in _STOP_IDS or insn.id in _READ_ALL or \
                _STOP_GROUPS.intersection(insn.groups):
            return False
        fl = insn.eflags
        if any(fl & _READS[f] for f in pending):
            return False
        if insn.id not in _COUNTED_SHIFTS:
            written = {f for f in _FLAGS if fl & _WRITES[f]}
            if {"OF", "SF", "ZF", "PF"} <= written:
                # and, or, xor, test: the SDM leaves AF undefined, capstone leaves it out
                written.add("AF")
            pending -= written
        if not pending:
            return True
    return False


#: ``lea rsp, [rsp-128]; pushfq`` and ``popfq; lea rsp, [rsp+128]``: the flags saved
#: below the red zone around an increment where they may be live.
_SAVE_FLAGS = bytes.fromhex("488d642480") + b"\x9c"
_RESTORE_FLAGS = b"\x9d" + bytes.fromhex("488da42480000000")
#: Bytes of an increment with the flags saved around it.
SAVED_COUNTER_LEN = len(_SAVE_FLAGS) + COUNTER_LEN + len(_RESTORE_FLAGS)


def saved_counter_bytes(at: int, counter: int) -> bytes:
    """``lock inc qword [counter]`` at ``at`` with rflags saved and restored around it,
    for a place where the flags ``inc`` writes may be live: the stack pointer first
    steps over the 128-byte red zone (``lea`` writes no flag), so the code there
    keeps its red zone and every flag."""
    inc = counter_bytes(at + len(_SAVE_FLAGS), counter)
    return _SAVE_FLAGS + inc + _RESTORE_FLAGS


def block_counter_bytes(at: int, counter: int, flags_dead: bool) -> bytes:
    """The increment to place at ``at``: the plain one where the flags are dead, the
    saved one otherwise (:func:`counter_len` bytes, whatever ``at``)."""
    return counter_bytes(at, counter) if flags_dead else saved_counter_bytes(at, counter)


def counter_len(flags_dead: bool) -> int:
    return COUNTER_LEN if flags_dead else SAVED_COUNTER_LEN


def counter_bytes(at: int, counter: int) -> bytes:
    """``lock inc qword [counter]`` placed at ``at`` (RIP-relative; OutOfRange if
    ``counter`` is beyond rel32 reach of it)."""
    w = X86Writer(at)
    w.put_lock_inc_rip(counter)
    return w.finish()


def counting_entry(at: int, counter: int, entry: int) -> bytes:
    """A counting entry placed at ``at``: ``lock inc qword [counter]``, ``jmp entry``
    (a copy's entry).  Only where :func:`inc_flags_dead` holds at the site whose patch
    targets it."""
    w = X86Writer(at)
    w.put_lock_inc_rip(counter)
    w.put_jmp(entry)
    return w.finish()


@dataclass(frozen=True)
class Trampoline:
    """A counting trampoline for the point ``site``: ``code`` to place at ``at``."""

    site: int
    at: int
    code: bytes
    #: Bytes of original code from ``site`` that it stands for (the patch covers 5).
    covered: int
    #: (address in ``code``, original target) of each branch back to original code.
    exits: tuple[tuple[int, int], ...] = ()


#: What a trampoline relocates: code that neither calls nor leaves by an indirect
#: branch, so it never leaves a return address or an unknown exit behind.
_TRAMPOLINE_KINDS = {Kind.COPY, Kind.RIPREL, Kind.JCC, Kind.JMP}


def counting_trampoline(code: bytes, site: int, at: int, counter: int,
                        relocator: Relocator | None = None) -> Trampoline:
    """The trampoline for the progress point ``site`` whose original bytes from there
    are ``code``: the counter's increment, the whole instructions that the 5-byte
    patch at ``site`` overwrites (relocated to follow it) and a ``jmp`` to the next
    original instruction.  Every branch in it leaves to original code.
    CannotRelocate if the flags ``inc`` writes are not dead at ``site``, if those
    instructions cannot be relocated here, or if one of them branches into the bytes
    the patch overwrites."""
    if not inc_flags_dead(code, site):
        raise CannotRelocate(f"flags live at {site:#x}: no counter there")
    head = counter_bytes(at, counter)
    tail, n, exits = relocate_site(code, site, at + len(head), relocator)
    return Trampoline(site, at, head + tail, n, exits)


def relocate_site(code: bytes, site: int, at: int, relocator: Relocator | None = None
                  ) -> tuple[bytes, int, tuple[tuple[int, int], ...]]:
    """The whole instructions from ``site`` (original bytes ``code``) that a 5-byte
    patch there overwrites, relocated to ``at``, then a ``jmp`` to the next original
    instruction (unless they end in a ``jmp``): (bytes, original bytes covered,
    (address, original target) of each branch back).  CannotRelocate if one of them
    calls, returns or branches indirectly, or branches into the patched bytes."""
    rel = relocator or Relocator()
    out = bytearray()
    exits: list[tuple[int, int]] = []
    n = 0
    ended = False
    while n < JMP_LEN:
        insn = rel.decode(code[n:], site + n)
        kind = rel.classify(insn)
        if kind not in _TRAMPOLINE_KINDS:
            raise CannotRelocate(f"{insn.mnemonic} at {insn.address:#x} in a counting "
                                 f"trampoline")
        if kind in (Kind.JCC, Kind.JMP) and \
                site < insn.operands[0].imm < site + max(JMP_LEN, n + insn.size):
            raise CannotRelocate(f"branch at {insn.address:#x} into the patched bytes")
        r = rel.relocate_insn(code[n:n + insn.size], site + n, at + len(out))
        exits += [(at + len(out) + f.insn_off, f.orig_target) for f in r.exits]
        out += r.code
        n += insn.size
        if kind is Kind.JMP:
            if n < JMP_LEN:
                raise CannotRelocate(f"{site:#x}: a jmp ends the code before the patch's "
                                     f"{JMP_LEN} bytes")
            ended = True
            break
    if not ended:
        w = X86Writer(at + len(out))
        w.put_jmp(site + n)
        exits.append((at + len(out), site + n))
        out += w.finish()
    return bytes(out), n, tuple(exits)
