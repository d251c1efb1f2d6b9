"""Memory views: what hot-code discovery may read of a client, and with what rights.

Discovery (patent fig. 10) disassembles only memory that is mapped, executable
and read-only, trusts data (jump tables, literal pointers) only in read-only
memory, and must stop at bytes of installed patches.  A :class:`MemoryView`
answers exactly those questions, for an ELF file loaded at its link address
(:class:`ElfMemoryView`, used by ``dbr analyze`` and the tests) or for a live
process through ``/proc/PID/maps`` and ``/proc/PID/mem`` (:class:`LiveMemoryView`).
"""

from __future__ import annotations

import abc
import bisect
import itertools
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field

from dbr_service.common.errors import MemoryViewError
from dbr_service.common.procfs import proc_dir
from dbr_service.common import procmaps

PAGE = 4096


@dataclass(frozen=True)
class MappedRange:
    """One contiguous range of a view: ``[start, end)`` with ``perms`` like ``"r-x"``."""

    start: int
    end: int
    perms: str
    #: Path of the file the range belongs to (None for anonymous memory).
    module: str | None = None
    #: True when the bytes come from a file (not heap, stack or anonymous).
    file_backed: bool = True
    #: File offset of ``start``, and the file's device (major, minor) and inode, as
    #: /proc/PID/maps gives them (0 where unknown).
    offset: int = 0
    dev: tuple[int, int] = (0, 0)
    inode: int = 0

    def contains(self, addr: int) -> bool:
        return self.start <= addr < self.end


class MemoryView(abc.ABC):
    """Read-only view of an address space, as discovery needs it.

    Subclasses provide :meth:`ranges` and :meth:`_read_range`; the rest is shared.
    The *excluded* set holds bytes that belong to installed patches: discovery
    treats them as a stop condition (the patent: "any byte of a patch instruction").
    """

    def __init__(self) -> None:
        self._excluded: list[tuple[int, int]] = []   # sorted, disjoint [start, end)

    # ---- what subclasses provide -----------------------------------------
    @abc.abstractmethod
    def ranges(self) -> list[MappedRange]:
        """All mapped ranges, sorted by address, disjoint."""

    @abc.abstractmethod
    def _read_range(self, rng: MappedRange, addr: int, n: int) -> bytes:
        """Read ``n`` bytes at ``addr``, all inside ``rng``."""

    # ---- lookups ---------------------------------------------------------
    def _range_at(self, addr: int) -> MappedRange | None:
        rs = self.ranges()
        starts = self._starts()
        i = bisect.bisect_right(starts, addr) - 1
        if i >= 0 and rs[i].contains(addr):
            return rs[i]
        return None

    def _starts(self) -> list[int]:
        return [r.start for r in self.ranges()]

    def read(self, addr: int, n: int) -> bytes:
        """``n`` bytes at ``addr``; MemoryViewError if any byte is unmapped."""
        out = bytearray()
        a = addr
        while len(out) < n:
            rng = self._range_at(a)
            if rng is None:
                raise MemoryViewError(f"address {a:#x} is not mapped")
            k = min(n - len(out), rng.end - a)
            out += self._read_range(rng, a, k)
            a += k
        return bytes(out)

    def readable_extent(self, addr: int, limit: int) -> int:
        """Bytes readable from ``addr`` (at most ``limit``) with the same rights as ``addr``."""
        rng = self._range_at(addr)
        if rng is None:
            return 0
        n = min(limit, rng.end - addr)
        a = rng.end
        while n < limit:                     # adjacent ranges with the same rights
            nxt = self._range_at(a)
            if nxt is None or nxt.perms != rng.perms:
                break
            k = min(limit - n, nxt.end - a)
            n += k
            a = nxt.end
        return n

    def perms(self, addr: int) -> str | None:
        rng = self._range_at(addr)
        return rng.perms if rng else None

    def is_exec(self, addr: int) -> bool:
        p = self.perms(addr)
        return p is not None and p[2] == "x"

    def is_readonly(self, addr: int) -> bool:
        """Readable and not writable: data here is trusted (jump tables, literal pointers)."""
        p = self.perms(addr)
        return p is not None and p[0] == "r" and p[1] != "w"

    def is_readonly_range(self, addr: int, n: int) -> bool:
        a, end = addr, addr + n
        while a < end:
            rng = self._range_at(a)
            if rng is None or rng.perms[0] != "r" or rng.perms[1] == "w":
                return False
            a = rng.end
        return True

    def is_file_backed(self, addr: int) -> bool:
        rng = self._range_at(addr)
        return bool(rng and rng.file_backed)

    def module_of(self, addr: int) -> str | None:
        rng = self._range_at(addr)
        return rng.module if rng else None

    def code_identity(self, addr: int) -> tuple[tuple, int, int] | None:
        """For code that any process mapping the same file holds alike: (the file's
        identity, the address its offset 0 is mapped at, the end of the mapping), else
        None.  Decoded instructions are cached by identity and offset across jobs and
        clients (decode.ModuleDecodeCache); views that cannot vouch for their bytes
        answer None."""
        return None

    def import_name(self, got_addr: int) -> str | None:
        """Name of the imported symbol whose GOT slot is at ``got_addr``, if known."""
        return None

    # ---- bytes of installed patches ----------------------------------------
    def exclude(self, addr: int, n: int) -> None:
        """Mark ``[addr, addr+n)`` as bytes of an installed patch."""
        self._excluded.append((addr, addr + n))
        self._excluded.sort()

    def unexclude(self, addr: int, n: int) -> None:
        """Forget a patch's bytes (after it has been removed)."""
        self._excluded = [r for r in self._excluded if r != (addr, addr + n)]

    def is_excluded(self, addr: int) -> bool:
        """True when the byte at ``addr`` belongs to an installed patch."""
        ex = self._excluded
        if not ex:
            return False
        i = bisect.bisect_right(ex, (addr, float("inf"))) - 1
        return i >= 0 and ex[i][0] <= addr < ex[i][1]

    def first_excluded(self, addr: int, n: int) -> int | None:
        """Lowest excluded address in ``[addr, addr+n)``, if any."""
        for s, e in self._excluded:
            if e > addr and s < addr + n:
                return max(s, addr)
        return None


