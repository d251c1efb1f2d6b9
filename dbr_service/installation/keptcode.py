"""A region's code emitted ahead, kept with the fields that depend on where the code
and its module are, so that a client places it by moving those fields instead of
emitting it (docs/decisions/0043-kept-code.md).

A selection made ahead from a module's file, or a warm job's selection kept for the
next processes (profiles/warmprep.py kept_codes, in a worker), emits each region at
a code address ``base`` (a page GAP beyond its module) and finds its fields by
emitting it again: with the code moved by CODE_STEP, and with code and module moved
together by BOTH_STEP (a module mapped below 4 GiB, at its link address, does not
move).  Every byte that differs belongs to one field:

* ``REL32``: a rel32 from the code to the module (an exit, a data operand, a real
  call, a pc-relative pointer of the unwind information): moves by the module's
  displacement minus the code's;
* ``CODE64``: an absolute address of the code itself: moves with the code;
* ``BACK32``: a 32-bit offset from the module to the code (a dispatch table's
  base), or, where the module does not move, an absolute address of the code below
  4 GiB: moves by the code's displacement minus the module's;
* ``MOD64``: an absolute address in the module (a return address a call pushes, a
  table of targets): moves with the module.

A byte that changes in any other way, a length that differs, a far-exit stub, a call
to a live copy or an address outside the region's own module (modules move apart
between processes): nothing is kept.  The fields found are then checked on a fourth
emission at other places: the kept bytes with their fields moved there must be that
emission's bytes exactly, else nothing is kept.  Emission is deterministic in the
region and its two addresses, so a field list that predicts an emission it was not
made from is the emission's whole dependence on them.

A client places a kept region only in a chunk whose address has the same alignment
as ``base`` to codegen's ALIGN (loop heads and unwind records keep theirs); the placed
code is decoded and checked as emitted code is (codegen/emit.py ``check_generated``),
the region's copied bytes were compared with the client's code before
(installation/optimize.py ``check_original``), and the agent checks every patch site.
"""

from __future__ import annotations

import dataclasses
import struct
from dataclasses import dataclass
from typing import Any, Callable

from dbr_service.codegen.cfi import CfiBlob
from dbr_service.codegen.emit import GeneratedCode
from dbr_service.codegen.frames import blobs_size
from dbr_service.codegen.layout import ALIGN
from dbr_service.common.errors import CodegenError
from dbr_service.region.model import CloneKey, SuperRegion

REL32, CODE64, BACK32, MOD64 = "rel32", "code64", "back32", "mod64"
#: The code moved alone (in rel32 reach of the module), and code and module moved
#: together (down: PREP_BASE is near the top of the user address space).  Page
#: multiples whose other bytes are all non-zero, so that every byte of a field but the
#: lowest changes.
CODE_STEP = 0x1111_1000
BOTH_STEP = -0x1111_1111_1000
#: The places the fields are checked at (another code offset, another module place).
CHECK_CODE, CHECK_BOTH = 0x0765_4000, -0x0222_2222_3000
#: The kept code's own distance from its module's highest byte.
GAP = 0x0100_0000

_FIELDS = {REL32: 4, CODE64: 8, BACK32: 4, MOD64: 8}


@dataclass(frozen=True)
class KeptCode:
    """One region's code and unwind information as emitted at ``base`` while its
    lowest block was at ``anchor``, with the fields that move (offset, kind)."""

    #: rebase (profiles/rebase.py) keeps it as it is: placing it moves it.
    REBASE_AS_IS = True

    image: bytes
    base: int
    anchor: int
    fixups: tuple[tuple[int, str], ...]
    gen: GeneratedCode
    blobs: tuple[CfiBlob, ...]
    cfi_refused: str | None
    #: Its module moves between processes (position independent); one that does not
    #: was not moved to find the fields, and is placed only where it has not moved.
    movable: bool = True

    @property
    def size(self) -> int:
        return len(self.image)


def anchor_of(sr: SuperRegion) -> int:
    """The region's lowest original block address: it moves with the module."""
    return min(bb.start for _, bb in sr.blocks())


