"""Hot-code discovery (patent fig. 10, docs/architecture.md): from sample IPs to the first SR.

Starting at every sampled address (ENSURE-BB with ``starts=False``), the client's
code is disassembled forward, following control flow a bounded number of
conditional jumps away from hot code (*jumps-from-hot*).  Everything found goes
into one super-region, ``first_sr``, for the partition pass.

The *Mapping* holds one :class:`Entry` per address that is or may become a block
start: disassembled (a :class:`Block`), not yet disassembled (size 1, with the
*pending* CFEs that target it, kept as exit edges until it is disassembled and
they are re-aimed) or unsupported (CFEs to it stay exits).  Entries may overlap
but have disjoint instruction boundaries; each records its *parent*, the lowest
overlapping entry, so that :class:`Position` (GET-POSITION) finds the
overlapping entries of an address without searching in the common case.

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

import bisect
import enum
import mmap
import os
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import capstone
from capstone import x86 as X

from dbr_service.errors import MemoryViewError
from dbr_service.region import jumptable
from dbr_service.region.memview import MemoryView
from dbr_service.region.model import END, START, BasicBlock, EdgeKind, SuperRegion, TermKind

#: Longest x86 instruction.
MAX_INSN = 15
#: Bytes decoded per capstone call (the run is cached by address).
DECODE_CHUNK = 96
#: Blocks longer than this many instructions end with a plain fall-through.
MAX_BLOCK_INSNS = 4096
#: Imported functions that never return: a call to them has no fall-through.
NORETURN = frozenset({
    "exit", "_exit", "_Exit", "quick_exit", "abort", "__stack_chk_fail", "__assert_fail",
    "__fortify_fail", "__chk_fail", "__libc_fatal", "err", "errx", "verr", "verrx",
    "longjmp", "_longjmp", "siglongjmp", "__longjmp_chk", "pthread_exit", "__cxa_throw",
    "__cxa_rethrow", "__cxa_bad_cast", "__cxa_bad_typeid", "__cxa_throw_bad_array_new_length",
    "_Unwind_Resume", "__cxa_call_unexpected", "_ZSt9terminatev",
    "_ZSt17__throw_bad_allocv", "_ZSt20__throw_length_errorPKc",
    "_ZSt24__throw_out_of_range_fmtPKcz", "_ZSt19__throw_logic_errorPKc",
})

_UNSUPPORTED = frozenset({
    X.X86_INS_LJMP, X.X86_INS_LCALL, X.X86_INS_RETF, X.X86_INS_RETFQ, X.X86_INS_IRET,
    X.X86_INS_IRETD, X.X86_INS_IRETQ, X.X86_INS_INT, X.X86_INS_INTO, X.X86_INS_INT1,
    X.X86_INS_SYSENTER, X.X86_INS_SYSEXIT, X.X86_INS_SYSEXITQ, X.X86_INS_SYSRET,
    X.X86_INS_SYSRETQ, X.X86_INS_XBEGIN,
})
_HALT = frozenset({X.X86_INS_HLT, X.X86_INS_UD2, X.X86_INS_UD0, X.X86_INS_UD1, X.X86_INS_INT3})


# ---------------------------------------------------------------------------
# Decoded instructions
# ---------------------------------------------------------------------------

class InsnKind(str, enum.Enum):
    PLAIN = "plain"
    JMP = "jmp"
    JCC = "jcc"
    CALL = "call"
    RET = "ret"
    IJMP = "ijmp"
    ICALL = "icall"
    HALT = "halt"
    UNSUPPORTED = "unsupported"

    @property
    def own_block(self) -> bool:
        """Instructions that sit alone in their block (seed: call, ret, indirect)."""
        return self in (InsnKind.CALL, InsnKind.RET, InsnKind.IJMP, InsnKind.ICALL)

    @property
    def transfers(self) -> bool:
        return self not in (InsnKind.PLAIN, InsnKind.UNSUPPORTED)


@dataclass(frozen=True, slots=True)
class Insn:
    """What discovery needs of one instruction."""

    addr: int
    size: int
    kind: InsnKind
    #: Direct target (jmp/jcc/call).
    target: int | None = None
    #: Literal load address of a memory-indirect transfer (``[rip+d]`` or ``[abs]``).
    literal: int | None = None
    #: Memory-indirect with base/index registers (a table access).
    indexed: bool = False

    @property
    def end(self) -> int:
        return self.addr + self.size


_RELOCATOR = None


def _relocatable(ci) -> bool:
    """Whether codegen can relocate this instruction: what it cannot must stay in
    original code, so discovery treats it as unsupported (the region exits before it)."""
    global _RELOCATOR
    if _RELOCATOR is None:
        from dbr_service.codegen.relocate import Relocator
        _RELOCATOR = Relocator()
    from dbr_service.codegen.relocate import CannotRelocate
    try:
        _RELOCATOR.classify(ci)
    except CannotRelocate:
        return False
    return True


def _classify(ci) -> Insn:
    iid = ci.id
    if iid in _UNSUPPORTED or not _relocatable(ci):
        return Insn(ci.address, ci.size, InsnKind.UNSUPPORTED)
    if iid in _HALT:
        return Insn(ci.address, ci.size, InsnKind.HALT)
    is_jump = ci.group(capstone.CS_GRP_JUMP)
    is_call = ci.group(capstone.CS_GRP_CALL)
    if ci.group(capstone.CS_GRP_RET) or iid == X.X86_INS_RET:
        return Insn(ci.address, ci.size, InsnKind.RET)
    if not (is_jump or is_call):
        return Insn(ci.address, ci.size, InsnKind.PLAIN)
    op = ci.operands[0]
    if op.type == X.X86_OP_IMM:
        kind = InsnKind.CALL if is_call else (
            InsnKind.JMP if iid == X.X86_INS_JMP else InsnKind.JCC)
        return Insn(ci.address, ci.size, kind, target=op.imm & 0xFFFFFFFFFFFFFFFF)
    kind = InsnKind.ICALL if is_call else InsnKind.IJMP
    if op.type == X.X86_OP_MEM:
        m = op.mem
        if m.base == X.X86_REG_RIP and not m.index:
            return Insn(ci.address, ci.size, kind, literal=ci.address + ci.size + m.disp)
        if not m.base and not m.index:
            return Insn(ci.address, ci.size, kind, literal=m.disp & 0xFFFFFFFFFFFFFFFF)
        return Insn(ci.address, ci.size, kind, indexed=True)
    return Insn(ci.address, ci.size, kind)


#: Instruction bytes -> (kind, target - address, literal - address, absolute literal,
#: indexed): classification reads only the bytes (ids, operands, prefixes;
#: codegen/relocate.py ``classify``), a direct target or a ``[rip+d]`` literal is the
#: address plus what the bytes encode, and most instructions of a program repeat
#: (``mov rax, [rbp-8]``...), so a hit skips capstone's detailed decoding, which was
#: two thirds of discovery's time.  Per process (workers are reused across jobs),
#: emptied when it grows past _KIND_CACHE_MAX entries.
_Template = tuple  # (InsnKind, int | None, int | None, int | None, bool)
_TEMPLATES: dict[bytes, _Template] = {}
_KIND_CACHE_MAX = 200_000
_MASK64 = 0xFFFFFFFFFFFFFFFF


def _template(ins: Insn, rip_relative: bool) -> _Template:
    a = ins.addr
    tdelta = None if ins.target is None else ins.target - a
    if ins.literal is None:
        return (ins.kind, tdelta, None, None, ins.indexed)
    if rip_relative:
        return (ins.kind, tdelta, ins.literal - a, None, ins.indexed)
    return (ins.kind, tdelta, None, ins.literal, ins.indexed)


def _from_template(t: _Template, address: int, size: int) -> Insn:
    kind, tdelta, ldelta, labs, indexed = t
    if tdelta is None and ldelta is None and labs is None and not indexed:
        return Insn(address, size, kind)
    return Insn(address, size, kind,
                target=None if tdelta is None else (address + tdelta) & _MASK64,
                literal=labs if ldelta is None else address + ldelta, indexed=indexed)


def _rip_relative(ci) -> bool:
    """Whether the transfer's memory operand is ``[rip+d]`` (its literal moves with it)."""
    if not (ci.group(capstone.CS_GRP_JUMP) or ci.group(capstone.CS_GRP_CALL)) or not ci.operands:
        return False
    op = ci.operands[0]
    return op.type == X.X86_OP_MEM and op.mem.base == X.X86_REG_RIP


