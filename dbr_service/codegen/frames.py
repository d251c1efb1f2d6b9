"""Unwind information for a region's replacement code (FRAMES_ADD blobs).

A region that makes real calls leaves return addresses into its code on the stack, and
an unwinder (a C++ throw, ``backtrace()``) looks each such frame up by that address.
So every piece of the region's code gets the rows of the original instruction it
stands for: :func:`region_blobs` walks the address map (one entry per original
instruction's translation, inlined clones included, the jumps that leave the region
or stand for a continuation, loop-head padding), finds the FDE covering each original
address in its module's ``.eh_frame`` (:class:`CfiSource`: loaded once per module file
and cached, with the module's load bias from the client's maps) and translates each
FDE's part with :func:`~dbr_service.codegen.cfi.translate` as
:class:`~dbr_service.codegen.cfi.Glue`: the whole translation of an instruction has
the row the original has at that instruction.  That is exact wherever an unwinder
asks: at a real call's return address (the row of the original call, and its LSDA call
site, whose landing pad is original code) and at every instruction boundary where the
translation is one instruction; inside a translation of several (an inlined call's
``push``+``jmp``, a compare cascade) a signal handler that unwinds may see the row of
before the sequence.  Far-exit stubs and the data after the code (far-exit slots,
dispatch tables, return-address slots) get no rows: nothing returns there.

The blobs go after the code in the region's chunk, 8-aligned, one per original FDE.
Any original address without an FDE (a module without ``.eh_frame``, code outside
every FDE) or CFI that cannot be translated faithfully raises CfiError: the caller then
emits the region without real calls (optimize.emit_with_frames).
"""

from __future__ import annotations

import os
import struct
import threading
from typing import Callable, Iterable, NamedTuple

from dbr_service.codegen.cfi import CfiBlob, CfiError, EhFrame, Glue, load_eh_frame, translate
from dbr_service.common.procmaps import mapped_file


class Module(NamedTuple):
    path: str
    bias: int
    eh: EhFrame


def records_len(data: bytes) -> int:
    """Bytes of a blob's CIE/FDE records, the zero terminator included (FRAMES_ADD's
    ``len``; translate puts the LSDAs after the terminator)."""
    off = 0
    while True:
        (n,) = struct.unpack_from("<I", data, off)
        if n == 0:
            return off + 4
        off += 4 + n


def _first_load_vaddr(path: str) -> int:
    """The lowest PT_LOAD address of an ELF file, page-aligned down."""
    with open(path, "rb") as f:
        eh = f.read(64)
        if len(eh) < 64 or eh[:4] != b"\x7fELF":
            raise CfiError(f"{path}: not an ELF file")
        phoff, = struct.unpack_from("<Q", eh, 32)
        phentsize, phnum = struct.unpack_from("<HH", eh, 54)
        f.seek(phoff)
        raw = f.read(phentsize * phnum)
    loads = [struct.unpack_from("<IIQQ", raw, i * phentsize)[3] for i in range(phnum)
             if len(raw) >= (i + 1) * phentsize and
             struct.unpack_from("<I", raw, i * phentsize)[0] == 1]
    if not loads:
        raise CfiError(f"{path}: no PT_LOAD")
    return min(loads) & ~0xFFF


