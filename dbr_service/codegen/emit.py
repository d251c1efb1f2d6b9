"""Emission: a selected super-region -> replacement code for a buffer at ``base``.

Pure code generation (bytes in, bytes out).  Blocks are laid out by
:func:`~dbr_service.codegen.layout.compute_layout`; each block's instructions go through
the :class:`~dbr_service.codegen.relocate.Relocator`, and its terminator is rewritten so
that every in-region transfer reaches the in-buffer copy of its target and everything
else exits with ``jmp rel32`` to the original address:

* fall-through / STOP: a ``jmp rel32`` to the successor (in-buffer or original end
  address) unless the successor is laid out next.
* ``jmp``: dropped when its target is next, else ``jmp rel32``.
* ``jcc``: ``jcc rel32`` to the taken side, the fall-through side falls or jumps; when the
  taken side is laid out next the condition is inverted.  ``loop``-family: the relocator's
  expansion, then the fall-through side as for fall-through.
* ``call``: the pseudo-instruction (push original return address), then the inlined
  callee (a clone, falls in when next) or the original callee (an exit).  A call region
  selection kept as a *real call* (its site's ``decision`` is "call", region/inline.py)
  is ``call rel32`` to the original callee (its far-exit stub when out of reach), then
  the continuation (falls in when next, else a jump to its copy or an exit to it).
  The return address, the instruction after the ``call``, is mapped to the original
  continuation in the address map and the eviction map (``returns``); it may call a
  live copy of the callee instead (``call_target``, codegen/calls.py).
* ``ret`` in a clone: ``lea rsp,[rsp+8+imm]`` then the continuation (the RETURN edge's
  block, or an exit to the original continuation).  ``ret`` elsewhere is copied: it
  returns to its caller (a dynamic exit).
* indirect ``call`` kept with promoted targets (``decision`` "promoted"): a compare per
  target, a ``call rel32`` to the original target on a hit (returning into the buffer,
  mapped like a real call), an exit to the original call instruction on a miss
  (:mod:`~dbr_service.codegen.calls`; target slots go in the data).
* indirect ``jmp``/``call``: compare cascade over in-region targets, then the original
  indirect jmp as a dynamic exit.  A PC-relative jump-table dispatch (``add R, B; jmp
  R`` with a known table base) is translated instead: checked table look-ups, no
  cascade (:mod:`~dbr_service.codegen.dispatch`); its tables are data after the code.
  An absolute table jump ``jmp [T + idx*8]`` that region selection kept goes through
  a copy of its table in the data (:mod:`~dbr_service.codegen.tables`).
* HALT (hlt/ud2/int3): copied, nothing follows.

Far exits: an exit whose original target lies beyond rel32 reach of the code (a region
spanning two modules more than 2 GiB apart, e.g. a PLT call inlined into a shared
library) jumps to a stub after the last block, ``jmp [rip+slot]`` with the 8-byte
original address in a table after the stubs: no register, flag or stack byte changes
(a ``push``/``ret`` pair would write below rsp, into the red zone of the code it exits
to).  The table is data: :func:`check_generated` stops decoding at ``data_start``.

Two passes: sizes depend only on region membership (every branch is rel32), so pass one
measures blocks and collects the exit targets, addresses (with loop-head alignment and
the far-exit stubs) are fixed, and pass two encodes.
The output is decoded in full to check invariant 1 (no ``call`` but the real calls, each
exactly where it was recorded) and that the address map covers every instruction; every
rel32 is range-checked when encoded (invariant 4).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TypeVar

import capstone

from dbr_service.codegen import tables as jtables
from dbr_service.codegen.calls import call_resolver, encode_promoted, needs_slot, slot_table
from dbr_service.codegen.dispatch import (
    DispatchPlan,
    dispatch_data,
    encode_dispatch,
    region_dispatch_plan,
)
from dbr_service.codegen.layout import ALIGN, Layout, compute_layout
from dbr_service.codegen.relocate import (
    CannotRelocate,
    Fixup,
    Kind,
    Relocated,
    Relocator,
    jcc_condition,
    put_push_return,
    ret_adjust,
)
from dbr_service.codegen.x86 import CALL_LEN, X86Writer, nop_bytes
from dbr_service.errors import CodegenError
from dbr_service.region.model import (
    END,
    MAX_CASCADE_TARGETS,
    CloneKey,
    EdgeKind,
    NodeKey,
    SuperRegion,
    TermKind,
    fmt_node,
)

T = TypeVar("T")

#: ``endbr64``: the only instruction allowed before a PLT stub's jump.
ENDBR64 = bytes.fromhex("f30f1efa")

@dataclass
class GeneratedCode:
    """Replacement code of one super-region, ready for a code buffer at ``base``."""

    code: bytes
    base: int
    #: Original patch-site address -> replacement address (one per entry edge).
    entries: dict[int, int]
    #: (replacement start, replacement end, original instruction address), in address order.
    addr_map: list[tuple[int, int, int]]
    #: (replacement address of the exit branch, original target) for every static exit
    #: (a real call included: its callee is original code the region depends on).
    exits: list[tuple[int, int]]
    #: Replacement addresses of exits with run-time targets (indirect jmp, plain ret).
    dynamic_exits: list[int] = field(default_factory=list)
    #: Replacement address of each block.
    block_addr: dict[NodeKey, int] = field(default_factory=dict)
    #: The block order used.
    layout: list[NodeKey] = field(default_factory=list)
    #: Which order it is ("chains", "original" or "given", see codegen.layout).
    layout_kind: str = ""
    #: True: every rel32 reaches its target (emission raises otherwise).
    reach_ok: bool = True
    #: Original target -> its far-exit stub (targets beyond rel32 reach of the code).
    far_exits: dict[int, int] = field(default_factory=dict)
    #: Offset where data begins (the far-exit address table); None: all instructions.
    data_start: int | None = None
    #: Addresses reached by RIP-relative data operands (disp32: must stay in reach).
    data_refs: list[int] = field(default_factory=list)
    #: Transfer points: original instruction address -> replacement address where a
    #: thread stopped at that original address can continue with unchanged state
    #: (the start of that instruction's own, complete translation in a block that is
    #: not an inlined clone).  The agent's TRANSFER moves threads by this map.
    transfers: dict[int, int] = field(default_factory=dict)
    #: Eviction points, the other way: replacement address -> original instruction
    #: address where a thread stopped at that replacement address can continue in
    #: original code with unchanged state (the start of an instruction's own, complete
    #: translation, inlined clones included: their calls pushed the original return
    #: address, so the stack is the original's).  The agent's EVICT moves threads out
    #: of a removed or suspended region by this map.
    evictions: dict[int, int] = field(default_factory=dict)
    #: Real calls: replacement address of each ``call`` -> original call instruction.
    #: :func:`check_generated` allows a ``call`` at these addresses only.
    calls: dict[int, int] = field(default_factory=dict)
    #: Return addresses of the real calls (in the buffer) -> the original continuation
    #: (the original call's return address): where a thread returning there, or
    #: stopped there, continues in original code (also in ``evictions``).
    returns: dict[int, int] = field(default_factory=dict)
    #: Real calls to a live copy of their callee: ``call`` address -> the copy's entry.
    call_copies: dict[int, int] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return len(self.code)

    def orig_of(self, addr: int) -> int | None:
        """Original instruction address of a replacement address (sample attribution)."""
        for s, e, o in self.addr_map:
            if s <= addr < e:
                return o
        return None


@dataclass
class _Piece:
    """Bytes standing for one original instruction (or a synthetic jump after it)."""

    code: bytes
    orig: int
    fixups: list[Fixup] = field(default_factory=list)
    dynamic: list[int] = field(default_factory=list)
    #: The piece is the whole translation of the instruction at ``orig`` and starts
    #: with the state the original has before it (a transfer point, unless in a clone).
    whole: bool = False
    #: A real ``call``: the original return address it stands for.
    call_ret: int | None = None


class _Dispatches:
    """The region's translated dispatches (codegen/dispatch.py), and two ways to save
    instructions around them:

    * ``fused``: a dispatch whose only way in is the fall-through from the block ending
      in its ``add R, B`` takes that add over (that block's copy leaves it out, the
      dispatch needs no ``sub R, B``);
    * ``prefixed``: a target block whose only way in is the dispatch starts its copy
      with the dispatch's ``add R, B``, and the dispatch's slot names that copy (no
      stub, one jump less per dispatch)."""

    def __init__(self, sr: SuperRegion) -> None:
        self.plan: dict[NodeKey, DispatchPlan] = {}
        self.fused: dict[NodeKey, NodeKey] = {}        # block giving up its add -> dispatch
        self.prefixed: dict[NodeKey, NodeKey] = {}     # target block -> its dispatch
        for k, bb in sr.blocks():
            p = region_dispatch_plan(sr, k) if bb.term is TermKind.IJMP else None
            if p is not None:
                self.plan[k] = p
        for k, p in list(self.plan.items()):
            ins = list(sr.g.in_edges(k))
            if p.split and len(ins) == 1 and ins[0][0] not in self.plan:
                self.fused[ins[0][0]] = k
                self.plan[k] = replace(p, split=False)
        for k, p in self.plan.items():
            for _, v, d in sr.g.out_edges(k, data=True):
                if v == END or d.get("kind") not in (EdgeKind.FLOW, EdgeKind.FALLTHROUGH):
                    continue
                if sr.g.in_degree(v) == 1 and v not in self.plan and v not in self.fused \
                        and sr.block(v).start in p.targets:
                    self.prefixed[v] = k


class _BlockEmitter:
    """Emits one block's pieces given the addresses of all blocks."""

    def __init__(self, sr: SuperRegion, reloc: Relocator,
                 addr_of: Callable[[NodeKey], int],
                 exit_to: Callable[[int], int] = lambda t: t,
                 tables: dict[NodeKey, int] | None = None,
                 plans: _Dispatches | None = None,
                 ret_slot: Callable[[int], int | None] = lambda _r: None,
                 real_calls: frozenset[NodeKey] = frozenset(),
                 promoted: dict[NodeKey, tuple[int, ...]] | None = None,
                 target_slot: Callable[[int], int] = lambda _t: 0,
                 jtabs: dict[NodeKey, jtables.TablePlan] | None = None,
                 jtab_at: dict[NodeKey, int] | None = None) -> None:
        self.sr, self.reloc, self.addr_of, self.exit_to = sr, reloc, addr_of, exit_to
        #: Where a real call to an original callee goes (calls.call_resolver).
        self.call_to = exit_to
        #: Translated absolute table jumps (codegen/tables.py), their copies' addresses
        #: (None: sizing pass), and per jump met: (its address, target -> copy address).
        self.jtabs, self.jtab_at = jtabs or {}, jtab_at
        self.jtab_dests: dict[NodeKey, tuple[int, dict[int, int]]] = {}
        #: Register-form table loads (block, address) -> the block of their jump.
        self.jtab_loads = jtables.load_sites(self.jtabs)
        #: Call blocks kept as real calls (:func:`real_call_sites`).
        self.real_calls = real_calls
        #: Indirect call blocks with promoted targets (:func:`promoted_call_sites`), and
        #: the data slot of each promoted target compared through one.
        self.promoted = promoted or {}
        self.target_slot = target_slot
        #: Data slot holding a call's original return address (push qword [rip+slot]).
        self.ret_slot = ret_slot
        #: Data address of each translated dispatch's tables (None: sizing pass).
        self.tables = tables
        self.plans = plans or _Dispatches(sr)
        #: Translated dispatches met: block -> (plan, miss address, slot of each target).
        self.dispatches: dict[NodeKey, tuple[DispatchPlan, int, dict[int, int]]] = {}

    def succ(self, key: NodeKey, kinds: set[EdgeKind]) -> dict[int, NodeKey]:
        out = {}
        for _, v, d in self.sr.g.out_edges(key, data=True):
            if v != END and d.get("kind") in kinds:
                out.setdefault(self.sr.block(v).start, v)
        return out

    def tmap(self, succ: dict[int, NodeKey]) -> Callable[[int], int | None]:
        return lambda t: self.addr_of(succ[t]) if t in succ else None

    def emit(self, key: NodeKey, at: int, nxt: NodeKey | None) -> list[_Piece]:
        bb = self.sr.block(key)
        flow = self.succ(key, {EdgeKind.FLOW, EdgeKind.FALLTHROUGH})
        self._at, self._pieces = at, []
        term = bb.term
        plan = self.plans.plan.get(key)
        body = bb.insns if term in (TermKind.FALLTHROUGH, TermKind.STOP, TermKind.HALT) \
            else bb.insns[:-2] if plan is not None and not plan.split else bb.insns[:-1]
        if key in self.plans.fused:
            body = body[:-1]                    # its add is done by the dispatch after it
        if key in self.plans.prefixed:          # the one dispatch into it: its add first
            j = self.plans.prefixed[key]
            jp = self.plans.plan[j]
            self._add(_Piece(jp.add, jp.jmp_addr))
        for a, n in body:
            j = self.jtab_loads.get((key, a))
            if j is None:
                self._reloc(bb, a, n, flow)
            else:       # reads the table copy; no transfer point, as the jump after it
                ld = next(x for x in self.jtabs[j].loads if x.addr == a)
                data = None if self.jtab_at is None else self.jtab_at[j]
                self._add(_Piece(jtables.encode_load(self.jtabs[j], ld, data), a))
        last_addr, last_size = bb.insns[-1]
        if term in (TermKind.FALLTHROUGH, TermKind.STOP):
            ft = bb.fallthrough if term is TermKind.FALLTHROUGH and bb.fallthrough is not None \
                else bb.end
            self._goto(ft, flow, nxt, last_addr)
        elif term is TermKind.JMP:
            t = self._insn(bb, last_addr).operands[0].imm
            if flow.get(t) != nxt or nxt is None:
                self._reloc(bb, last_addr, last_size, flow)
        elif term is TermKind.JCC:
            self._jcc(bb, last_addr, last_size, flow, nxt)
        elif term is TermKind.CALL and key in self.real_calls:
            self._real_call(bb, last_addr, last_size, flow, nxt)
        elif term is TermKind.CALL:
            self._call(bb, key, last_addr, last_size, nxt)
        elif term is TermKind.ICALL and key in self.promoted:
            self._promoted_call(bb, last_addr, flow, nxt, self.promoted[key])
        elif term is TermKind.ICALL:
            calls = self.succ(key, {EdgeKind.CALL})
            self._reloc(bb, last_addr, last_size, calls, ijmp=bb.targets)
        elif term is TermKind.RET:
            self._ret(bb, key, last_addr, last_size, nxt)
        elif plan is not None:
            self._dispatch(key, plan, flow)
        elif key in self.jtabs:
            # no transfer point: a thread must come through the bounding ``and``
            p = self.jtabs[key]
            data = None if self.jtab_at is None else self.jtab_at[key]
            self.jtab_dests[key] = (self._at, {t: self.addr_of(v) for t, v in flow.items()})
            self._add(_Piece(jtables.encode_jump(p, data), last_addr, dynamic=[0]))
        elif term is TermKind.IJMP:
            targets = bb.targets if len(bb.targets) <= MAX_CASCADE_TARGETS else ()
            self._reloc(bb, last_addr, last_size, flow, ijmp=targets,
                        abi_entry=self._plt_entry(key, bb))
        elif term is not TermKind.HALT:
            raise CodegenError(f"unknown terminator {term!r}")
        return self._pieces

    # ---- pieces ---------------------------------------------------------------------
    def _add(self, p: _Piece) -> None:
        self._pieces.append(p)
        self._at += len(p.code)

    def _insn(self, bb, addr: int) -> capstone.CsInsn:
        off = addr - bb.start
        return self.reloc.decode(bb.data[off:off + 15], addr)

    def _plt_entry(self, key: NodeKey, bb) -> bool:
        """Whether ``key`` is a PLT stub inlined at a call: a clone entered only by call
        edges, made of ``[endbr64;] [bnd] jmp [rip+d]``.  Its jump runs at the callee's
        entry under the SysV ABI (the call went through the PLT, so the caller assumed
        nothing of the callee), where flags, r10 and r11 are dead."""
        if not isinstance(key, CloneKey) or not key.path:
            return False
        ins = self.sr.g.in_edges(key, data=True)
        if not ins or any(d.get("kind") != EdgeKind.CALL for _, _, d in ins):
            return False
        *head, (la, ln) = bb.insns
        off = la - bb.start
        jmp = bb.data[off:off + ln]
        if jmp.startswith(b"\xf2"):
            jmp = jmp[1:]
        return (len(jmp) == 6 and jmp[:2] == b"\xff\x25"
                and all(bb.data[a - bb.start:a - bb.start + n] == ENDBR64 for a, n in head))

    def _reloc(self, bb, a: int, n: int, succ: dict[int, NodeKey], *, ijmp=(),
               ret_target: int | None = None, abi_entry: bool = False) -> None:
        off = a - bb.start
        try:
            r: Relocated = self.reloc.relocate_insn(
                bb.data[off:off + n], a, self._at, target_map=self.tmap(succ),
                ret_target=ret_target, ijmp_targets=ijmp, exit_map=self.exit_to,
                abi_entry=abi_entry, ret_slot=self.ret_slot)
        except CannotRelocate as e:
            raise CodegenError(f"{self.sr.id}: block {fmt_node(bb.start)}: {e}") from e
        self._add(_Piece(r.code, a, r.fixups, r.dynamic_exits, whole=True))

    def _dispatch(self, key: NodeKey, plan: DispatchPlan, flow: dict[int, NodeKey]) -> None:
        """The translated ``add R, B; jmp R`` (see codegen/dispatch.py): checks and the
        table jump, the miss path, then a stub per target (``add R, B``, then the jump
        to the target's copy or an exit to the target)."""
        sizing = self.tables is None
        at = self._at
        data = at if sizing else self.tables[key]
        direct = {t: v for t, v in flow.items() if self.plans.prefixed.get(v) == key}
        try:
            dc = encode_dispatch(plan, at, data, [t for t in plan.targets if t not in direct],
                                 check=not sizing)
        except CannotRelocate as e:
            raise CodegenError(f"{self.sr.id}: dispatch at {plan.jmp_addr:#x}: {e}") from e
        slots = {t: at + off for t, off in dc.stubs.items()}
        slots.update((t, self.addr_of(v)) for t, v in direct.items())
        self.dispatches[key] = (plan, at + dc.miss_at, slots)
        c = dc.code
        # the add of a split plan is the previous block's: everything here is the jump's
        add = plan.jmp_addr if plan.split else plan.add_addr
        self._add(_Piece(c[:dc.table_jmp], add))
        self._add(_Piece(c[dc.table_jmp:dc.miss_at], plan.jmp_addr))
        self._add(_Piece(c[dc.miss_at:dc.exit_at], add))
        self._add(_Piece(c[dc.exit_at:plan.head_size], plan.jmp_addr, dynamic=[0]))
        for t in dc.stubs:
            assert self._at == at + dc.stubs[t]
            self._add(_Piece(plan.add, add))
            self._jump(t, flow, plan.jmp_addr)

    def _jump(self, t: int, succ: dict[int, NodeKey], orig: int) -> None:
        v = succ.get(t)
        dst = self.exit_to(t) if v is None else self.addr_of(v)
        w = X86Writer(self._at)
        f = self._encode(lambda: w.put_jmp(dst))
        self._add(_Piece(bytes(w.code), orig, [Fixup(0, f, dst, t, v is None)]))

    def _goto(self, t: int, succ: dict[int, NodeKey], nxt: NodeKey | None, orig: int) -> None:
        """Continue at original address ``t``: fall into the next block or jump."""
        if nxt is None or succ.get(t) != nxt:
            self._jump(t, succ, orig)

    def _encode(self, f: Callable[[], T]) -> T:
        try:
            return f()
        except CannotRelocate as e:
            raise CodegenError(f"{self.sr.id}: {e}") from e

    def _jcc(self, bb, a: int, n: int, flow, nxt) -> None:
        insn = self._insn(bb, a)
        ft = bb.fallthrough if bb.fallthrough is not None else a + n
        if self.reloc.classify(insn) is Kind.LOOP:
            self._reloc(bb, a, n, flow)
            self._goto(ft, flow, nxt, a)
            return
        t = insn.operands[0].imm
        cc = jcc_condition(insn)
        vt, vf = flow.get(t), flow.get(ft)
        if nxt is not None and vt == nxt and vf != nxt:
            cc, t, ft = cc ^ 1, ft, t                       # invert: fall into the taken side
        elif vt is None and vf is not None and vf != nxt:
            # neither side next: the jcc goes to the side in the buffer (a loop's back
            # edge, rotated to the end by the layout), the jmp after it to the exit
            cc, t, ft = cc ^ 1, ft, t
        v = flow.get(t)
        dst = self.exit_to(t) if v is None else self.addr_of(v)
        w = X86Writer(self._at)
        f = self._encode(lambda: w.put_jcc(cc, dst))
        self._add(_Piece(bytes(w.code), a, [Fixup(0, f, dst, t, v is None)], whole=True))
        self._goto(ft, flow, nxt, a)

    def _call(self, bb, key, a: int, n: int, nxt) -> None:
        callee = self._insn(bb, a).operands[0].imm
        calls = self.succ(key, {EdgeKind.CALL})
        w = X86Writer(self._at)
        fixups = put_push_return(w, a + n, self.ret_slot(a + n))
        self._add(_Piece(bytes(w.code), a, fixups, whole=True))
        self._goto(callee, calls, nxt, a)

    def _real_call(self, bb, a: int, n: int, flow, nxt) -> None:
        """``call rel32`` to the original callee, then on at the continuation (the
        jump there, if any, stands for the continuation in the maps)."""
        callee = self._insn(bb, a).operands[0].imm
        dst = self.call_to(callee)
        w = X86Writer(self._at)
        f = self._encode(lambda: w.put_call(dst))
        self._add(_Piece(bytes(w.code), a, [Fixup(0, f, dst, callee, True)], whole=True,
                         call_ret=a + n))
        self._goto(a + n, flow, nxt, a + n)

    def _promoted_call(self, bb, a: int, flow, nxt, targets: tuple[int, ...]) -> None:
        """Compares, a ``call rel32`` per promoted target and the miss's exit to the
        call instruction (codegen/calls.py), then on at the continuation.  Only the
        first piece is a transfer point (the others run with changed flags, or rax and
        rsp); each call's return address is mapped to the continuation."""
        insn = self._insn(bb, a)
        cont = a + insn.size
        v = flow.get(cont)
        dst = self.exit_to(cont) if v is None else self.addr_of(v)
        parts = self._encode(lambda: encode_promoted(
            self.reloc, insn, self._at, targets, slot_of=self.target_slot,
            exit_to=self.exit_to, cont=(cont, dst, v is None), call_to=self.call_to))
        for i, p in enumerate(parts):
            self._add(_Piece(p.code, cont if p.role == "cont" else a, p.fixups, whole=i == 0,
                             call_ret=cont if p.role == "call" else None))
        self._goto(cont, flow, nxt, cont)

    def _ret(self, bb, key, a: int, n: int, nxt) -> None:
        if not isinstance(key, CloneKey) or not key.path:
            self._reloc(bb, a, n, {})                       # returns into original code
            return
        rets = self.succ(key, {EdgeKind.RETURN})
        cont = next(iter(rets)) if rets else self._continuation(key)
        if cont is None:
            self._reloc(bb, a, n, {})
            return
        insn = self._insn(bb, a)
        imm = insn.operands[0].imm if insn.operands else 0
        self._add(_Piece(ret_adjust(imm), a))
        self._goto(cont, rets, nxt, a)

    def _continuation(self, key: CloneKey) -> int | None:
        """Original return address of the inlined call a clone belongs to."""
        call = key.path[-1]
        for _, bb in self.sr.blocks():
            la, ls = bb.last_insn
            if la == call and bb.term in (TermKind.CALL, TermKind.ICALL):
                return la + ls
        return None


