"""Translated absolute jump tables: a table dispatch that stays in replacement code.

Non-PIE code (and computed goto, e.g. Lua's ``luaV_execute``) dispatches with ::

    and  r32, M                   ; idx in [0, M]: the bound (M + 1 entries)
    jmp  qword [T + idx*8]        ; T: disp32, no base; the table in read-only memory

Left alone in replacement code the ``jmp`` is an exit at every dispatch, and with more
than a few targets no compare cascade is worth it (region/dispatch.py).  Translated,
the jump reads a copy ``T'`` of the table in the code buffer's data instead::

    jmp  qword [T' + idx*8]       ; the original instruction, only its disp32 changed

with ``T'[i]`` the replacement address of the block at ``T[i]`` when the region holds
that block as a successor of the dispatch, else ``T[i]`` itself: an exit to original
code (a value that is not code included, where the original jumps too).  The jump
writes no register, flag or memory, so every path reaches ``T[i]`` or its copy with
exactly the state the original has there; only RIP differs, and a copy entered at its
start with the original's state is equivalent to it (the graph's edges say which
copies exist).

The register form ``and idx, M; mov r, [T + idx*8]; jmp r`` is translated the same
way, in its load (``mov r, [T' + idx*8]``); ``r`` then holds the replacement address
instead of ``T[i]``, so the copy names a block only where ``r`` is dead: the block (and
the lone successors it jumps or falls to, :func:`_kills`) writes all of ``r`` before
any read, partial write or exit.  Every other entry keeps ``T[i]``: ``r`` is exact.

Conditions, each making ``T'[idx]`` the entry the original reads:

* the jump is ``[notrack|bnd] jmp qword [disp32 + idx*8]`` (no base, no segment or
  address-size prefix), or the load ``mov r64, qword [disp32 + idx*8]`` before a
  ``jmp r``, ``disp32 = T`` non-negative;
* the instruction right before the jump (load) is ``and idx32, M`` or ``and idx64,
  M`` with ``0 <= M`` (idx is then in ``[0, M]``), in the same block or, when the jump
  has a block of its own, ending every predecessor, each falling through into it; such
  a lone jump has no entry edge, and no patch may split the ``and`` from what follows
  (region/dispatch.py marks those blocks unpatchable: code entered there has no bound).
  The translated pieces are no transfer points, so a thread moved in always comes
  through the ``and``;
* ``T[0..M]`` lies in read-only memory and was read at selection time
  (:func:`record_tables`, kept in ``sr.info["tables"]``), as jump-table inference
  trusts read-only memory;
* ``T' + 8*(M+1) <= 2**31`` (a disp32 without base is sign-extended).  Where the
  buffer's data lies higher, the original instructions are emitted instead (an exit);
  both forms have the same size and the copy is emitted either way, so a region's
  size never depends on where it is placed (installation/optimize.py emits at a provisional address
  first).

Counted refusals (the partition pass's counters): an index without a mask right
before the load (``table-unbounded``), a table not in read-only memory
(``table-writable``), one that cannot be read (``table-unreadable``).
"""

from __future__ import annotations

import struct
from collections import Counter
from dataclasses import dataclass

import capstone
from capstone import x86 as X

from dbr_service.codegen.x86 import REG_NAMES, X86Writer
from dbr_service.common.errors import MemoryViewError
from dbr_service.region.jumptable import MAX_TABLE, _reg64, _reg_size
from dbr_service.region.model import END, BasicBlock, EdgeKind, NodeKey, SuperRegion, TermKind

#: ``T'`` and all its entries must lie below this (disp32 sign extension).
DATA_LIMIT = 1 << 31
#: Where :func:`record_tables` keeps the tables read, by the jump's address.
INFO_KEY = "tables"

_PREFIXES = (0x3E, 0xF2)        # notrack, bnd: no effect on the operand

_cs = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
_cs.detail = True


@dataclass(frozen=True)
class TableCopy:
    """A table as read at selection time: ``values[i]`` = ``T[i]``, and which are code."""

    table: int
    values: tuple[int, ...]
    code: frozenset[int]


@dataclass(frozen=True)
class Load:
    """An instruction that reads the table: its block, address, bytes, disp32 offset."""

    key: NodeKey
    addr: int
    raw: bytes
    disp_off: int