def _image(gen: GeneratedCode, blobs: list[CfiBlob]) -> bytes:
    out = bytearray(gen.code)
    out.extend(bytes(blobs_size(blobs, gen.base + gen.size)))
    for b in blobs:
        at = b.at - gen.base
        out[at:at + len(b.data)] = b.data
    return bytes(out)


def _int(buf: bytes, at: int, width: int) -> int:
    return int.from_bytes(buf[at:at + width], "little")


def find_fixups(a: bytes, code: bytes, both: bytes | None, dc: int, db: int
                ) -> list[tuple[int, str]] | None:
    """The fields of image ``a`` from its emissions with the code moved by ``dc``
    (``code``) and with code and module moved by ``db`` (``both``; None: the module
    does not move); None when a changed byte fits no field."""
    if len(code) != len(a) or (both is not None and len(both) != len(a)):
        return None
    out: list[tuple[int, str]] = []
    covered: set[int] = set()
    m64 = (1 << 64) - 1
    for p in range(len(a)):
        if both is None or p in covered or both[p] == a[p]:
            continue
        s = p - 1                       # the steps leave a field's lowest byte alone
        if s < 0 or s + 8 > len(a) or (_int(both, s, 8) - _int(a, s, 8)) & m64 != db & m64:
            return None
        d = (_int(code, s, 8) - _int(a, s, 8)) & m64
        kind = CODE64 if d == dc & m64 else MOD64 if d == 0 else None
        if kind is None:
            return None
        out.append((s, kind))
        covered.update(range(s, s + 8))
    m32 = (1 << 32) - 1
    for p in range(len(a)):
        if p in covered or code[p] == a[p]:
            continue
        s = p - 1
        if s < 0 or s + 4 > len(a) or covered & set(range(s, s + 4)):
            return None
        d = (_int(code, s, 4) - _int(a, s, 4)) & m32
        kind = REL32 if d == -dc & m32 else BACK32 if d == dc & m32 else None
        if kind is None:
            return None
        out.append((s, kind))
        covered.update(range(s, s + 4))
    return sorted(out)


def moved_image(image: bytes, fixups: tuple[tuple[int, str], ...] | list, dc: int,
                dm: int, movable: bool = True) -> bytes | None:
    """``image`` with its fields moved for code moved by ``dc`` and module by ``dm``;
    None when a field's new value does not fit it (the place is out of reach).
    ``movable``: the module moves (a BACK32 is a signed offset, else an address)."""
    out = bytearray(image)
    for at, kind in fixups:
        width = _FIELDS[kind]
        if kind in (REL32, BACK32) and (kind == REL32 or movable):
            v = struct.unpack_from("<i", out, at)[0] + (dm - dc if kind == REL32 else dc - dm)
            if not -(1 << 31) <= v < 1 << 31:
                return None
            struct.pack_into("<i", out, at, v)
            continue
        v = _int(out, at, width) + (dm if kind == MOD64 else dc - dm if kind == BACK32 else dc)
        if not 0 <= v < 1 << (8 * width):
            return None
        out[at:at + width] = v.to_bytes(width, "little")
    return bytes(out)


def _key(k: Any, dm: int) -> Any:
    if isinstance(k, CloneKey):
        return CloneKey(tuple(a + dm for a in k.path), k.start + dm)
    return k + dm if isinstance(k, int) else k


#: GeneratedCode's fields and how each moves; a field added there needs its rule here
#: (tests/unit/test_kept_code.py checks the list).
GEN_FIELDS = ("code", "base", "entries", "addr_map", "exits", "dynamic_exits",
              "block_addr", "layout", "layout_kind", "reach_ok", "far_exits", "data_start",
              "data_refs", "transfers", "evictions", "calls", "returns", "call_copies",
              "counting", "counted_sides")


