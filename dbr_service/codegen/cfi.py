"""Call-frame information (``.eh_frame``) of a module: parse, evaluate, translate for a copy.

Replacement code executes real calls, so return addresses can point into copies of
functions.  Unwinders (C++ exceptions, ``backtrace()``, ``_Unwind_Backtrace``) find a
frame's rules by the return address, so every copy needs CFI of its own: the rows of the
original function, re-keyed to the copy's addresses, in a self-contained ``.eh_frame``
blob that the agent learns (FRAMES_ADD) before the copy is reachable and gives unwinders
through its own ``_Unwind_Find_FDE`` (dbr_agent/frames.c).

Formats: the record layout and the pointer encodings (``DW_EH_PE_*``) are the Linux
Standard Base's ``.eh_frame`` specification (LSB Core, "Exception Frames"): a sequence
of CIE and FDE records, each ``length`` (0xffffffff then a 64-bit length for 64-bit
DWARF; 0 = terminator) and a 4-byte CIE id (0) or CIE pointer (backward offset); CIE
augmentation strings ``z`` (augmentation data length), ``R`` (FDE pointer encoding),
``P`` (personality encoding + pointer), ``L`` (LSDA encoding), ``S`` (signal frame),
or the old ``eh`` form.  The instructions are DWARF 4 section 6.4 (call frame
instructions, with the GNU extensions ``DW_CFA_GNU_args_size`` and
``DW_CFA_GNU_negative_offset_extended``); :func:`evaluate` runs them to the table of
rows DWARF 6.4.1 describes.  LSDAs are in :mod:`~dbr_service.codegen.cfi_lsda`.

The parts: codegen/cfi_encoding.py (pointer encodings, LEB128, the bounds-checked
reader and the module image), codegen/cfi_parse.py (loading, records, evaluation into
rows) and this module (translation for a copy), which re-exports the API below.

API: :func:`load_eh_frame` (an ELF file) or :func:`parse_eh_frame` (bytes at an address)
give an :class:`EhFrame` (:class:`Cie`, :class:`Fde` records; ``find(addr)``);
:func:`function_ranges` gives function boundaries; :func:`evaluate` gives an FDE's
:class:`FrameTable` of :class:`Row` (``row_at(addr)``); :func:`translate` gives the
:class:`CfiBlob` for a copy laid out as pieces of the original and :class:`Glue`.

Addresses are the module's link-time virtual addresses (what ``readelf`` shows); a
translation takes the load ``bias`` and produces run-time addresses.  Hostile input
raises :class:`CfiError`: every read is bounds-checked and every loop consumes input.
Not supported (CfiError): CIE versions other than 1 and 3, augmentations without ``z``
other than ``eh``, datarel/textrel pointers (x86-64 libgcc has no base for them),
indirect pc_begin or LSDA pointers, DW_CFA opcodes outside DWARF 4 + GNU (e.g.
GNU_window_save, the LLVM address-space ones) and, for translation, anything in the
list at :func:`translate`.
"""

from __future__ import annotations

import bisect
import struct
from dataclasses import dataclass
from typing import NamedTuple

from dbr_service.codegen.cfi_encoding import (
    ABSPTR, INDIRECT, MASK64, RIP, SDATA4_PCREL, CfiError, Cur, Image, is_absolute, sleb,
    uleb)
from dbr_service.codegen.cfi_lsda import build_lsda, map_call_sites, parse_lsda
from dbr_service.codegen.cfi_parse import (
    Cfa, Cie, EhFrame, Fde, FrameTable, Row, Rule, evaluate, function_ranges, load_eh_frame,
    parse_eh_frame)

__all__ = ["CfiBlob", "CfiError", "Cfa", "Cie", "EhFrame", "Fde", "FrameTable", "Glue",
           "Image", "Row", "Rule", "check_expression", "evaluate", "function_ranges",
           "load_eh_frame", "parse_eh_frame", "sleb", "translate", "uleb"]


# --------------------------------------------------------------------------- translation

class Glue(NamedTuple):
    """Synthetic code [new_lo, new_hi) of a copy whose row (and LSDA call site) is that of
    the original address ``orig_at``."""

    new_lo: int
    new_hi: int
    orig_at: int


