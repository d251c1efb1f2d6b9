"""Emission: a selected super-region -> replacement code for a buffer at ``base``.

Pure code generation (bytes in, bytes out).  Blocks are laid out by
:func:`~dbr_service.codegen.layout.compute_layout` and translated one by one
(:mod:`~dbr_service.codegen.blocks`): every in-region transfer reaches the in-buffer
copy of its target and everything else exits with ``jmp rel32`` to the original
address.  This module places the blocks and appends the data after them.

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
from dataclasses import dataclass, field

import capstone

from dbr_service.codegen import tables as jtables
from dbr_service.codegen.blocks import BlockEmitter, CountPlan, Dispatches
from dbr_service.codegen.calls import call_resolver, needs_slot, slot_table
from dbr_service.codegen.dispatch import DispatchPlan, dispatch_data, region_dispatch_plan
from dbr_service.codegen.layout import ALIGN, Layout, compute_layout
from dbr_service.codegen.relocate import Relocator
from dbr_service.codegen.x86 import CALL_LEN, X86Writer, nop_bytes
from dbr_service.common.errors import CodegenError
from dbr_service.region.model import CloneKey, NodeKey, SuperRegion, TermKind, fmt_node


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
    #: A counting region's counters (None: none), and per ``jcc`` block the original
    #: address of the side its side counter counts (codegen/blocks.py).
    counting: CountPlan | None = None
    counted_sides: dict[NodeKey, int] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return len(self.code)

    def orig_of(self, addr: int) -> int | None:
        """Original instruction address of a replacement address (sample attribution)."""
        for s, e, o in self.addr_map:
            if s <= addr < e:
                return o
        return None


class _Dispatches(Dispatches):
    """:class:`~dbr_service.codegen.blocks.Dispatches` as :func:`region_dispatch_plan`
    plans them (the name looked up in this module: tests replace it to turn the
    translation off)."""

    def __init__(self, sr: SuperRegion) -> None:
        super().__init__(sr, region_dispatch_plan)


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
                call_target: Callable[[int], int | None] | None = None,
                counting: CountPlan | None = None) -> GeneratedCode:
    """Replacement code for ``sr`` placed at ``base`` (see the module docstring).
    ``call_target(callee)``: the entry of a live copy of ``callee`` that its real calls
    may go to instead (used when in rel32 reach), or None.
    ``far_exits=False``: an exit beyond rel32 reach is an error instead of a stub.
    ``real_calls=False``: the call blocks selection kept as real calls are emitted as
    the other calls that leave the region (the original return address pushed, a jump
    to the original callee), e.g. for a region whose CFI cannot be translated.
    ``counting``: the counters of a region in its counting phase (codegen/blocks.py)."""
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
    sizing = BlockEmitter(sr, reloc, lambda _k: base, lambda _t: base, plans=plans,
                           ret_slot=lambda r: base if r in rets else None, real_calls=calls,
                           promoted=promoted, target_slot=lambda _t: base, jtabs=jtabs)
    sizing.counting = counting
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
    em = BlockEmitter(sr, reloc, block_addr.__getitem__, lambda t: stub.get(t, t), tables,
                       plans, slots.get, calls, promoted, tslots.__getitem__, jtabs, jtab_at)
    em.call_to = call_resolver(em.exit_to, call_target, lambda c: _near(c, base, blocks_end))
    em.counting = counting
    out = bytearray()
    gen = GeneratedCode(b"", base, {}, [], [], block_addr=block_addr, layout=list(lay.order),
                        layout_kind=lay.kind, counting=counting)
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
    gen.counted_sides = dict(em.counted_sides)
    if counting is not None:
        gen.data_refs += [*counting.blocks.values(), *counting.sides.values()]
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
