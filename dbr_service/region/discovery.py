"""Hot-code discovery (patent fig. 10, docs/architecture.md): from sample IPs to the first SR.

Starting at every sampled address (ENSURE-BB with ``starts=False``), the client's
code is disassembled forward, following control flow a bounded number of
conditional jumps away from hot code (*jumps-from-hot*).  Everything found goes
into one super-region, ``first_sr``, for the partition pass.

Its parts: region/decode.py decodes instructions, region/blockmap.py is the
*Mapping* of entries and blocks under construction, region/transfers.py finds the
targets of a block's last instruction (indirect ones included).

Conventions this module fixes for later passes:

* A transfer whose target is unknown (``ret``, an indirect jump's or call's
  unknown pseudo-target, ``hlt``/``ud2``/``int3``) is an exit edge whose exit
  address is the transferring instruction itself: replacement code jumps back to
  it and lets the original instruction do the transfer.
* A block that stops before an unsupported, illegal, unreadable or patched byte
  has ``term=STOP`` and ``fallthrough`` = that byte's address, with an exit there.
* A call is two CFEs (call block -> END with the callee as exit address, and
  START -> callee block) plus its fall-through (kind ``fallthrough``), except for
  calls through the PLT/GOT to known noreturn functions, which have no fall-through.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from dbr_service.common.errors import MemoryViewError
from dbr_service.region import decode
from dbr_service.region.blockmap import (
    Block, Cfe, CfeKind, DisResult, Entry, EntryMapping, EntryState, Position)
from dbr_service.region.decode import Decoder, Insn, InsnKind
from dbr_service.region.memview import MemoryView
from dbr_service.region.model import END, START, BasicBlock, EdgeKind, SuperRegion, TermKind
from dbr_service.region.transfers import TransferTargets

#: Blocks longer than this many instructions end with a plain fall-through.
MAX_BLOCK_INSNS = 4096


@dataclass
class DiscoveryStats:
    entries: int = 0
    blocks: int = 0
    pending: int = 0
    unsupported: int = 0
    splits: int = 0
    merges: int = 0
    jump_tables: int = 0
    indirect_resolved: int = 0
    noreturn_calls: int = 0
    samples_unplaced: float = 0.0
    #: Samples after a system call counted once each (place_samples).
    samples_after_syscall: float = 0.0
    rounds: int = 0


class HotCodeDiscovery(TransferTargets):
    """State of one run of HOT-CODE-DISCOVERY."""

    def __init__(self, samples: Mapping[int, float], mem: MemoryView, *,
                 jumps_from_hot_limit: int = 2,
                 branch_samples: Mapping[int, Mapping[int, float]] | None = None,
                 patched: Callable[[int], bool] | None = None,
                 seed_min: float = 0.0, max_blocks: int | None = None,
                 entries: Iterable[int] = ()) -> None:
        self.samples = samples
        self.entries = sorted(set(entries))
        self.seed_min = seed_min
        self.max_blocks = max_blocks
        self.made = 0                      # blocks made by new_bb (for max_blocks)
        self.mem = mem
        self.limit = jumps_from_hot_limit
        self.branch_samples = branch_samples or {}
        self.dec = Decoder(mem, patched)
        self.map = EntryMapping()
        self.worklist: deque[Block] = deque()
        self.indirect: list[Block] = []
        self.stats = DiscoveryStats()

    # ---- driver ----------------------------------------------------------
    def run(self) -> SuperRegion:
        for addr in self.seeds():
            self.ensure_bb(addr, starts=False, jfh=0)
        for addr in self.entries:
            self.ensure_bb(addr, starts=True, jfh=0)
        while True:
            self.stats.rounds += 1
            self.process_work_list()
            if not self.discover_indirect_code():
                break
        self.place_samples()
        self.mark_unpatchable()
        return self.build()

    def seeds(self) -> list[int]:
        """The sampled IPs discovery starts from, in address order."""
        return sorted(a for a, n in self.samples.items() if n > 0 and n >= self.seed_min)

    # ---- work list and jumps-from-hot --------------------------------------
    def set_jumps_from_hot(self, b: Block, jfh: int) -> None:
        """SET-JUMPS-FROM-HOT: a lower jfh puts the block (back) on the work list."""
        if jfh < b.jfh:
            b.jfh = jfh
            if not b.on_worklist:
                b.on_worklist = True
                self.worklist.append(b)

    def process_work_list(self) -> None:
        """PROCESS-WORK-LIST: follow successor CFEs of blocks below the jfh limit."""
        while self.worklist:
            b = self.worklist.popleft()
            if not b.on_worklist:
                continue                      # swapped out by a split
            b.on_worklist = False
            for cfe in list(b.succs):
                self.follow(cfe)

    def follow(self, cfe: Cfe) -> None:
        if cfe.kind == CfeKind.UNKNOWN or not cfe.followable:
            return
        if self.max_blocks is not None and self.made >= self.max_blocks:
            return                            # the budget is spent: as beyond the limit
        jfh = cfe.src.jfh + cfe.jfh_step
        if jfh >= self.limit:
            return
        if cfe.dst is None:
            self.ensure_bb(cfe.target, starts=True, jfh=jfh)
        else:
            self.set_jumps_from_hot(cfe.dst, jfh)

    # ---- ENSURE-BB / FIND-ENTRY ---------------------------------------------
    def find_entry(self, addr: int, starts: bool) -> Position:
        """FIND-ENTRY: the position of ``addr``; split a block if it must start there."""
        pos = self.map.position(addr)
        e = pos.entry
        if starts and e is not None and e.block is not None and e.addr != addr:
            self.split(e.block, addr)
            pos = self.map.position(addr)
        return pos

    def ensure_bb(self, addr: int, *, starts: bool, jfh: int) -> Block | None:
        """ENSURE-BB: a block containing ``addr`` as a boundary (starting there if
        ``starts``), disassembling it if needed."""
        pos = self.find_entry(addr, starts)
        e = pos.entry
        if e is not None and e.state == EntryState.UNSUPPORTED:
            return None
        if e is not None and e.block is not None:
            self.set_jumps_from_hot(e.block, jfh)
            return e.block
        res = self.disassemble_bb(addr)
        if res is None:
            return None
        nxt = self.map.position(res.insns[-1].end)
        if self.can_merge_entry(res, nxt):
            b = self.merge_entry(pos, res, nxt)
            self.set_jumps_from_hot(b, jfh)
        else:
            b = self.new_bb(pos, res)
            self.set_jumps_from_hot(b, jfh)    # before its CFEs: a split swaps the tail in
            self.add_control_flow(b)
        return b

    def set_unsupported(self, addr: int, pos: Position, why: str) -> None:
        e = pos.entry if pos.entry is not None and pos.entry.addr == addr else None
        if e is None:
            e = self.map.new_entry(addr, pos)
        e.state = EntryState.UNSUPPORTED
        e.why = why

    # ---- DISASSEMBLE-BB ---------------------------------------------------
    def disassemble_bb(self, addr: int) -> DisResult | None:
        """DISASSEMBLE-BB: decode from ``addr`` until a stop condition."""
        pos = self.map.position(addr)
        insns: list[Insn] = []
        a = addr
        term = TermKind.FALLTHROUGH
        why = ""
        while True:
            ins = self.dec.at(a)
            if isinstance(ins, str) or ins.kind == InsnKind.UNSUPPORTED:
                why = ins if isinstance(ins, str) else "unsupported instruction"
                term = TermKind.STOP
                break
            if ins.kind.own_block and insns:
                break                             # call/ret/indirect get their own block
            insns.append(ins)
            a = ins.end
            if ins.kind.transfers:
                term = _TERM_OF[ins.kind]
                break
            pos = self.map.advance(pos, a)
            if pos.entry is not None or len(insns) >= MAX_BLOCK_INSNS:
                break                             # synced with an entry's boundaries
        if not insns:
            self.set_unsupported(addr, self.map.position(addr), why)
            self.stats.unsupported += 1
            return None
        return DisResult(insns, term, why)

    # ---- CAN-MERGE-ENTRY / MERGE-ENTRY -------------------------------------
    def can_merge_entry(self, res: DisResult, nxt: Position) -> bool:
        e = nxt.entry
        return (res.term == TermKind.FALLTHROUGH
                and e is not None and e.addr == nxt.addr
                and e.block is not None and not e.block.preds and not e.pending
                and not e.call_target
                and not any(i.kind.own_block for i in e.block.insns))

    def merge_entry(self, pos: Position, res: DisResult, nxt: Position) -> Block:
        """MERGE-ENTRY: extend the next entry's block backwards to ``res``'s start."""
        old = nxt.entry
        assert old is not None and old.block is not None
        b = old.block
        start = res.insns[0].addr
        self.map.delete_entry(old)
        e = pos.entry if pos.entry is not None and pos.entry.addr == start else None
        if e is None:
            e = self.map.new_entry(start, self.map.position(start))
        b.insns = res.insns + b.insns
        self._attach(e, b)
        self.stats.merges += 1
        return b

    # ---- NEW-BB / split ----------------------------------------------------
    def new_bb(self, pos: Position, res: DisResult) -> Block:
        start = res.insns[0].addr
        e = pos.entry if pos.entry is not None and pos.entry.addr == start else None
        if e is None:
            e = self.map.new_entry(start, pos)
        b = Block(res.insns, res.term)
        self.made += 1
        decode.DECODE_CACHE.blocks += 1     # looked up at use: tests replace the cache
        self._fill_transfer(b, res)
        self._attach(e, b)
        return b

    def _attach(self, e: Entry, b: Block) -> None:
        """Give entry ``e`` block ``b``: boundaries, parents, re-aimed pending CFEs."""
        e.state = EntryState.BLOCK
        e.block = b
        for ins in b.insns:
            self.map.boundary[ins.addr] = e
        self.map.cover(e, b.start, b.end)
        for cfe in e.pending:
            cfe.dst = b
            b.preds.append(cfe)
        e.pending = []

    def split(self, b: Block, at: int) -> Block:
        """Split ``b`` before its instruction at ``at``; the tail takes its successors
        and its place on the work list."""
        head_entry = self.map.boundary[b.start]
        k = next(i for i, ins in enumerate(b.insns) if ins.addr == at)
        tail = Block(b.insns[k:], b.term, b.targets, b.fallthrough, b.unknown_target,
                     table_base=b.table_base, jfh=b.jfh, indirect_tried=b.indirect_tried)
        tail.samples, tail.first_sampled = 0.0, None
        b.insns = b.insns[:k]
        b.term, b.targets, b.fallthrough, b.unknown_target, b.table_base = (
            TermKind.FALLTHROUGH, [], at, False, None)
        tail.succs, b.succs = b.succs, []
        for cfe in tail.succs:
            cfe.src = tail
        if b in self.indirect:
            self.indirect[self.indirect.index(b)] = tail
        pos = self.map.position(at)
        pos.overlapping = [o for o in pos.overlapping if o is not head_entry]
        te = self.map.new_entry(at, pos)
        if head_entry.parent is not None and (te.parent is None or te.parent > head_entry.parent):
            te.parent = head_entry.parent
        self._attach(te, tail)
        if b.on_worklist:
            b.on_worklist = False
            tail.on_worklist = True
            self.worklist.append(tail)
        link = Cfe(b, at, CfeKind.FALLTHROUGH, dst=tail)
        b.succs.append(link)
        tail.preds.append(link)
        self.stats.splits += 1
        return tail

    # ---- ADD-CONTROL-FLOW --------------------------------------------------
    def add_control_flow(self, b: Block) -> None:
        """ADD-CONTROL-FLOW: a CFE per target; connect to blocks, else pend as exits."""
        new = self._cfes_of(b)
        b.succs.extend(new)
        for cfe in new:
            self.connect(cfe)

    def _cfes_of(self, b: Block, targets: Iterable[int] | None = None) -> list[Cfe]:
        last = b.last
        k = last.kind if b.term not in (TermKind.FALLTHROUGH, TermKind.STOP) else InsnKind.PLAIN
        bs = self.branch_samples.get(last.addr)
        out: list[Cfe] = []
        tgts = list(b.targets if targets is None else targets)
        cond = k == InsnKind.JCC        # jfh counts conditional jumps only (the patent)
        for t in tgts:
            kind = CfeKind.CALL if k in (InsnKind.CALL, InsnKind.ICALL) else CfeKind.FLOW
            out.append(self._cfe(b, t, kind, bs, 1 if cond else 0))
        if targets is None:
            if b.fallthrough is not None and b.term != TermKind.STOP:
                out.append(self._cfe(b, b.fallthrough, CfeKind.FALLTHROUGH, bs,
                                     1 if k == InsnKind.JCC else 0))
            if b.term == TermKind.STOP:
                out.append(Cfe(b, b.fallthrough, CfeKind.UNKNOWN))
            elif k in (InsnKind.RET, InsnKind.HALT) or b.unknown_target:
                out.append(Cfe(b, last.addr, CfeKind.UNKNOWN))
        return out

    def _cfe(self, b: Block, t: int, kind: CfeKind, bs: Mapping[int, float] | None,
             step: int) -> Cfe:
        cfe = Cfe(b, t, kind, jfh_step=step)
        if bs is not None:
            cfe.count = float(bs.get(t, 0.0))
            if b.term == TermKind.JCC:
                cfe.followable = cfe.count > 0
        return cfe

    def connect(self, cfe: Cfe) -> None:
        """Aim ``cfe`` at the block starting at its target, or pend it on the entry."""
        if cfe.kind == CfeKind.UNKNOWN:
            return
        pos = self.find_entry(cfe.target, starts=True)
        e = pos.entry
        if e is None:
            e = self.map.new_entry(cfe.target, pos)
        if cfe.kind == CfeKind.CALL:
            e.call_target = True
        if e.block is not None:
            cfe.dst = e.block
            e.block.preds.append(cfe)
        else:
            e.pending.append(cfe)

    # ---- samples and MARK-UNPATCHABLE -------------------------------------------
    def place_samples(self) -> None:
        for addr, n in self.samples.items():
            e = self.map.boundary.get(addr)
            if e is None or e.block is None:
                self.stats.samples_unplaced += n
                continue
            b = e.block
            if n > 1 and self._after_syscall(addr, b):
                # the kernel's time, sampled at the return address of the system
                # call: it shows the block ran, not how often (a loop's write looked
                # 1/13 as hot as its body; docs/decisions/0014-samples-after-a-system-call.md)
                self.stats.samples_after_syscall += n - 1
                n = 1
            b.samples += n
            if n > 0 and (b.first_sampled is None or addr < b.first_sampled):
                b.first_sampled = addr

    def _after_syscall(self, addr: int, b: Block) -> bool:
        """``addr`` follows a ``syscall``, ``sysenter`` or ``int 0x80`` of block ``b``."""
        if addr - 2 < b.start:
            return False
        prev = self.map.boundary.get(addr - 2)
        if prev is None or prev.block is not b:
            return False
        try:
            return self.mem.read(addr - 2, 2) in (b"\x0f\x05", b"\x0f\x34", b"\xcd\x80")
        except MemoryViewError:     # unreadable now: an ordinary sample
            return False

    def blocks(self) -> list[Block]:
        return [e.block for e in self.map.sorted_entries() if e.block is not None]

    def mark_unpatchable(self) -> None:
        """MARK-UNPATCHABLE: overlapping blocks; blocks not known to execute; the top
        part of partly executed blocks."""
        executed, partial = self._known_to_execute()
        for b in self.blocks():
            if b in partial:
                top = b
                tail = self.split(top, top.first_sampled)
                tail.samples, tail.first_sampled = top.samples, top.first_sampled
                top.samples, top.first_sampled = 0.0, None
                tail.known_exec = True
                top.unpatchable_why = "top of a partly executed block"
            elif b in executed:
                b.known_exec = True
            else:
                b.unpatchable_why = "not known to execute"
        self._mark_overlaps()

    def _mark_overlaps(self) -> None:
        active: list[Entry] = []
        for e in self.map.sorted_entries():
            active = [o for o in active if o.end > e.addr]
            for o in active:
                for x, y in ((o, e), (e, o)):
                    if x.block is not None and not x.block.unpatchable_why.startswith("over"):
                        x.block.unpatchable_why = f"overlaps entry {y.addr:#x}"
            active.append(e)

    def _known_to_execute(self) -> tuple[set[Block], set[Block]]:
        blocks = self.blocks()
        # a function that holds a sample was entered at its entry (hot text's seeds)
        entries = set(self.entries)
        executed = {b for b in blocks if (b.samples > 0 and b.first_sampled == b.start)
                    or b.start in entries}
        partial = {b for b in blocks if b.samples > 0 and b.first_sampled != b.start
                   and b.start not in entries}
        work = deque(executed | partial)
        seen = set(work)
        while work:
            b = work.popleft()
            for c in b.succs:
                if c.dst is None or (c.kind == CfeKind.FALLTHROUGH and b.term == TermKind.CALL) \
                        or (c.kind == CfeKind.FALLTHROUGH and b.term == TermKind.ICALL):
                    continue
                d = c.dst
                partial.discard(d)
                executed.add(d)
                if d not in seen:
                    seen.add(d)
                    work.append(d)
        return executed, partial

    # ---- the super-region -------------------------------------------------------
    def build(self) -> SuperRegion:
        sr = SuperRegion()
        for b in self.blocks():
            sr.add_block(self._basic_block(b))
        for b in self.blocks():
            for c in b.succs:
                self._add_edge(sr, b, c)
        for e in self.map.sorted_entries():
            if e.call_target and e.block is not None:
                n = sum(c.count for c in e.block.preds if c.kind == CfeKind.CALL)
                sr.add_edge(START, e.block.start, EdgeKind.ENTRY, n)
        s = self.stats
        s.entries = len(self.map.entries)
        s.blocks = sum(1 for e in self.map.entries.values() if e.block is not None)
        s.pending = sum(1 for e in self.map.entries.values() if e.state == EntryState.PENDING)
        sr.info["discovery"] = s
        sr.info["unsupported"] = {e.addr: e.why for e in self.map.entries.values()
                                  if e.state == EntryState.UNSUPPORTED}
        return sr

    def _basic_block(self, b: Block) -> BasicBlock:
        return BasicBlock(
            start=b.start, size=b.end - b.start, insns=[(i.addr, i.size) for i in b.insns],
            data=self._bytes(b), term=b.term, targets=list(b.targets),
            fallthrough=b.fallthrough, unknown_target=b.unknown_target,
            table_base=b.table_base, samples=b.samples,
            jfh=b.jfh, known_exec=b.known_exec, unpatchable=bool(b.unpatchable_why),
            unpatchable_why=b.unpatchable_why, module=self.mem.module_of(b.start))

    @staticmethod
    def _add_edge(sr: SuperRegion, b: Block, c: Cfe) -> None:
        if c.kind == CfeKind.CALL or c.dst is None:
            sr.add_edge(b.start, END, EdgeKind.EXIT, c.count, target=c.target)
            return
        kind = EdgeKind.FALLTHROUGH if c.kind == CfeKind.FALLTHROUGH else EdgeKind.FLOW
        sr.add_edge(b.start, c.dst.start, kind, c.count)


_TERM_OF = {
    InsnKind.JMP: TermKind.JMP, InsnKind.JCC: TermKind.JCC, InsnKind.CALL: TermKind.CALL,
    InsnKind.RET: TermKind.RET, InsnKind.IJMP: TermKind.IJMP, InsnKind.ICALL: TermKind.ICALL,
    InsnKind.HALT: TermKind.HALT,
}


def hot_code_discovery(samples: Mapping[int, float], mem: MemoryView, *,
                       jumps_from_hot_limit: int = 2,
                       branch_samples: Mapping[int, Mapping[int, float]] | None = None,
                       patched: Callable[[int], bool] | None = None,
                       seed_min: float = 0.0, max_blocks: int | None = None,
                       entries: Iterable[int] = ()) -> SuperRegion:
    """HOT-CODE-DISCOVERY (patent fig. 10): the first super-region from sample IPs.

    ``samples`` maps instruction addresses to sample counts; ``branch_samples``
    maps a branch instruction's address to ``{target: count}`` (for a conditional
    branch the fall-through address stands for the not-taken direction);
    ``patched(addr)`` tells whether a byte belongs to an installed patch (the
    view's own excluded ranges are honoured as well).  With ``seed_min``, only IPs
    with at least that many samples start blocks; the others still count in the
    blocks discovery reaches from those (a cheaper first selection on a flat
    profile).  With ``max_blocks``, no jump is followed once discovery has made
    that many blocks (what is left unexplored leaves the region, as beyond the
    jumps-from-hot limit).  ``entries``: function entries to start blocks at as well
    (hot text: the entries of the functions holding samples), taken as executed.
    """
    return HotCodeDiscovery(samples, mem, jumps_from_hot_limit=jumps_from_hot_limit,
                            branch_samples=branch_samples, patched=patched,
                            seed_min=seed_min, max_blocks=max_blocks,
                            entries=entries).run()