#: Bytes of one far-exit stub (``jmp [rip+disp32]``) and of its table slot.
FAR_STUB, FAR_SLOT = 6, 8
#: Reach with a margin for the instruction lengths around the measured addresses.
_REACH = (1 << 31) - 64


def _near(t: int, lo: int, hi: int) -> bool:
    """rel32 from anywhere in [lo, hi) reaches ``t``."""
    return abs(t - lo) < _REACH and abs(t - hi) < _REACH


def far_exit_bound(n_targets: int) -> int:
    """Most bytes the far-exit stubs and table of ``n_targets`` exit targets take."""
    return n_targets * (FAR_STUB + FAR_SLOT) + FAR_SLOT if n_targets else 0


def real_call_sites(sr: SuperRegion) -> frozenset[NodeKey]:
    """Direct call blocks region selection kept as real calls (``decision`` "call" in
    ``sr.info["inline"]["sites"]``)."""
    sites = sr.info.get("inline", {}).get("sites", {})
    return frozenset(k for k, s in sites.items() if s.get("decision") == "call"
                     and k in sr.g and sr.block(k).term is TermKind.CALL)


def promoted_call_sites(sr: SuperRegion) -> dict[NodeKey, tuple[int, ...]]:
    """Indirect call blocks region selection kept with promoted targets (``decision``
    "promoted"): block -> the targets, hottest first."""
    sites = sr.info.get("inline", {}).get("sites", {})
    return {k: tuple(s["targets"]) for k, s in sites.items() if s.get("decision") == "promoted"
            and k in sr.g and sr.block(k).term is TermKind.ICALL}