class ModuleDecodeCache:
    """Decoded instructions of file-backed code by (file identity, offset), kept for the
    life of a worker process: the same program's later jobs, and its other clients (16
    processes of one compiler), take them instead of reading /proc/PID/mem and
    decoding again.  An entry is ``(size, template, base)`` (_template: position-free
    except an absolute literal, reused only at the ``base`` it was decoded at).  Only
    instructions whose bytes in memory are those of the file are entered (:meth:`same_as_file`:
    never a patch, even one a job's list of patches does not know yet), and each use
    checks the using job's own patches.  Emptied when it grows past ``max_entries``."""

    def __init__(self, max_entries: int = 1_000_000) -> None:
        self.max_entries = max_entries
        self.modules: dict[tuple, dict[int, tuple[int, _Template, int]]] = {}
        #: The files themselves, mapped read-only (None: cannot be read or not the
        #: file of the identity any more).
        self._files: dict[tuple, mmap.mmap | None] = {}
        self.entries = 0
        self.hits = 0      # instructions taken from the cache
        self.decoded = 0   # instructions decoded from memory
        #: Blocks discovery made in this process (a job's size, for its CPU cost per
        #: block: scheduler.CpuBudget.max_blocks).
        self.blocks = 0

    def get(self, ident: tuple, offset: int) -> tuple[int, _Template, int] | None:
        m = self.modules.get(ident)
        return None if m is None else m.get(offset)

    def put(self, ident: tuple, offset: int, size: int, t: _Template, base: int) -> None:
        m = self.modules.get(ident)
        if m is None:
            m = self.modules[ident] = {}
        if offset not in m:
            if self.entries >= self.max_entries:
                self.clear()
                m = self.modules[ident] = {}
            m[offset] = (size, t, base)
            self.entries += 1

    def same_as_file(self, ident: tuple, offset: int, code: bytes) -> bool:
        """Whether ``code`` is what the file of ``ident`` (path, dev, inode, mtime,
        size) holds at ``offset``."""
        if ident not in self._files:
            fm = None
            try:
                with open(ident[0], "rb") as f:
                    st = os.fstat(f.fileno())
                    if (st.st_ino, st.st_mtime_ns, st.st_size) == (ident[2], ident[3], ident[4]) \
                            and st.st_size:
                        fm = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
            except (OSError, ValueError):
                pass
            self._files[ident] = fm
        fm = self._files[ident]
        return fm is not None and 0 <= offset and fm[offset:offset + len(code)] == code

    def counts(self) -> tuple[int, int]:
        """(hits, decoded) so far."""
        return self.hits, self.decoded

    def clear(self) -> None:
        self.modules.clear()
        for fm in self._files.values():
            if fm is not None:
                fm.close()
        self._files.clear()
        self.entries = 0