@dataclass(frozen=True)
class CfiBlob:
    """A self-contained ``.eh_frame`` for a copy, to be placed at ``at``.

    ``register_at`` is what ``__register_frame`` gets (the first record; the records end
    with a zero terminator, translated LSDAs follow it).  ``ranges`` are the copy's
    contiguous runs, one FDE each."""

    data: bytes
    at: int
    register_at: int
    ranges: tuple[tuple[int, int], ...]
    has_lsda: bool

    @property
    def lo(self) -> int:
        return self.ranges[0][0]

    @property
    def hi(self) -> int:
        return self.ranges[-1][1]


#: Operand sizes of the DWARF expression operations with fixed-size operands.
_OPS_FIXED = {0x03: 8, 0x08: 1, 0x09: 1, 0x0A: 2, 0x0B: 2, 0x0C: 4, 0x0D: 4, 0x0E: 8, 0x0F: 8,
              0x15: 1, 0x28: 2, 0x2F: 2, 0x94: 1, 0x95: 1, 0x98: 2, 0x99: 4, 0x9A: 4}


def check_expression(expr: bytes, what: str) -> None:
    """Raise CfiError unless a DWARF expression (DWARF 4 section 2.5) is the same wherever
    the code runs: no program-counter register, no absolute address, no call."""
    cur = Cur(expr, 0, len(expr), 0)
    while cur.pos < cur.end:
        op = cur.u8()
        reg = None
        if op in (0x03, 0x98, 0x99, 0x9A):
            raise CfiError(f"{what}: expression op {op:#x} depends on the code's location")
        if op in _OPS_FIXED:
            cur.bytes(_OPS_FIXED[op])
        elif 0x50 <= op <= 0x6F:
            reg = op - 0x50
        elif 0x70 <= op <= 0x8F:
            reg = op - 0x70
            cur.sleb()
        elif op in (0x10, 0x23, 0x93):
            cur.uleb()
        elif op in (0x11, 0x91):
            cur.sleb()
        elif op in (0x90, 0x92):
            reg = cur.uleb()
            if op == 0x92:
                cur.sleb()
        elif op == 0x9D:
            cur.uleb()
            cur.uleb()
        elif op == 0x9E:
            cur.bytes(cur.uleb())
        elif not (0x06 <= op <= 0x9F):
            raise CfiError(f"{what}: unknown expression op {op:#x}")
        if reg == RIP:
            raise CfiError(f"{what}: expression reads the program counter")


def _check_row(row: Row, what: str) -> None:
    if row.cfa.reg is None:
        if not row.cfa.expr:
            raise CfiError(f"{what}: no CFA rule")
        check_expression(row.cfa.expr, what)
    elif row.cfa.reg == RIP:
        raise CfiError(f"{what}: CFA based on the program counter")
    for reg, rule in row.regs:
        if rule.kind in ("expression", "val_expression"):
            check_expression(rule.arg, what)
        elif rule.kind == "register" and rule.arg == RIP:
            raise CfiError(f"{what}: register {reg} holds the program counter")


