"""``.eh_frame`` of a module: load and parse its records, evaluate an FDE into rows.

:func:`load_eh_frame` (an ELF file) and :func:`parse_eh_frame` (bytes at an address)
give an :class:`EhFrame` of :class:`Cie` and :class:`Fde` records; :func:`evaluate`
runs an FDE's program into a :class:`FrameTable` of :class:`Row`.  Formats and limits
are described in codegen/cfi.py, which re-exports these names.
"""

from __future__ import annotations

import bisect
import os
import struct
from dataclasses import dataclass, field
from typing import NamedTuple

from dbr_service.codegen.cfi_encoding import (
    ABSPTR, INDIRECT, MASK64, OMIT, CfiError, Cur, Image)


def _elf_tables(path: str):
    """ELF64 little-endian x86-64 header fields, sections and program headers."""
    with open(path, "rb") as f:
        eh = f.read(64)
        if len(eh) < 64 or eh[:4] != b"\x7fELF" or eh[4] != 2 or eh[5] != 1:
            raise CfiError(f"{path}: not a little-endian ELF64 file")
        (etype, machine, _v, _e, phoff, shoff, _fl, _eh, phentsize, phnum, shentsize, shnum,
         shstrndx) = struct.unpack_from("<HHIQQQIHHHHHH", eh, 16)
        if machine != 62:
            raise CfiError(f"{path}: not x86-64 (e_machine {machine})")
        size = os.fstat(f.fileno()).st_size

        def table(off: int, entsize: int, num: int, minsize: int) -> bytes:
            if not num:
                return b""
            if entsize < minsize or off + entsize * num > size:
                raise CfiError(f"{path}: header table outside the file")
            f.seek(off)
            return f.read(entsize * num)

        raw = table(phoff, phentsize, phnum, 56)
        phdrs = [struct.unpack_from("<IIQQQQQQ", raw, i * phentsize) for i in range(phnum)]
        secs = {}
        if shoff:
            first = table(shoff, shentsize, 1, 64)
            sh0 = struct.unpack_from("<IIQQQQIIQQ", first)
            shnum = shnum or sh0[5]
            shstrndx = sh0[6] if shstrndx == 0xFFFF else shstrndx
            raw = table(shoff, shentsize, shnum, 64)
            shdrs = [struct.unpack_from("<IIQQQQIIQQ", raw, i * shentsize) for i in range(shnum)]
            if shstrndx < shnum:
                names = shdrs[shstrndx]
                strtab = table(names[4], 1, names[5], 1)
                for sh in shdrs:
                    end = strtab.find(b"\0", sh[0])
                    if 0 <= sh[0] < len(strtab) and end >= 0:
                        secs.setdefault(strtab[sh[0]:end].decode("latin-1"), sh)
        return etype, phdrs, secs


def load_eh_frame(path: str) -> EhFrame:
    """Parse the ``.eh_frame`` of the ELF file at ``path`` (found by its section header,
    or, without section headers, through PT_GNU_EH_FRAME's ``.eh_frame_hdr``)."""
    etype, phdrs, secs = _elf_tables(path)
    image = Image(path, [(p[3], p[2], p[5]) for p in phdrs if p[0] == 1], pic=etype == 3)
    sh = secs.get(".eh_frame")
    if sh is not None and sh[1] != 8:                  # not SHT_NOBITS
        with open(path, "rb") as f:
            f.seek(sh[4])
            data = f.read(sh[5])
        if len(data) != sh[5]:
            raise CfiError(f"{path}: .eh_frame outside the file")
        return parse_eh_frame(data, sh[3], image=image)
    hdr = next((p for p in phdrs if p[0] == 0x6474E550), None)
    if hdr is None:
        return parse_eh_frame(b"", 0, image=image)
    cur = image.cursor(hdr[3])
    if cur.u8() != 1:
        raise CfiError(f"{path}: unknown .eh_frame_hdr version")
    enc = cur.u8()
    cur.pos += 2
    addr, ind = cur.ptr(enc)
    if ind:
        raise CfiError(f"{path}: indirect eh_frame_ptr")
    cur = image.cursor(addr)
    return parse_eh_frame(cur.buf[cur.pos:], addr, image=image, stop_at_terminator=True)


# --------------------------------------------------------------------------- records

@dataclass(frozen=True)
class Cie:
    """A Common Information Entry.  ``personality`` is the resolved pointer (the address
    of the slot holding the routine when ``personality_enc`` is indirect)."""

    addr: int
    version: int
    augmentation: str
    code_align: int
    data_align: int
    ra_reg: int
    initial: bytes
    fde_enc: int = ABSPTR
    lsda_enc: int = OMIT
    personality_enc: int = OMIT
    personality: int | None = None
    signal: bool = False
    #: False when a ``z`` augmentation had letters this parser does not know (skipped).
    known: bool = True


