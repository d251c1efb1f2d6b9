"""The full branch trace of sampled branch stacks: the not-taken conditional branches
inside their fall-through ranges (sampling/lbr.py), found by decoding the client's code.

A fall-through range ``(start, end)`` says the program ran from ``start`` straight to the
instruction at ``end`` (the source of the next taken branch).  Decoding it from ``start``
must land on ``end``; every conditional branch met on the way was not taken, so its
edge to the next instruction gets the range's count.  A range that does not decode to
``end``, or meets an unconditional transfer first, is not what the trace says (a
replacement-code address mapped back, code changed since) and is left out.

The result joins the taken counts in the form region selection reads
(``{branch: {target: count}}``, a conditional branch's fall-through address standing for
its not-taken side; region/discovery.py).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Mapping

import capstone

#: Longest range decoded, in bytes.
MAX_RANGE = 4096
#: Distinct ranges decoded per profile at most (the hottest first).
MAX_RANGES = 20000

_COND = frozenset({"loop", "loope", "loopne", "jrcxz", "jecxz"})
_UNCOND = frozenset({"jmp", "call", "ret", "retf", "iret", "iretq", "int3", "ud2", "hlt",
                     "ljmp", "lcall", "sysret", "sysexit"})

ReadFn = Callable[[int, int], bytes]


@dataclass(slots=True)
class FullTrace:
    """Not-taken edges recovered from fall-through ranges."""

    #: conditional branch -> its fall-through address -> times not taken.
    not_taken: dict[int, Counter] = field(default_factory=dict)
    ranges: int = 0
    #: Ranges left out: unreadable, not decoding to their end, or crossing a transfer.
    rejected: int = 0


def _kind(mnemonic: str) -> str:
    op = mnemonic.split()[-1]         # "bnd jmp", "notrack jmp"
    if op in _COND or (op.startswith("j") and op != "jmp"):
        return "cond"
    return "uncond" if op in _UNCOND else "plain"


def _decode(md: capstone.Cs, start: int, end: int, read: ReadFn
            ) -> list[tuple[int, int]] | None:
    """(address, next address) of the conditional branches in ``[start, end)``, or None
    when the bytes do not decode to ``end`` without a transfer."""
    if start == end:
        return []
    try:
        code = read(start, end - start)
    except Exception:       # any reader's failure: an unmapped or vanished range
        return None
    conds: list[tuple[int, int]] = []
    pos = start
    for addr, size, mnemonic, _ in md.disasm_lite(code, start):
        kind = _kind(mnemonic)
        if kind == "uncond":
            return None
        if kind == "cond":
            conds.append((addr, addr + size))
        pos = addr + size
    return conds if pos == end else None


def full_trace(fallthroughs: Mapping[tuple[int, int], int], read: ReadFn,
               max_range: int = MAX_RANGE, max_ranges: int = MAX_RANGES) -> FullTrace:
    """Not-taken edge counts from fall-through range counts (see the module doc)."""
    md = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    out = FullTrace()
    ranked = sorted(fallthroughs.items(), key=lambda kv: -kv[1])
    for (start, end), n in ranked[:max_ranges]:
        out.ranges += 1
        if not 0 <= end - start <= max_range:
            out.rejected += 1
            continue
        conds = _decode(md, start, end, read)
        if conds is None:
            out.rejected += 1
            continue
        for addr, nxt in conds:
            out.not_taken.setdefault(addr, Counter())[nxt] += n
    out.rejected += max(0, len(ranked) - max_ranges)
    return out


def full_branch_counts(taken: Mapping[int, Mapping[int, int]],
                       fallthroughs: Mapping[tuple[int, int], int], read: ReadFn
                       ) -> dict[int, dict[int, int]]:
    """Taken counts joined by the not-taken counts of the ranges: what region selection
    reads as ``branch_samples``."""
    out = {src: dict(dsts) for src, dsts in taken.items()}
    if fallthroughs:
        for src, dsts in full_trace(fallthroughs, read).not_taken.items():
            row = out.setdefault(src, {})
            for dst, n in dsts.items():
                row[dst] = row.get(dst, 0) + n
    return out