def moved_gen(gen: GeneratedCode, code: bytes, dc: int, dm: int, size: int) -> GeneratedCode:
    """``gen``'s record for its code moved by ``dc`` (bytes ``code``; ``size`` bytes
    with its unwind information) and its module by ``dm``."""
    def c(x: int) -> int:
        return x + dc

    def o(x: int) -> int:
        return x + dm

    def ref(x: int) -> int:                 # a data operand: its own table, or the module's
        return x + (dc if gen.base <= x < gen.base + size else dm)

    return dataclasses.replace(
        gen, code=code, base=c(gen.base),
        entries={o(k): c(v) for k, v in gen.entries.items()},
        addr_map=[(c(s), c(e), o(x)) for s, e, x in gen.addr_map],
        exits=[(c(a), o(t)) for a, t in gen.exits],
        dynamic_exits=[c(a) for a in gen.dynamic_exits],
        block_addr={_key(k, dm): c(v) for k, v in gen.block_addr.items()},
        layout=[_key(k, dm) for k in gen.layout],
        data_refs=[ref(x) for x in gen.data_refs],
        transfers={o(k): c(v) for k, v in gen.transfers.items()},
        evictions={c(k): o(v) for k, v in gen.evictions.items()},
        calls={c(k): o(v) for k, v in gen.calls.items()},
        returns={c(k): o(v) for k, v in gen.returns.items()})


def placed(kept: KeptCode, sr: SuperRegion, addr: int
           ) -> tuple[GeneratedCode, list[CfiBlob]] | None:
    """``kept`` (made for ``sr`` where it was selected) for a chunk at ``addr``, with
    ``sr`` where the client has it: (the code's record, its unwind information); None
    when that place does not suit it (alignment, a field out of reach)."""
    dc, dm = addr - kept.base, anchor_of(sr) - kept.anchor
    if dc % ALIGN or (dm and not kept.movable):
        return None
    image = moved_image(kept.image, kept.fixups, dc, dm, kept.movable)
    if image is None:
        return None
    n = kept.gen.size
    blobs = [CfiBlob(image[b.at - kept.base:b.at - kept.base + len(b.data)], b.at + dc,
                     b.register_at + dc, tuple((lo + dc, hi + dc) for lo, hi in b.ranges),
                     b.has_lsda) for b in kept.blobs]
    return moved_gen(kept.gen, image[:n], dc, dm, kept.size), blobs


Emit = Callable[[SuperRegion, int, int], tuple[GeneratedCode, list[CfiBlob], str | None]]


def _within(gen: GeneratedCode, lo: int, hi: int, size: int) -> bool:
    """Whether every original address the code was made from (its instructions, exit
    targets, data operands other than its own tables in its ``size`` bytes) lies in
    [lo, hi): one module, which moves as a whole."""
    addrs = [x for _, _, x in gen.addr_map] + [t for _, t in gen.exits] + \
        module_refs(gen.data_refs, gen.base, size)
    return all(lo <= a < hi for a in addrs)


def module_refs(refs: list[int], base: int, size: int) -> list[int]:
    """The data operands of code at ``base`` (``size`` bytes) that are not its own
    (dispatch tables, return-address slots): those in its module."""
    return [x for x in refs if not base <= x < base + size]


def keep(sr: SuperRegion, base: int, module: tuple[int, int], movable: bool,
         emit: Emit) -> KeptCode | None:
    """``sr``'s code emitted at ``base`` and its fields (the module's docstring), or
    None when they cannot be found, do not predict the check emission, or the code
    reaches outside its ``module`` (its [lo, hi) span: another module moves apart).
    ``emit(sr, code_at, module_shift)``: (code, unwind blobs, why real calls were
    given up) with the module moved by ``module_shift`` (CodegenError if it cannot
    be); ``movable``: whether the module is position independent."""
    try:
        gen, blobs, why = emit(sr, base, 0)
        a = _image(gen, blobs)
        if gen.far_exits or gen.call_copies or gen.counting is not None or \
                not _within(gen, *module, len(a)):
            return None
        code = _image(*emit(sr, base + CODE_STEP, 0)[:2])
        both = _image(*emit(sr, base + BOTH_STEP, BOTH_STEP)[:2]) if movable else None
        fixups = find_fixups(a, code, both, CODE_STEP, BOTH_STEP)
        if fixups is None:
            return None
        shift = CHECK_BOTH if movable else 0
        want = _image(*emit(sr, base + shift + CHECK_CODE, shift)[:2])
    except CodegenError:
        return None
    if moved_image(a, fixups, shift + CHECK_CODE, shift, movable) != want:
        return None
    return KeptCode(a, base, anchor_of(sr), tuple(fixups), gen, tuple(blobs), why, movable)
