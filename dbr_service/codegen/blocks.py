"""One block of a super-region translated for its place in the code buffer.

Each instruction goes through the :class:`~dbr_service.codegen.relocate.Relocator`;
the terminator is rewritten so that every in-region transfer reaches the in-buffer copy
of its target and everything else exits with ``jmp rel32`` to the original address
(:mod:`~dbr_service.codegen.emit` places the blocks and the data):

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

A block comes out as pieces, each standing for one original instruction (the address
map, transfer and eviction points are made from them).

In a region's counting phase (a :class:`CountPlan`) every counted block starts with
the increment of its counter, and a ``jcc`` block counts the side it does not jump to
right after the ``jcc``: block entries and those sides give every edge's count exactly
(docs/decisions/0041-exact-counts.md).  The increments are no transfer or eviction
points (a thread moved in starts after one; one with the flags saved has rsp moved).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TypeVar

import capstone

from dbr_service.codegen import tables as jtables
from dbr_service.codegen.calls import encode_promoted
from dbr_service.codegen.counting import block_counter_bytes, inc_flags_dead
from dbr_service.codegen.dispatch import DispatchPlan, encode_dispatch, region_dispatch_plan
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
from dbr_service.codegen.x86 import X86Writer
from dbr_service.common.errors import CodegenError
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
class Piece:
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


class Dispatches:
    """The region's translated dispatches (codegen/dispatch.py), and two ways to save
    instructions around them:

    * ``fused``: a dispatch whose only way in is the fall-through from the block ending
      in its ``add R, B`` takes that add over (that block's copy leaves it out, the
      dispatch needs no ``sub R, B``);
    * ``prefixed``: a target block whose only way in is the dispatch starts its copy
      with the dispatch's ``add R, B``, and the dispatch's slot names that copy (no
      stub, one jump less per dispatch).

    ``plan_of(sr, key)`` is the plan of block ``key``'s dispatch, or None."""

    def __init__(self, sr: SuperRegion,
                 plan_of: Callable[[SuperRegion, NodeKey], DispatchPlan | None]) -> None:
        self.plan: dict[NodeKey, DispatchPlan] = {}
        self.fused: dict[NodeKey, NodeKey] = {}        # block giving up its add -> dispatch
        self.prefixed: dict[NodeKey, NodeKey] = {}     # target block -> its dispatch
        for k, bb in sr.blocks():
            p = plan_of(sr, k) if bb.term is TermKind.IJMP else None
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


@dataclass
class CountPlan:
    """Counters of a region in its counting phase (data-buffer addresses)."""

    #: Block -> the counter of its entries.
    blocks: dict[NodeKey, int] = field(default_factory=dict)
    #: ``jcc`` block -> the counter of the side its copy does not jump to.
    sides: dict[NodeKey, int] = field(default_factory=dict)


