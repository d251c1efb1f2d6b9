"""Targets of the transfer that ends a block, for hot-code discovery.

Direct targets and fall-throughs, calls to functions that never return, the value in
a memory-indirect transfer's literal slot, and DISCOVER-INDIRECT-CODE: the targets of
register and indexed indirect transfers, inferred from the code before them
(region/jumptable.py).
"""

from __future__ import annotations

from dbr_service.common.errors import MemoryViewError
from dbr_service.region import jumptable
from dbr_service.region.blockmap import Block, CfeKind, DisResult
from dbr_service.region.decode import InsnKind
from dbr_service.region.model import TermKind

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


class TransferTargets:
    """The part of :class:`~dbr_service.region.discovery.HotCodeDiscovery` that finds
    the targets of a block's last instruction.  It works on that class's state
    (``mem``, ``dec``, ``samples``, ``branch_samples``, ``indirect``, ``worklist``,
    ``stats``) and calls its ``_cfes_of`` and ``connect``."""

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
        unresolved slot points back at the stub's own module); plus sampled targets.  A
        value believed here can only make a compare case: the loaded target is compared
        with it at run time, so a slot that changes later exits to original code."""
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
