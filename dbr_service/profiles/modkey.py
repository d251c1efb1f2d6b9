"""Which file a stored profile belongs to: a module's key for the profile store.

A module with a GNU build id (the ``NT_GNU_BUILD_ID`` note ``ld --build-id`` writes)
is keyed by it, in lower-case hex: the id the agent sends in HELLO for the main
program, and what pprof's Mapping.build_id and ``readelf -n`` show.  A rebuilt
program has another id, so its old profile is not found.  A module without one is
keyed ``path-`` + 32 hex digits of a SHA-256 over its path, size, modification time
and the bytes of its executable PT_LOAD segments: a program rebuilt or replaced at
the same path has another key too.

The file is read with bounded reads only (ELF header, program headers, notes, and at
most MAX_TEXT_BYTES of executable segments); it must be a regular file, so a FIFO or
a device named by a hostile path neither blocks nor streams forever.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
import struct
from dataclasses import dataclass

from dbr_service.common.errors import DbrError

PT_LOAD, PT_NOTE, PF_X = 1, 4, 1
NT_GNU_BUILD_ID = 3
#: More program headers than this: not a file the loader would map.
MAX_PHDRS = 512
#: Notes segments larger than this are not searched for the build id.
MAX_NOTE_BYTES = 1 << 16
#: Executable segments hashed for a module without a build id, at most.
MAX_TEXT_BYTES = 256 << 20
#: Build ids longer than this are not GNU build ids (sha1: 20 bytes, md5: 16).
MAX_BUILD_ID = 64

KEY_RE = re.compile(r"^(?:[0-9a-f]{2,128}|path-[0-9a-f]{32})$")


class ModuleKeyError(DbrError):
    """A module's file cannot be identified (missing, not a regular file, not ELF)."""


@dataclass(frozen=True)
class ModuleKey:
    """A module as the profile store knows it."""

    key: str
    path: str
    #: The GNU build id in hex, "" when the module has none.
    build_id: str = ""


def valid_key(key: object) -> bool:
    return isinstance(key, str) and KEY_RE.match(key) is not None


def key_for_build_id(build_id: bytes | str) -> str:
    """The store key of a module whose build id is ``build_id`` (bytes or hex)."""
    hexid = build_id.hex() if isinstance(build_id, bytes) else build_id.lower()
    if not valid_key(hexid) or hexid.startswith("path-"):
        raise ModuleKeyError(f"{build_id!r} is not a build id")
    return hexid


def _pread(fd: int, n: int, off: int) -> bytes:
    data = os.pread(fd, n, off)
    if len(data) != n:
        raise ModuleKeyError(f"short read at offset {off:#x}")
    return data


def _phdrs(fd: int, size: int) -> list[tuple[int, int, int, int, int]]:
    """(p_type, p_flags, p_offset, p_vaddr, p_filesz) of an ELF64 little-endian file."""
    ehdr = _pread(fd, 64, 0) if size >= 64 else b""
    if len(ehdr) < 64 or ehdr[:4] != b"\x7fELF" or ehdr[4] != 2 or ehdr[5] != 1:
        raise ModuleKeyError("not an ELF64 little-endian file")
    phoff, = struct.unpack_from("<Q", ehdr, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", ehdr, 0x36)
    if phentsize < 56 or phnum > MAX_PHDRS or phoff + phentsize * phnum > size:
        raise ModuleKeyError("bad program headers")
    raw = _pread(fd, phentsize * phnum, phoff) if phnum else b""
    out = []
    for i in range(phnum):
        p_type, p_flags, p_offset, p_vaddr, _pa, p_filesz = struct.unpack_from(
            "<IIQQQQ", raw, i * phentsize)
        out.append((p_type, p_flags, p_offset, p_vaddr, p_filesz))
    return out


def _build_id(fd: int, size: int, phdrs: list[tuple[int, int, int, int, int]]) -> bytes:
    for p_type, _flags, off, _vaddr, filesz in phdrs:
        if p_type != PT_NOTE or filesz > MAX_NOTE_BYTES or off + filesz > size:
            continue
        notes = _pread(fd, filesz, off)
        pos = 0
        while pos + 12 <= len(notes):
            namesz, descsz, ntype = struct.unpack_from("<III", notes, pos)
            name_end = pos + 12 + namesz
            desc = (name_end + 3) & ~3
            nxt = (desc + descsz + 3) & ~3
            if desc + descsz > len(notes):
                break
            if ntype == NT_GNU_BUILD_ID and notes[pos + 12:name_end] == b"GNU\0" \
                    and 1 <= descsz <= MAX_BUILD_ID:
                return notes[desc:desc + descsz]
            pos = nxt
    return b""


def _text_digest(fd: int, size: int, phdrs: list[tuple[int, int, int, int, int]]) -> bytes:
    h = hashlib.sha256()
    total = 0
    for p_type, flags, off, vaddr, filesz in phdrs:
        if p_type != PT_LOAD or not flags & PF_X:
            continue
        if off + filesz > size:
            raise ModuleKeyError("an executable segment lies beyond the end of the file")
        total += filesz
        if total > MAX_TEXT_BYTES:
            raise ModuleKeyError(f"more than {MAX_TEXT_BYTES} bytes of executable segments")
        h.update(struct.pack("<QQ", vaddr, filesz))
        pos = 0
        while pos < filesz:
            chunk = _pread(fd, min(1 << 20, filesz - pos), off + pos)
            h.update(chunk)
            pos += len(chunk)
    return h.digest()


def module_key(path: str) -> ModuleKey:
    """The store key of the ELF file at ``path``; ModuleKeyError if it cannot be read
    or is no ELF64 file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as exc:
        raise ModuleKeyError(f"{path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ModuleKeyError(f"{path}: not a regular file")
        try:
            phdrs = _phdrs(fd, st.st_size)
            bid = _build_id(fd, st.st_size, phdrs)
            if bid:
                return ModuleKey(bid.hex(), path, bid.hex())
            text = _text_digest(fd, st.st_size, phdrs)
        except ModuleKeyError as exc:
            raise ModuleKeyError(f"{path}: {exc}") from None
        except OSError as exc:
            raise ModuleKeyError(f"{path}: {exc.strerror}") from None
    finally:
        os.close(fd)
    h = hashlib.sha256()
    h.update(os.fsencode(path) + b"\0")
    h.update(struct.pack("<QQ", st.st_size, st.st_mtime_ns))
    h.update(text)
    return ModuleKey("path-" + h.hexdigest()[:32], path, "")