@dataclass(frozen=True)
class TablePlan:
    """How one dispatch block's table jump is translated: the memory form (``loads`` is
    the jump itself) or the register form (``loads`` are the ``mov r, [T + idx*8]``
    before ``jmp r``, one per predecessor of a lone jump)."""

    jmp_addr: int
    jmp: bytes                  #: the original jump
    loads: tuple[Load, ...]
    copy: TableCopy
    #: Register form: the register the jump goes through (a 64-bit name), and the
    #: targets whose block in the region writes it before reading it (only those are
    #: entered through the copy; the others exit with the original value).
    reg: str | None = None
    dead: frozenset[int] = frozenset()

    @property
    def entries(self) -> int:
        return len(self.copy.values)

    @property
    def data_size(self) -> int:
        return 8 * self.entries

    def enters(self, target: int) -> bool:
        """Whether the copy may name ``target``'s replacement block."""
        return self.reg is None or target in self.dead


def _modrm_sib_disp(raw: bytes, op: int, i: int) -> tuple[int, int, int, int] | None:
    """(ModRM reg field, SIB index, disp32 offset, T) of ``op /r`` with operand
    ``[disp32 + idx*8]`` at ``raw[i]`` (REX in ``raw[i-1]`` if any), else None."""
    rex = raw[i - 1] if i and 0x40 <= raw[i - 1] <= 0x4F else 0
    if len(raw) != i + 7 or raw[i] != op or raw[i + 1] & 0xC7 != 0x04:
        return None
    sib = raw[i + 2]
    if sib >> 6 != 3 or sib & 7 != 5:
        return None
    idx = (rex >> 1 & 1) << 3 | sib >> 3 & 7
    if idx == 4:                                    # SIB index 100 without REX.X: none
        return None
    t = struct.unpack_from("<i", raw, i + 3)[0]
    if t < 0:
        return None
    return (rex >> 2 & 1) << 3 | raw[i + 1] >> 3 & 7, idx, i + 3, t


def _skip_prefixes(raw: bytes) -> int:
    i = 0
    while i < len(raw) and raw[i] in _PREFIXES:
        i += 1
    if i < len(raw) and 0x40 <= raw[i] <= 0x4F:
        i += 1
    return i


def parse_table_jmp(raw: bytes) -> tuple[int, int, int] | None:
    """(index register, disp32 offset, T) of ``[notrack|bnd] jmp qword [T + idx*8]``
    (FF /4, mod 00, SIB base 101: disp32 and no base), else None."""
    m = _modrm_sib_disp(raw, 0xFF, _skip_prefixes(raw))
    if m is None or m[0] & 7 != 4:
        return None
    return m[1], m[2], m[3]


def parse_table_load(raw: bytes) -> tuple[int, int, int, int] | None:
    """(destination, index register, disp32 offset, T) of ``mov r64, qword [T +
    idx*8]`` (REX.W 8B /r, no other prefix), else None."""
    if not raw or raw[0] & 0xF8 != 0x48:
        return None
    return _modrm_sib_disp(raw, 0x8B, 1)


def _parse_jmp_reg(raw: bytes) -> int | None:
    """Register of ``[notrack|bnd] jmp r64`` (FF /4, mod 11), else None."""
    i = _skip_prefixes(raw)
    rex = raw[i - 1] if i and 0x40 <= raw[i - 1] <= 0x4F else 0
    if len(raw) != i + 2 or raw[i] != 0xFF or raw[i + 1] & 0xF8 != 0xE0 \
            or rex not in (0, 0x40, 0x41):
        return None
    return (rex & 1) << 3 | raw[i + 1] & 7


def _insn(bb: BasicBlock, i: int) -> tuple[int, bytes]:
    a, n = bb.insns[i]
    return a, bb.data[a - bb.start:a - bb.start + n]


def _and_bound(raw: bytes, addr: int, idx: int) -> int | None:
    """Entries ``and idx32/idx64, M`` (``0 <= M``) leaves the index within: M + 1."""
    insn = next(_cs.disasm(raw, addr, 1), None)
    if insn is None or insn.mnemonic != "and" or len(insn.operands) != 2:
        return None
    dst, src = insn.operands
    if dst.type != X.X86_OP_REG or src.type != X.X86_OP_IMM or _reg_size(dst.reg) < 4 \
            or _reg64(dst.reg) != REG_NAMES[idx] or not 0 <= src.imm < MAX_TABLE:
        return None
    return src.imm + 1


def _lone_preds(sr: SuperRegion, key: NodeKey) -> list[NodeKey] | None:
    """The predecessors of a lone jump when each falls through into it and there is no
    other way in (no entry edge), else None."""
    bb = sr.block(key)
    ins = list(sr.g.in_edges(key, data=True))
    if not ins:
        return None
    out = []
    for u, _, d in ins:
        if d.get("kind") is not EdgeKind.FALLTHROUGH or \
                not isinstance(sr.g.nodes[u].get("bb"), BasicBlock):
            return None
        pb = sr.block(u)
        if pb.term is not TermKind.FALLTHROUGH or pb.end != bb.start or not pb.insns:
            return None
        out.append(u)
    return out


