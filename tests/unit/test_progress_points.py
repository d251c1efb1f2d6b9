"""Which progress points a speed check counts (dbr_service/installation/progress_points.py), from
made-up regions over assembled original code, and the counters' data buffers."""

from __future__ import annotations

import types

from codegen_util import asm

from dbr_service.wire import protocol as P
from dbr_service.wire.agentconn import make_site
from dbr_service.installation.progress_points import SLOT, CounterSpace, choose_points

BASE = 0x400000


def _code() -> dict[int, bytes]:
    """Original code by address: candidate exit targets of different kinds."""
    return {
        0x400100: asm("mov eax, 0x12345678; add eax, ebx", 0x400100),   # good
        0x400200: asm("mov eax, 0x12345678; add eax, ebx", 0x400200),   # copied by r2
        0x400300: asm("xor eax, eax; add eax, ebx", 0x400300),          # 2-byte first insn
        0x400400: asm("mov eax, 0x12345678; sete bl", 0x400400),         # flags live
        0x400500: asm("mov eax, 0x12345678; add eax, ebx", 0x400500),   # a patch site
        0x400600: asm("mov eax, 0x12345678; add eax, ebx", 0x400600),   # good
    }


def _read(code: dict[int, bytes]):
    def read(addr: int, n: int) -> bytes:
        for a, b in code.items():
            if a <= addr < a + 0x100:
                return (b + bytes(0x100))[addr - a:addr - a + n]
        raise OSError(f"unmapped {addr:#x}")
    return read


def _region(exits=(), orig=(), sites=()):
    return types.SimpleNamespace(
        gen=types.SimpleNamespace(exits=[(0, t) for t in exits]), orig_ranges=list(orig),
        sites=[make_site(s, 0x500000, bytes(5)) for s in sites], suspended_sites=[])


def test_exit_targets_outside_copies_and_sites_with_dead_flags_are_chosen():
    code = _code()
    r1 = _region(exits=[0x400100, 0x400200, 0x400300, 0x400400, 0x400500, 0x400600,
                        0x400700], orig=[(0x400000, 0x400080)])
    r2 = _region(orig=[(0x400200, 0x400210)], sites=[0x400500])
    got = choose_points([r1], [r1, r2], _read(code))
    # 0x400700 is unreadable, the others are refused for the reasons in _code
    assert got == [0x400100, 0x400600]
    assert choose_points([r1], [r1, r2], _read(code), limit=1) == [0x400100]
    # a target r1 copies itself is passed by its copy, not counted
    r1.orig_ranges.append((0x400100, 0x400108))
    assert choose_points([r1], [r1, r2], _read(code)) == [0x400600]


class _Buf:
    def __init__(self, buffer_id: int, base: int, size: int = 4096) -> None:
        self.buffer_id, self.base, self.size = buffer_id, base, size
        self.mem = bytearray(b"\xff" * size)

    def write(self, addr: int, data: bytes) -> None:
        self.mem[addr - self.base:addr - self.base + len(data)] = data


class _Conn:
    def __init__(self) -> None:
        self.asked: list[tuple[int, int, int]] = []

    def code_buffer(self, near: int, size: int, flags: int = 0):
        self.asked.append((near, size, flags))
        return _Buf(len(self.asked), near + 0x10000)


def test_counters_are_fresh_zeroed_slots_within_reach():
    conn = _Conn()
    space = CounterSpace(conn)
    a = [space.counter(BASE) for _ in range(4096 // SLOT)]
    assert len(conn.asked) == 1 and conn.asked[0][2] == P.BUFFER_F_DATA
    addrs = [addr for _, addr in a]
    assert len(set(addrs)) == len(addrs) and all(addr % SLOT == 0 for addr in addrs)
    buf = a[0][0]
    assert all(buf.mem[x - buf.base:x - buf.base + SLOT] == bytes(SLOT) for x in addrs)
    space.counter(BASE)                    # the first buffer is full: another one
    assert len(conn.asked) == 2
    far = BASE + (3 << 30)                 # beyond rel32 reach of both: a third
    _, addr = space.counter(far)
    assert len(conn.asked) == 3 and abs(addr - far) < 1 << 31
