"""Translated absolute jump tables (codegen/tables.py), differentially with unicorn.

A dispatch ``and eax, M; jmp [T + rax*8]`` (as one block, or the jump alone after a block
ending in the ``and``, as discovery makes it) is selected with CUT-WIDE-DISPATCH and
emitted; the original and the replacement then run from the same random states, with
``rax`` steering every index 0..M, until control reaches a common continuation (every
handler ends there) or faults.  Final GPRs, flags, stack and destination must agree.
Entries whose block is in the region must be reached without executing original code;
the others (not in the region, or not code at all) exit to exactly ``T[i]``.

Also: the bytes of the translated jump, the refusals (writable table, unbounded index,
a way into a lone jump that skips the ``and``, a buffer above 2 GiB), and region
selection on the benchmark's Lua interpreter.
"""

from __future__ import annotations

import os
import random
import struct
from collections import Counter

import pytest
from codegen_util import CS, Machine, asm, build_blocks, random_state
from unicorn import UcError
from unicorn.x86_const import UC_X86_REG_RIP

from dbr_service.codegen import tables
from dbr_service.codegen.emit import emit_region
from dbr_service.region.dispatch import cut_wide_dispatch
from dbr_service.region.memview import MappedRange, MemoryView
from dbr_service.region.model import END, START, EdgeKind, SuperRegion, TermKind

ORIG = 0x40_1000                 # code: dispatch, then handlers
TABLE = 0x40_4000                # the table (read-only)
DONE = 0x40_6000                 # where every handler continues (outside the region)
NEW = 0x1000_0000                # replacement code below 2 GiB
HIGH = 0x8000_0000               # a buffer whose data cannot be a disp32
STACK, STACK_SIZE = 0x7FFE_0000_0000, 0x2000
RSP = STACK + 0x1000
NOT_CODE = [0x0000_1234_5678_9ABC, 0x40_8000, 0x7000_0000_0000]      # all unmapped


class View(MemoryView):
    """Code (r-x) at ORIG, the table at TABLE with the given permissions."""

    def __init__(self, code: bytes, table: bytes, perms: str = "r--") -> None:
        super().__init__()
        self.code, self.table, self.tperms = code.ljust(0x1000, b"\xf4"), table, perms

    def ranges(self):
        return [MappedRange(ORIG, ORIG + 0x1000, "r-x", "t"),
                MappedRange(TABLE, TABLE + 0x1000, self.tperms, "t")]

    def _read_range(self, rng, addr, n):
        src = self.code if rng.start == ORIG else self.table.ljust(0x1000, b"\0")
        return src[addr - rng.start:addr - rng.start + n]


def program(mask: int, lone: bool, reg: str = "rax", notrack: bool = False,
            via: str | None = None):
    """(code, handler addresses, the lone jump's address): ``mov``, ``and``, the table
    jump, then one handler per code entry: a little arithmetic and ``jmp DONE``.
    ``via``: the register form, ``mov via, [T + reg*8]; jmp via``; then every third
    handler reads ``via`` first (it must be left with the original value), the others
    write it first (through 32 bits, a zero idiom, or two blocks on)."""
    r32 = {"rax": "eax", "r9": "r9d", "rdx": "edx"}[reg]
    head = asm(f"mov {r32}, {r32}; and {r32}, {mask:#x}", ORIG)
    if via is None:
        jmp = asm(f"jmp qword ptr [{reg}*8 + {TABLE:#x}]", 0)
    else:
        head += asm(f"mov {via}, qword ptr [{reg}*8 + {TABLE:#x}]", 0)
        jmp = asm(f"jmp {via}", 0)
    code = head + (b"\x3e" if notrack else b"") + jmp
    handlers = []
    for i in range(mask + 1):
        at = ORIG + 0x100 + 0x20 * i
        code = code.ljust(at - ORIG, b"\xf4")
        w32 = f"{via}d" if via and via[1:].isdigit() else f"e{via and via[1:]}"
        first = "" if via is None else [f"add rbx, {via}", f"mov {w32}, {i}",
                                        f"xor {w32}, {w32}"][i % 3]
        code += asm(f"{first + '; ' if first else ''}lea rbx, [rbx + {3 * i + 1}]; "
                    f"xor rcx, rbx; add rsi, rcx; jmp {DONE:#x}", at)
        handlers.append(at)
    return code, handlers, (ORIG + len(head) if lone else None)