# ---------------------------------------------------------------------------
# ELF file at its link address
# ---------------------------------------------------------------------------

@dataclass
class _Image:
    path: str
    base: int
    ranges: list[MappedRange] = field(default_factory=list)
    data: dict[int, bytes] = field(default_factory=dict)      # range start -> bytes
    got_names: dict[int, str] = field(default_factory=dict)   # GOT slot -> symbol
    #: Slots the loader fills from other modules (imports, TLS offsets, IRELATIVE
    #: resolvers): the file does not hold their values.
    unresolved: list[int] = field(default_factory=list)


def _perm_str(flags: int) -> str:
    # lief segment flags: R=4, W=2, X=1
    return ("r" if flags & 4 else "-") + ("w" if flags & 2 else "-") + ("x" if flags & 1 else "-")


def elf_got_names(path: str) -> dict[int, str]:
    """GOT slot (link address) -> imported symbol name, from the file's ``SHT_RELA``
    sections against their ``SHT_DYNSYM`` table.  A small struct reader: the live
    view needs only this, and importing lief costs a worker about a second."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise MemoryViewError(f"{path}: {exc}") from exc
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise MemoryViewError(f"{path}: not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    if not shoff or shentsize < 64 or shoff + shnum * shentsize > len(data):
        return {}
    secs = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize)
            for i in range(shnum)]
    out: dict[int, str] = {}
    for _, sh_type, _, _, off, size, link, _, _, entsize in secs:
        if sh_type != 4 or link >= shnum or secs[link][1] != 11:   # SHT_RELA -> SHT_DYNSYM
            continue
        symoff, symsize, strsec = secs[link][4], secs[link][5], secs[link][6]
        stroff = secs[strsec][4] if strsec < shnum else 0
        for k in range(0, size - 23, entsize or 24):
            r_offset, r_info = struct.unpack_from("<QQ", data, off + k)
            sym = r_info >> 32
            if sym == 0 or (sym + 1) * 24 > symsize:
                continue
            st_name, = struct.unpack_from("<I", data, symoff + sym * 24)
            end = data.find(b"\0", stroff + st_name)
            name = data[stroff + st_name:end].decode(errors="replace")
            if name:
                out[r_offset] = name
    return out


def _load_elf_image(path: str, base: int | None) -> _Image:
    import lief

    if not os.path.exists(path):
        raise MemoryViewError(f"{path}: no such file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"\x7fELF":
        raise MemoryViewError(f"{path}: not an ELF file")
    lief.logging.disable()
    elf = lief.ELF.parse(path)
    if elf is None:
        raise MemoryViewError(f"{path}: cannot parse ELF")
    if elf.header.machine_type != lief.ELF.ARCH.X86_64:
        raise MemoryViewError(f"{path}: not an x86-64 ELF ({elf.header.machine_type})")
    pie = elf.header.file_type == lief.ELF.Header.FILE_TYPE.DYN
    b = (base or 0) if pie else 0
    if not pie and base:
        raise MemoryViewError(f"{path}: not position independent; cannot load at base {base:#x}")
    img = _Image(path=os.path.abspath(path), base=b)
    loads: list[tuple[int, str, bytearray]] = []
    relro = (0, 0)
    for seg in elf.segments:
        if seg.type == lief.ELF.Segment.TYPE.GNU_RELRO and seg.virtual_size:
            # the loader makes [page of its start, page of its end) read-only once
            # it has relocated (glibc _dl_protect_relro: both ends rounded down)
            relro = ((b + seg.virtual_address) & ~(_PAGE - 1),
                     (b + seg.virtual_address + seg.virtual_size) & ~(_PAGE - 1))
        if seg.type != lief.ELF.Segment.TYPE.LOAD or seg.virtual_size == 0:
            continue
        content = bytearray(bytes(seg.content)[: seg.physical_size])
        content += bytes(seg.virtual_size - len(content))          # zero-fill bss
        loads.append((b + seg.virtual_address, _perm_str(int(seg.flags)), content))
    relative = lief.ELF.Relocation.TYPE.X86_64_RELATIVE
    for rel in list(elf.pltgot_relocations) + list(elf.dynamic_relocations):
        name = rel.symbol.name if rel.symbol is not None else ""
        if name:
            img.got_names[b + rel.address] = name
        if rel.type == relative and not name:
            _write_slot(loads, b + rel.address, (b + rel.addend) & 0xFFFFFFFFFFFFFFFF)
        else:
            img.unresolved.append(b + rel.address)
    img.unresolved.sort()
    for start, perms, content in loads:
        end = start + len(content)
        lo, hi = max(start, relro[0]), min(end, relro[1])
        if perms != "rw-" or lo >= hi:
            lo = hi = end                     # no read-only part in this segment
        for a, z, p in ((start, lo, perms), (lo, hi, "r--"), (hi, end, perms)):
            if a < z:
                img.ranges.append(MappedRange(a, z, p, img.path, True))
                img.data[a] = bytes(content[a - start: z - start])
    return img


_PAGE = 4096


def _write_slot(loads: list[tuple[int, str, bytearray]], addr: int, value: int) -> None:
    for start, _, content in loads:
        if start <= addr and addr + 8 <= start + len(content):
            content[addr - start: addr - start + 8] = value.to_bytes(8, "little")
            return


class ElfMemoryView(MemoryView):
    """An ELF executable (and optionally shared libraries) as it would be mapped.

    Each PT_LOAD segment is mapped at its link address (plus ``base`` for PIE or
    shared objects) with its own permissions, bss zero-filled.  As the loader
    would: ``R_X86_64_RELATIVE`` slots hold base + addend (a PIE's pointer tables
    in ``.data.rel.ro``, which the file holds unrelocated), and PT_GNU_RELRO is
    read-only.  A slot the loader fills from elsewhere (an import's GOT entry, an
    IRELATIVE or TLS slot) is never trusted like read-only data: the file does not
    hold its value.
    """

    def __init__(self, path: str, base: int | None = None,
                 libs: Iterable[tuple[str, int]] = ()) -> None:
        super().__init__()
        self.path = os.path.abspath(path)
        self.images = [_load_elf_image(path, base)]
        for lib_path, lib_base in libs:
            self.images.append(_load_elf_image(lib_path, lib_base))
        rs = sorted((r for img in self.images for r in img.ranges), key=lambda r: r.start)
        for a, b in itertools.pairwise(rs):
            if a.end > b.start:
                raise MemoryViewError(f"{a.module} and {b.module} overlap at {b.start:#x}")
        self._ranges = rs
        self._range_starts = [r.start for r in rs]
        self._bytes = {s: d for img in self.images for s, d in img.data.items()}
        self._got = {a: n for img in self.images for a, n in img.got_names.items()}
        self._unresolved = sorted(a for img in self.images for a in img.unresolved)

    def is_readonly_range(self, addr: int, n: int) -> bool:
        i = bisect.bisect_left(self._unresolved, addr - 7)
        if i < len(self._unresolved) and self._unresolved[i] < addr + n:
            return False            # overlaps a slot whose value the file does not hold
        return super().is_readonly_range(addr, n)

    def ranges(self) -> list[MappedRange]:
        return self._ranges

    def _starts(self) -> list[int]:
        return self._range_starts

    def _read_range(self, rng: MappedRange, addr: int, n: int) -> bytes:
        off = addr - rng.start
        return self._bytes[rng.start][off: off + n]

    def import_name(self, got_addr: int) -> str | None:
        return self._got.get(got_addr)


# ---------------------------------------------------------------------------
# A live process
# ---------------------------------------------------------------------------

def parse_maps(text: str) -> list[MappedRange]:
    """Ranges of a ``/proc/PID/maps`` text (``[vsyscall]`` and unreadable ranges kept)."""
    out = [MappedRange(m.lo, m.hi, m.perms[:3], m.path or None,
                       m.ino != 0 and m.path.startswith("/"), m.offset, m.dev, m.ino)
           for m in procmaps.parse_maps(text)]
    out.sort(key=lambda r: r.start)
    return out


class LiveMemoryView(MemoryView):
    """A running process: ranges from ``/proc/PID/maps``, bytes from ``/proc/PID/mem``.

    Pages are cached once read; call :meth:`invalidate` after the map or the
    code changed (dlclose, mprotect, a patch) and :meth:`refresh_maps` after
    map changes.
    """

    def __init__(self, pid: int) -> None:
        super().__init__()
        self.pid = pid
        self._fd = -1          # set before anything can fail: __del__ closes it
        self._pages: dict[int, bytes] = {}
        self._ranges: list[MappedRange] = []
        self._range_starts: list[int] = []
        self._got_cache: dict[str, dict[int, str]] = {}
        self._identities: dict[tuple[str, str, int], tuple | None] = {}
        self.refresh_maps()
        try:
            self._fd = os.open(f"{proc_dir(pid)}/mem", os.O_RDONLY)
        except OSError as exc:
            raise MemoryViewError(f"cannot open /proc/{pid}/mem: {exc}") from exc

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self.close()
        except OSError:
            pass

    def refresh_maps(self) -> None:
        try:
            with open(f"{proc_dir(self.pid)}/maps") as f:
                text = f.read()
        except OSError as exc:
            raise MemoryViewError(f"cannot read /proc/{self.pid}/maps: {exc}") from exc
        self._ranges = parse_maps(text)
        self._range_starts = [r.start for r in self._ranges]
        self._pages.clear()

    def invalidate(self, addr: int | None = None, n: int = 1) -> None:
        """Drop cached pages (all, or those holding ``[addr, addr+n)``)."""
        if addr is None:
            self._pages.clear()
            return
        for p in range(addr & ~(PAGE - 1), addr + n, PAGE):
            self._pages.pop(p, None)

    def ranges(self) -> list[MappedRange]:
        return self._ranges

    def _starts(self) -> list[int]:
        return self._range_starts

    def _page(self, page: int) -> bytes:
        data = self._pages.get(page)
        if data is None:
            try:
                data = os.pread(self._fd, PAGE, page)
            except OSError as exc:
                raise MemoryViewError(f"pid {self.pid}: cannot read {page:#x}: {exc}") from exc
            if len(data) != PAGE:
                raise MemoryViewError(f"pid {self.pid}: short read at {page:#x}")
            self._pages[page] = data
        return data

    def _read_range(self, rng: MappedRange, addr: int, n: int) -> bytes:
        out = bytearray()
        a = addr
        while len(out) < n:
            page = a & ~(PAGE - 1)
            off = a - page
            k = min(n - len(out), PAGE - off)
            out += self._page(page)[off: off + k]
            a += k
        return bytes(out)

    def code_identity(self, addr: int) -> tuple[tuple, int, int] | None:
        """Read-only executable file mappings: the file as (path, dev, inode, mtime,
        size), checked against the file the path names now (a file replaced since it
        was mapped, or a path of another mount namespace, has another inode: None)."""
        rng = self._range_at(addr)
        if rng is None or not rng.file_backed or rng.perms != "r-x" or not rng.module:
            return None
        k = (rng.module, rng.dev, rng.inode)
        if k not in self._identities:
            ident = None
            try:
                st = procmaps.mapped_file(rng.module, rng.dev, rng.inode)
                if st is not None:
                    ident = (rng.module, rng.dev, rng.inode, st.st_mtime_ns, st.st_size)
            except OSError:
                pass
            self._identities[k] = ident
        ident = self._identities[k]
        return None if ident is None else (ident, rng.start - rng.offset, rng.end)

    def import_name(self, got_addr: int) -> str | None:
        """Resolve a GOT slot through the relocations of the module it lies in."""
        rng = self._range_at(got_addr)
        if rng is None or not rng.file_backed or rng.module is None:
            return None
        base = self._module_base(rng.module)
        names = self._got_cache.get(rng.module)
        if names is None:
            try:
                names = elf_got_names(rng.module)
            except MemoryViewError:
                names = {}
            self._got_cache[rng.module] = names
        return names.get(got_addr - base)

    def _module_base(self, module: str) -> int:
        """Load bias of a module: its lowest mapping (offset 0 maps link address 0 or the
        executable's first PT_LOAD; non-PIE executables get 0 by checking the ELF type)."""
        lo = min(r.start for r in self._ranges if r.module == module)
        try:
            with open(module, "rb") as f:
                hdr = f.read(18)
            if hdr[16] == 2:          # ET_EXEC: absolute addresses
                return 0
        except OSError:
            pass
        return lo
