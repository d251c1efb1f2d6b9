"""The *Mapping* of hot-code discovery: entries, blocks under construction, CFEs.

The *Mapping* holds one :class:`Entry` per address that is or may become a block
start: disassembled (a :class:`Block`), not yet disassembled (size 1, with the
*pending* CFEs that target it, kept as exit edges until it is disassembled and
they are re-aimed) or unsupported (CFEs to it stay exits).  Entries may overlap
but have disjoint instruction boundaries; each records its *parent*, the lowest
overlapping entry, so that :class:`Position` (GET-POSITION) finds the
overlapping entries of an address without searching in the common case.
"""

from __future__ import annotations

import bisect
import enum
from collections.abc import Iterable
from dataclasses import dataclass, field

from dbr_service.region.decode import Insn
from dbr_service.region.model import TermKind


class EntryState(str, enum.Enum):
    PENDING = "pending"          # not yet disassembled: size 1, CFEs wait here as exits
    BLOCK = "block"              # disassembled: has a block
    UNSUPPORTED = "unsupported"  # cannot be disassembled: CFEs to it stay exits


class CfeKind(str, enum.Enum):
    FLOW = "flow"                # taken branch, jump, indirect target
    FALLTHROUGH = "fallthrough"  # sequential flow, incl. a call's return address
    CALL = "call"                # call -> callee entry (rendered as exit + entry edge)
    UNKNOWN = "unknown"          # unknown target of ret/indirect/halt: always an exit


@dataclass(eq=False)
class Cfe:
    """A control-flow edge during discovery.  ``dst`` None means it is an exit."""

    src: Block
    target: int
    kind: CfeKind
    count: float = 0.0
    #: Jumps-from-hot added by following this edge (1 after a conditional choice).
    jfh_step: int = 0
    #: False when branch samples say this direction was never taken.
    followable: bool = True
    dst: Block | None = None


@dataclass(eq=False)
class Block:
    """A basic block under construction (becomes a model.BasicBlock at the end)."""

    #: Decoded instructions, in order (their addresses are the block's boundaries).
    insns: list[Insn]
    #: How the block ends (model.TermKind).
    term: TermKind
    #: Known targets of the last instruction (branch, callee, table or sampled targets).
    targets: list[int] = field(default_factory=list)
    #: Where control goes when the last instruction does not transfer; None if nowhere.
    fallthrough: int | None = None
    #: An indirect transfer may go somewhere not in ``targets``.
    unknown_target: bool = False
    #: Base of the PC-relative jump table the last instruction dispatches through.
    table_base: int | None = None
    #: Jumps-from-hot; "infinite" until SET-JUMPS-FROM-HOT gives it a value.
    jfh: int = 1 << 30
    #: On the work list (False also marks a stale work-list slot after a split).
    on_worklist: bool = False
    #: Outgoing CFEs (ADD-CONTROL-FLOW) and incoming ones aimed at this block.
    succs: list[Cfe] = field(default_factory=list)
    preds: list[Cfe] = field(default_factory=list)
    #: Indirect inference was tried with this many predecessors (retry when more).
    indirect_tried: int = -1
    #: Samples at the block's instructions, and the lowest sampled instruction.
    samples: float = 0.0
    first_sampled: int | None = None
    #: Why MARK-UNPATCHABLE refused it ("" = patchable).
    unpatchable_why: str = ""
    #: Reachable from a sampled block (MARK-UNPATCHABLE's executed group).
    known_exec: bool = False

    @property
    def start(self) -> int:
        return self.insns[0].addr

    @property
    def end(self) -> int:
        return self.insns[-1].end

    @property
    def last(self) -> Insn:
        return self.insns[-1]


@dataclass(eq=False)
class Entry:
    """One Mapping entry: an address that is, or may become, a block start."""

    addr: int
    state: EntryState = EntryState.PENDING
    block: Block | None = None
    #: CFEs aimed at this address while it has no block (held as exits).
    pending: list[Cfe] = field(default_factory=list)
    #: Lowest address of an entry overlapping this one (a lower bound; None: none).
    parent: int | None = None
    #: A call targets this address: START -> its block is an entry edge.
    call_target: bool = False
    why: str = ""

    @property
    def end(self) -> int:
        return self.block.end if self.block is not None else self.addr + 1


@dataclass
class Position:
    """GET-POSITION: where an address stands in the Mapping.

    ``overlapping`` are the entries covering ``addr``; ``entry`` the one of them
    (at most one) that has ``addr`` as an instruction boundary (the *matching
    entry*); ``next`` the entry with the lowest address above ``addr``.
    """

    addr: int
    overlapping: list[Entry]
    entry: Entry | None
    next: Entry | None


class EntryMapping:
    """The patent's *Mapping*: entries by address, plus instruction boundaries for matching."""

    def __init__(self) -> None:
        self.entries: dict[int, Entry] = {}
        self.starts: list[int] = []              # sorted entry addresses
        self.boundary: dict[int, Entry] = {}     # instruction address -> entry owning it

    # ---- GET-POSITION and ADVANCE ----------------------------------------
    def position(self, addr: int) -> Position:
        i = bisect.bisect_right(self.starts, addr) - 1
        overlapping: list[Entry] = []
        if i >= 0:
            p = self.entries[self.starts[i]]
            lo = i if p.parent is None else bisect.bisect_left(self.starts, p.parent)
            for j in range(lo, i + 1):
                e = self.entries[self.starts[j]]
                if e.addr <= addr < e.end:
                    overlapping.append(e)
        nxt = self.entries[self.starts[i + 1]] if i + 1 < len(self.starts) else None
        return Position(addr, overlapping, self.boundary.get(addr), nxt)

    def advance(self, pos: Position, addr: int) -> Position:
        """Move ``pos`` forward to ``addr``, incrementally when no entry starts between."""
        if pos.next is not None and addr >= pos.next.addr:
            return self.position(addr)
        pos.addr = addr
        if pos.overlapping:
            pos.overlapping = [e for e in pos.overlapping if e.end > addr]
        pos.entry = self.boundary.get(addr)
        return pos

    # ---- entries ---------------------------------------------------------
    def new_entry(self, addr: int, pos: Position) -> Entry:
        e = Entry(addr)
        lower = [o.addr for o in pos.overlapping if o.addr < addr]
        e.parent = min(lower) if lower else None
        self.entries[addr] = e
        bisect.insort(self.starts, addr)
        self.boundary[addr] = e
        return e

    def delete_entry(self, e: Entry) -> None:
        del self.entries[e.addr]
        i = bisect.bisect_left(self.starts, e.addr)
        del self.starts[i]
        if self.boundary.get(e.addr) is e:
            del self.boundary[e.addr]

    def cover(self, e: Entry, lo: int, hi: int) -> None:
        """``e`` now covers ``[lo, hi)``: entries starting inside get ``e`` as parent bound."""
        i = bisect.bisect_right(self.starts, lo)
        while i < len(self.starts) and self.starts[i] < hi:
            o = self.entries[self.starts[i]]
            if o is not e and (o.parent is None or o.parent > e.addr):
                o.parent = e.addr
            i += 1

    def sorted_entries(self) -> Iterable[Entry]:
        for a in self.starts:
            yield self.entries[a]


@dataclass
class DisResult:
    """What DISASSEMBLE-BB found: the block's instructions and how it ends."""

    insns: list[Insn]
    term: TermKind
    why: str = ""