@dataclass(frozen=True)
class Fde:
    """A Frame Description Entry: code [start, end), its program, its LSDA address."""

    addr: int
    cie: Cie
    start: int
    end: int
    instructions: bytes
    #: Address of the first instruction byte (DW_CFA_set_loc may be pc-relative).
    insn_addr: int
    lsda: int | None = None
    image: Image | None = field(default=None, compare=False, repr=False)


@dataclass
class EhFrame:
    """The parsed ``.eh_frame`` of a module: CIEs by address, FDEs sorted by start."""

    addr: int
    cies: dict[int, Cie]
    fdes: list[Fde]
    image: Image | None = None

    def __post_init__(self) -> None:
        self.fdes.sort(key=lambda f: (f.start, f.end))
        self._starts = [f.start for f in self.fdes]

    def find(self, addr: int) -> Fde | None:
        """The FDE covering ``addr`` (None if none)."""
        i = bisect.bisect_right(self._starts, addr)
        for j in range(i - 1, max(i - 9, -1), -1):      # a few back: nested FDEs
            if self.fdes[j].start <= addr < self.fdes[j].end:
                return self.fdes[j]
        return None


def parse_eh_frame(data: bytes, addr: int, *, image: Image | None = None,
                   stop_at_terminator: bool = False) -> EhFrame:
    """Parse an ``.eh_frame`` section whose first byte is at address ``addr``.

    Zero terminators are skipped (a linked section can hold several) unless
    ``stop_at_terminator`` (libgcc's view of a registered frame, and of a section whose
    size is unknown).  FDEs with a null pc_begin (discarded link-once code) are kept but
    cover nothing."""
    buf = memoryview(bytes(data))
    cies: dict[int, Cie] = {}
    fdes = []
    pos = 0
    while pos < len(buf):
        rec, end = _record_at(buf, pos, addr)
        if rec is None:
            if stop_at_terminator:
                break
            pos = end
            continue
        cid = rec.fixed("<I", 4)
        if cid == 0:
            if pos not in cies:
                cies[pos] = _parse_cie(rec, addr + pos)
        else:
            cpos = rec.pos - 4 - cid
            if cpos < 0:
                raise CfiError(f"FDE at {addr + pos:#x}: CIE pointer before the section")
            if cpos not in cies:
                crec, _ = _record_at(buf, cpos, addr)
                if crec is None or crec.fixed("<I", 4) != 0:
                    raise CfiError(f"CIE pointer to {addr + cpos:#x}: not a CIE")
                cies[cpos] = _parse_cie(crec, addr + cpos)
            fdes.append(_parse_fde(rec, addr + pos, cies[cpos], image))
        pos = end
    return EhFrame(addr, {addr + k: v for k, v in cies.items()}, fdes, image)


def _record_at(buf, pos: int, addr: int) -> tuple[Cur | None, int]:
    """The record at ``pos``: a reader over its body (None for a zero terminator), and
    the offset after it."""
    cur = Cur(buf, pos, len(buf), addr)
    length = cur.fixed("<I", 4)
    if length == 0:
        return None, cur.pos
    if length == 0xFFFFFFFF:
        length = cur.fixed("<Q", 8)
    cur.need(length)
    if length < 4:
        raise CfiError(f"record at {addr + pos:#x} shorter than its id")
    return Cur(buf, cur.pos, cur.pos + length, addr), cur.pos + length


def _parse_cie(cur: Cur, at: int) -> Cie:
    version = cur.u8()
    if version not in (1, 3):
        raise CfiError(f"CIE at {at:#x}: version {version}")
    aug = cur.cstr()
    if aug.startswith("eh"):
        cur.bytes(8)                                    # old g++ eh_ptr
        aug = aug[2:]
    code_align, data_align = cur.uleb(), cur.sleb()
    ra = cur.u8() if version == 1 else cur.uleb()
    kw: dict = {}
    known = True
    if aug.startswith("z"):
        n = cur.uleb()
        cur.need(n)
        aug_end = cur.pos + n
        data = Cur(cur.buf, cur.pos, aug_end, cur.base)
        for ch in aug[1:]:
            if ch == "R":
                kw["fde_enc"] = data.u8()
            elif ch == "L":
                kw["lsda_enc"] = data.u8()
            elif ch == "P":
                enc = kw["personality_enc"] = data.u8()
                kw["personality"], _ = data.ptr(enc)
            elif ch == "S":
                kw["signal"] = True
            else:
                known = False
                break
        cur.pos = aug_end
    elif aug:
        raise CfiError(f"CIE at {at:#x}: augmentation {aug!r} without 'z'")
    return Cie(at, version, aug, code_align, data_align, ra, cur.bytes(cur.end - cur.pos),
               known=known, **kw)