class BlockEmitter:
    """Emits one block's pieces given the addresses of all blocks."""

    def __init__(self, sr: SuperRegion, reloc: Relocator,
                 addr_of: Callable[[NodeKey], int],
                 exit_to: Callable[[int], int] = lambda t: t,
                 tables: dict[NodeKey, int] | None = None,
                 plans: Dispatches | None = None,
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
        #: Call blocks kept as real calls (emit.real_call_sites).
        self.real_calls = real_calls
        #: Indirect call blocks with promoted targets (emit.promoted_call_sites), and
        #: the data slot of each promoted target compared through one.
        self.promoted = promoted or {}
        self.target_slot = target_slot
        #: Data slot holding a call's original return address (push qword [rip+slot]).
        self.ret_slot = ret_slot
        #: Data address of each translated dispatch's tables (None: sizing pass).
        self.tables = tables
        self.plans = plans or Dispatches(sr, region_dispatch_plan)
        #: Translated dispatches met: block -> (plan, miss address, slot of each target).
        self.dispatches: dict[NodeKey, tuple[DispatchPlan, int, dict[int, int]]] = {}
        #: Counters of a counting region (None: none), and per ``jcc`` block met, the
        #: original address of the side its ``sides`` counter counts.
        self.counting: CountPlan | None = None
        self.counted_sides: dict[NodeKey, int] = {}

    def succ(self, key: NodeKey, kinds: set[EdgeKind]) -> dict[int, NodeKey]:
        out = {}
        for _, v, d in self.sr.g.out_edges(key, data=True):
            if v != END and d.get("kind") in kinds:
                out.setdefault(self.sr.block(v).start, v)
        return out

    def tmap(self, succ: dict[int, NodeKey]) -> Callable[[int], int | None]:
        return lambda t: self.addr_of(succ[t]) if t in succ else None

    def emit(self, key: NodeKey, at: int, nxt: NodeKey | None) -> list[Piece]:
        bb = self.sr.block(key)
        flow = self.succ(key, {EdgeKind.FLOW, EdgeKind.FALLTHROUGH})
        self._at, self._pieces, self._key = at, [], key
        term = bb.term
        plan = self.plans.plan.get(key)
        body = bb.insns if term in (TermKind.FALLTHROUGH, TermKind.STOP, TermKind.HALT) \
            else bb.insns[:-2] if plan is not None and not plan.split else bb.insns[:-1]
        if key in self.plans.fused:
            body = body[:-1]                    # its add is done by the dispatch after it
        if self.counting is not None and key in self.counting.blocks:
            self._count(self.counting.blocks[key], bb.start,
                        inc_flags_dead(bb.data, bb.start))
        if key in self.plans.prefixed:          # the one dispatch into it: its add first
            j = self.plans.prefixed[key]
            jp = self.plans.plan[j]
            self._add(Piece(jp.add, jp.jmp_addr))
        for a, n in body:
            j = self.jtab_loads.get((key, a))
            if j is None:
                self._reloc(bb, a, n, flow)
            else:       # reads the table copy; no transfer point, as the jump after it
                ld = next(x for x in self.jtabs[j].loads if x.addr == a)
                data = None if self.jtab_at is None else self.jtab_at[j]
                self._add(Piece(jtables.encode_load(self.jtabs[j], ld, data), a))
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
            self._add(Piece(jtables.encode_jump(p, data), last_addr, dynamic=[0]))
        elif term is TermKind.IJMP:
            targets = bb.targets if len(bb.targets) <= MAX_CASCADE_TARGETS else ()
            self._reloc(bb, last_addr, last_size, flow, ijmp=targets,
                        abi_entry=self._plt_entry(key, bb))
        elif term is not TermKind.HALT:
            raise CodegenError(f"unknown terminator {term!r}")
        return self._pieces

    # ---- pieces ---------------------------------------------------------------------
    def _count(self, counter: int, orig: int, flags_dead: bool) -> None:
        self._add(Piece(block_counter_bytes(self._at, counter, flags_dead), orig))

    def _add(self, p: Piece) -> None:
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
        self._add(Piece(r.code, a, r.fixups, r.dynamic_exits, whole=True))

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
        self._add(Piece(c[:dc.table_jmp], add))
        self._add(Piece(c[dc.table_jmp:dc.miss_at], plan.jmp_addr))
        self._add(Piece(c[dc.miss_at:dc.exit_at], add))
        self._add(Piece(c[dc.exit_at:plan.head_size], plan.jmp_addr, dynamic=[0]))
        for t in dc.stubs:
            assert self._at == at + dc.stubs[t]
            self._add(Piece(plan.add, add))
            self._jump(t, flow, plan.jmp_addr)

    def _jump(self, t: int, succ: dict[int, NodeKey], orig: int) -> None:
        v = succ.get(t)
        dst = self.exit_to(t) if v is None else self.addr_of(v)
        w = X86Writer(self._at)
        f = self._encode(lambda: w.put_jmp(dst))
        self._add(Piece(bytes(w.code), orig, [Fixup(0, f, dst, t, v is None)]))

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
            self._count_side(a, ft, flow)
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
        self._add(Piece(bytes(w.code), a, [Fixup(0, f, dst, t, v is None)], whole=True))
        self._count_side(a, ft, flow)
        self._goto(ft, flow, nxt, a)

    def _count_side(self, a: int, ft: int, flow: dict[int, NodeKey]) -> None:
        """In a counting region: count the side ``ft`` a ``jcc`` at ``a`` did not jump to."""
        key = self._key
        if self.counting is not None and key in self.counting.sides:
            vf = flow.get(ft)
            dead = vf is not None and inc_flags_dead(self.sr.block(vf).data, ft)
            self._count(self.counting.sides[key], a, dead)
            self.counted_sides[key] = ft

    def _call(self, bb, key, a: int, n: int, nxt) -> None:
        callee = self._insn(bb, a).operands[0].imm
        calls = self.succ(key, {EdgeKind.CALL})
        w = X86Writer(self._at)
        fixups = put_push_return(w, a + n, self.ret_slot(a + n))
        self._add(Piece(bytes(w.code), a, fixups, whole=True))
        self._goto(callee, calls, nxt, a)

    def _real_call(self, bb, a: int, n: int, flow, nxt) -> None:
        """``call rel32`` to the original callee, then on at the continuation (the
        jump there, if any, stands for the continuation in the maps)."""
        callee = self._insn(bb, a).operands[0].imm
        dst = self.call_to(callee)
        w = X86Writer(self._at)
        f = self._encode(lambda: w.put_call(dst))
        self._add(Piece(bytes(w.code), a, [Fixup(0, f, dst, callee, True)], whole=True,
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
            self._add(Piece(p.code, cont if p.role == "cont" else a, p.fixups, whole=i == 0,
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
        self._add(Piece(ret_adjust(imm), a))
        self._goto(cont, rets, nxt, a)

    def _continuation(self, key: CloneKey) -> int | None:
        """Original return address of the inlined call a clone belongs to."""
        call = key.path[-1]
        for _, bb in self.sr.blocks():
            la, ls = bb.last_insn
            if la == call and bb.term in (TermKind.CALL, TermKind.ICALL):
                return la + ls
        return None