def _program(rows: list[Row], data_align: int) -> bytes:
    """CFA instructions producing exactly ``rows`` (contiguous) from an empty CIE state."""
    out = bytearray()
    cfa, regs, args, loc = Cfa(None, 0, b""), {}, 0, rows[0].start
    for row in rows:
        d = row.start - loc
        if d:
            if d < 0x40:
                out.append(0x40 | d)
            else:
                for op, fmt, lim in ((2, "<B", 1 << 8), (3, "<H", 1 << 16), (4, "<I", 1 << 32)):
                    if d < lim:
                        out += bytes([op]) + struct.pack(fmt, d)
                        break
                else:
                    raise CfiError("copy larger than 4 GiB")
        loc = row.start
        if row.cfa != cfa:
            c = row.cfa
            if c.reg is None:
                out += b"\x0f" + uleb(len(c.expr)) + c.expr
            elif cfa.reg == c.reg and c.offset >= 0:
                out += b"\x0e" + uleb(c.offset)
            elif cfa.reg is not None and cfa.offset == c.offset:
                out += b"\x0d" + uleb(c.reg)
            elif c.offset >= 0:
                out += b"\x0c" + uleb(c.reg) + uleb(c.offset)
            else:
                out += b"\x12" + uleb(c.reg) + sleb(c.offset // data_align)
            cfa = c
        new = dict(row.regs)
        for reg in sorted(regs.keys() - new.keys()):
            out += bytes([0xC0 | reg]) if reg < 64 else b"\x06" + uleb(reg)
        for reg, rule in row.regs:
            if regs.get(reg) == rule:
                continue
            k, a = rule
            if k == "undefined":
                out += b"\x07" + uleb(reg)
            elif k == "same":
                out += b"\x08" + uleb(reg)
            elif k == "register":
                out += b"\x09" + uleb(reg) + uleb(a)
            elif k in ("expression", "val_expression"):
                out += (b"\x10" if k == "expression" else b"\x16") + uleb(reg) + uleb(len(a)) + a
            elif k == "offset" and a // data_align >= 0:
                f = a // data_align
                out += bytes([0x80 | reg]) + uleb(f) if reg < 64 else b"\x05" + uleb(reg) + uleb(f)
            else:
                out += (b"\x11" if k == "offset" else b"\x15") + uleb(reg) + sleb(a // data_align)
        regs = new
        if row.args_size != args:
            out += b"\x2e" + uleb(row.args_size)
            args = row.args_size
    return bytes(out)


def _record(body: bytes) -> bytes:
    body += b"\0" * (-(len(body) + 4) % 8)            # DW_CFA_nop padding
    return struct.pack("<I", len(body)) + body


def translate(fde: Fde, layout, at: int, *, bias: int = 0,
              image: Image | None = None) -> CfiBlob:
    """CFI for a copy of (parts of) ``fde``'s function, as an ``.eh_frame`` blob at ``at``.

    ``layout``: items ``(new_lo, new_hi, orig_lo)`` (copy bytes [new_lo, new_hi) are the
    original's from ``orig_lo``; link-time original addresses, run-time copy addresses)
    or :class:`Glue`.  At every copy address the blob's row equals the original's row at
    the mapped address, and with an LSDA its call-site entry (landing pads stay at the
    original's addresses + ``bias``).  One FDE per contiguous run of the copy.  ``at``
    must be 8-aligned; free the blob only after ``__deregister_frame(register_at)``.

    Raises CfiError when the result would not be faithful: a row whose CFA or register
    rule reads the program counter (a PLT stub's CFA expression) or uses DW_OP_addr or a
    DW_OP_call; a layout item outside the FDE or overlapping another (a Glue's
    ``orig_at`` must lie inside the FDE too); an unknown CIE augmentation letter; an
    absolute (non-pcrel) personality, LSDA, landing-pad or type pointer in a module
    that is relocated (``bias`` != 0 or position-independent); an LSDA it cannot parse
    (pc-relative call-site encoding, uleb type entries, filters without a type table)."""
    cie, what = fde.cie, f"FDE at {fde.addr:#x}"
    if at % 8:
        raise CfiError(f"blob address {at:#x} not 8-byte aligned (libgcc reads it aligned)")
    if not cie.known:
        raise CfiError(f"{what}: unknown CIE augmentation {cie.augmentation!r}")
    image = image or fde.image
    pic = image.pic if image is not None else False

    def runtime(value: int, enc: int, name: str) -> int:
        if value and is_absolute(enc) and (bias or pic):
            raise CfiError(f"{what}: absolute {name} in a relocated module")
        return (value + bias) & MASK64 if value else 0

    table = evaluate(fde)
    pieces = sorted((tuple(it) + (isinstance(it, Glue),) for it in layout), key=lambda p: p[0])
    if not pieces:
        raise CfiError(f"{what}: empty layout")
    runs: list[list[tuple]] = []
    for p in pieces:
        lo, hi, orig, glue = p
        n = 1 if glue else hi - lo
        if not 0 <= lo < hi <= MASK64 or orig < fde.start or orig + n > fde.end:
            raise CfiError(f"{what}: layout item {p[:3]} outside [{fde.start:#x}, {fde.end:#x})")
        if runs and lo < runs[-1][-1][1]:
            raise CfiError(f"{what}: layout items overlap at {lo:#x}")
        if runs and lo == runs[-1][-1][1]:
            runs[-1].append(p)
        else:
            runs.append([p])
    run_rows = []
    for run in runs:
        rows: list[Row] = []
        for lo, hi, orig, glue in run:
            if glue:
                segs = [(lo, hi, table.row_at(orig))]
            else:
                segs, n = [], hi - lo
                i = max(bisect.bisect_right(table._starts, orig) - 1, 0)
                while i < len(table.rows) and table.rows[i].start < orig + n:
                    r = table.rows[i]
                    a, b = max(r.start, orig), min(r.end, orig + n)
                    if a < b:
                        segs.append((lo + a - orig, lo + b - orig, r))
                    i += 1
            for a, b, r in segs:
                if r is None:
                    raise CfiError(f"{what}: no row at {orig:#x}")
                _check_row(r, f"{what} at {r.start:#x}")
                if rows and rows[-1].end == a and rows[-1].state() == r.state():
                    rows[-1] = Row(rows[-1].start, b, *r.state())
                else:
                    rows.append(Row(a, b, *r.state()))
        if not rows or rows[0].start != run[0][0] or rows[-1].end != run[-1][1] or any(
                x.end != y.start for x, y in zip(rows, rows[1:])):
            raise CfiError(f"{what}: rows do not cover the copy")
        run_rows.append(rows)

    lsda = None
    if fde.lsda is not None:
        if pic and is_absolute(cie.lsda_enc):
            raise CfiError(f"{what}: absolute LSDA pointer in a position-independent module")
        if image is None:
            raise CfiError(f"{what}: LSDA at {fde.lsda:#x} but no module image to read it")
        lsda = parse_lsda(image, fde.lsda, fde.start, cie.fde_enc)
    data_align = -8 if all(not r.cfa.offset % 8 and all(
        rule.kind not in ("offset", "val_offset") or not rule.arg % 8 for _, rule in r.regs)
        for rows in run_rows for r in rows) else -1
    aug = "z" + ("P" if cie.personality is not None else "") + ("L" if lsda else "") + "R" \
        + ("S" if cie.signal else "")
    augdata = b""
    if cie.personality is not None:
        pers = runtime(cie.personality, cie.personality_enc, "personality")
        augdata += bytes([INDIRECT if cie.personality_enc & INDIRECT else ABSPTR])
        augdata += struct.pack("<Q", pers)
    far = any(abs(run[0][0] - at) >= 1 << 30 or run[-1][1] - run[0][0] >= 1 << 31
              for run in runs)
    fde_enc = ABSPTR if far else SDATA4_PCREL
    augdata += (bytes([SDATA4_PCREL]) if lsda else b"") + bytes([fde_enc])
    ra = bytes([cie.ra_reg]) if cie.ra_reg < 256 else None
    if ra is None:
        raise CfiError(f"{what}: return-address register {cie.ra_reg}")
    out = bytearray(_record(b"\0\0\0\0\x01" + aug.encode() + b"\0" + uleb(1)
                            + sleb(data_align) + ra + uleb(len(augdata)) + augdata))
    fde_fixups, want_sites = [], []
    for run, rows in zip(runs, run_rows):
        rec = len(out)
        lo, hi = run[0][0], run[-1][1]
        body = bytearray(struct.pack("<I", rec + 4))
        field_addr = at + rec + 8
        body += struct.pack("<Q", lo) if far else struct.pack("<i", lo - field_addr)
        body += struct.pack("<Q" if far else "<I", hi - lo)
        if lsda:
            body += uleb(4)
            fde_fixups.append((rec + 4 + len(body), run, lo, hi))
            body += b"\0\0\0\0"
        else:
            body += uleb(0)
        body += _program(rows, data_align)
        out += _record(bytes(body))
    out += b"\0\0\0\0"
    for fix, run, lo, hi in fde_fixups:
        sites = map_call_sites(lsda, run)
        want_sites.append([(a, b, runtime(lp, lsda.lp_enc, "landing pad") if lp else 0, act)
                           for a, b, lp, act in sites])
        blob = build_lsda(lsda, sites, lo, runtime)
        out += b"\0" * (-len(out) % 4)
        struct.pack_into("<i", out, fix, len(out) - fix)
        out += blob
    result = CfiBlob(bytes(out), at, at, tuple((r[0][0], r[-1][1]) for r in runs), bool(lsda))
    _verify(result, run_rows, want_sites)
    return result


def _verify(blob: CfiBlob, run_rows: list[list[Row]], sites: list) -> None:
    """Re-parse the blob as libgcc would and check every row and call site (a cheap guard
    against an encoder bug shipping wrong CFI)."""
    eh = parse_eh_frame(blob.data, blob.at, stop_at_terminator=True)
    got = [[(r.start, r.end, r.state()) for r in evaluate(f).rows] for f in eh.fdes]
    want = [[(r.start, r.end, r.state()) for r in rows] for rows in run_rows]
    if sites:
        image = Image.from_bytes(blob.at, blob.data)
        got.append([[(c.start, c.end, c.landing_pad, c.action) for c in
                     parse_lsda(image, f.lsda, f.start, f.cie.fde_enc).call_sites]
                    for f in eh.fdes])
        want.append([[s for s in run if s[1] > s[0]] for run in sites])
    if got != want:
        raise CfiError("translated CFI does not reproduce the original rows")