def _site(sr: SuperRegion, key: NodeKey) -> tuple[int, list[Load], str | None] | None:
    """(entries the index is proven within, the loads, the register of a register-form
    jump) of block ``key``'s table jump, or None.  Each load is preceded by ``and idx,
    M`` in its block; a register-form load is right before the jump or ends every
    predecessor of a lone jump, as does the ``and`` of a lone memory-form jump."""
    bb = sr.block(key)
    if bb.term is not TermKind.IJMP or not bb.insns:
        return None
    ja, jraw = _insn(bb, -1)
    mem = parse_table_jmp(jraw)
    if mem is not None:
        idx, off, t = mem
        if len(bb.insns) >= 2:
            n = _and_bound(_insn(bb, -2)[1], bb.insns[-2][0], idx)
            return None if n is None else (n, [Load(key, ja, jraw, off)], None)
        preds = _lone_preds(sr, key)
        if preds is None:
            return None
        ns = [_and_bound(_insn(sr.block(u), -1)[1], sr.block(u).insns[-1][0], idx)
              for u in preds]
        if None in ns:
            return None
        return max(ns), [Load(key, ja, jraw, off)], None
    r = _parse_jmp_reg(jraw)
    if r is None or r == 4:
        return None
    if len(bb.insns) >= 3:
        holders = [(key, bb.insns[-2], bb.insns[-3])]
    elif len(bb.insns) == 1 and (preds := _lone_preds(sr, key)) is not None:
        holders = []
        for u in preds:
            pb = sr.block(u)
            if len(pb.insns) < 2:
                return None
            holders.append((u, pb.insns[-1], pb.insns[-2]))
    else:
        return None
    loads, bound, tables = [], 0, set()
    for u, (la, ln), (aa, an) in holders:
        hb = sr.block(u)
        raw = hb.data[la - hb.start:la - hb.start + ln]
        parsed = parse_table_load(raw)
        if parsed is None or parsed[0] != r:
            return None
        dst, idx, off, t = parsed
        n = _and_bound(hb.data[aa - hb.start:aa - hb.start + an], aa, idx)
        if n is None:
            return None
        loads.append(Load(u, la, raw, off))
        bound, tables = max(bound, n), tables | {t}
    if len(tables) != 1:
        return None
    return bound, loads, REG_NAMES[r]


def _table_of(load: Load) -> int:
    return struct.unpack_from("<i", load.raw, load.disp_off)[0]


def table_bound(sr: SuperRegion, key: NodeKey) -> int | None:
    """Entries the index of block ``key``'s table jump is proven within, or None."""
    site = _site(sr, key)
    return None if site is None else site[0]


def _kills(sr: SuperRegion, key: NodeKey, reg: str, depth: int = 4) -> bool:
    """Whether code entering block ``key`` writes all of ``reg`` (32 or 64 bits) before
    any read, exit or partial write of it: the block, then on through a lone
    in-region successor it jumps or falls to (at most ``depth`` blocks)."""
    for _ in range(depth):
        bb = sr.block(key)
        for a, n in bb.insns:
            insn = next(_cs.disasm(bb.data[a - bb.start:a - bb.start + n], a, 1), None)
            if insn is None:
                return False
            try:
                read, written = insn.regs_access()
            except capstone.CsError:
                return False
            reads = {_reg64(x) for x in read}
            ops = insn.operands
            if insn.mnemonic in ("xor", "sub") and len(ops) == 2 and \
                    ops[0].type == ops[1].type == X.X86_OP_REG and ops[0].reg == ops[1].reg:
                reads.discard(_reg64(ops[0].reg))        # the zero idiom reads nothing
            if reg in reads or any(_reg64(x) == reg and _reg_size(x) < 4 for x in written):
                return False
            if any(_reg64(x) == reg for x in written):
                return True
        succ = list(sr.g.successors(key))
        if bb.term not in (TermKind.FALLTHROUGH, TermKind.JMP) or len(succ) != 1 \
                or succ[0] == END:
            return False
        key = succ[0]
    return False


def _register_form(sr: SuperRegion, key: NodeKey) -> bool:
    """Whether block ``key`` is ``jmp r`` after some ``mov r, [T + idx*8]``."""
    bb = sr.block(key)
    insns = [_insn(bb, -2)] if len(bb.insns) >= 2 else \
        [_insn(sr.block(u), -1) for u in sr.g.predecessors(key)
         if isinstance(sr.g.nodes[u].get("bb"), BasicBlock) and sr.block(u).insns]
    return any(parse_table_load(raw) is not None for _, raw in insns)