def region(code: bytes, handlers: list[int], entries: list[int], in_region: set[int],
           jmp_at: int, lone_at: int | None) -> SuperRegion:
    """The dispatch and the handlers in ``in_region``; the other entries exit."""
    blocks = build_blocks(code[:0x100 + 0x20 * len(handlers)], ORIG,
                          {jmp_at: [t for t in entries if t in handlers],
                           0: [lone_at] if lone_at is not None else []})
    sr = SuperRegion("t")
    for a, bb in blocks.items():
        if a in (ORIG, lone_at) or a in in_region:
            sr.add_block(bb)
    if lone_at is not None:                # discovery gives the jump a block of its own
        assert lone_at in blocks and blocks[ORIG].term is TermKind.FALLTHROUGH
        sr.add_edge(ORIG, lone_at, EdgeKind.FALLTHROUGH, 10.0)
    sr.add_edge(START, ORIG, EdgeKind.ENTRY, 10.0)
    disp = lone_at if lone_at is not None else ORIG
    for t in dict.fromkeys(entries):
        if t in in_region:
            sr.add_edge(disp, t, EdgeKind.FLOW, 1.0)
            sr.add_edge(t, END, EdgeKind.EXIT, 1.0, target=DONE)
        elif t in handlers:
            sr.add_edge(disp, END, EdgeKind.EXIT, 1.0, target=t)
    return sr


def _run(m: Machine, start: int):
    """Run to DONE: (rip or the fault, whether original code ran before a handler)."""
    seen = []

    def inside(a: int) -> bool:
        seen.append(a)
        return a != DONE
    try:
        rip = m.run(start, inside, limit=200)
    except UcError as e:
        rip = ("fault", e.errno, m.uc.reg_read(UC_X86_REG_RIP))
    return rip, seen


CASES = [("rax", True, False, 7, None), ("rax", False, False, 7, None),
         ("r9", True, True, 15, None), ("rdx", False, True, 3, None),
         ("rax", True, False, 15, "rax"), ("rax", False, True, 7, "rax"),
         ("r9", True, False, 15, "r11"), ("rdx", False, False, 7, "rcx")]


@pytest.mark.parametrize("reg, lone, notrack, mask, via", CASES,
                         ids=[f"{c[0]}-{'lone' if c[1] else 'block'}"
                              f"{'-notrack' if c[2] else ''}-{c[3] + 1}"
                              f"{'-via-' + c[4] if c[4] else ''}" for c in CASES])
