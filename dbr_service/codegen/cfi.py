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
import os
import struct
from dataclasses import dataclass, field
from typing import NamedTuple

from dbr_service.errors import CodegenError

MASK64 = (1 << 64) - 1
OMIT = 0xFF
ABSPTR, ULEB, SLEB = 0x00, 0x01, 0x09
PCREL, TEXTREL, DATAREL, FUNCREL, ALIGNED, INDIRECT = 0x10, 0x20, 0x30, 0x40, 0x50, 0x80
SDATA4_PCREL = PCREL | 0x0B
#: Fixed-size pointer formats (low nibble of a DW_EH_PE encoding): struct format, size.
_FIXED = {0x00: ("<Q", 8), 0x02: ("<H", 2), 0x03: ("<I", 4), 0x04: ("<Q", 8),
          0x08: ("<q", 8), 0x0A: ("<h", 2), 0x0B: ("<i", 4), 0x0C: ("<q", 8)}
#: DWARF register number of the x86-64 program counter (the return-address column).
RIP = 16


class CfiError(CodegenError):
    """CFI that cannot be parsed, or cannot be translated faithfully for a copy."""


class Cur:
    """A bounds-checked reader over ``buf[pos:end]``; ``base`` is the address of ``buf[0]``."""

    __slots__ = ("buf", "pos", "end", "base")

    def __init__(self, buf, pos: int, end: int, base: int):
        if not 0 <= pos <= end <= len(buf):
            raise CfiError(f"range {pos:#x}..{end:#x} outside the data")
        self.buf, self.pos, self.end, self.base = buf, pos, end, base

    @property
    def addr(self) -> int:
        return self.base + self.pos

    def need(self, n: int) -> None:
        if n < 0 or self.pos + n > self.end:
            raise CfiError(f"truncated at {self.addr:#x} (need {n} bytes)")

    def fixed(self, fmt: str, n: int) -> int:
        self.need(n)
        v = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += n
        return v

    def u8(self) -> int:
        self.need(1)
        self.pos += 1
        return self.buf[self.pos - 1]

    def bytes(self, n: int) -> bytes:
        self.need(n)
        self.pos += n
        return bytes(self.buf[self.pos - n:self.pos])

    def uleb(self) -> int:
        v = shift = 0
        while True:
            if self.pos >= self.end:
                raise CfiError(f"truncated LEB128 at {self.addr:#x}")
            b = self.buf[self.pos]
            self.pos += 1
            v |= (b & 0x7F) << shift
            shift += 7
            if b < 0x80:
                return v
            if shift >= 70:
                raise CfiError(f"LEB128 wider than 64 bits at {self.addr:#x}")

    def sleb(self) -> int:
        start = self.pos
        v = self.uleb()
        bits = 7 * (self.pos - start)
        return v - (1 << bits) if v >> (bits - 1) & 1 else v

    def cstr(self) -> str:
        i = bytes(self.buf[self.pos:self.end]).find(b"\0")
        if i < 0:
            raise CfiError(f"unterminated string at {self.addr:#x}")
        s = bytes(self.buf[self.pos:self.pos + i])
        self.pos += i + 1
        if not s.isascii():
            raise CfiError(f"non-ASCII augmentation at {self.addr:#x}")
        return s.decode()

    def ptr(self, enc: int, func: int | None = None) -> tuple[int, bool]:
        """Read a DW_EH_PE-encoded pointer: (value, indirect).  pcrel is resolved against
        the field's address; a raw 0 stays 0 (null), as libgcc's read_encoded_value."""
        if enc == OMIT:
            raise CfiError(f"omitted pointer read at {self.addr:#x}")
        fmt, app = enc & 0x0F, enc & 0x70
        if app == ALIGNED:
            if fmt != ABSPTR:
                raise CfiError(f"aligned encoding {enc:#x} with a format")
            self.pos += -self.addr % 8
        where = self.addr
        if fmt == ULEB:
            raw = self.uleb()
        elif fmt == SLEB:
            raw = self.sleb()
        elif fmt in _FIXED:
            raw = self.fixed(*_FIXED[fmt])
        else:
            raise CfiError(f"pointer encoding {enc:#x} has an unknown format")
        if raw == 0 or app in (ABSPTR, ALIGNED):
            return raw & MASK64, bool(enc & INDIRECT)
        if app == PCREL:
            return (where + raw) & MASK64, bool(enc & INDIRECT)
        if app == FUNCREL and func is not None:
            return (func + raw) & MASK64, bool(enc & INDIRECT)
        raise CfiError(f"pointer encoding {enc:#x} needs a base address it cannot know")

    def size_value(self, enc: int) -> int:
        """A pc_range: the encoding's format only, no application (LSB)."""
        fmt = enc & 0x0F
        if fmt == ULEB:
            return self.uleb()
        if fmt == SLEB:
            return self.sleb()
        if fmt not in _FIXED:
            raise CfiError(f"pointer encoding {enc:#x} has an unknown format")
        return self.fixed(*_FIXED[fmt]) & MASK64


def is_absolute(enc: int) -> bool:
    """Whether an encoding stores a value that a PIC module's dynamic relocations change."""
    return enc & 0x70 in (ABSPTR, ALIGNED)


def uleb(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def sleb(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        done = (n == 0 and not b & 0x40) or (n == -1 and b & 0x40)
        out.append(b | (0 if done else 0x80))
        if done:
            return bytes(out)


# --------------------------------------------------------------------------- module image

class Image:
    """The file-backed bytes of a module's PT_LOAD segments, by link-time address (read on
    demand), so LSDAs in ``.gcc_except_table`` can be read without knowing their size."""

    def __init__(self, path: str | None, segments: list[tuple[int, int, int]], pic: bool,
                 blobs: dict[int, bytes] | None = None):
        self.path, self.pic = path, pic
        self._segs = sorted(segments)           # (vaddr, file offset, filesz)
        self._data: dict[int, bytes] = dict(blobs or {})

    @classmethod
    def from_bytes(cls, addr: int, data: bytes, pic: bool = False) -> Image:
        return cls(None, [(addr, 0, len(data))], pic, {addr: bytes(data)})

    def cursor(self, addr: int) -> Cur:
        """A reader at ``addr``, bounded by the end of the segment holding it."""
        for vaddr, off, size in self._segs:
            if vaddr <= addr < vaddr + size:
                if vaddr not in self._data:
                    with open(self.path, "rb") as f:
                        f.seek(off)
                        self._data[vaddr] = f.read(size)
                data = self._data[vaddr]
                return Cur(data, addr - vaddr, len(data), vaddr)
        raise CfiError(f"address {addr:#x} is not in the module's file-backed segments")


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
    from dbr_service.codegen.cfi_lsda import build_lsda, map_call_sites, parse_lsda

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
    from dbr_service.codegen.cfi_lsda import parse_lsda

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