def emit_region(sr: SuperRegion, base: int, *, relocator: Relocator | None = None,
                layout: Layout | None = None, far_exits: bool = True,
                real_calls: bool = True,
                call_target: Callable[[int], int | None] | None = None) -> GeneratedCode:
    """Replacement code for ``sr`` placed at ``base`` (see the module docstring).
    ``call_target(callee)``: the entry of a live copy of ``callee`` that its real calls
    may go to instead (used when in rel32 reach), or None.
    ``far_exits=False``: an exit beyond rel32 reach is an error instead of a stub.
    ``real_calls=False``: the call blocks selection kept as real calls are emitted as
    the other calls that leave the region (the original return address pushed, a jump
    to the original callee), e.g. for a region whose CFI cannot be translated."""
    if len(sr) == 0:
        raise CodegenError(f"{sr.id}: empty region")
    reloc = relocator or Relocator()
    lay = layout or compute_layout(sr)
    nxt = lay.next_of()
    # pass 1: sizes (independent of addresses) and the static exit targets
    plans = _Dispatches(sr)
    jtabs = jtables.region_tables(sr)
    calls = real_call_sites(sr) if real_calls else frozenset()
    promoted = promoted_call_sites(sr) if real_calls else {}
    rets = _return_addresses(sr, calls | set(promoted))
    sizing = _BlockEmitter(sr, reloc, lambda _k: base, lambda _t: base, plans=plans,
                           ret_slot=lambda r: base if r in rets else None, real_calls=calls,
                           promoted=promoted, target_slot=lambda _t: base, jtabs=jtabs)
    sizes, targets = {}, set()
    for k in lay.order:
        pieces = sizing.emit(k, base, nxt[k])
        sizes[k] = sum(len(p.code) for p in pieces)
        targets |= {f.orig_target for p in pieces for f in p.fixups if f.exit}
    addr, block_addr, pads = base, {}, {}
    for k in lay.order:
        pads[k] = (-addr) % ALIGN if k in lay.aligned else 0
        addr += pads[k]
        block_addr[k] = addr
        addr += sizes[k]
    blocks_end = addr
    bound = blocks_end + far_exit_bound(len(targets))
    far = sorted(t for t in targets if not _near(t, base, bound)) if far_exits else []
    stub = {t: blocks_end + i * FAR_STUB for i, t in enumerate(far)}
    # dispatch tables go after the far-exit stubs and their table, 8-aligned
    data_at = blocks_end + len(far) * FAR_STUB
    data_at += (-data_at) % FAR_SLOT + len(far) * FAR_SLOT
    tables = {}
    for k in lay.order:
        if k in sizing.dispatches:
            tables[k] = data_at
            data_at += sizing.dispatches[k][0].data_size
    # then the copies of absolute jump tables (8-aligned; emitted whatever the base)
    data_at += (-data_at) % 8
    jtab_at = {}
    for k in lay.order:
        if k in jtabs:
            jtab_at[k] = data_at
            data_at += jtabs[k].data_size
    # then the return-address slots of the calls (8-aligned)
    data_at += (-data_at) % 8
    slots = {r: data_at + 8 * i for i, r in enumerate(rets)}
    data_at += 8 * len(rets)
    # then the promoted targets compared through a slot
    tslots = {t: data_at + 8 * i for i, t in enumerate(
        sorted({t for ts in promoted.values() for t in ts if needs_slot(t)}))}
    # pass 2: encode
    em = _BlockEmitter(sr, reloc, block_addr.__getitem__, lambda t: stub.get(t, t), tables,
                       plans, slots.get, calls, promoted, tslots.__getitem__, jtabs, jtab_at)
    em.call_to = call_resolver(em.exit_to, call_target, lambda c: _near(c, base, blocks_end))
    out = bytearray()
    gen = GeneratedCode(b"", base, {}, [], [], block_addr=block_addr, layout=list(lay.order),
                        layout_kind=lay.kind)
    ambiguous: set[int] = set()
    for k in lay.order:
        if pads[k]:
            gen.addr_map.append((base + len(out), base + len(out) + pads[k], sr.block(k).start))
            out += nop_bytes(pads[k])
        assert base + len(out) == block_addr[k]
        pieces = em.emit(k, block_addr[k], nxt[k])
        clone = sr.block(k).is_clone
        for p in pieces:
            at = base + len(out)
            if p.whole and p.code:
                gen.evictions[at] = p.orig
            if p.whole and not clone:
                if p.orig in gen.transfers:
                    ambiguous.add(p.orig)
                gen.transfers.setdefault(p.orig, at)
            if p.code:
                gen.addr_map.append((at, at + len(p.code), p.orig))
            gen.exits += [(at + f.insn_off, f.orig_target) for f in p.fixups if f.exit]
            gen.data_refs += [f.target for f in p.fixups if f.data]
            gen.dynamic_exits += [at + o for o in p.dynamic]
            if p.call_ret is not None:
                gen.calls[at] = p.orig
                gen.returns[at + CALL_LEN] = p.call_ret
                f = p.fixups[0]
                if f.target not in (f.orig_target, stub.get(f.orig_target)):
                    gen.call_copies[at] = f.target
            out += p.code
        if base + len(out) != block_addr[k] + sizes[k]:
            raise CodegenError(f"{sr.id}: block {fmt_node(k)} changed size between passes")
    for a in ambiguous:                 # copied twice: no one place to continue at
        del gen.transfers[a]
    # A thread at a return address has the original's state at its continuation,
    # whatever comes next in the buffer (a jump, padding, the continuation's copy).
    gen.evictions.update(gen.returns)
    if far:
        _far_stubs(gen, out, far, stub)
    if tables:
        _dispatch_tables(gen, out, em.dispatches, tables)
    for k, at in sorted(jtab_at.items(), key=lambda kv: kv[1]):
        jmp_at, dest = em.jtab_dests[k]
        _append_data(gen, out, at, jtables.table_data(jtabs[k], dest), "jump table copy")
        done = jtables.addressable(at, jtabs[k])
        gen.exits += [(jmp_at, t) for t in jtables.table_exits(jtabs[k], dest, done)]
    if slots:
        _return_slots(gen, out, slots)
    if tslots:
        _append_data(gen, out, min(tslots.values()), slot_table(tslots), "target slots")
    gen.code = bytes(out)
    for v, _c in ([] if sr.transfer_only else sr.entry_edges()):
        if isinstance(v, CloneKey):
            raise CodegenError(f"{sr.id}: entry edge into clone {fmt_node(v)}")
        gen.entries[sr.block(v).start] = block_addr[v]
    check_generated(gen, reloc)
    return gen