def test_table_differential(reg: str, lone: bool, notrack: bool, mask: int,
                            via: str | None) -> None:
    rng = random.Random(f"{reg}{lone}{notrack}{mask}{via}")
    code, handlers, lone_at = program(mask, lone, reg, notrack, via)
    n_code = (mask + 1) * 3 // 4                    # a tail of entries that are not code
    entries = [rng.choice(handlers[:n_code]) for _ in range(n_code)]
    entries[:3] = handlers[:3]
    values = entries + NOT_CODE[:mask + 1 - n_code] + \
        [NOT_CODE[0]] * max(0, mask + 1 - n_code - len(NOT_CODE))
    table = struct.pack(f"<{mask + 1}Q", *values)
    in_region = {h for h in handlers[:n_code] if rng.random() < 0.6} | {entries[0]}
    in_region.discard(entries[1])
    if via is not None:
        in_region |= {handlers[0], handlers[1], handlers[2]}     # reads, writes, zeroes
    last = [i for i in CS.disasm(code[:0x100], ORIG) if i.mnemonic.endswith("jmp")][0]
    sr = region(code, handlers, entries, in_region, last.address, lone_at)
    counters = Counter()
    cut_wide_dispatch(sr, 4, counters, View(code, table), True)
    live = {h for k, h in enumerate(handlers)
            if h in in_region and h in entries and via and k % 3 == 0}
    assert counters["translated-tables"] == 1 and counters["edges-cut"] == len(live), counters
    disp = lone_at if lone else ORIG
    assert sr.block(disp).unpatchable      # its first long instruction: the jump or load
    entered = in_region - live
    gen = emit_region(sr, NEW)
    jmp_new = next(a for a, o in ((s, o) for s, _e, o in gen.addr_map) if o == last.address)
    load = next(i.address for i in CS.disasm(code[:0x100], ORIG) if i.address < last.address
                and i.mnemonic == "mov" and i.disp == TABLE) if via else last.address
    load_new = next(a for a, _e, o in gen.addr_map if o == load)
    text = {i.address: i for i in CS.disasm(gen.code[:gen.data_start], NEW)}
    copy_at = text[load_new].disp
    assert NEW < copy_at < NEW + len(gen.code) and copy_at % 8 == 0
    assert {t for _, t in gen.exits} >= set(entries) - entered
    m = Machine([(ORIG, 0x1000), (TABLE, 0x1000), (DONE, 0x1000), (NEW, len(gen.code)),
                 (STACK, STACK_SIZE)])
    m.write(ORIG, code.ljust(0x1000, b"\xf4"))
    m.write(TABLE, table)
    m.write(DONE, b"\xf4")
    m.write(NEW, gen.code)
    idx_reg = reg
    stayed = exited = faulted = 0
    for i in list(range(mask + 1)) * 2:
        v = i | rng.getrandbits(64) & ~mask       # the ``and`` drops the other bits
        st = random_state(rng, RSP, {STACK: STACK_SIZE}, {idx_reg: v})
        m.set_state(st)
        a_rip, _ = _run(m, ORIG)
        a = m.snapshot([(STACK, STACK_SIZE)])
        m.set_state(st)
        b_rip, seen = _run(m, gen.entries[ORIG])
        bs = m.snapshot([(STACK, STACK_SIZE)])
        ctx = f"index {i}: T[i]={values[i]:#x}"
        assert b_rip == a_rip, f"{ctx}: {b_rip} vs original {a_rip}"
        assert bs.regs == a.regs, ctx
        assert bs.rflags == a.rflags, ctx
        assert bs.mem == a.mem, ctx
        ran_orig = any(ORIG <= x < ORIG + 0x1000 for x in seen)
        if values[i] in entered:
            assert not ran_orig, f"{ctx}: left replacement code"
            stayed += 1
        elif values[i] in handlers:
            assert values[i] in seen and seen[seen.index(values[i]) - 1] == jmp_new, ctx
            exited += 1
        else:
            assert isinstance(b_rip, tuple) and b_rip[2] == values[i], ctx
            faulted += 1
    assert stayed and exited and faulted


def test_golden_bytes() -> None:
    """The translated jump is the original with its disp32 replaced, prefixes kept."""
    for text, pre in (("jmp qword ptr [rax*8 + 0x404000]", b""),
                      ("jmp qword ptr [r9*8 + 0x404000]", b"\x3e"),
                      ("jmp qword ptr [r13*8 + 0x404000]", b"\xf2")):
        raw = pre + asm(text, 0)
        idx, off, t = tables.parse_table_jmp(raw)
        assert t == TABLE and raw[off:off + 4] == struct.pack("<I", TABLE)
        plan = tables.TablePlan(0x401000, raw, (tables.Load(0, 0x401000, raw, off),),
                                tables.TableCopy(TABLE, (0x401100,) * 8, frozenset()))
        new = tables.encode_jump(plan, 0x1000_2000)
        assert len(new) == len(raw) and new[:off] == raw[:off]
        assert new[off:] == bytes.fromhex("00200010")
        insn = next(CS.disasm(new, 0))
        assert insn.mnemonic.endswith("jmp") and insn.disp == 0x1000_2000
    raw = bytes.fromhex("ff24c500404000")
    assert bytes.fromhex("ff24c500200010") == tables.encode_jump(
        tables.TablePlan(0, raw, (tables.Load(0, 0, raw, 3),),
                         tables.TableCopy(TABLE, (0,) * 4, frozenset())), 0x1000_2000)
    # the register form's load: only its disp32 changes
    for text in ("mov rax, qword ptr [rax*8 + 0x404000]", "mov r11, qword ptr [r9*8 + 0x404000]"):
        raw = asm(text, 0)
        dst, idx, off, t = tables.parse_table_load(raw)
        assert t == TABLE and raw[off:off + 4] == struct.pack("<I", TABLE)
        plan = tables.TablePlan(0, b"\xff\xe0", (tables.Load(0, 0, raw, off),),
                                tables.TableCopy(TABLE, (0,) * 4, frozenset()), "rax")
        new = tables.encode_load(plan, plan.loads[0], 0x1000_2000)
        assert new == raw[:off] + bytes.fromhex("00200010")
        assert tables.encode_jump(plan, 0x1000_2000) == b"\xff\xe0"
    assert tables.parse_table_load(asm("mov eax, dword ptr [rax*4 + 0x404000]", 0)) is None
    # no index, a base register, scale 4, rip-relative, a negative disp32
    for text in ("jmp qword ptr [0x404000]", "jmp qword ptr [rbx + rax*8 + 0x404000]",
                 "jmp qword ptr [rax*4 + 0x404000]", "jmp qword ptr [rip + 0x100]",
                 "jmp qword ptr [rax*8 - 0x10]", "jmp rax"):
        assert tables.parse_table_jmp(asm(text, 0)) is None, text
    assert tables.parse_table_jmp(b"\x64" + asm("jmp qword ptr [rax*8 + 0x404000]", 0)) is None


