"""DISCOVER-INDIRECT-CODE's inference (patent fig. 10): targets of indirect transfers.

Given a path of instructions that ends in an indirect jump or call (the block
itself and a chain of predecessors, earliest first), a tiny forward symbolic
evaluation gives the transfer target as an expression over unknown inputs.
Recognised shapes, as gcc emits them at -O0..-O3:

* absolute jump table:  ``cmp idx, N; ja dflt; ... jmp [T + idx*8]``
  (or ``mov rax, [T + idx*8]; jmp rax``);
* PC-relative table:    ``cmp idx, N; ja dflt; lea rdx, [rip+T];
  movsxd rax, [rdx + idx*4]; add rax, rdx; jmp rax``;
* a table of function pointers indexed by a masked value:
  ``and eax, 3; call [rdx + rax*8]`` (the mask bounds the index: 4 entries);
* a constant (``lea rax, [rip+f]; call rax``) or a literal pointer load.

Table entries and literal pointers are read only from read-only memory; the
index bound comes only from the guarding compare-and-branch on the path or from
an ``and`` with a small non-negative immediate (the result is at most that).  The
targets are the table's entries that are code: all of them, or a prefix of at least
half when the rest is not code (a mask wider than the table, see :func:`_read_table`);
``entries`` stays the bound.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import capstone
from capstone import x86 as X

from dbr_service.common.errors import MemoryViewError
from dbr_service.region.memview import MemoryView

#: Largest jump table believed (entries).
MAX_TABLE = 4096

Expr = tuple | int

_cs = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
_cs.detail = True


@dataclass(frozen=True)
class PathStep:
    """One block of the backward path: its raw bytes and how it leads on.

    ``taken`` tells, when the block ends in a conditional branch, whether the
    path continues along the taken direction (True) or the fall-through (False).
    """

    start: int
    data: bytes
    taken: bool | None = None


@dataclass(frozen=True)
class IndirectTargets:
    """What the inference found: targets and whether they are complete."""

    targets: tuple[int, ...]
    #: "table-abs", "table-rel", "const", "literal", "literal-writable"
    how: str
    table: int | None = None
    entries: int = 0
    #: False when read from writable memory: the value may change, so a target is
    #: only to be believed if it also has samples, and others remain possible.
    complete: bool = True
    #: True when a register the path never set was given a guessed value (a hoisted
    #: table base): the caller wants evidence (sampled targets) before believing it.
    guessed: bool = False
    #: PC-relative table: the address its (sign-extended) entries are added to.
    rel_base: int | None = None


# ---- expressions -------------------------------------------------------------
# ("c", v) constant; ("s", n) unknown input; ("add", (terms...)) sum;
# ("mul", e, k); ("ld", size, addr); ("sx", e) sign extension of a 32-bit value.

_fresh = [0]


def _sym() -> tuple:
    _fresh[0] += 1
    return ("s", _fresh[0])


def _const(e: Expr) -> int | None:
    return e[1] if e[0] == "c" else None


def _add(a: tuple, b: tuple) -> tuple:
    terms: list[tuple] = []
    c = 0
    for e in (a, b):
        if e[0] == "c":
            c += e[1]
        elif e[0] == "add":
            for t in e[1]:
                if t[0] == "c":
                    c += t[1]
                else:
                    terms.append(t)
        else:
            terms.append(e)
    if not terms:
        return ("c", c & 0xFFFFFFFFFFFFFFFF)
    c &= 0xFFFFFFFFFFFFFFFF
    if c:
        terms.append(("c", c))
    if len(terms) == 1:
        return terms[0]
    return ("add", tuple(sorted(terms, key=repr)))


def _mul(a: tuple, k: int) -> tuple:
    if k == 1:
        return a
    if a[0] == "c":
        return ("c", (a[1] * k) & 0xFFFFFFFFFFFFFFFF)
    return ("mul", a, k)


def _strip_ext(e: tuple) -> tuple:
    while e[0] == "sx":
        e = e[1]
    return e


def _split_sum(e: tuple) -> tuple[int, list[tuple]]:
    if e[0] == "c":
        return e[1], []
    if e[0] == "add":
        c = sum(t[1] for t in e[1] if t[0] == "c")
        return c, [t for t in e[1] if t[0] != "c"]
    return 0, [e]


# ---- registers ---------------------------------------------------------------

def _reg64(reg: int) -> str | None:
    """64-bit family name of a general-purpose register, or None for others."""
    name = _cs.reg_name(reg)
    if name is None:
        return None
    name = name.lower()
    fam = {"al": "rax", "ah": "rax", "ax": "rax", "eax": "rax", "rax": "rax",
           "bl": "rbx", "bh": "rbx", "bx": "rbx", "ebx": "rbx", "rbx": "rbx",
           "cl": "rcx", "ch": "rcx", "cx": "rcx", "ecx": "rcx", "rcx": "rcx",
           "dl": "rdx", "dh": "rdx", "dx": "rdx", "edx": "rdx", "rdx": "rdx",
           "sil": "rsi", "si": "rsi", "esi": "rsi", "rsi": "rsi",
           "dil": "rdi", "di": "rdi", "edi": "rdi", "rdi": "rdi",
           "bpl": "rbp", "bp": "rbp", "ebp": "rbp", "rbp": "rbp",
           "spl": "rsp", "sp": "rsp", "esp": "rsp", "rsp": "rsp"}.get(name)
    if fam:
        return fam
    if name.startswith("r") and name[1:].rstrip("dwb").isdigit():
        return "r" + name[1:].rstrip("dwb")
    return None


def _reg_size(reg: int) -> int:
    """Width in bytes of a general-purpose register operand."""
    n = (_cs.reg_name(reg) or "").lower()
    if n[:1] == "r" and n[1:].isdigit():
        return 8
    if n[:1] == "r" and n[-1:] in "dwb" and n[1:-1].isdigit():
        return {"d": 4, "w": 2, "b": 1}[n[-1]]
    if n[:1] == "r":
        return 8
    if n[:1] == "e":
        return 4
    if n in ("ax", "bx", "cx", "dx", "si", "di", "sp", "bp"):
        return 2
    return 1


class _State:
    """Symbolic register file plus the last flag-setting compare."""

    def __init__(self) -> None:
        self.regs: dict[str, tuple] = {}
        self.flags: tuple | None = None           # ("cmp", expr, imm)
        self.guards: list[tuple[tuple, int]] = []  # (index expr, number of entries)

    def get(self, reg: int) -> tuple:
        fam = _reg64(reg)
        if fam is None:
            return _sym()
        v = self.regs.get(fam)
        if v is None:
            v = self.regs[fam] = ("s", fam)
        return v

    def set(self, reg: int, value: tuple) -> None:
        fam = _reg64(reg)
        if fam is None:
            return
        size = _reg_size(reg)
        self.regs[fam] = value if size >= 4 else _sym()


def _mem_addr(st: _State, insn, op) -> tuple:
    m = op.mem
    if m.base == X.X86_REG_RIP:
        return ("c", insn.address + insn.size + m.disp)
    e: tuple = ("c", m.disp & 0xFFFFFFFFFFFFFFFF)
    if m.base:
        e = _add(e, st.get(m.base))
    if m.index:
        e = _add(e, _mul(st.get(m.index), m.scale))
    return e


def _value(st: _State, insn, op) -> tuple:
    if op.type == X.X86_OP_REG:
        return st.get(op.reg)
    if op.type == X.X86_OP_IMM:
        return ("c", op.imm & 0xFFFFFFFFFFFFFFFF)
    return ("ld", op.size, _mem_addr(st, insn, op))


_NO_FLAGS = {"mov", "movabs", "movsxd", "movzx", "movsx", "lea", "nop", "endbr64", "push",
             "pop", "cdqe", "jmp", "cmove", "cmovne", "cmova", "cmovae", "cmovb", "cmovbe"}

_GUARDS = {  # (mnemonic, taken) -> entries given compare immediate N
    ("ja", False): 1, ("jbe", True): 1,      # idx <= N  -> N + 1 entries
    ("jae", False): 0, ("jb", True): 0,      # idx <  N  -> N entries
}


def _step(st: _State, insn, taken: bool | None) -> None:
    """Advance the symbolic state over one instruction."""
    mn = insn.mnemonic.split()[-1]            # drop notrack/bnd prefixes
    ops = insn.operands
    if insn.group(capstone.CS_GRP_JUMP) and mn != "jmp":
        if st.flags is not None and taken is not None:
            extra = _GUARDS.get((mn, taken))
            if extra is not None:
                _, expr, imm = st.flags
                st.guards.append((expr, imm + extra))
        return
    if mn == "cmp" and len(ops) == 2 and ops[1].type == X.X86_OP_IMM:
        st.flags = ("cmp", _value(st, insn, ops[0]), ops[1].imm)
        return
    if mn not in _NO_FLAGS:
        st.flags = None
    if mn in ("mov", "movabs") and ops[0].type == X.X86_OP_REG:
        st.set(ops[0].reg, _value(st, insn, ops[1]))
    elif mn == "lea":
        st.set(ops[0].reg, _mem_addr(st, insn, ops[1]))
    elif mn == "movsxd" or (mn == "movsx" and ops[1].size == 4):
        st.set(ops[0].reg, ("sx", _value(st, insn, ops[1])))
    elif mn == "movzx" and ops[0].type == X.X86_OP_REG:
        st.set(ops[0].reg, _value(st, insn, ops[1]))
    elif mn == "cdqe":
        st.regs["rax"] = ("sx", st.regs.get("rax", ("s", "rax")))
    elif mn == "add" and ops[0].type == X.X86_OP_REG:
        st.set(ops[0].reg, _add(st.get(ops[0].reg), _value(st, insn, ops[1])))
    elif mn == "sub" and ops[0].type == X.X86_OP_REG and ops[1].type == X.X86_OP_IMM:
        st.set(ops[0].reg, _add(st.get(ops[0].reg), ("c", -ops[1].imm)))
    elif mn == "shl" and ops[0].type == X.X86_OP_REG and ops[1].type == X.X86_OP_IMM:
        st.set(ops[0].reg, _mul(st.get(ops[0].reg), 1 << ops[1].imm))
    elif mn == "xor" and ops[0].type == X.X86_OP_REG and ops[1].type == X.X86_OP_REG \
            and ops[0].reg == ops[1].reg:
        st.set(ops[0].reg, ("c", 0))
    elif mn == "and" and ops[0].type == X.X86_OP_REG and ops[1].type == X.X86_OP_IMM \
            and 0 <= ops[1].imm < MAX_TABLE and _reg_size(ops[0].reg) >= 4:
        # the result lies in [0, imm]: a fresh value bounded like a guarded index
        v = _sym()
        st.set(ops[0].reg, v)
        st.guards.append((v, ops[1].imm + 1))
    else:
        _clobber(st, insn)


def _clobber(st: _State, insn) -> None:
    try:
        _, written = insn.regs_access()
    except capstone.CsError:
        written = []
    for r in written:
        fam = _reg64(r)
        if fam is not None:
            st.regs[fam] = _sym()
    if insn.group(capstone.CS_GRP_CALL):
        for fam in ("rax", "rcx", "rdx", "rsi", "rdi", "r8", "r9", "r10", "r11"):
            st.regs[fam] = _sym()


def decode(step: PathStep) -> list:
    return list(_cs.disasm(step.data, step.start))


def infer_targets(path: Sequence[PathStep], mem: MemoryView,
                  resolve: Callable[[str], Sequence[int]] | None = None
                  ) -> IndirectTargets | None:
    """Targets of the indirect transfer ending ``path[-1]``, or None if not inferred.

    ``resolve(reg)`` may offer candidate values for a register the path reads but
    never sets (a table base gcc hoisted out of the loop, into code discovery did
    not reach); each is tried in turn and a match says ``guessed=True``."""
    st = _State()
    insns: list = []
    for k, step in enumerate(path):
        block = decode(step)
        if k == len(path) - 1:
            block = block[:-1]     # the transfer itself reads, not writes, its operand
        for i, insn in enumerate(block):
            _step(st, insn, step.taken if i == len(block) - 1 else None)
        insns = decode(step)
    if not insns:
        return None
    last = insns[-1]
    op = last.operands[0] if last.operands else None
    if op is None:
        return None
    target = st.get(op.reg) if op.type == X.X86_OP_REG else ("ld", 8, _mem_addr(st, last, op))
    found = _match(target, st.guards, mem)
    if found is not None or resolve is None:
        return found
    for name in sorted(_inputs(target)):
        for value in resolve(name):
            guess = _match(_subst(target, name, value), [(_subst(e, name, value), n)
                                                         for e, n in st.guards], mem)
            if guess is not None and guess.how.startswith("table"):
                return replace(guess, guessed=True)
    return None


def _inputs(e: tuple) -> set[str]:
    """Names of the unknown register inputs an expression uses."""
    kind = e[0]
    if kind == "s":
        return {e[1]} if isinstance(e[1], str) else set()
    if kind == "add":
        return set().union(*(_inputs(t) for t in e[1]))
    if kind in ("mul", "sx"):
        return _inputs(e[1])
    if kind == "ld":
        return _inputs(e[2])
    return set()


def _subst(e: tuple, name: str, value: int) -> tuple:
    """``e`` with the unknown register ``name`` replaced by the constant ``value``."""
    kind = e[0]
    if kind == "s":
        return ("c", value) if e[1] == name else e
    if kind == "c":
        return e
    if kind == "add":
        out: tuple = ("c", 0)
        for t in e[1]:
            out = _add(out, _subst(t, name, value))
        return out
    if kind == "mul":
        return _mul(_subst(e[1], name, value), e[2])
    if kind == "ld":
        return ("ld", e[1], _subst(e[2], name, value))
    if kind == "sx":
        return ("sx", _subst(e[1], name, value))
    return tuple(_subst(x, name, value) if isinstance(x, tuple) else x for x in e)


def _match(target: tuple, guards: list[tuple[tuple, int]], mem: MemoryView) \
        -> IndirectTargets | None:
    c = _const(target)
    if c is not None:
        return IndirectTargets((c,), "const") if mem.is_exec(c) else None
    if target[0] == "ld" and target[1] == 8:
        return _match_abs(target[2], guards, mem)
    base, terms = _split_sum(target)
    if len(terms) == 1 and terms[0][0] == "sx" and terms[0][1][0] == "ld" \
            and terms[0][1][1] == 4:
        return _match_rel(base, terms[0][1][2], guards, mem)
    return None


def _index_of(addr: tuple, scale: int) -> tuple[int, tuple] | None:
    """Split ``T + idx*scale`` into (T, idx)."""
    base, terms = _split_sum(addr)
    if len(terms) != 1:
        return None
    t = terms[0]
    if t[0] == "mul" and t[2] == scale:
        return base, t[1]
    return None


def _bound(idx: tuple, guards: list[tuple[tuple, int]]) -> int | None:
    want = _strip_ext(idx)
    for expr, n in reversed(guards):
        if _strip_ext(expr) == want:
            return n
    return None


def _match_abs(addr: tuple, guards, mem: MemoryView) -> IndirectTargets | None:
    c = _const(addr)
    if c is not None:                               # literal pointer: jmp [rip+x]
        try:
            t = int.from_bytes(mem.read(c, 8), "little")
        except MemoryViewError:
            return None
        if not mem.is_exec(t):
            return None
        if not mem.is_readonly_range(c, 8):
            return IndirectTargets((t,), "literal-writable", complete=False)
        return IndirectTargets((t,), "literal")
    found = _table_and_bound(addr, 8, guards)
    if found is None:
        return None
    return _read_table(*found, 8, lambda v: v, "table-abs", mem)


def _table_and_bound(addr: tuple, scale: int, guards) -> tuple[int, int] | None:
    """(table address, entries) of ``T + idx*scale`` with idx bounded by a guard."""
    split = _index_of(addr, scale)
    if split is None:
        return None
    table, idx = split
    n = _bound(idx, guards)
    if n is None or not 0 < n <= MAX_TABLE:
        return None
    return table, n


def _match_rel(base: int, addr: tuple, guards, mem: MemoryView) -> IndirectTargets | None:
    found = _table_and_bound(addr, 4, guards)
    if found is None:
        return None
    table, n = found

    def rel(v: int) -> int:
        if v & 0x80000000:
            v -= 1 << 32
        return (base + v) & 0xFFFFFFFFFFFFFFFF

    res = _read_table(table, n, 4, rel, "table-rel", mem)
    return None if res is None else replace(res, rel_base=base)


def _read_table(table: int, n: int, width: int, conv, how: str,
                mem: MemoryView) -> IndirectTargets | None:
    if not mem.is_readonly_range(table, n * width):
        return None
    try:
        raw = mem.read(table, n * width)
    except MemoryViewError:
        return None
    out = []
    for i in range(n):
        t = conv(int.from_bytes(raw[i * width:(i + 1) * width], "little"))
        if not mem.is_exec(t):
            break
        out.append(t)
    # A mask bounds the index by a power of two, often beyond the table's end (Lua's
    # ``disptab`` has 83 entries under ``and eax, 0x7f``): a tail that is not code is
    # other data the program never indexes.  Code must be a prefix of at least half
    # the entries (and two), and nothing after it code, or the table is not believed.
    k = len(out)
    if k < n and (k < 2 or 2 * k < n or any(
            mem.is_exec(conv(int.from_bytes(raw[i * width:(i + 1) * width], "little")))
            for i in range(k, n))):
        return None
    return IndirectTargets(tuple(out), how, table, n)