class CfiSource:
    """The ``.eh_frame`` of a client's modules by run-time address.

    ``maps()`` gives the client's mappings as ``(lo, hi, path, (major, minor), inode)``
    (those of files, with an absolute path); a module's bias is its lowest mapping minus
    its first PT_LOAD address.  The file read must be the one mapped: its device and
    inode as the service sees them must be those of the maps (a client in another mount
    namespace, a file replaced since), else CfiError.  Parsed ``.eh_frame``s are cached
    per file (path, device, inode, modification time) for every client, modules per
    mapping until :meth:`refresh`."""

    _files: dict[tuple, EhFrame | CfiError] = {}
    _files_lock = threading.Lock()

    def __init__(self, maps: Callable[[], Iterable[tuple[int, int, str, tuple[int, int], int]]]
                 ) -> None:
        self._maps = maps
        self._ranges: list[tuple[int, int, str, tuple[int, int], int]] | None = None
        self._mods: dict[tuple[str, int], Module | CfiError] = {}
        self._lock = threading.Lock()

    def refresh(self) -> None:
        """Read the maps again at the next look-up (a library was loaded or unloaded)."""
        with self._lock:
            self._ranges = None
            self._mods = {}

    @classmethod
    def eh_frame(cls, path: str, st: os.stat_result) -> EhFrame:
        key = (path, st.st_dev, st.st_ino, st.st_mtime_ns)
        with cls._files_lock:
            got = cls._files.get(key)
        if got is None:
            try:
                got = load_eh_frame(path)
            except (OSError, CfiError) as exc:
                got = exc if isinstance(exc, CfiError) else CfiError(f"{path}: {exc}")
            with cls._files_lock:
                if len(cls._files) > 256:
                    cls._files.clear()
                cls._files[key] = got
        if isinstance(got, CfiError):
            raise got
        return got

    def module_at(self, addr: int) -> Module:
        for again in (False, True):
            hit = self._lookup(addr, again)
            if hit is not None:
                break
        else:
            raise CfiError(f"{addr:#x} is in no module file")
        path, base, dev, ino = hit
        with self._lock:
            got = self._mods.get((path, base))
        if got is None:
            try:
                st = mapped_file(path, dev, ino)
                if st is None:
                    raise CfiError(f"{path} here is not the file the client mapped")
                got = Module(path, base - _first_load_vaddr(path), self.eh_frame(path, st))
            except OSError as exc:
                got = CfiError(f"{path}: {exc}")
            except CfiError as exc:
                got = exc
            with self._lock:
                self._mods[(path, base)] = got
        if isinstance(got, CfiError):
            raise got
        return got

    def _lookup(self, addr: int, reread: bool):
        """(path, lowest mapping, device, inode) of the module file holding ``addr``
        (maps read again with ``reread``, or when never read), or None."""
        with self._lock:
            if self._ranges is None or reread:
                self._ranges = sorted(m for m in self._maps() if m[2].startswith("/"))
                self._mods = {}
            hit = next((m for m in self._ranges if m[0] <= addr < m[1]), None)
            if hit is None:
                return None
            base = min(m[0] for m in self._ranges if m[2] == hit[2])
            return hit[2], base, hit[3], hit[4]


def region_blobs(addr_map: Iterable[tuple[int, int, int]], at: int,
                 module_at: Callable[[int], Module], skip: Iterable[int] = ()) -> list[CfiBlob]:
    """Blobs for the pieces ``addr_map`` lists (``(repl_lo, repl_hi, orig)``), placed
    from ``at`` (8-aligned) on, one per original FDE; pieces starting at an address in
    ``skip`` (far-exit stubs) get none.  Raises CfiError (see the module docstring)."""
    skip = set(skip)
    groups: dict[tuple[str, int], tuple] = {}
    for lo, hi, orig in addr_map:
        if lo in skip or hi <= lo:
            continue
        mod = module_at(orig)
        fde = mod.eh.find(orig - mod.bias)
        if fde is None:
            raise CfiError(f"no FDE covers {orig:#x} in {mod.path}")
        g = groups.setdefault((mod.path, fde.addr), (fde, mod, []))
        g[2].append(Glue(lo, hi, orig - mod.bias))
    blobs = []
    at += -at % 8
    for fde, mod, items in groups.values():
        blob = translate(fde, items, at, bias=mod.bias, image=mod.eh.image)
        blobs.append(blob)
        at += len(blob.data)
        at += -at % 8
    return blobs


def blobs_size(blobs: list[CfiBlob], code_end: int) -> int:
    """Bytes from ``code_end`` to the end of the last blob (0 without blobs)."""
    return (blobs[-1].at + len(blobs[-1].data) - code_end) if blobs else 0