def _selected(code, handlers, table, perms="r--", lone=True, mask=7):
    in_region = set(handlers[:4])
    _, _, lone_at = program(mask, lone)
    last = [i for i in CS.disasm(code[:0x100], ORIG) if i.mnemonic.endswith("jmp")][0]
    sr = region(code, handlers, handlers, in_region, last.address, lone_at)
    counters = Counter()
    cut_wide_dispatch(sr, 4, counters, View(code, table, perms), True)
    return sr, counters, (lone_at if lone else ORIG)


def test_refusals() -> None:
    code, handlers, _ = program(7, True)
    table = struct.pack("<8Q", *handlers)
    sr, c, disp = _selected(code, handlers, table)
    assert c["translated-tables"] == 1 and tables.region_table_plan(sr, disp) is not None
    # a table that may change
    sr, c, disp = _selected(code, handlers, table, "rw-")
    assert c["table-writable"] == 1 and c["translated-tables"] == 0
    assert c["wide-dispatches"] == 1 and c["edges-cut"] == 4 and tables.region_tables(sr) == {}
    # no mask right before the jump: the index is unbounded
    unbounded = code.replace(asm("and eax, 7", ORIG + 2), asm("add eax, 7", ORIG + 2))
    sr, c, disp = _selected(unbounded, handlers, table)
    assert c["table-unbounded"] == 1 and c["edges-cut"] == 4
    # a byte mask leaves the rest of rax; a wider mask than the table read
    for text in ("and al, 7", "and ecx, 7"):
        other = code.replace(asm("and eax, 7", ORIG + 2), asm(text, ORIG + 2).ljust(3, b"\x90"))
        sr, c, disp = _selected(other, handlers, table)
        assert c["translated-tables"] == 0, text
    # another way into the lone jump (a jump past the ``and``, an entry edge)
    sr, c, disp = _selected(code, handlers, table)
    sr.add_edge(START, disp, EdgeKind.ENTRY, 1.0)
    assert tables.region_table_plan(sr, disp) is None
    sr, c, disp = _selected(code, handlers, table)
    sr.g.remove_edge(ORIG, disp)
    sr.add_edge(ORIG, disp, EdgeKind.FLOW, 1.0)
    assert tables.region_table_plan(sr, disp) is None and tables.region_tables(sr) == {}
    # switched off: cut as before
    code2, handlers2, lone_at = program(7, True)
    last = [i for i in CS.disasm(code2[:0x100], ORIG) if i.mnemonic.endswith("jmp")][0]
    sr = region(code2, handlers2, handlers2, set(handlers2[:4]), last.address, lone_at)
    c = Counter()
    cut_wide_dispatch(sr, 4, c, View(code2, table), False)
    assert c["wide-dispatches"] == 1 and "tables" not in sr.info


def test_buffer_above_2gib_falls_back_to_the_original_jump() -> None:
    code, handlers, lone_at = program(7, True)
    table = struct.pack("<8Q", *handlers)
    sr, c, disp = _selected(code, handlers, table)
    low, high = emit_region(sr, NEW), emit_region(sr, HIGH)
    assert len(low.code) == len(high.code)           # placement never changes the size
    jmp = code[lone_at - ORIG:lone_at - ORIG + 7]
    o = next(s for s, _e, orig in high.addr_map if orig == lone_at) - HIGH
    assert high.code[o:o + 7] == jmp                 # the original jump: an exit
    assert {t for _, t in high.exits} >= set(handlers)
    o = next(s for s, _e, orig in low.addr_map if orig == lone_at) - NEW
    assert low.code[o:o + 7] != jmp
    # the copy's last entry would cross 2**31: not addressable either
    plan = tables.region_table_plan(sr, disp)
    assert tables.addressable((1 << 31) - plan.data_size, plan)
    assert not tables.addressable((1 << 31) - plan.data_size + 8, plan)


