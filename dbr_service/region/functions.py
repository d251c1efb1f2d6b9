"""Known function entries of a client, for entry sites (region/patchpoints.py).

An entry site patches the first few instructions of a function, so its address must
be a function entry: only then do callers arrive at its first byte and nothing else
in the function branches back into its first five bytes.  :class:`FunctionEntries`
answers ``addr in entries`` (run-time addresses) from

* addresses given to it: direct call targets discovery saw (:func:`call_targets`);
* each module's ``.eh_frame``: an address where an FDE starts (through
  ``module_at``, ``codegen.frames.CfiSource.module_at``: file, bias, parsed CFI);
* the same module's ELF symbol table (``.symtab``, else ``.dynsym``; dbr_service/
  common/symbols.py): a defined function symbol's value.

It also gives the FDE start holding an address (hot text's discovery seeds) and
whether a direct branch anywhere in a module may land in a range (region/
branchindex.py), which entry sites must not have in their bytes 1..4.

A look-up that fails (no module file, unreadable CFI) says no.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

from dbr_service.codegen.cfi import CfiError
from dbr_service.region.branchindex import BranchIndexError, index_of
from dbr_service.region.model import SuperRegion, TermKind
from dbr_service.common.symbols import symbols_of


def call_targets(sr: SuperRegion) -> set[int]:
    """Targets of the direct calls among ``sr``'s blocks (clones included: their
    targets are the original's)."""
    return {t for _, bb in sr.blocks() if bb.term is TermKind.CALL for t in bb.targets}


class FunctionEntries:
    """``addr in entries``: whether ``addr`` is known to be a function's entry."""

    def __init__(self, addrs: Iterable[int] = (),
                 module_at: Callable[[int], Any] | None = None) -> None:
        self._addrs = set(addrs)
        self._module_at = module_at
        #: Samples per function entry (hot text: function_samples); empty otherwise.
        self.samples: dict[int, float] = {}

    def add(self, addrs: Iterable[int]) -> None:
        self._addrs.update(addrs)

    def __contains__(self, addr: object) -> bool:
        if not isinstance(addr, int):
            return False
        if addr in self._addrs:
            return True
        mod = self._module(addr)
        if mod is None:
            return False
        link = addr - mod.bias
        fde = mod.eh.find(link)
        if fde is not None and fde.start == link:
            return True
        return link in symbols_of(mod.path).starts()

    def _module(self, addr: int) -> Any:
        """The module holding ``addr`` with its parsed CFI, or None (no look-up, no
        module file, unreadable CFI)."""
        if self._module_at is None:
            return None
        try:
            return self._module_at(addr)
        except (CfiError, OSError):
            return None

    def function_start(self, addr: int) -> int | None:
        """The run-time start of the ``.eh_frame`` FDE holding ``addr``, or None."""
        mod = self._module(addr)
        if mod is None:
            return None
        fde = mod.eh.find(addr - mod.bias)
        return None if fde is None else fde.start + mod.bias

    def count_samples(self, samples: Any, seed_min: float = 0.0) -> list[int]:
        """Sum ``samples`` ({ip: count}) per function (``self.samples``, by FDE start);
        return the entries of the functions holding an IP with at least ``seed_min``."""
        self.samples = {}
        seeds = set()
        for ip, n in samples.items():
            start = self.function_start(ip) if n > 0 else None
            if start is not None:
                self.samples[start] = self.samples.get(start, 0.0) + n
                if n >= seed_min:
                    seeds.add(start)
        return sorted(seeds)

    def may_branch_into(self, lo: int, hi: int) -> bool:
        """Whether a direct branch anywhere in the module holding ``lo`` may land in
        [lo, hi) (region/branchindex.py); True when that cannot be known.  Without a
        module look-up only what discovery decoded is known: False."""
        if self._module_at is None:
            return False
        try:
            mod = self._module_at(lo)
            return index_of(mod.path).may_branch_into(lo - mod.bias, hi - mod.bias)
        except (CfiError, OSError, BranchIndexError):
            return True

    def name(self, addr: int) -> str | None:
        """``func+0x12`` for a run-time address: the module's symbol holding it, else
        ``fn_START`` for the ``.eh_frame`` FDE holding it (START: its link address in
        hex); None where neither does (region graphs label their nodes with it)."""
        mod = self._module(addr)
        if mod is None:
            return None
        link = addr - mod.bias
        hit = symbols_of(mod.path).lookup(link)
        if hit is None:
            fde = mod.eh.find(link)
            if fde is None:
                return None
            hit = (f"fn_{fde.start:x}", link - fde.start)
        return f"{hit[0]}+{hit[1]:#x}" if hit[1] else hit[0]

    def __deepcopy__(self, memo: dict) -> "FunctionEntries":
        return self          # read-only for the passes; its module look-up holds locks

    def __repr__(self) -> str:
        return f"FunctionEntries({len(self._addrs)} addresses, " \
               f"{'with' if self._module_at else 'no'} module look-up)"