def record_tables(sr: SuperRegion, mem, counters: Counter) -> None:
    """Read the table of every translatable table jump of ``sr`` from ``mem`` into
    ``sr.info["tables"]`` (by the jump's address; clones made later share it); count
    the refusals."""
    tables: dict[int, TableCopy] = sr.info.setdefault(INFO_KEY, {})
    for k, bb in sr.blocks():
        if bb.term is not TermKind.IJMP:
            continue
        site = _site(sr, k)
        if site is None:
            if parse_table_jmp(_insn(bb, -1)[1]) is not None or _register_form(sr, k):
                counters["table-unbounded"] += 1
            continue
        n, loads, _reg = site
        t = _table_of(loads[0])
        if not mem.is_readonly_range(t, 8 * n):
            counters["table-writable"] += 1
            continue
        try:
            raw = mem.read(t, 8 * n)
        except MemoryViewError:
            counters["table-unreadable"] += 1
            continue
        values = struct.unpack(f"<{n}Q", raw)
        tables[bb.insns[-1][0]] = TableCopy(t, values,
                                            frozenset(v for v in values if mem.is_exec(v)))


def region_table_plan(sr: SuperRegion, key: NodeKey) -> TablePlan | None:
    """The translation of block ``key``'s table jump, or None: the one decision that
    region selection (region/dispatch.py, which keeps the jump's edges to the targets
    the copy enters) and code generation (codegen/emit.py) both take."""
    copies = sr.info.get(INFO_KEY, {})
    bb = sr.block(key)
    if bb.term is not TermKind.IJMP or not bb.insns:
        return None
    ja, jraw = _insn(bb, -1)
    c = copies.get(ja)
    site = _site(sr, key) if c is not None else None
    if site is None:
        return None
    n, loads, reg = site
    if any(_table_of(ld) != c.table for ld in loads) or n > len(c.values):
        return None
    dead = frozenset()
    if reg is not None:
        dead = frozenset(sr.block(v).start for v in sr.g.successors(key)
                         if v != END and _kills(sr, v, reg))
    return TablePlan(ja, jraw, tuple(loads), c, reg, dead)


def region_tables(sr: SuperRegion) -> dict[NodeKey, TablePlan]:
    """Every translated table jump of ``sr``, by block."""
    if not sr.info.get(INFO_KEY):
        return {}
    out = {}
    for k, bb in sr.blocks():
        if bb.term is TermKind.IJMP:
            p = region_table_plan(sr, k)
            if p is not None:
                out[k] = p
    return out


def load_sites(plans: dict[NodeKey, TablePlan]) -> dict[tuple[NodeKey, int], NodeKey]:
    """(block, address) of each register-form load -> the block of its jump."""
    return {(ld.key, ld.addr): k for k, p in plans.items() if p.reg is not None
            for ld in p.loads}


def addressable(data: int, plan: TablePlan) -> bool:
    """Whether a copy at ``data`` can be a disp32 without base register."""
    return 0 <= data and data + plan.data_size <= DATA_LIMIT


def encode_load(plan: TablePlan, load: Load, data: int | None) -> bytes:
    """``load`` reading the copy at ``data``; the original instruction when ``data`` is
    None (sizing) or not addressable.  Both are the original's length."""
    if data is None or not addressable(data, plan):
        return load.raw
    w = X86Writer()
    w.put_insn_disp32(load.raw, load.disp_off, data)
    return bytes(w.code)


def encode_jump(plan: TablePlan, data: int | None) -> bytes:
    """The jump: through the copy (memory form, see :func:`encode_load`), or the
    original ``jmp r`` (register form: its load read the copy)."""
    return plan.jmp if plan.reg is not None else encode_load(plan, plan.loads[0], data)


def table_data(plan: TablePlan, dest: dict[int, int]) -> bytes:
    """The copy: each entry's destination in ``dest`` (its block's replacement
    address) where the copy may enter it, every other entry unchanged."""
    return struct.pack(f"<{plan.entries}Q", *(dest[v] if v in dest and plan.enters(v) else v
                                               for v in plan.copy.values))


def table_exits(plan: TablePlan, dest: dict[int, int], translated: bool) -> list[int]:
    """Code the jump exits to: the entries that are code and are not entered through
    the copy (all of them when the original instructions are emitted)."""
    return sorted(v for v in plan.copy.code
                  if not translated or v not in dest or not plan.enters(v))