def _far_stubs(gen: GeneratedCode, out: bytearray, far: list[int], stub: dict[int, int]) -> None:
    """Append ``jmp [rip+slot]`` per far target, then the 8-aligned table of targets."""
    base = gen.base
    assert base + len(out) == stub[far[0]]
    table = base + len(out) + len(far) * FAR_STUB
    table += (-table) % FAR_SLOT
    for i, t in enumerate(far):
        w = X86Writer(base + len(out))
        w.put_jmp_rip(table + i * FAR_SLOT)
        assert w.offset == FAR_STUB
        gen.addr_map.append((w.base, w.pc, t))
        gen.far_exits[t] = w.base
        out += w.code
    gen.data_start = len(out)
    out += b"\xcc" * (table - (base + len(out)))
    for t in far:
        out += struct.pack("<Q", t)


def _append_data(gen: GeneratedCode, out: bytearray, at: int, data: bytes, what: str) -> None:
    """Append ``data`` at address ``at`` (where pass 2 encoded it), after int3 padding;
    the first data appended starts ``gen.data_start``."""
    if gen.data_start is None:
        gen.data_start = len(out)
    if gen.base + len(out) > at:
        raise CodegenError(f"{what} at {at:#x} overlaps code or data")
    out += b"\xcc" * (at - (gen.base + len(out)))
    out += data


