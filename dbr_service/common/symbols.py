"""Function names for addresses, from a module's ELF symbol tables.

Hot spots, regions, DOT graphs and ``dbr analyze`` print ``name+0xoff`` where the
module names its functions: ``.symtab`` when the file keeps it, else ``.dynsym``
(exported functions only, which is all a stripped library or ``-rdynamic`` program
has).  A stripped program without either keeps ``module+offset``.

Only ``STT_FUNC`` and ``STT_GNU_IFUNC`` symbols with a size count; a symbol of size 0
names only its own address.  Aliases (several names for one range) resolve to the
global one, then the shortest, then the first in byte order, so output is stable.

The reader parses section headers and symbol entries with ``struct`` (no ELF library:
a 30 MiB compiler's symbols load in well under a second) and never trusts a length
or offset of the file: every one is checked against the file's size, and a file
that is not a little-endian ELF64 gives an empty table.  Tables are cached per
(path, device, inode, modification time).
"""

from __future__ import annotations

import bisect
import os
import stat
import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass

SHT_SYMTAB, SHT_DYNSYM = 2, 11
STT_FUNC, STT_GNU_IFUNC = 2, 10
STB_GLOBAL = 1
#: A table larger than this many entries is read no further (a hostile file).
MAX_SYMBOLS = 4_000_000


@dataclass(frozen=True)
class Symbol:
    start: int          # link-time address (st_value)
    size: int
    name: str


class SymbolTable:
    """A module's function symbols, by link-time address."""

    def __init__(self, symbols: list[Symbol], source: str, first_load: int = 0) -> None:
        self.source = source            # ".symtab", ".dynsym" or "" (none)
        #: Lowest PT_LOAD address, page-aligned: the link address of the module's first
        #: mapped byte, so link address = offset from the module's lowest mapping + this.
        self.first_load = first_load
        self._syms = sorted(symbols, key=lambda s: (s.start, -s.size))
        self._starts = [s.start for s in self._syms]
        self._start_set = frozenset(self._starts)

    def __len__(self) -> int:
        return len(self._syms)

    def find(self, vaddr: int) -> Symbol | None:
        """The function symbol containing link-time address ``vaddr``."""
        i = bisect.bisect_right(self._starts, vaddr) - 1
        # the nearest start may be a size-0 label inside a bigger function: look back
        # over the few symbols that start at or below vaddr
        for j in range(i, max(-1, i - 8), -1):
            s = self._syms[j]
            if s.start <= vaddr < s.start + max(s.size, 1):
                return s
        return None

    def lookup(self, vaddr: int) -> tuple[str, int] | None:
        """``(name, offset)`` of the function containing link-time address ``vaddr``."""
        s = self.find(vaddr)
        return None if s is None else (s.name, vaddr - s.start)

    def starts(self) -> frozenset[int]:
        """Link-time addresses where a named function starts."""
        return self._start_set

    def by_name(self, name: str) -> Symbol | None:
        """The function named ``name`` (the first of several with that name)."""
        return next((s for s in self._syms if s.name == name), None)

    def symbols(self) -> list[Symbol]:
        """Every function symbol, by address."""
        return list(self._syms)

    def at_offset(self, offset: int) -> tuple[str, int] | None:
        """:meth:`lookup` of the byte ``offset`` bytes into the module's lowest mapping."""
        return self.lookup(offset + self.first_load)


def _pick(a: tuple[int, str, int], b: tuple[int, str, int]) -> tuple[int, str, int]:
    """Of two names for one (start, size): global first, then shortest, then first."""
    return min(a, b, key=lambda t: (t[0] != STB_GLOBAL, len(t[1]), t[2]))


def read_symbols(path: str) -> SymbolTable:
    """Function symbols of the ELF file at ``path`` (empty if it has none or is not
    ELF64 little-endian).  OSError if the file cannot be read."""
    with open(path, "rb") as f:
        data = f.read()
    return parse_symbols(data)


def _sections(data: bytes) -> list[tuple] | None:
    """The section headers of little-endian ELF64 ``data``, None for anything else."""
    if len(data) < 64 or data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return None
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    if shentsize < 64 or shoff + shentsize * shnum > len(data):
        return None
    return [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]


def parse_symbols(data: bytes) -> SymbolTable:
    secs = _sections(data)
    if secs is None:
        return SymbolTable([], "")
    first = _first_load(data)
    for want, label in ((SHT_SYMTAB, ".symtab"), (SHT_DYNSYM, ".dynsym")):
        syms = _table(data, secs, want)
        if syms:
            return SymbolTable(syms, label, first)
    return SymbolTable([], "", first)


