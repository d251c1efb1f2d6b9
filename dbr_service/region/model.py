"""The super-region (SR) model of the patent (docs/architecture.md): a networkx.DiGraph
with START and END.

Body nodes are basic blocks.  A node key is the block's start address (``int``)
for original code, or a :class:`CloneKey` for a block cloned by inlining.  Edges
are control-flow edges (CFE) with a :class:`EdgeKind` and a ``count``.

* Edges from START are *entry edges*: their targets become patch points.
* Edges to END are *exit edges*: replacement code jumps back to original code.
  Because a DiGraph holds one edge per pair, the edge ``(b, END)`` carries
  ``exits = {original_target_address: count}`` for every exit of ``b`` and its
  ``count`` is their sum.
* Everything codegen needs about a block's own control transfer (its terminator
  kind, static targets and fall-through address) lives on the block; in-region
  successors are found by matching those addresses against successor nodes.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Iterator, NamedTuple, Union

import networkx as nx

from dbr_service.common.errors import RegionError
from dbr_service.region.dot import Namer, block_label, escape
from dbr_service.common.states import RegionState

START = "START"
END = "END"


class CloneKey(NamedTuple):
    """Node key of a block cloned into a call site by inlining.

    ``path`` is the chain of call-instruction addresses from the outermost
    inlined call site inwards; ``start`` is the original block's address.
    """

    path: tuple[int, ...]
    start: int


NodeKey = Union[int, CloneKey, str]


class EdgeKind(str, enum.Enum):
    """Kinds of control-flow edge (the patent's terms)."""

    FLOW = "flow"                 # taken branch or jump between body blocks
    FALLTHROUGH = "fallthrough"   # sequential flow into the next block
    CALL = "call"                 # call block -> inlined callee entry
    RETURN = "return"             # inlined return -> call continuation
    ENTRY = "entry"               # START -> block (a patch point)
    EXIT = "exit"                 # block -> END (jump back to original code)


#: An indirect jump with more known targets than this is not turned into a compare
#: cascade (each compare costs every dispatch, and flags must be saved around it);
#: it stays the original indirect jump, an exit to original code.  Measured on a
#: 12-way interpreter dispatch: the cascade made the loop 3-4x slower than native.
#: Region selection cuts such a jump's edges to its targets for the same reason
#: (region/dispatch.py): code generation and selection see the same graph.
MAX_CASCADE_TARGETS = 4


class TermKind(str, enum.Enum):
    """How a basic block ends."""

    FALLTHROUGH = "fallthrough"   # ends because the next address starts a block
    JMP = "jmp"                   # direct unconditional jump
    JCC = "jcc"                   # direct conditional branch (incl. loop/jrcxz)
    CALL = "call"                 # direct call
    RET = "ret"                   # return (ret / ret imm16)
    IJMP = "ijmp"                 # indirect jump (register or memory)
    ICALL = "icall"               # indirect call
    STOP = "stop"                 # unsupported/illegal/unreadable next byte: must exit before it
    HALT = "halt"                 # hlt/ud2/int3: control never continues


@dataclass
class BasicBlock:
    """One basic block of original (or cloned) code."""

    #: Address of the first instruction.
    start: int
    #: Size in bytes, ``start + size`` is the address after the last instruction.
    size: int
    #: (address, size) of every instruction, in order: the instruction boundaries.
    insns: list[tuple[int, int]]
    #: The block's raw bytes as read from the client.
    data: bytes
    #: How the block ends.
    term: TermKind
    #: Known targets of the last instruction (branch target, call target,
    #: jump-table or sampled indirect targets).  Empty when unknown.
    targets: list[int] = field(default_factory=list)
    #: Address control reaches when the last instruction does not transfer
    #: (jcc not taken, call return, plain fall-through); None when it cannot.
    fallthrough: int | None = None
    #: True when an indirect transfer may also go somewhere not in ``targets``.
    unknown_target: bool = False
    #: Base address a PC-relative jump table's entries are added to (``add R, B``), when
    #: jump-table inference found one: code generation may translate the dispatch
    #: (codegen/dispatch.py).
    table_base: int | None = None
    #: Samples whose IP lies in this block.
    samples: float = 0.0
    #: Estimated number of times the block executed (filled by count passes).
    count: float = 0.0
    #: Jumps-from-hot: conditional jumps away from a sampled block.
    jfh: int = 0
    #: Known to execute (sampled, or reachable from a sampled block).
    known_exec: bool = False
    #: May not hold a patch point (overlaps another entry, not known to execute,
    #: partly executed top part, clone, ...).
    unpatchable: bool = False
    #: Why it is unpatchable (for dumps and tests).
    unpatchable_why: str = ""
    #: For clones: the original block's start address.
    clone_of: int | None = None
    #: Path of the module (file) the block's code belongs to, if known.
    module: str | None = None

    @property
    def end(self) -> int:
        return self.start + self.size

    @property
    def is_clone(self) -> bool:
        return self.clone_of is not None

    @property
    def last_insn(self) -> tuple[int, int]:
        return self.insns[-1]

    @property
    def never_returns(self) -> bool:
        """A call discovery knows never returns (``abort``, ``__cxa_throw``...): it
        gave the call no fall-through."""
        return self.term in (TermKind.CALL, TermKind.ICALL) and self.fallthrough is None \
            and bool(self.targets) and not self.unknown_target

    def contains(self, addr: int) -> bool:
        return self.start <= addr < self.end

    def first_patchable(self, min_len: int = 5) -> int | None:
        """Address of the first instruction at least ``min_len`` bytes long, if any."""
        for a, s in self.insns:
            if s >= min_len:
                return a
        return None


_ids = itertools.count(1)


class SuperRegion:
    """A super-region: one DiGraph with START/END and body blocks.

    Passes mutate it in place; :meth:`verify` checks the structural invariants
    every pass must keep.
    """

    def __init__(self, region_id: str | None = None) -> None:
        self.id: str = region_id or f"sr{next(_ids)}"
        self.g: nx.DiGraph = nx.DiGraph()
        self.g.add_node(START)
        self.g.add_node(END)
        self.state: RegionState = RegionState.DISCOVERED
        #: Free-form per-pass results (loop forest, inlining decisions, stats).
        self.info: dict[str, object] = {}

    # ---- nodes ---------------------------------------------------------
    def add_block(self, bb: BasicBlock, key: NodeKey | None = None) -> NodeKey:
        if key is None:
            key = bb.start if bb.clone_of is None else CloneKey((), bb.start)
        self.g.add_node(key, bb=bb)
        return key

    def block(self, key: NodeKey) -> BasicBlock:
        return self.g.nodes[key]["bb"]

    def blocks(self) -> Iterator[tuple[NodeKey, BasicBlock]]:
        for k, d in self.g.nodes(data=True):
            if k not in (START, END):
                yield k, d["bb"]

    def body_nodes(self) -> list[NodeKey]:
        return [k for k in self.g.nodes if k not in (START, END)]

    def __len__(self) -> int:
        return self.g.number_of_nodes() - 2

    # ---- edges ---------------------------------------------------------
    def add_edge(self, u: NodeKey, v: NodeKey, kind: EdgeKind, count: float = 0.0,
                 target: int | None = None) -> None:
        """Add (or accumulate onto) an edge.  Exit edges need ``target``."""
        if v == END:
            if target is None:
                raise RegionError(f"exit edge from {u!r} needs an original target address")
            if self.g.has_edge(u, END):
                d = self.g.edges[u, END]
                d["exits"][target] = d["exits"].get(target, 0.0) + count
                d["count"] += count
                return
            self.g.add_edge(u, END, kind=EdgeKind.EXIT, count=count, exits={target: count})
            return
        if self.g.has_edge(u, v):
            self.g.edges[u, v]["count"] += count
            return
        self.g.add_edge(u, v, kind=EdgeKind.ENTRY if u == START else kind, count=count)

    def entry_edges(self) -> list[tuple[NodeKey, float]]:
        return [(v, d["count"]) for _, v, d in self.g.out_edges(START, data=True)]

    def exit_edges(self) -> list[tuple[NodeKey, dict[int, float]]]:
        return [(u, d["exits"]) for u, _, d in self.g.in_edges(END, data=True)]

    def body_edges(self) -> Iterator[tuple[NodeKey, NodeKey, dict]]:
        for u, v, d in self.g.edges(data=True):
            if u != START and v != END:
                yield u, v, d

    @property
    def transfer_only(self) -> bool:
        """No patch points: entered only by threads the agent moves in (TRANSFER)."""
        return bool(self.info.get("transfer_only"))

    def entry_points(self) -> list[int]:
        """Original addresses of the patch points (targets of entry edges; none for a
        transfer-only SR, whose entry edges say where threads are expected)."""
        if self.transfer_only:
            return []
        return sorted(self.block(v).start for v, _ in self.entry_edges())

    # ---- checks and views ----------------------------------------------
    def verify(self) -> None:
        """Raise RegionError unless the structural invariants hold.

        START reaches every block, every block reaches END, counts are finite
        and non-negative, entry edges never target clones, and a clone is only
        entered from its own call site's blocks (a CALL edge, or edges from
        other clones of the same inlining path).
        """
        g = self.g
        for u, v, d in g.edges(data=True):
            c = d.get("count", 0.0)
            if not (c >= 0.0) or c == float("inf"):
                raise RegionError(f"{self.id}: edge {u!r}->{v!r} has count {c!r}")
            if u == START and isinstance(v, CloneKey):
                raise RegionError(f"{self.id}: entry edge into clone {v!r}")
            if isinstance(v, CloneKey) and not isinstance(u, CloneKey):
                if d.get("kind") != EdgeKind.CALL:
                    raise RegionError(f"{self.id}: edge {u!r}->{v!r} enters a clone")
            if isinstance(v, CloneKey) and isinstance(u, CloneKey) and u.path != v.path:
                # A nested call enters one level deeper; a nested return leaves
                # one level up to the enclosing clone's continuation.
                nested_call = d.get("kind") == EdgeKind.CALL and v.path[:-1] == u.path
                nested_ret = d.get("kind") == EdgeKind.RETURN and u.path[:-1] == v.path
                if not (nested_call or nested_ret):
                    raise RegionError(f"{self.id}: edge {u!r}->{v!r} crosses inlining paths")
        if len(self) == 0:
            return
        from_start = nx.descendants(g, START)
        to_end = nx.ancestors(g, END)
        for k in self.body_nodes():
            if k not in from_start:
                raise RegionError(f"{self.id}: block {_fmt(k)} not reachable from START")
            if k not in to_end:
                raise RegionError(f"{self.id}: block {_fmt(k)} does not reach END")

    def to_dot(self, title: str | None = None, name: Namer | None = None) -> str:
        """Graphviz text of the region (the patent's figs. 4-9 style): a node per block,
        labelled with its address, the function ``name`` gives for it (``func+0x12``)
        and its disassembly (region/dot.py)."""
        lines = [f'digraph "{escape(title or self.id)}" {{',
                 "  node [shape=box fontname=monospace];"]
        for k in self.g.nodes:
            if k in (START, END):
                lines.append(f'  "{k}" [shape=oval];')
                continue
            bb = self.block(k)
            style = []
            if bb.unpatchable:
                style.append("dashed")
            if bb.is_clone:
                style.append("filled")
            attrs = f' style="{",".join(style)}"' if style else ""
            label = block_label(_fmt(k), bb, name)
            lines.append(f'  "{_fmt(k)}" [label="{label}"{attrs}];')
        for u, v, d in self.g.edges(data=True):
            lbl = f'{d["kind"].value if hasattr(d["kind"], "value") else d["kind"]} {d["count"]:g}'
            lines.append(f'  "{_fmt(u)}" -> "{_fmt(v)}" [label="{lbl}"];')
        lines.append("}")
        return "\n".join(lines)

    def subregion(self, nodes: set[NodeKey], region_id: str | None = None) -> "SuperRegion":
        """A new SR with these body nodes and every edge among them, START and END."""
        sr = SuperRegion(region_id)
        keep = set(nodes) | {START, END}
        sub = self.g.subgraph(keep).copy()
        sr.g = sub
        sr.g.add_node(START)
        sr.g.add_node(END)
        sr.state = self.state
        return sr


def _fmt(k: NodeKey) -> str:
    if isinstance(k, int):
        return f"{k:#x}"
    if isinstance(k, CloneKey):
        return "clone[" + ">".join(f"{p:#x}" for p in k.path) + f"]{k.start:#x}"
    return str(k)


fmt_node = _fmt