def _parse_fde(cur: Cur, at: int, cie: Cie, image: Image | None) -> Fde:
    if cie.fde_enc & INDIRECT:
        raise CfiError(f"FDE at {at:#x}: indirect pc_begin encoding")
    start, _ = cur.ptr(cie.fde_enc)
    size = cur.size_value(cie.fde_enc)
    lsda = None
    if cie.augmentation.startswith("z"):
        n = cur.uleb()
        cur.need(n)
        aug_end = cur.pos + n
        if cie.lsda_enc != OMIT and cie.known:
            data = Cur(cur.buf, cur.pos, aug_end, cur.base)
            lsda, ind = data.ptr(cie.lsda_enc)
            if ind:
                raise CfiError(f"FDE at {at:#x}: indirect LSDA pointer")
        cur.pos = aug_end
    end = start + size if start else 0
    if end > MASK64:
        raise CfiError(f"FDE at {at:#x}: range wraps around")
    insn_addr = cur.addr
    return Fde(at, cie, start, end, cur.bytes(cur.end - cur.pos), insn_addr, lsda or None,
               image)


def function_ranges(module: str | EhFrame) -> list[tuple[int, int]]:
    """Sorted, non-overlapping (start, end) code ranges of a module's FDEs (link-time
    addresses): function boundaries.  Overlapping FDEs are merged into one range."""
    eh = load_eh_frame(module) if isinstance(module, str | os.PathLike) else module
    out: list[list[int]] = []
    for f in eh.fdes:
        if f.start and f.end > f.start:
            if out and f.start < out[-1][1]:
                out[-1][1] = max(out[-1][1], f.end)
            else:
                out.append([f.start, f.end])
    return [(a, b) for a, b in out]


# --------------------------------------------------------------------------- rows

class Rule(NamedTuple):
    """A register's rule: kind is ``undefined``, ``same``, ``offset`` (saved at CFA+arg),
    ``val_offset`` (value CFA+arg), ``register`` (in register arg), ``expression`` or
    ``val_expression`` (arg = the DWARF expression bytes).  Unspecified = no rule."""

    kind: str
    arg: int | bytes = 0


class Cfa(NamedTuple):
    """The CFA rule: register + offset, or a DWARF expression (reg None)."""

    reg: int | None
    offset: int = 0
    expr: bytes | None = None


@dataclass(frozen=True)
class Row:
    """The rules in force for addresses [start, end).  ``regs`` is sorted by register;
    ``args_size`` is DW_CFA_GNU_args_size's value (libgcc keeps it out of remembered state)."""

    start: int
    end: int
    cfa: Cfa
    regs: tuple[tuple[int, Rule], ...]
    args_size: int = 0

    def rule(self, reg: int) -> Rule | None:
        return dict(self.regs).get(reg)

    def state(self) -> tuple:
        """Everything but the address range (rows with equal states are the same row)."""
        return self.cfa, self.regs, self.args_size


class FrameTable:
    """The rows of one FDE, sorted and contiguous over [fde.start, fde.end)."""

    def __init__(self, fde: Fde, rows: list[Row]):
        self.fde, self.rows = fde, rows
        self._starts = [r.start for r in rows]

    def row_at(self, addr: int) -> Row | None:
        i = bisect.bisect_right(self._starts, addr) - 1
        return self.rows[i] if i >= 0 and addr < self.rows[i].end else None


def evaluate(fde: Fde) -> FrameTable:
    """Run the CIE's initial instructions and the FDE's program (DWARF 4 section 6.4.2)
    into rows.  Instructions past the end of the FDE's range are not run (libgcc stops
    at the target address too)."""
    cie = fde.cie
    st = _State()
    _run(st, cie.initial, 0, cie, None, 0, [])
    initial = dict(st.regs)
    rows: list[Row] = []
    st.initial = initial
    _run(st, fde.instructions, fde.insn_addr, cie, fde, fde.start, rows)
    return FrameTable(fde, rows)


class _State:
    def __init__(self):
        self.cfa = Cfa(None, 0, b"")            # no CFA rule yet (an empty expression)
        self.regs: dict[int, Rule] = {}
        self.args_size = 0
        self.stack: list[tuple[Cfa, dict[int, Rule]]] = []
        self.initial: dict[int, Rule] = {}