#: The process's cache (a worker's, across its jobs).
DECODE_CACHE = ModuleDecodeCache()


class Decoder:
    """Cached capstone decoding of memory that is executable and read-only."""

    def __init__(self, mem: MemoryView, patched: Callable[[int], bool] | None) -> None:
        self.mem = mem
        self.patched = patched
        self.cs = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
        self.cs.detail = True
        self.lite = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)  # sizes only
        self.cache: dict[int, Insn | str] = {}

    def at(self, addr: int) -> Insn | str:
        """The instruction at ``addr``, or a string saying why there is none."""
        got = self.cache.get(addr)
        if got is None:
            got = self._from_module_cache(addr)
            if got is None:
                got = self._decode(addr)
            self.cache[addr] = got
        return got

    def _from_module_cache(self, addr: int) -> Insn | str | None:
        where = self.mem.code_identity(addr)
        if where is None:
            return None
        ident, base, end = where
        got = DECODE_CACHE.get(ident, addr - base)
        if got is None:
            return None
        size, t, at_base = got
        if addr + size > end or (t[3] is not None and at_base != base):
            return None
        DECODE_CACHE.hits += 1
        if self._touches_patch(addr, size):
            return "byte of an installed patch"
        return _from_template(t, addr, size)

    def _decode(self, addr: int) -> Insn | str:
        """Decode a run of instructions from ``addr`` (cached by address) and return the
        first: decoding at an address depends only on the bytes there."""
        mem = self.mem
        if not mem.is_exec(addr):
            return "not executable"
        if not mem.is_readonly(addr):
            return "writable code"
        n = mem.readable_extent(addr, DECODE_CHUNK)
        try:
            buf = mem.read(addr, n)
        except MemoryViewError:
            return "unreadable"
        first: Insn | str = "illegal instruction"
        where = self.mem.code_identity(addr)
        for address, size, _mn, _ops in self.lite.disasm_lite(buf, addr):
            if address + MAX_INSN > addr + n and address != addr \
                    and addr + n - address < MAX_INSN and n == DECODE_CHUNK:
                break                  # may be cut short by the chunk: decode it on its own
            DECODE_CACHE.decoded += 1
            if self._touches_patch(address, size):
                ins: Insn | str = "byte of an installed patch"
            else:
                ins = self._classify_at(buf, address - addr, address, size)
                code = buf[address - addr:address - addr + size]
                if where is not None and address + size <= where[2] and \
                        DECODE_CACHE.same_as_file(where[0], address - where[1], code):
                    DECODE_CACHE.put(where[0], address - where[1], size,
                                     _TEMPLATES.get(code) or _template(ins, False), where[1])
            if address == addr:
                first = ins
            else:
                self.cache.setdefault(address, ins)
            if isinstance(ins, str) or ins.kind.transfers:
                break
        return first

    def _classify_at(self, buf: bytes, off: int, address: int, size: int) -> Insn:
        code = buf[off:off + size]
        t = _TEMPLATES.get(code)
        if t is not None:
            return _from_template(t, address, size)
        ci = next(self.cs.disasm(code, address, 1))
        ins = _classify(ci)
        if len(_TEMPLATES) >= _KIND_CACHE_MAX:
            _TEMPLATES.clear()
        _TEMPLATES[code] = _template(ins, _rip_relative(ci))
        return ins

    def _touches_patch(self, addr: int, size: int) -> bool:
        if self.mem.first_excluded(addr, size) is not None:
            return True
        return self.patched is not None and any(self.patched(a) for a in range(addr, addr + size))

    def plt_import(self, addr: int) -> str | None:
        """Imported name behind a PLT stub at ``addr`` (``[endbr64;] [bnd] jmp [rip+got]``)."""
        a = addr
        for _ in range(2):
            ins = self.at(a)
            if isinstance(ins, str):
                return None
            if ins.kind == InsnKind.IJMP and ins.literal is not None:
                return self.mem.import_name(ins.literal)
            if ins.kind != InsnKind.PLAIN or ins.size != 4:    # only endbr64 may precede
                return None
            a = ins.end
        return None