LUA = os.path.expanduser("~/.cache/dbr-bench-long/lua-6b05ec9e20ee/plain/lua")


@pytest.mark.skipif(not os.path.exists(LUA), reason="the long benchmark's Lua is not built")
def test_lua_interpreter_dispatch_is_translated() -> None:
    """Samples over luaV_execute: its computed-goto dispatches (``and eax, 0x7f; jmp
    [disptab + rax*8]``, 83 opcodes in a 128-entry range) keep their edges, and the
    region's code jumps through copies of ``disptab``."""
    from dbr_service.region.memview import ElfMemoryView
    from dbr_service.region.pipeline import RegionConfig, select_regions

    mem = ElfMemoryView(LUA)
    lo, hi = _lua_symbols()
    samples = {i.address: 3.0 for i in CS.disasm(mem.read(lo, hi - lo), lo)}
    res = select_regions(samples, mem, RegionConfig(real_calls=True))
    counters = res.counters["partition-code"]
    assert counters["translated-tables"] == 6 and "wide-dispatches" not in counters, counters
    plans = {k: p for sr in res.regions for k, p in tables.region_tables(sr).items()}
    disptab = {p.copy.table for p in plans.values()}
    assert len(plans) == 6 and len(disptab) == 1 and mem.is_readonly(disptab.pop())
    assert all(p.entries == 128 and len(p.copy.code) == 83 for p in plans.values())
    assert sum(p.reg is not None for p in plans.values()) == 2
    sr = max(res.regions, key=lambda r: len(tables.region_tables(r)))
    gen = emit_region(sr, 0x1000_0000)
    for k, p in tables.region_tables(sr).items():
        succ = {sr.block(v).start for v in sr.g.successors(k) if v != END}
        assert succ and all(p.enters(t) for t in succ)     # the others were cut
        for ld in p.loads:
            at = next(s for s, _e, o in gen.addr_map if o == ld.addr)
            insn = next(CS.disasm(gen.code[at - gen.base:], at, 1))
            assert len(insn.bytes) == len(ld.raw) and insn.disp != p.copy.table
            copy = struct.unpack_from("<128Q", gen.code, insn.disp - gen.base)
            inside = [v for v in copy if gen.base <= v < gen.base + len(gen.code)]
            assert len(inside) == sum(1 for v in p.copy.values if v in succ) > 40
            assert all(c == v for c, v in zip(copy, p.copy.values) if v not in succ)
    # switched off, as before: every dispatch cut
    off = select_regions(samples, mem, RegionConfig(real_calls=True, translate_tables=False))
    assert off.counters["partition-code"]["wide-dispatches"] == 6


def _lua_symbols() -> tuple[int, int]:
    """luaV_execute's extent, from the binary's symbol table."""
    from dbr_service.common.symbols import read_symbols
    ex = next(s for s in read_symbols(LUA)._syms if s.name == "luaV_execute")
    return ex.start, ex.start + ex.size


def test_register_liveness_at_targets() -> None:
    """Which target blocks the register form may enter: those that write the whole
    register (32 or 64 bits, or the zero idiom) before any read, partial write or end."""
    cases = {"mov eax, 2": True, "xor eax, eax": True, "mov rax, rbx": True,
             "pop rax": True, "mov al, 1; mov eax, 2": False, "add rbx, rax": False,
             "lea rax, [rax + 1]": False, "mov ebx, [rax]": False, "cdqe": False,
             "mov rbx, 1; jmp 0x401080": True,            # on into the next block
             "test ebx, ebx; jne 0x401080": False, "nop": True, "ret": False}
    for text, kills in cases.items():
        code = asm(f"{text}", ORIG).ljust(0x80, b"\x90") + asm("mov eax, 1; ret", ORIG + 0x80)
        blocks = build_blocks(code, ORIG)
        sr = SuperRegion("t")
        for bb in blocks.values():
            sr.add_block(bb)
        first = blocks[ORIG]
        if first.term in (TermKind.JMP, TermKind.JCC, TermKind.FALLTHROUGH):
            sr.add_edge(ORIG, ORIG + 0x80, EdgeKind.FLOW, 1.0)
        if first.term is TermKind.JCC:
            sr.add_edge(ORIG, END, EdgeKind.EXIT, 1.0, target=first.end)
        assert tables._kills(sr, ORIG, "rax") == kills, text
