"""A client's call-stack profile: sampled, unwound, named, folded; and its call graph.

:func:`collect` samples every thread of a process for a bounded time with
sampling/stacks.py, unwinds each sample with stacks/unwind.py and adds it to a
:class:`StackProfile`: the folded stacks (outermost frame first, as flame graphs
draw them) and the :class:`CallGraph` of functions (caller -> callee counts, samples
per function, function sizes) that function ordering (region/callorder.py) takes.

Frames are named by :class:`Namer`: the function's symbol where the module file
names it (common/symbols.py, read only from the very file the client mapped), else
``module+0xSTART`` with the start of the function's FDE (so the samples of a
stripped function still fold together), else ``module+0xOFFSET``; addresses in no
file mapping are ``[anon]`` or the mapping's name (``[vdso]``).  Names come from the
client's files: they are made printable and stripped of the folded format's
separators before they are kept.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Protocol

from dbr_service.common.clientfiles import safe_text
from dbr_service.codegen.cfi import CfiError
from dbr_service.codegen.frames import CfiSource
from dbr_service.common.hotnames import mapped_symbols
from dbr_service.common.procmaps import MapEntry, find_mapping, module_base, parse_maps
from dbr_service.region.callorder import CallOrder, c3_order
from dbr_service.sampling.stacks import StackSample, StackSampler
from dbr_service.common.symbols import SymbolTable
from dbr_service.stacks.unwind import Unwinder

#: Longest frame name kept (characters).
NAME_MAX = 200
#: Most distinct stacks one profile keeps; further new stacks count as ``[other]``.
MAX_STACKS = 20_000
MAX_SECONDS = 60.0


class Process(Protocol):
    """What a collection reads of the client (clientfiles.ProcHandle has it)."""

    def tids(self) -> set[int] | None: ...

    def alive(self) -> bool: ...

    def read(self, rel: str, limit: int = ...) -> bytes | None: ...

    def live_dir(self) -> str: ...


@dataclass(frozen=True, slots=True)
class Func:
    """A function of the call graph: its module and start offset in it (from the
    module's lowest mapping), its size in bytes (0: unknown) and its name."""

    module: str
    start: int
    size: int
    name: str


def clean_name(text: str) -> str:
    """A frame name safe for the folded format, SVG text and a terminal."""
    return safe_text(text, NAME_MAX).replace(";", ":").replace(" ", "_") or "?"


class Namer:
    """Names and functions of a client's original addresses, cached per module."""

    def __init__(self, maps: list[MapEntry], module_at: Callable[[int], Any]) -> None:
        self.maps = sorted(maps)
        self.module_at = module_at
        self._tables: dict[str, SymbolTable | None] = {}
        self._funcs: dict[int, Func] = {}

    def func(self, addr: int) -> Func:
        got = self._funcs.get(addr)
        if got is None:
            got = self._func(addr)
            if len(self._funcs) > 200_000:
                self._funcs.clear()
            self._funcs[addr] = got
        return got

    def _func(self, addr: int) -> Func:
        m = find_mapping(self.maps, addr)
        if m is None or not m.path.startswith("/"):
            label = m.path if m is not None and m.path.startswith("[") else "[anon]"
            return Func(label, 0, 0, clean_name(label))
        base = module_base(self.maps, m.path)
        off = addr - base
        if m.path not in self._tables:
            self._tables[m.path] = mapped_symbols(m.path, m.dev, m.ino)
        table = self._tables[m.path]
        short = os.path.basename(m.path)
        if table is not None:
            sym = table.find(off + table.first_load)
            if sym is not None:
                start = sym.start - table.first_load
                return Func(m.path, start, sym.size, clean_name(sym.name))
        try:
            mod = self.module_at(addr)
            fde = mod.eh.find(addr - mod.bias)
        except CfiError:
            fde = None
        if fde is not None:
            start = fde.start + mod.bias - base
            return Func(m.path, start, fde.end - fde.start, clean_name(f"{short}+{start:#x}"))
        return Func(m.path, off, 0, clean_name(f"{short}+{off:#x}"))


@dataclass
class CallGraph:
    """Caller -> callee call counts of functions, from call stacks: each sample counts
    each distinct (caller, callee) pair of its stack once, and its innermost
    function once in ``samples``."""

    calls: Counter = field(default_factory=Counter)
    samples: Counter = field(default_factory=Counter)
    funcs: dict[tuple[str, int], Func] = field(default_factory=dict)

    def add(self, stack: list[Func], count: int = 1) -> None:
        """``stack`` innermost first."""
        if not stack:
            return
        for f in stack:
            self.funcs.setdefault((f.module, f.start), f)
        self.samples[(stack[0].module, stack[0].start)] += count
        pairs = {((c.module, c.start), (e.module, e.start))
                 for e, c in zip(stack, stack[1:])}
        for pair in pairs:
            if pair[0] != pair[1]:
                self.calls[pair] += count

    def order(self, module: str | None = None) -> CallOrder:
        """The C3 order of the functions (of one module, when given)."""
        keys = [k for k in self.funcs if module is None or k[0] == module]
        sizes = {k: max(1, self.funcs[k].size) for k in keys}
        calls = [(u, v, c) for (u, v), c in self.calls.items() if u in sizes and v in sizes]
        return c3_order(sizes, self.samples, calls)

    def top_calls(self, n: int) -> list[dict[str, Any]]:
        """The ``n`` most frequent calls; ties by caller, then callee name (the calls
        of one stack are counted through a set: their order is not the stack's)."""
        named = sorted(((c, self.funcs[u].name, self.funcs[v].name)
                        for (u, v), c in self.calls.items()), key=lambda t: (-t[0], t[1], t[2]))
        return [{"caller": u, "callee": v, "count": c} for c, u, v in named[:n]]


@dataclass
class StackProfile:
    """Folded stacks (outermost first) with counts, and the call graph."""

    folded: Counter = field(default_factory=Counter)
    graph: CallGraph = field(default_factory=CallGraph)
    samples: int = 0
    truncated: int = 0
    methods: Counter = field(default_factory=Counter)
    other: int = 0

    def add(self, funcs: list[Func], truncated: bool, method: str) -> None:
        self.samples += 1
        self.truncated += truncated
        self.methods[method] += 1
        self.graph.add(funcs)
        key = tuple(f.name for f in reversed(funcs))
        if truncated:
            key = ("[truncated]",) + key
        if key in self.folded or len(self.folded) < MAX_STACKS:
            self.folded[key] += 1
        else:
            self.other += 1
            self.folded[("[other]",)] += 1

    def folded_lines(self) -> list[str]:
        return [f"{';'.join(k)} {n}" for k, n in sorted(self.folded.items())]


def collect(proc: Process, pid: int, seconds: float, *,
            attribute: Callable[[int], int] = lambda a: a,
            sp_offset: Callable[[int], int | None] = lambda a: 0,
            sample_period_us: int = 2000, stack_bytes: int = 16 << 10,
            poll_s: float = 0.02, stop: Callable[[], bool] = lambda: False
            ) -> tuple[StackProfile, dict[str, Any]]:
    """Sample every thread of ``proc`` (threads born meanwhile included) for
    ``seconds`` (at most :data:`MAX_SECONDS`) and build its profile; also some
    statistics.  ``attribute`` and ``sp_offset``: see unwind.Unwinder.  SamplingError
    when the events cannot be opened."""
    seconds = min(max(seconds, 0.0), MAX_SECONDS)
    maps_of = _maps_reader(proc)
    maps = maps_of()
    cfi = CfiSource(lambda: [(m.lo, m.hi, m.path, m.dev, m.ino) for m in maps])
    unwinder = Unwinder(cfi.module_at, attribute, sp_offset=sp_offset)
    sampler = StackSampler(pid, sample_period_us=sample_period_us, stack_bytes=stack_bytes)
    stacks: list[tuple[tuple[int, ...], bool, str]] = []
    t0 = time.monotonic()
    threads = 0
    try:
        sampler.add(sorted(proc.tids() or ()))
        if not proc.alive():          # the pid may name another process by now
            sampler.close()
            return StackProfile(), {"error": "the process ended"}
        deadline = t0 + seconds
        while time.monotonic() < deadline and not stop():
            time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))
            # unwound at once: replacement code is attributed while its region lives
            stacks.extend(_unwound(unwinder, sampler.read()))
            if proc.alive():
                sampler.add(sorted(proc.tids() or ()))
        stacks.extend(_unwound(unwinder, sampler.read()))
        threads = len(sampler.tids)
    finally:
        sampler.close()
    # the maps after sampling: libraries loaded meanwhile are in them
    maps = maps_of() or maps
    cfi.refresh()
    namer = Namer(maps, cfi.module_at)
    prof = StackProfile()
    for frames, truncated, method in stacks:
        prof.add([namer.func(a) for a in frames], truncated, method)
    stats = {"seconds": round(time.monotonic() - t0, 3), "threads": threads,
             "lost": sampler.lost, "throttles": sampler.throttles,
             "bad_records": sampler.bad_records, "threads_over": sampler.threads_over,
             "unwind": dict(unwinder.stats)}
    return prof, stats


def _unwound(unwinder: Unwinder, samples: Iterable[StackSample]
             ) -> Iterable[tuple[tuple[int, ...], bool, str]]:
    for s in samples:
        u = unwinder.unwind(s)
        yield u.frames, u.truncated, u.method


def _maps_reader(proc: Process) -> Callable[[], list[MapEntry]]:
    def read() -> list[MapEntry]:
        text = proc.read(f"{proc.live_dir()}/maps", 256 << 20)
        return parse_maps(text.decode(errors="replace")) if text else []

    return read


def parse_folded(lines: Iterable[str]) -> Counter:
    """Folded lines back into {stack tuple: count} (lines that do not parse skipped)."""
    out: Counter = Counter()
    for line in lines:
        stack, _, n = line.rstrip("\n").rpartition(" ")
        if stack and n.isdigit():
            out[tuple(stack.split(";"))] += int(n)
    return out
