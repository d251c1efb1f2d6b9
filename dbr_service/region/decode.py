"""Decoding for hot-code discovery: what it needs of each instruction, and its caches.

:class:`Decoder` decodes memory that is executable and read-only with capstone and
classifies each instruction (:class:`Insn`); what codegen cannot relocate is
unsupported.  Two caches spare capstone's detailed decoding: templates by instruction
bytes (``_TEMPLATES``) and, for the life of a worker process, the instructions of
file-backed modules (:data:`DECODE_CACHE`).
"""

from __future__ import annotations

import enum
import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass

import capstone
from capstone import x86 as X

from dbr_service.common.errors import MemoryViewError
from dbr_service.region.memview import MemoryView

#: Longest x86 instruction.
MAX_INSN = 15
#: Bytes decoded per capstone call (the run is cached by address).
DECODE_CHUNK = 96

_UNSUPPORTED = frozenset({
    X.X86_INS_LJMP, X.X86_INS_LCALL, X.X86_INS_RETF, X.X86_INS_RETFQ, X.X86_INS_IRET,
    X.X86_INS_IRETD, X.X86_INS_IRETQ, X.X86_INS_INT, X.X86_INS_INTO, X.X86_INS_INT1,
    X.X86_INS_SYSENTER, X.X86_INS_SYSEXIT, X.X86_INS_SYSEXITQ, X.X86_INS_SYSRET,
    X.X86_INS_SYSRETQ, X.X86_INS_XBEGIN,
})
_HALT = frozenset({X.X86_INS_HLT, X.X86_INS_UD2, X.X86_INS_UD0, X.X86_INS_UD1, X.X86_INS_INT3})


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
        #: block: budget.CpuBudget.max_blocks).
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