def _dispatch_tables(gen: GeneratedCode, out: bytearray,
                     dispatches: dict[NodeKey, tuple[DispatchPlan, int, dict[int, int]]],
                     tables: dict[NodeKey, int]) -> None:
    """Append each translated dispatch's data at the address pass 2 encoded for it."""
    for k, at in sorted(tables.items(), key=lambda kv: kv[1]):
        plan, miss, slots = dispatches[k]
        _append_data(gen, out, at, dispatch_data(plan, miss, slots), "dispatch data")
        gen.data_refs.append(plan.base)        # the table jump's disp32 is from the base


def _return_addresses(sr: SuperRegion, real_calls: frozenset[NodeKey] | set[NodeKey]
                      = frozenset()) -> list[int]:
    """Original return addresses of the region's calls that ``push imm32`` cannot push
    (>= 2**31): each gets an 8-byte slot in the data (see relocate.put_push_return).  Real
    calls push nothing of ours."""
    rets = set()
    for k, bb in sr.blocks():
        if bb.term in (TermKind.CALL, TermKind.ICALL) and k not in real_calls:
            a, n = bb.last_insn
            if a + n >= 1 << 31:
                rets.add(a + n)
    return sorted(rets)


def _return_slots(gen: GeneratedCode, out: bytearray, slots: dict[int, int]) -> None:
    """Append the return-address slots (consecutive 8-byte words) at the address pass 2
    encoded for them."""
    order = sorted(slots.items(), key=lambda kv: kv[1])
    assert all(at == order[0][1] + 8 * i for i, (_, at) in enumerate(order))
    _append_data(gen, out, order[0][1], b"".join(struct.pack("<Q", r) for r, _ in order),
                 "return-address slots")