def _run(st: _State, prog: bytes, prog_addr: int, cie: Cie, fde: Fde | None, loc: int,
         rows: list[Row]) -> None:
    cur = Cur(prog, 0, len(prog), prog_addr)
    ca, da = cie.code_align, cie.data_align
    end = fde.end if fde else 0

    def emit(upto: int) -> None:
        nonlocal loc
        if upto < loc:
            raise CfiError(f"FDE at {fde.addr:#x}: location moves backwards")
        hi = min(upto, end)
        if hi > loc:
            state = (st.cfa, tuple(sorted(st.regs.items())), st.args_size)
            if rows and rows[-1].state() == state and rows[-1].end == loc:
                rows[-1] = Row(rows[-1].start, hi, *state)
            else:
                rows.append(Row(loc, hi, *state))
        loc = upto

    def cfa_reg_only(what: str) -> None:
        if st.cfa.reg is None:
            raise CfiError(f"{what} while the CFA is not register-based")

    while cur.pos < cur.end:
        if fde is not None and loc >= end:
            return
        op = cur.u8()
        hi2, low = op & 0xC0, op & 0x3F
        if hi2 == 0x40:
            if fde is None:
                raise CfiError(f"CIE at {cie.addr:#x}: advance in initial instructions")
            emit(loc + low * ca)
        elif hi2 == 0x80:
            st.regs[low] = Rule("offset", cur.uleb() * da)
        elif hi2 == 0xC0:
            _restore(st, low)
        elif op in (0x01, 0x02, 0x03, 0x04, 0x1D):
            if fde is None:
                raise CfiError(f"CIE at {cie.addr:#x}: advance in initial instructions")
            if op == 0x01:
                v, ind = cur.ptr(cie.fde_enc)
                if ind:
                    raise CfiError("indirect DW_CFA_set_loc")
                emit(v)
            else:
                emit(loc + cur.fixed(*{2: ("<B", 1), 3: ("<H", 2), 4: ("<I", 4),
                                       0x1D: ("<Q", 8)}[op]) * ca)
        elif op == 0x00:
            pass
        elif op in (0x05, 0x11, 0x14, 0x15, 0x2F):          # offset/val_offset forms
            reg = cur.uleb()
            n = cur.uleb() if op in (0x05, 0x14, 0x2F) else cur.sleb()
            kind = "val_offset" if op in (0x14, 0x15) else "offset"
            st.regs[reg] = Rule(kind, -n * da if op == 0x2F else n * da)
        elif op == 0x06:
            _restore(st, cur.uleb())
        elif op == 0x07:
            st.regs[cur.uleb()] = Rule("undefined")
        elif op == 0x08:
            st.regs[cur.uleb()] = Rule("same")
        elif op == 0x09:
            reg = cur.uleb()
            st.regs[reg] = Rule("register", cur.uleb())
        elif op == 0x0A:
            st.stack.append((st.cfa, dict(st.regs)))
        elif op == 0x0B:
            if not st.stack:
                raise CfiError("DW_CFA_restore_state without remembered state")
            st.cfa, st.regs = st.stack.pop()
        elif op == 0x0C:
            reg = cur.uleb()
            st.cfa = Cfa(reg, cur.uleb())
        elif op == 0x12:
            reg = cur.uleb()
            st.cfa = Cfa(reg, cur.sleb() * da)
        elif op == 0x0D:
            cfa_reg_only("DW_CFA_def_cfa_register")
            st.cfa = Cfa(cur.uleb(), st.cfa.offset)
        elif op in (0x0E, 0x13):
            cfa_reg_only("DW_CFA_def_cfa_offset")
            st.cfa = Cfa(st.cfa.reg, cur.uleb() if op == 0x0E else cur.sleb() * da)
        elif op == 0x0F:
            st.cfa = Cfa(None, 0, cur.bytes(cur.uleb()))
        elif op in (0x10, 0x16):
            reg = cur.uleb()
            st.regs[reg] = Rule("expression" if op == 0x10 else "val_expression",
                                cur.bytes(cur.uleb()))
        elif op == 0x2E:
            st.args_size = cur.uleb()
        else:
            raise CfiError(f"unknown call frame instruction {op:#x} at {cur.addr - 1:#x}")
    if fde is not None:
        emit(max(loc, end))


def _restore(st: _State, reg: int) -> None:
    if reg in st.initial:
        st.regs[reg] = st.initial[reg]
    else:
        st.regs.pop(reg, None)
