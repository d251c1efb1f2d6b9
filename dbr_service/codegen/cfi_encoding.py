"""Pointer encodings and LEB128 of call-frame information, and reading it safely.

:class:`Cur` reads bytes bounds-checked (fixed-size values, LEB128, ``DW_EH_PE_*``
pointers); :class:`Image` gives readers over a module's file-backed segments;
:func:`uleb` and :func:`sleb` encode.  Shared by the ``.eh_frame`` parser
(codegen/cfi_parse.py), the translation (codegen/cfi.py) and LSDAs
(codegen/cfi_lsda.py); cfi.py describes the formats.
"""

from __future__ import annotations

import struct

from dbr_service.common.errors import CodegenError


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