# ---------------------------------------------------------------------------
# Mapping, entries, blocks, CFEs
# ---------------------------------------------------------------------------

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


# ---------------------------------------------------------------------------
# Discovery
# ---------------------------------------------------------------------------

@dataclass
class DisResult:
    """What DISASSEMBLE-BB found: the block's instructions and how it ends."""

    insns: list[Insn]
    term: TermKind
    why: str = ""


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


class HotCodeDiscovery:
    """State of one run of HOT-CODE-DISCOVERY."""

    def __init__(self, samples: Mapping[int, float], mem: MemoryView, *,
                 jumps_from_hot_limit: int = 2,
                 branch_samples: Mapping[int, Mapping[int, float]] | None = None,
                 patched: Callable[[int], bool] | None = None,
                 seed_min: float = 0.0, max_blocks: int | None = None) -> None:
        self.samples = samples
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
        DECODE_CACHE.blocks += 1
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

    # ---- targets of the last instruction -------------------------------------
    def _fill_transfer(self, b: Block, res: DisResult) -> None:
        last = b.last
        k = last.kind
        if res.term in (TermKind.FALLTHROUGH, TermKind.STOP):
            b.fallthrough = last.end
        elif k in (InsnKind.JMP, InsnKind.JCC, InsnKind.CALL):
            b.targets = [last.target]
            if k == InsnKind.JCC:
                b.fallthrough = last.end
            elif k == InsnKind.CALL:
                b.fallthrough = None if self._is_noreturn(last.target) else last.end
        elif k in (InsnKind.IJMP, InsnKind.ICALL):
            self._memory_indirect_targets(b)
            if k == InsnKind.ICALL:
                name = self.mem.import_name(last.literal) if last.literal is not None else None
                noret = name is not None and name.split("@")[0] in NORETURN
                self.stats.noreturn_calls += noret
                b.fallthrough = None if noret else last.end
            if last.literal is None:
                self.indirect.append(b)
        # RET and HALT: no targets, unknown exit (added by add_control_flow)

    def _is_noreturn(self, target: int) -> bool:
        name = self.dec.plt_import(target)
        if name is not None and name.split("@")[0] in NORETURN:
            self.stats.noreturn_calls += 1
            return True
        return False

    def _memory_indirect_targets(self, b: Block) -> None:
        """Literal load address: its value is trusted in read-only memory, elsewhere
        only when the value is itself a sampled address or the slot is an import's GOT
        entry already resolved into another module (a PLT stub under lazy binding: the
        callee's first instruction, e.g. a 1-byte ``push rbp``, is rarely sampled; an
        unresolved slot points back at the stub's own module); plus sampled targets.  A value believed
        here can only make a compare case: the loaded target is compared with it at run
        time, so a slot that changes later exits to original code."""
        last = b.last
        trusted = False
        if last.literal is not None:
            try:
                t = int.from_bytes(self.mem.read(last.literal, 8), "little")
            except MemoryViewError:
                t = None
            readonly = self.mem.is_readonly_range(last.literal, 8)
            believed = readonly or (t is not None and self.samples.get(t, 0) > 0) \
                or (t is not None and self.mem.import_name(last.literal) is not None
                    and self.mem.module_of(t) != self.mem.module_of(last.literal))
            if t is not None and self.mem.is_exec(t) and believed:
                b.targets.append(t)
                trusted = readonly
        for t, n in self.branch_samples.get(last.addr, {}).items():
            if n > 0 and t not in b.targets:
                b.targets.append(t)
        b.unknown_target = not trusted

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

    # ---- DISCOVER-INDIRECT-CODE --------------------------------------------
    def discover_indirect_code(self) -> bool:
        """Infer targets of register/indexed indirect transfers; True if any new."""
        found = False
        for b in list(self.indirect):
            if b.indirect_tried == len(b.preds):
                continue
            b.indirect_tried = len(b.preds)
            res = self._infer(b)
            if res is None:
                continue
            if not res.complete:               # writable memory: only sampled targets
                res = jumptable.IndirectTargets(
                    tuple(t for t in res.targets if self.samples.get(t, 0) > 0), res.how,
                    complete=False)
                if not res.targets:
                    continue
            new = [t for t in res.targets if t not in b.targets]
            if res.rel_base is not None and b.table_base is None:
                b.table_base = res.rel_base
            if res.how.startswith("table"):
                self.stats.jump_tables += 1
            self.stats.indirect_resolved += 1
            self.indirect.remove(b)
            b.indirect_tried = 1 << 30
            if not new and not b.unknown_target:
                continue
            b.targets.extend(dict.fromkeys(new))
            if b.unknown_target and res.complete:   # bounded table / constant: complete
                b.unknown_target = False
                b.succs = [c for c in b.succs if c.kind != CfeKind.UNKNOWN]
            cfes = self._cfes_of(b, dict.fromkeys(new))
            b.succs.extend(cfes)
            for c in cfes:
                self.connect(c)
            b.on_worklist = True
            self.worklist.append(b)
            found = True
        return found

    def _infer(self, b: Block) -> jumptable.IndirectTargets | None:
        for path in self._backward_paths(b):
            steps = [jumptable.PathStep(p.start, self._bytes(p), taken) for p, taken in path]
            first = path[0][0].start
            res = jumptable.infer_targets(steps, self.mem,
                                          lambda reg: self._hoisted_lea(reg, first))
            if res is not None and res.guessed and \
                    not any(self.samples.get(t, 0) > 0 for t in res.targets):
                continue          # a guessed table base needs a sampled target as evidence
            if res is not None:
                return res
        return None

    _REG_NUM = {n: i for i, n in enumerate(
        ["rax", "rcx", "rdx", "rbx", "rsp", "rbp", "rsi", "rdi",
         "r8", "r9", "r10", "r11", "r12", "r13", "r14", "r15"])}

    def _hoisted_lea(self, reg: str, before: int, window: int = 4096) -> list[int]:
        """Values of ``lea reg, [rip+disp32]`` found in the bytes before ``before``:
        where gcc hoists a jump table's base out of a loop that discovery entered in
        the middle.  Nearest first; a candidate is only a guess, checked by the caller."""
        num = self._REG_NUM.get(reg)
        if num is None:
            return []
        lo = max(before - window, 0)
        try:
            raw = self.mem.read(lo, before - lo)
        except MemoryViewError:
            return []
        rex = 0x4C if num >= 8 else 0x48
        pat = bytes([rex, 0x8D, ((num & 7) << 3) | 5])
        out: list[int] = []
        at = raw.rfind(pat)
        while at >= 0 and len(out) < 8:
            if at + 7 <= len(raw):
                disp = int.from_bytes(raw[at + 3:at + 7], "little", signed=True)
                value = lo + at + 7 + disp
                if value not in out and self.mem.is_readonly(value):
                    out.append(value)
            at = raw.rfind(pat, 0, at)
        return out

    def _backward_paths(self, b: Block, depth: int = 4, limit: int = 8):
        """Chains of predecessors ending in ``b`` (earliest first), at most ``limit``."""
        out: list[list[tuple[Block, bool | None]]] = []

        def walk(cur: Block, chain: list[tuple[Block, bool | None]]) -> None:
            if len(out) >= limit:
                return
            preds = [c for c in cur.preds if c.kind in (CfeKind.FLOW, CfeKind.FALLTHROUGH)
                     and c.src is not cur]
            if len(chain) > depth or not preds:
                out.append(chain)
                return
            for c in preds:
                taken = None
                if c.src.term == TermKind.JCC:
                    taken = c.kind == CfeKind.FLOW
                walk(c.src, [(c.src, taken)] + chain)

        walk(b, [(b, None)])
        return out

    def _bytes(self, b: Block) -> bytes:
        return self.mem.read(b.start, b.end - b.start)

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
        executed = {b for b in blocks if b.samples > 0 and b.first_sampled == b.start}
        partial = {b for b in blocks if b.samples > 0 and b.first_sampled != b.start}
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
                       seed_min: float = 0.0, max_blocks: int | None = None) -> SuperRegion:
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
    jumps-from-hot limit).
    """
    return HotCodeDiscovery(samples, mem, jumps_from_hot_limit=jumps_from_hot_limit,
                            branch_samples=branch_samples, patched=patched,
                            seed_min=seed_min, max_blocks=max_blocks).run()
