"""Where a module's direct branches may land, for entry sites (docs/architecture.md,
"Invariants" 3).

An entry site overwrites a function's first instructions; a direct branch from code
discovery never decoded into the site's bytes 1..4 would run the middle of the jump
(glibc's ``__mempcpy_*`` ends in a jump to ``__memcpy_*+3``).  :class:`BranchIndex`
answers whether any direct branch of the module *may* land in a byte range: every
byte of its executable segments is read as the first byte of a ``call``/``jmp rel32``
(E8, E9), a ``jcc rel32`` (0F 80..8F), or a ``jmp``/``jcc``/``loop``/``jrcxz`` rel8
(EB, 70..7F, E0..E3), whether or not an instruction starts there.  That over-counts
(a refused site costs one entry site, never correctness) and needs no decoding: the
rel32 targets of a few MB of text are gathered in well under a second, once per
module file; rel8 branches are looked for only in the 128 bytes before a site.
"""

from __future__ import annotations

import bisect
import os
import re
import stat
import struct
import threading
from array import array

#: A module whose executable segments are larger is not indexed (entry sites there
#: are refused).
MAX_TEXT_BYTES = 128 << 20

_REL32 = re.compile(rb"[\xe8\xe9]|\x0f[\x80-\x8f]", re.DOTALL)
_REL8 = frozenset([0xEB, *range(0x70, 0x80), 0xE0, 0xE1, 0xE2, 0xE3])

_PT_LOAD, _PF_X = 1, 1


class BranchIndexError(Exception):
    """The module file cannot be indexed (unreadable, not ELF64, too large)."""


def exec_segments(data: bytes) -> list[tuple[int, int, int]]:
    """(link address, file offset, size) of an ELF64 little-endian file's executable
    PT_LOAD segments, as (vaddr, offset, filesz) triples."""
    if len(data) < 64 or data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise BranchIndexError("not an ELF64 little-endian file")
    phoff, = struct.unpack_from("<Q", data, 32)
    phentsize, phnum = struct.unpack_from("<HH", data, 54)
    if phentsize < 56 or phoff + phnum * phentsize > len(data):
        raise BranchIndexError("program headers out of the file")
    out = []
    for i in range(phnum):
        p_type, p_flags, p_offset, p_vaddr, _, p_filesz = struct.unpack_from(
            "<IIQQQQ", data, phoff + i * phentsize)
        if p_type == _PT_LOAD and p_flags & _PF_X:
            if p_offset + p_filesz > len(data):
                raise BranchIndexError("an executable segment runs past the file's end")
            out.append((p_vaddr, p_offset, p_filesz))
    return out


class BranchIndex:
    """The possible direct-branch targets of one module file, link addresses."""

    def __init__(self, data: bytes) -> None:
        self._segs: list[tuple[int, bytes]] = []
        targets = array("q")
        segs = exec_segments(data)
        if sum(size for _, _, size in segs) > MAX_TEXT_BYTES:
            raise BranchIndexError("executable segments too large to index")
        for vaddr, off, size in segs:
            text = data[off:off + size]
            self._segs.append((vaddr, text))
            for m in _REL32.finditer(text):
                i = m.start()
                n = m.end() - i                       # opcode length: 1 or 2
                if i + n + 4 <= len(text):
                    rel, = struct.unpack_from("<i", text, i + n)
                    targets.append(vaddr + i + n + 4 + rel)
        self._targets = array("q", sorted(targets))

    def may_branch_into(self, lo: int, hi: int) -> bool:
        """Whether a direct branch of the module may land in [lo, hi) (link addresses)."""
        t = self._targets
        i = bisect.bisect_left(t, lo)
        if i < len(t) and t[i] < hi:
            return True
        for vaddr, text in self._segs:     # rel8: from 129 bytes before to 126 after
            a = max(vaddr, lo - 2 - 127)
            b = min(vaddr + len(text) - 1, hi - 2 + 128)
            for p in range(a, b):
                if text[p - vaddr] in _REL8:
                    rel = text[p - vaddr + 1]
                    dst = p + 2 + (rel - 256 if rel > 127 else rel)
                    if lo <= dst < hi:
                        return True
        return False


_CACHE: dict[tuple[str, int, int, int], BranchIndex | BranchIndexError] = {}
_CACHE_MAX = 8
_LOCK = threading.Lock()


def index_of(path: str) -> BranchIndex:
    """The index of the module file ``path`` (cached per file identity, a few files);
    raises BranchIndexError when it cannot be made."""
    try:      # a path a client maps: no symlink, no FIFO or device to block on
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        raise BranchIndexError(f"{path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise BranchIndexError(f"{path}: not a regular file")
        key = (path, st.st_dev, st.st_ino, st.st_mtime_ns)
        with _LOCK:
            got = _CACHE.get(key)
        if got is None:
            if st.st_size > MAX_TEXT_BYTES * 2:
                got = BranchIndexError(f"{path}: {st.st_size} bytes, too large to index")
            else:
                with os.fdopen(os.dup(fd), "rb") as f:
                    data = f.read(st.st_size)
                try:
                    got = BranchIndex(data)
                except (BranchIndexError, struct.error) as exc:
                    got = BranchIndexError(f"{path}: {exc}")
            with _LOCK:
                if len(_CACHE) >= _CACHE_MAX:
                    _CACHE.pop(next(iter(_CACHE)))
                _CACHE[key] = got
    finally:
        os.close(fd)
    if isinstance(got, BranchIndexError):
        raise got
    return got