def _first_load(data: bytes) -> int:
    phoff, = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    if phentsize < 56 or phoff + phentsize * phnum > len(data):
        return 0
    loads = [struct.unpack_from("<IIQQ", data, phoff + i * phentsize)[3] for i in range(phnum)
             if struct.unpack_from("<I", data, phoff + i * phentsize)[0] == 1]
    return min(loads) & ~0xFFF if loads else 0


def _entries(data: bytes, secs: list[tuple],
             kind: int) -> Iterator[tuple[int, str, int, int, int]]:
    """``(index, name, st_info, value, size)`` of the defined, named symbols with a
    value in the symbol tables of section type ``kind`` (bounded: MAX_SYMBOLS a table,
    every offset checked against ``data``)."""
    for sec in secs:
        _name, typ, _flags, _addr, off, size, link, _info, _align, entsize = sec
        if typ != kind or entsize < 24 or link >= len(secs) or off + size > len(data):
            continue
        stroff, strsize = secs[link][4], secs[link][5]
        if stroff + strsize > len(data):
            continue
        for i in range(min(size // entsize, MAX_SYMBOLS)):
            st_name, st_info, _other, shndx, value, sz = struct.unpack_from(
                "<IBBHQQ", data, off + i * entsize)
            if shndx == 0 or not value or st_name >= strsize:
                continue
            end = data.find(b"\0", stroff + st_name, stroff + strsize)
            if end < 0:
                continue
            name = data[stroff + st_name:end].decode("utf-8", "replace")
            if name:
                yield i, name, st_info, value, sz


def _table(data: bytes, secs: list[tuple], kind: int) -> list[Symbol]:
    best: dict[tuple[int, int], tuple[int, str, int]] = {}
    for i, name, st_info, value, sz in _entries(data, secs, kind):
        if st_info & 0xF not in (STT_FUNC, STT_GNU_IFUNC):
            continue
        cand = (st_info >> 4, name, i)
        key = (value, sz)
        best[key] = _pick(best[key], cand) if key in best else cand
    return [Symbol(start, size, name) for (start, size), (_b, name, _i) in best.items()]


_cache: dict[tuple, SymbolTable] = {}
_cache_lock = threading.Lock()


def symbols_of(path: str, st: os.stat_result | None = None) -> SymbolTable:
    """:func:`read_symbols`, cached per file identity; an unreadable or non-regular
    file gives an empty table (not cached: it may be readable next time)."""
    try:
        st = st or os.stat(path)
    except OSError:
        return SymbolTable([], "")
    if not stat.S_ISREG(st.st_mode):
        return SymbolTable([], "")
    key = (path, st.st_dev, st.st_ino, st.st_mtime_ns)
    with _cache_lock:
        got = _cache.get(key)
    if got is None:
        try:
            got = read_symbols(path)
        except OSError:
            # not kept: a passing failure (EMFILE, EINTR) must not blank the module
            # for the rest of the process
            return SymbolTable([], "")
        with _cache_lock:
            if len(_cache) > 128:
                _cache.clear()
            _cache[key] = got
    return got


def describe(table: SymbolTable, module: str, offset: int) -> str:
    """``name+0xoff`` when ``table`` names the byte ``offset`` bytes into the module's
    lowest mapping, else ``module+0xoffset``."""
    hit = table.at_offset(offset)
    if hit is not None:
        name, off = hit
        return f"{name}+{off:#x}" if off else name
    return f"{os.path.basename(module)}+{offset:#x}"


def dynamic_functions(path: str, names: set[str],
                      max_size: int = 256 << 20) -> tuple[dict[str, int], int]:
    """Link-time addresses of the defined ``STT_FUNC`` symbols named in ``names`` in the
    ``.dynsym`` of the ELF64 file at ``path`` (what another process's loader exports:
    `dbr attach` looks up ``dlopen`` this way), and the page of its first ``PT_LOAD``
    (the load bias is a mapping's start minus it).  OSError if unreadable; an empty
    dict for a file that is not little-endian ELF64 or is over ``max_size``."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > max_size:
            return {}, 0
        data = os.pread(fd, st.st_size, 0)
    finally:
        os.close(fd)
    secs = _sections(data)
    if secs is None:
        return {}, 0
    found: dict[str, int] = {}
    for _i, name, st_info, value, _sz in _entries(data, secs, SHT_DYNSYM):
        if st_info & 0xF == STT_FUNC and name in names and name not in found:
            found[name] = value
    return found, _first_load(data)
