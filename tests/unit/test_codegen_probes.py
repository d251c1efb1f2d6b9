"""Probe handlers (dbr_service/codegen/probes.py), run in unicorn.

From random states, the original code from a location and the same code with the
location patched to a probe trampoline reach the same exit with the same registers,
flags and memory (the red zone and the stack included), and the probe's data is what
the kind says: a count probe counts every pass (with flags live, through its
pushfq path), an args probe records the argument registers and the return address,
only for passes its filter accepts."""

from __future__ import annotations

import random
import struct

import pytest
from codegen_util import Machine, asm, random_state

from dbr_service.codegen.probes import (RING_BYTES, RING_RECORDS, args_handler,
                                        count_handler, parse_filter, probe_trampoline,
                                        read_ring)
from dbr_service.codegen.relocate import jmp_rel32

ORIG = 0x400000
BUF = 0x500000
DATA = 0x600000
STACK = 0x700000
END = ORIG + 0x800
RANGES = [(ORIG, 0x1000), (BUF, 0x1000), (DATA, 0x2000), (STACK - 0x1000, 0x2000)]
#: Below rsp: the red zone (128 bytes; what lies below it is free for signal
#: frames, and the handler's) the original code uses; above: the return address.
WATCH = [(STACK - 0x100, 0x200), (DATA, RING_BYTES)]


def _code(lines: list[str]) -> bytes:
    out = b""
    for line in lines:
        out += asm(line, ORIG + len(out))
    return out + jmp_rel32(ORIG + len(out), END)


#: A function entry: the first instructions span 5 bytes, flags are live after
#: them (setz reads the flags the location's caller left: cmp before the jump in).
ENTRY = ["mov qword ptr [rsp - 8], rdi", "mov eax, esi", "setz bl", "add eax, edx", "setp bh"]


def _run(code: bytes, handler, seed: int, regs: dict | None = None):
    tr = probe_trampoline(code, ORIG, BUF, handler)
    m = Machine(RANGES)

    def inside(a: int) -> bool:
        return ORIG <= a < ORIG + len(code) or BUF <= a < BUF + len(tr.code)

    st = random_state(random.Random(seed), STACK, {STACK - 0x100: 0x200}, regs or {})
    out = []
    for patched in (False, True):
        m.write(ORIG, jmp_rel32(ORIG, BUF) + code[5:] if patched else code)
        m.write(BUF, tr.code)
        m.write(DATA, bytes(RING_BYTES))
        m.set_state(st)
        assert m.run(ORIG, inside) == END
        out.append(m.snapshot(WATCH))
    return st, out[0], out[1]


@pytest.mark.parametrize("flags_dead", [True, False])
def test_count_probe_keeps_state(flags_dead: bool) -> None:
    code = _code(["imul eax, edi, 1000", "add eax, ecx", "setz bl"] if flags_dead else ENTRY)
    for seed in range(40):
        _, plain, probed = _run(code, lambda at: count_handler(at, DATA + 8, flags_dead), seed)
        assert plain.regs == probed.regs and plain.rflags == probed.rflags, seed
        assert plain.mem[STACK - 0x100][0x80:] == probed.mem[STACK - 0x100][0x80:]
        assert struct.unpack_from("<Q", probed.mem[DATA], 8)[0] == 1


def test_count_handler_with_live_flags_saves_them() -> None:
    assert count_handler(BUF, DATA, True) != count_handler(BUF, DATA, False)
    assert b"\x9c" in count_handler(BUF, DATA, False)


@pytest.mark.parametrize("flt", [None, "arg1>100", "arg0==7", "arg2!=-1", "arg5<=0"])
def test_args_probe_records(flt: str | None) -> None:
    code = _code(ENTRY)
    f = parse_filter(flt) if flt else None
    hits = 0
    for seed in range(40):
        rng = random.Random(1000 + seed)
        regs = {r: rng.choice([7, 100, 101, -1 & (2**64 - 1), 0, rng.getrandbits(64)])
                for r in ("rdi", "rsi", "rdx", "rcx", "r8", "r9")}
        st, plain, probed = _run(code, lambda at: args_handler(at, DATA, f), seed, regs)
        assert plain.regs == probed.regs and plain.rflags == probed.rflags, seed
        assert plain.mem[STACK - 0x100][0x80:] == probed.mem[STACK - 0x100][0x80:]
        n, recs = read_ring(probed.mem[DATA], 8)
        want = [st.regs[r] for r in ("rdi", "rsi", "rdx", "rcx", "r8", "r9")]
        if f is None or f.matches(want[f.arg]):
            hits += 1
            ret = struct.unpack_from("<Q", plain.mem[STACK - 0x100], 0x100)[0]
            assert (n, recs) == (1, [(0, want, ret)]), seed
        else:
            assert (n, recs) == (0, [])
    assert 0 < hits


def test_ring_wraps_and_keeps_the_last() -> None:
    """Records past the ring's size overwrite the oldest: the reader gets the last ones
    in order, by their numbers."""
    data = bytearray(RING_BYTES)
    total = RING_RECORDS + 10
    for k in range(total):
        off = 64 + (k % RING_RECORDS) * 64
        struct.pack_into("<8Q", data, off, k + 1, k, 0, 0, 0, 0, 0, 0xAA)
    struct.pack_into("<Q", data, 0, total)
    n, recs = read_ring(bytes(data), 5)
    assert n == total and [k for k, _, _ in recs] == list(range(total - 5, total))
    # a record whose seq does not match (being written) is left out
    struct.pack_into("<Q", data, 64 + ((total - 1) % RING_RECORDS) * 64, 0)
    assert [k for k, _, _ in read_ring(bytes(data), 5)[1]] == list(range(total - 5, total - 1))


@pytest.mark.parametrize("text,want", [
    ("arg0==5", ("0", "==", 5)), ("arg1 > 0x10", ("1", ">", 16)),
    ("arg5<-3", ("5", "<", -3)), ("arg2>=18446744073709551615", ("2", ">=", -1)),
])
def test_parse_filter(text: str, want: tuple) -> None:
    f = parse_filter(text)
    assert (str(f.arg), f.op, f.value) == want


@pytest.mark.parametrize("text", ["arg6==1", "arg0=1", "rdi==1", "arg0==", "arg0==1x",
                                  "arg0==18446744073709551616"])
def test_parse_filter_refuses(text: str) -> None:
    with pytest.raises(ValueError):
        parse_filter(text)
