"""Builders for hand-made and random super-regions (tests of the region passes).

A block is given by its address and its instruction lengths; bytes are NOPs.
Edges are added the way hot-code discovery adds them: a call block gets an exit
edge to its callee and the callee entry an entry edge; a block whose successor
is not in the region gets an exit edge to that address.
"""

from __future__ import annotations

from dbr_service.region.model import END, START, BasicBlock, EdgeKind, SuperRegion, TermKind

T = TermKind
FT, FLOW, CALL, RET = EdgeKind.FALLTHROUGH, EdgeKind.FLOW, EdgeKind.CALL, EdgeKind.RETURN


def bb(addr: int, sizes=(5,), term: TermKind = T.FALLTHROUGH, targets=(),
       ft: int | None | str = "next",
       count: float = 0.0, samples: float = 0.0, known_exec: bool = True,
       unpatchable: bool = False, unknown_target: bool = False) -> BasicBlock:
    insns, a = [], addr
    for s in sizes:
        insns.append((a, s))
        a += s
    size = a - addr
    if ft == "next":
        ft = None if term in (T.JMP, T.RET, T.IJMP, T.HALT) else addr + size
    return BasicBlock(start=addr, size=size, insns=insns, data=b"\x90" * size, term=term,
                      targets=list(targets), fallthrough=ft, unknown_target=unknown_target,
                      samples=samples, count=count, known_exec=known_exec,
                      unpatchable=unpatchable, unpatchable_why="test" if unpatchable else "")


class Builder:
    """Small DSL: ``b = Builder(); b.block(0x10, (2, 5)); b.flow(0x10, 0x20)``."""

    def __init__(self, region_id: str | None = None) -> None:
        self.sr = SuperRegion(region_id)

    def block(self, addr: int, sizes=(5,), term: TermKind = T.FALLTHROUGH, **kw) -> int:
        self.sr.add_block(bb(addr, sizes, term, **kw))
        return addr

    def edge(self, u, v, kind: EdgeKind = FLOW, count: float = 0.0) -> None:
        self.sr.add_edge(u, v, kind, count)

    def ft(self, u, v, count: float = 0.0) -> None:
        self.sr.add_edge(u, v, FT, count)

    def flow(self, u, v, count: float = 0.0) -> None:
        self.sr.add_edge(u, v, FLOW, count)

    def entry(self, v, count: float = 0.0) -> None:
        self.sr.add_edge(START, v, EdgeKind.ENTRY, count)

    def exit(self, u, target: int, count: float = 0.0) -> None:
        self.sr.add_edge(u, END, EdgeKind.EXIT, count, target=target)

    def call(self, c, callee: int, count: float = 0.0, cont: int | None = None) -> None:
        """Call block ``c`` -> END (to the callee) and START -> callee, as discovery does."""
        self.exit(c, callee, count)
        if callee in self.sr.g:
            self.sr.add_edge(START, callee, EdgeKind.ENTRY, 0.0)
        if cont is not None:
            self.ft(c, cont, count)


def set_counts(sr: SuperRegion, counts: dict) -> None:
    for k, c in counts.items():
        sr.block(k).count = c


def edge_count(sr: SuperRegion, u, v) -> float:
    return sr.g.edges[u, v]["count"]


def sr_with_indirect() -> SuperRegion:
    """An indirect jump (0x100) to a block (0x200) that jumps back, entered at 0x100 and
    left from it to 0x300."""
    sr = SuperRegion("t")
    sr.add_block(BasicBlock(0x100, 2, [(0x100, 2)], b"\xff\xe0", TermKind.IJMP,
                            targets=[0x200]))
    sr.add_block(BasicBlock(0x200, 2, [(0x200, 2)], b"\xeb\xfe", TermKind.JMP,
                            targets=[0x100]))
    sr.add_edge(START, 0x100, EdgeKind.ENTRY, 1)
    sr.add_edge(0x100, 0x200, EdgeKind.FLOW, 1)
    sr.add_edge(0x200, 0x100, EdgeKind.FLOW, 1)
    sr.add_edge(0x100, END, EdgeKind.EXIT, 0, target=0x300)
    return sr
