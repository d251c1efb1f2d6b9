"""Function names for a client's hot spots (``dbr ctl hotspots``, `dbr run`'s report).

A hot spot carries its module's path and its offset from the module's lowest mapping
(worker.find_hotspots).  Its ``symbol`` is ``name+0xoff`` from that module file's
``.symtab`` or ``.dynsym`` (common/symbols.py), read only when the file at that path is a
regular file with the device and inode the client's maps show: the service is root,
and a path in another process's maps names whatever that process chose, or a file
replaced since it was mapped.  Where no symbol names the address, the hot spot gets
no ``symbol`` (a stripped program without exported functions)."""

from __future__ import annotations

import os
from typing import Any, Iterable, Protocol

from dbr_service.common.procmaps import MapEntry, find_mapping, mapped_file, module_base
from dbr_service.common.symbols import SymbolTable, symbols_of


class FileMapping(Protocol):
    """What a mapping needs for this (clientfiles.Mapping has it)."""

    path: str
    dev: tuple[int, int]
    ino: int


def mapped_symbols(path: str, dev: tuple[int, int], ino: int) -> SymbolTable | None:
    """The symbols of ``path`` if it is the file mapped with ``dev`` and ``ino``."""
    if not path.startswith("/"):
        return None
    try:
        st = mapped_file(path, dev, ino)
    except OSError:
        return None
    if st is None:
        return None
    table = symbols_of(path, st)
    return table if len(table) else None


def name_hotspots(hotspots: list[dict[str, Any]], maps: Iterable[FileMapping] | None) -> None:
    """Add ``symbol`` to each hot spot the module file mapped at its path names."""
    files = {m.path: (m.dev, m.ino) for m in maps or () if m.path.startswith("/")}
    tables: dict[str, SymbolTable | None] = {}
    for h in hotspots:
        module, offset = h.get("module"), h.get("offset")
        if module not in files or offset is None:
            continue
        if module not in tables:
            tables[module] = mapped_symbols(module, *files[module])
        table = tables[module]
        hit = table.at_offset(offset) if table is not None else None
        if hit is not None:
            name, off = hit
            h["symbol"] = f"{name}+{off:#x}" if off else name


def name_address(addr: int, maps: list[MapEntry]) -> str:
    """``function+0xoff`` for ``addr`` in a client (checked as above), else
    ``module+0xoffset``, else the address."""
    m = find_mapping(maps, addr)
    if m is None or not m.path.startswith("/"):
        return f"{addr:#x}"
    off = addr - module_base(maps, m.path)
    table = mapped_symbols(m.path, m.dev, m.ino)
    hit = table.at_offset(off) if table is not None else None
    if hit is not None:
        return f"{hit[0]}+{hit[1]:#x}" if hit[1] else hit[0]
    return f"{os.path.basename(m.path)}+{off:#x}"