def check_generated(gen: GeneratedCode, reloc: Relocator | None = None) -> None:
    """Decode all of ``gen.code``: no ``call`` (invariant 1) but a ``call rel32`` at each
    recorded real call (``gen.calls``) to its callee (or its far stub, or the live copy
    ``gen.call_copies`` names), no undecodable bytes, every instruction inside one
    address-map range."""
    md = (reloc or Relocator()).md
    ranges = iter(gen.addr_map)
    cur = next(ranges, None)
    pos = 0
    code = gen.code if gen.data_start is None else gen.code[:gen.data_start]
    callee = {a: t for a, t in gen.exits if a in gen.calls}
    seen_calls = 0
    for insn in md.disasm(code, gen.base):
        if insn.id in (capstone.x86_const.X86_INS_CALL, capstone.x86_const.X86_INS_LCALL):
            t = callee.get(insn.address)
            if t is None or insn.bytes[0] != 0xE8 or insn.size != CALL_LEN or \
                    insn.operands[0].imm not in (t, gen.far_exits.get(t),
                                                 gen.call_copies.get(insn.address)):
                raise CodegenError(f"call in replacement code at {insn.address:#x}")
            seen_calls += 1
        while cur is not None and cur[1] <= insn.address:
            cur = next(ranges, None)
        if cur is None or not cur[0] <= insn.address < insn.address + insn.size <= cur[1]:
            raise CodegenError(f"instruction at {insn.address:#x} not covered by the map")
        pos += insn.size
    if pos != len(code):
        raise CodegenError(f"replacement code does not decode at {gen.base + pos:#x}")
    if seen_calls != len(gen.calls):
        raise CodegenError(f"{len(gen.calls)} real calls recorded, {seen_calls} decoded")


def perf_map_lines(gen: GeneratedCode, name: str) -> list[str]:
    """``/tmp/perf-PID.map`` lines (``START SIZE symbol``, hex) for the replacement code,
    one per run of replacement bytes standing for one original instruction."""
    lines = []
    runs: list[list[int]] = []
    for s, e, o in gen.addr_map:
        if runs and runs[-1][1] == s and runs[-1][2] == o:
            runs[-1][1] = e
        else:
            runs.append([s, e, o])
    for s, e, o in runs:
        lines.append(f"{s:x} {e - s:x} {name}@{o:#x}")
    return lines
