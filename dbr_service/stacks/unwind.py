"""Unwinding call-stack samples in the service: ``.eh_frame`` first, frame pointers after.

A sample (sampling/stacks.py) gives a thread's rip, rsp, rbp, a copy of its stack from
rsp up, and the kernel's frame-pointer chain.  :class:`Unwinder` turns it into the
thread's frames, innermost first, each an *original* address: the IP, then for every
caller the address of its call (return address - 1), replacement code mapped back to
the original instruction it stands for (``attribute``), so a patched and an unpatched
program give the same stacks.  Region code carries the unwind rows of the original
instructions it translates (codegen/frames.py), so a replacement-code frame unwinds
with the original module's row at the original address.  A sampled IP inside a
translation that moved rsp on its way (a dispatch's red-zone step and saved scratch
registers) first has rsp set back to the original's (``sp_offset``,
codegen/spoffset.py); where that offset is unknown the stack ends there, truncated.

Per frame, the module's CFI row at that address gives the canonical frame address
(CFA = rsp or rbp + offset), the return address (saved at CFA + n) and the caller's
rbp; rsp of the caller is the CFA.  Anything else stops the walk and marks the stack
*truncated*: a CFA from another register or an expression other than the few forms
stubs use (cfa_expression; the PLT's), a signal frame, a read outside the stack
copy, a CFA that does not move up.
A return address rule ``undefined`` is the outermost frame (``_start``, a thread's
``clone``): the stack is complete.

Frame pointers are trusted only where the module keeps them (most of its FDEs define
the CFA by rbp, :meth:`Unwinder.keeps_frame_pointers`) or has no CFI at all (then they
are all there is): a frame-pointer chain through code built without them is garbage.
So a frame without CFI steps by rbp (``[rbp]``, ``[rbp+8]``) only in such a module;
when the stack copy ends before the stack does, the kernel's chain continues the
stack if it agrees with the frames found so far and only for as long as its frames are
in such modules; and a sample whose IP is in no module with CFI takes the kernel's
chain as it is.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Callable

from dbr_service.codegen.cfi import CfiError, evaluate
from dbr_service.codegen.frames import Module
from dbr_service.sampling.stacks import StackSample

#: DWARF register numbers of x86-64.
DW_RBP, DW_RSP, DW_RA = 6, 7, 16
#: Highest user-space address plus one (4-level paging).
USER_TOP = 1 << 47
MAX_DEPTH = 128
MASK64 = (1 << 64) - 1
#: Share of a module's FDEs defining the CFA by rbp above which its frame pointers
#: are trusted (functions too small for a frame have none even with
#: -fno-omit-frame-pointer).
FP_SHARE = 0.5


def cfa_expression(expr: bytes, regs: dict[int, int | None]) -> int | None:
    """Evaluate a CFA expression of the few operations compilers and linkers emit for
    x86-64 stubs (the PLT's ``rsp + 8 + ((rip & 15) >= 11) << 3``): DW_OP_bregN of a
    known register, DW_OP_litN, const1u, and, ge, shl, plus, plus_uconst, minus.
    None for anything else or a register not known."""
    st: list[int] = []
    i, n = 0, len(expr)
    try:
        while i < n:
            op = expr[i]
            i += 1
            if 0x70 <= op <= 0x8F:                      # DW_OP_bregN sleb
                val, i = _sleb(expr, i)
                reg = regs.get(op - 0x70)
                if reg is None:
                    return None
                st.append((reg + val) & MASK64)
            elif 0x30 <= op <= 0x4F:                    # DW_OP_litN
                st.append(op - 0x30)
            elif op == 0x08:                            # DW_OP_const1u
                st.append(expr[i])
                i += 1
            elif op == 0x23:                            # DW_OP_plus_uconst uleb
                val, i = _uleb(expr, i)
                st.append((st.pop() + val) & MASK64)
            elif op in (0x1A, 0x2A, 0x24, 0x22, 0x1C):
                b, a = st.pop(), st.pop()
                st.append({0x1A: a & b, 0x2A: int(a >= b), 0x24: (a << b) & MASK64,
                           0x22: (a + b) & MASK64, 0x1C: (a - b) & MASK64}[op])
            else:
                return None
    except IndexError:
        return None
    return st[-1] if len(st) == 1 else None


def _uleb(b: bytes, i: int) -> tuple[int, int]:
    val = shift = 0
    while True:
        byte = b[i]
        i += 1
        val |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return val, i


def _sleb(b: bytes, i: int) -> tuple[int, int]:
    val, j = _uleb(b, i)
    bits = 7 * (j - i)
    return (val - (1 << bits) if val & (1 << (bits - 1)) else val), j


@dataclass(frozen=True, slots=True)
class Unwound:
    """A sample's frames (original addresses, innermost first) and how they were found:
    ``cfi``, ``fp`` (the kernel's chain or rbp steps only), ``mixed``."""

    frames: tuple[int, ...]
    truncated: bool
    method: str


class _Step:
    END = "end"          # outermost frame: the stack is complete


class Unwinder:
    """Unwinds samples of one client.  ``module_at(addr)`` gives the module holding an
    address with its ``.eh_frame`` (frames.CfiSource.module_at; CfiError when there is
    none); ``attribute(addr)`` maps a replacement-code address to its original one;
    ``sp_offset(ip)`` is rsp at a sampled IP less the original's rsp at the instruction
    it stands for (0 in original code, None when unknown)."""

    def __init__(self, module_at: Callable[[int], Module],
                 attribute: Callable[[int], int] = lambda a: a,
                 max_depth: int = MAX_DEPTH, *,
                 sp_offset: Callable[[int], int | None] = lambda a: 0) -> None:
        self.module_at = module_at
        self.attribute = attribute
        self.sp_offset = sp_offset
        self.max_depth = max_depth
        self._tables: dict[tuple[str, int], object] = {}
        self._fp: dict[str, bool] = {}
        self.stats = {"cfi_frames": 0, "fp_frames": 0, "chain_frames": 0}

    # -- modules ---------------------------------------------------------------------

    def _module(self, addr: int) -> Module | None:
        try:
            return self.module_at(addr)
        except CfiError:
            return None

    def keeps_frame_pointers(self, mod: Module | None) -> bool:
        """Whether rbp chains can be trusted through ``mod`` (None: no CFI at all)."""
        if mod is None or not mod.eh.fdes:
            return True
        got = self._fp.get(mod.path)
        if got is None:
            fdes = [f for f in mod.eh.fdes if f.end - f.start >= 16]
            by_rbp = 0
            for f in fdes:
                # DW_CFA_def_cfa_register rbp (0x0d 0x06) or def_cfa rbp,n (0x0c 0x06)
                prog = f.instructions
                if b"\x0d\x06" in prog or b"\x0c\x06" in prog:
                    by_rbp += 1
            got = bool(fdes) and by_rbp >= FP_SHARE * len(fdes)
            self._fp[mod.path] = got
        return got

    def _row(self, mod: Module, addr: int):
        fde = mod.eh.find(addr - mod.bias)
        if fde is None or fde.cie.signal:     # a signal frame: registers in a ucontext
            return None
        key = (mod.path, fde.addr)
        table = self._tables.get(key)
        if table is None:
            if len(self._tables) > 4096:
                self._tables.clear()
            try:
                table = evaluate(fde)
            except CfiError:
                table = False
            self._tables[key] = table
        return table.row_at(addr - mod.bias) if table else None

    # -- one sample --------------------------------------------------------------------

    def unwind(self, s: StackSample) -> Unwound:
        stack, base = s.stack, s.sp

        def read(addr: int) -> int | None:
            if base is None or addr < base or addr + 8 > base + len(stack):
                return None
            return struct.unpack_from("<Q", stack, addr - base)[0]

        leaf_mod = self._module(self.attribute(s.ip))
        if leaf_mod is None or base is None or not stack:
            # no CFI for the IP (JIT code, the vdso...) or no registers: the kernel's
            # chain is all there is
            frames = self._chain_frames(s.chain or (s.ip,), 0)
            self.stats["chain_frames"] += len(frames)
            return Unwound(tuple(frames), len(frames) >= self.max_depth, "fp")
        frames: list[int] = []
        raws: list[int] = []          # the raw return addresses found, for the chain
        pc, sp, bp = s.ip, s.sp, s.bp
        used_fp = False
        moved = self.sp_offset(s.ip)
        if moved is None:             # inside a translation whose rsp is not known
            return Unwound((self.attribute(s.ip),), True, "cfi")
        sp -= moved
        while len(frames) < self.max_depth:
            look = pc if not frames else pc - 1
            orig = self.attribute(look)
            frames.append(orig)
            mod = self._module(orig)
            row = self._row(mod, orig) if mod is not None else None
            if row is not None:
                # a rip-relative CFA (the PLT's) reads the original's rip
                rip = pc if orig == look else orig
                step = self._cfi_step(row, rip, sp, bp, read)
                if step is _Step.END:
                    return Unwound(tuple(frames), False, "mixed" if used_fp else "cfi")
                self.stats["cfi_frames"] += step is not None
            elif self.keeps_frame_pointers(mod) and bp is not None and bp >= sp:
                ra, saved = read(bp + 8), read(bp)
                step = None if ra is None else (ra, bp + 16, saved)
                used_fp = step is not None
                self.stats["fp_frames"] += used_fp
            else:
                step = None
            if step is None:
                break
            ra, cfa, bp = step
            if ra == 0:
                return Unwound(tuple(frames), False, "mixed" if used_fp else "cfi")
            if not 4096 <= ra < USER_TOP or cfa <= sp:
                break
            raws.append(ra)
            pc, sp = ra, cfa
        else:
            return Unwound(tuple(frames), True, "mixed" if used_fp else "cfi")
        more = self._continue_with_chain(s.chain, raws, len(frames))
        if more:
            self.stats["chain_frames"] += len(more)
            return Unwound(tuple(frames + more), len(frames) + len(more) >= self.max_depth,
                           "mixed")
        return Unwound(tuple(frames), True, "mixed" if used_fp else "cfi")

    def _cfi_step(self, row, pc: int, sp: int, bp: int | None,
                  read: Callable[[int], int | None]):
        """(return address, CFA, caller's rbp) by ``row``; _Step.END at the outermost
        frame; None where the rules cannot be evaluated here."""
        cfa_rule = row.cfa
        if cfa_rule.expr is not None:
            cfa = cfa_expression(cfa_rule.expr, {DW_RSP: sp, DW_RBP: bp, DW_RA: pc})
            if cfa is None:
                return None
        else:
            basereg = {DW_RSP: sp, DW_RBP: bp}.get(cfa_rule.reg)
            if basereg is None:
                return None
            cfa = (basereg + cfa_rule.offset) & MASK64
        ra_rule = row.rule(DW_RA)
        if ra_rule is None:
            return None
        if ra_rule.kind == "undefined":
            return _Step.END
        if ra_rule.kind != "offset":
            return None
        ra = read(cfa + ra_rule.arg)
        if ra is None:
            return None
        bp_rule = row.rule(DW_RBP)
        if bp_rule is None or bp_rule.kind == "same":
            new_bp = bp
        elif bp_rule.kind == "offset":
            new_bp = read(cfa + bp_rule.arg)
        elif bp_rule.kind == "val_offset":
            new_bp = cfa + bp_rule.arg
        else:
            new_bp = None
        return ra, cfa, new_bp

    def _chain_frames(self, chain: tuple[int, ...], start: int) -> list[int]:
        """Frames from the kernel's chain from ``start`` on (entry 0 is the IP, the
        others return addresses), attributed, as far as its frames can be trusted."""
        out = []
        for i in range(start, min(len(chain), start + self.max_depth)):
            a = chain[i]
            if not 4096 <= a < USER_TOP:
                break
            orig = self.attribute(a if i == 0 else a - 1)
            out.append(orig)
            if i and not self.keeps_frame_pointers(self._module(orig)):
                break       # its caller's rbp may be anything: the chain ends here
        return out

    def _continue_with_chain(self, chain: tuple[int, ...], raws: list[int],
                             have: int) -> list[int]:
        """The kernel chain's frames beyond the CFI walk's last return address, when the
        chain holds the walk's return addresses in the same order."""
        if not raws or len(chain) <= len(raws):
            return []
        last = raws[-1]
        for j in range(1, len(chain)):
            if chain[j] == last and (len(raws) < 2 or chain[j - 1] == raws[-2]):
                if not self.keeps_frame_pointers(self._module(self.attribute(last - 1))):
                    return []
                return self._chain_frames(chain, j + 1)[:self.max_depth - have]
        return []
