"""Probe handlers (docs/decisions/0040-probes.md): the code a dynamic probe runs at its
location before the location's own instructions.

A probe is a trampoline like a counting trampoline (codegen/counting.py): the
location is patched with a 5-byte ``jmp`` to it; it runs the probe kind's handler,
then the instructions the patch overwrote, relocated, and jumps back.  No trap per
hit.  The kinds:

* ``count``: ``lock inc`` of a 64-bit counter.  Where the flags ``inc`` writes are
  dead (counting.inc_flags_dead) that is all; elsewhere the handler moves rsp below
  the red zone and saves rflags around it.
* ``args``: at a function entry, records the integer argument registers and the
  return address into a ring of :data:`RING_RECORDS` records in a data buffer, each
  claimed with ``lock xadd`` of the ring's index.  A filter (``argI OP N``, signed
  64-bit compare) is evaluated first; a pass it rejects records nothing.

Ring layout (little-endian u64 words): word 0 of the ring is the index (records
claimed so far); record k sits at ``RING_HEADER + (k % RING_RECORDS) * RECORD`` and
holds ``seq, arg0..arg5, return address``.  The handler sets ``seq`` to 0, writes the
rest, then sets ``seq`` to k + 1 (x86 keeps stores in order), so a reader takes a
record only when its ``seq`` is the one it expects.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Callable
from dataclasses import dataclass

from dbr_service.codegen.counting import Trampoline, counter_bytes, relocate_site
from dbr_service.codegen.relocate import Relocator
from dbr_service.codegen.x86 import (CC_E, CC_G, CC_GE, CC_L, CC_LE, CC_NE, R8, R9, R10,
                                     R11, RAX, RCX, RDI, RDX, RSI, RSP, X86Writer)

KINDS = ("count", "args", "latency")
#: The integer argument registers of the SysV ABI, in order (arg0 .. arg5).
ARG_REGS = (RDI, RSI, RDX, RCX, R8, R9)
RED_ZONE = 128
RING_RECORDS = 64
RECORD = 64
RING_HEADER = 64
RING_BYTES = RING_HEADER + RING_RECORDS * RECORD

_OPS = {"==": CC_E, "!=": CC_NE, "<": CC_L, "<=": CC_LE, ">": CC_G, ">=": CC_GE}
_FILTER = re.compile(r"\s*arg([0-5])\s*(==|!=|<=|>=|<|>)\s*([-+]?(?:0[xX][0-9a-fA-F]+|\d+))\s*")


@dataclass(frozen=True)
class Filter:
    """``arg OP value``: a signed 64-bit comparison of an argument register."""

    arg: int
    op: str
    value: int

    def __str__(self) -> str:
        return f"arg{self.arg}{self.op}{self.value}"

    def matches(self, v: int) -> bool:
        """The same predicate in Python (``v`` as a signed 64-bit value)."""
        v = v - (1 << 64) if v >= 1 << 63 else v
        return {"==": v == self.value, "!=": v != self.value, "<": v < self.value,
                "<=": v <= self.value, ">": v > self.value, ">=": v >= self.value}[self.op]


def parse_filter(text: str) -> Filter:
    """``argI OP N`` (I 0-5, OP one of == != < <= > >=, N decimal or 0x hex, signed
    64-bit; 2**63 .. 2**64-1 are taken as their two's-complement value); ValueError
    with the reason otherwise."""
    m = _FILTER.fullmatch(text)
    if m is None:
        raise ValueError(f"filter {text!r} is not argI OP N (I 0-5; OP ==, !=, <, <=, >, >=)")
    v = int(m.group(3), 0)
    if not -(1 << 63) <= v < (1 << 64):
        raise ValueError(f"filter value {m.group(3)} does not fit 64 bits")
    if v >= 1 << 63:
        v -= 1 << 64
    return Filter(int(m.group(1)), m.group(2), v)


def count_handler(at: int, counter: int, flags_dead: bool) -> bytes:
    """``lock inc qword [counter]`` at ``at``; wrapped in ``pushfq``/``popfq`` below the
    red zone unless ``flags_dead``."""
    if flags_dead:
        return counter_bytes(at, counter)
    w = X86Writer(at)
    w.put_lea(RSP, RSP, -RED_ZONE)
    w.put_pushfq()
    w.put_lock_inc_rip(counter)
    w.put_popfq()
    w.put_lea(RSP, RSP, RED_ZONE)
    return w.finish()


def args_handler(at: int, ring: int, flt: Filter | None = None) -> bytes:
    """Record arg0..arg5 and the return address at ``[rsp]`` (the location is a
    function entry) in the ring at ``ring`` (module docstring); every register and
    flag is as before when it ends."""
    w = X86Writer(at)
    w.put_lea(RSP, RSP, -RED_ZONE)
    w.put_pushfq()
    for r in (RAX, R10, R11):
        w.put_push_reg(r)
    saved = RED_ZONE + 32          # rsp to the entry's [rsp]: the red zone, 4 pushes
    if flt is not None:
        w.put_mov_reg_imm64(RAX, flt.value)
        w.put_cmp_reg_reg(ARG_REGS[flt.arg], RAX)
        w.put_jcc_near_label(_OPS[flt.op] ^ 1, "skip")
    w.put_bytes(b"\xb8\x01\x00\x00\x00")                    # mov eax, 1
    w.put_insn_rip(b"\xf0\x48\x0f\xc1\x05" + bytes(4), 5, ring)   # lock xadd [ring], rax
    w.put_lea(R11, RAX, 1)                                  # seq = k + 1
    w.put_bytes(b"\x83\xe0" + bytes((RING_RECORDS - 1,)))  # and eax, RING_RECORDS-1
    w.put_bytes(b"\x48\xc1\xe0" + bytes((RECORD.bit_length() - 1,)))  # shl rax, log2
    w.put_insn_rip(b"\x4c\x8d\x15" + bytes(4), 3, ring + RING_HEADER)  # lea r10, [records]
    w.put_bytes(b"\x4c\x01\xd0")                            # add rax, r10
    w.put_bytes(b"\x48\xc7\x00\x00\x00\x00\x00")            # mov qword [rax], 0
    for i, r in enumerate(ARG_REGS):
        w.put_bytes(_mov_store(RAX, 8 + 8 * i, r))
    w.put_bytes(_mov_load(R10, RSP, saved))                 # the return address
    w.put_bytes(_mov_store(RAX, 56, R10))
    w.put_bytes(_mov_store(RAX, 0, R11))                    # publish
    w.put_label("skip")
    for r in (R11, R10, RAX):
        w.put_pop_reg(r)
    w.put_popfq()
    w.put_lea(RSP, RSP, RED_ZONE)
    return w.finish()


def _modrm_disp(reg: int, base: int, disp: int) -> bytes:
    """ModRM (+SIB for an rsp base) and disp8/disp32 of ``[base + disp]``."""
    mod, d = (1, struct.pack("<b", disp)) if -128 <= disp < 128 else (2, struct.pack("<i", disp))
    out = bytes((mod << 6 | (reg & 7) << 3 | (base & 7),))
    if base & 7 == RSP:
        out += b"\x24"
    return out + d


def _rex(reg: int, base: int) -> bytes:
    return bytes((0x48 | (reg >> 3) << 2 | (base >> 3),))


def _mov_store(base: int, disp: int, src: int) -> bytes:
    """``mov qword [base + disp], src`` (REX.W 89 /r)."""
    return _rex(src, base) + b"\x89" + _modrm_disp(src, base, disp)


def _mov_load(dst: int, base: int, disp: int) -> bytes:
    """``mov dst, qword [base + disp]`` (REX.W 8B /r)."""
    return _rex(dst, base) + b"\x8b" + _modrm_disp(dst, base, disp)


def probe_trampoline(code: bytes, site: int, at: int, handler: Callable[[int], bytes],
                     relocator: Relocator | None = None) -> Trampoline:
    """The probe's trampoline at ``at`` for the location ``site`` (original bytes
    ``code`` from there): ``handler(at)``, then the patched instructions relocated and
    a jmp back (counting.relocate_site; CannotRelocate as it says)."""
    head = handler(at)
    tail, n, exits = relocate_site(code, site, at + len(head), relocator)
    return Trampoline(site, at, head + tail, n, exits)


def read_ring(data: bytes, last: int) -> tuple[int, list[tuple[int, list[int], int]]]:
    """The ring ``data`` (RING_BYTES read from the buffer): (records claimed so far,
    the last ``last`` complete ones as (number, [arg0..arg5], return address), oldest
    first).  A record being written, or overwritten, while it was read is left out."""
    idx, = struct.unpack_from("<Q", data, 0)
    out = []
    for k in range(max(0, idx - min(last, RING_RECORDS)), idx):
        w = struct.unpack_from("<8Q", data, RING_HEADER + (k % RING_RECORDS) * RECORD)
        if w[0] == k + 1:
            out.append((k, list(w[1:7]), w[7]))
    return idx, out
