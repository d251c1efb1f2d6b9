"""Node labels of region graphs (SuperRegion.to_dot): the block's address and the
function holding it, its counts, and its disassembly, left-aligned.

A label is a DOT quoted string: ``\\`` and ``"`` are escaped, every line ends with
``\\l`` (left-justified), and a block longer than :data:`MAX_DOT_INSNS`
instructions shows its first ones and ``...``.
"""

from __future__ import annotations

from typing import Callable

import capstone

#: Instructions shown per node; the rest of the block is one "..." line.
MAX_DOT_INSNS = 12
#: Characters of one label line at most (a long symbol, a long operand).
MAX_LINE = 96

_cs = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
_cs.syntax = capstone.CS_OPT_SYNTAX_INTEL

#: ``addr -> "func+0x12"`` (or None where nothing names it).
Namer = Callable[[int], "str | None"]


def escape(text: str) -> str:
    """``text`` as the inside of a DOT quoted string, on one line, at most MAX_LINE long."""
    text = " ".join(text.split())
    if len(text) > MAX_LINE:
        text = text[:MAX_LINE - 3] + "..."
    return text.replace("\\", "\\\\").replace('"', '\\"')


def disassembly(start: int, data: bytes, limit: int = MAX_DOT_INSNS) -> list[str]:
    """``addr: mnemonic operands`` of the instructions in ``data`` (code at ``start``),
    the first ``limit`` of them and ``...`` when there are more; undecodable bytes end
    the listing with ``(bad)``."""
    out: list[str] = []
    end = start
    for addr, size, mnemonic, ops in _cs.disasm_lite(data, start):
        if len(out) == limit:
            out.append("...")
            return out
        out.append(f"{addr:#x}: {mnemonic} {ops}".rstrip())
        end = addr + size
    if end < start + len(data):
        out.append(f"{end:#x}: (bad)")
    return out


def block_label(key: str, bb, name: Namer | None = None) -> str:
    """The label of one block's node (``bb``: region/model.py BasicBlock)."""
    head = key
    label = name(bb.start) if name is not None else None
    if label:
        head += f" {label}"
    lines = [head, f"{bb.size}B {bb.term.value} samples={bb.samples:g} n={bb.count:g}"]
    lines += disassembly(bb.start, bytes(bb.data))
    return "".join(escape(line) + "\\l" for line in lines)
