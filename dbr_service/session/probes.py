"""Dynamic probes of a client (docs/decisions/0040-probes.md): ``dbr ctl probe
add|list|show|del``.

A probe is a trampoline at an operator-given location (codegen/probes.py), installed
like a tiny region through the installer: its code in a code buffer, the location
patched with a 5-byte ``jmp``, its data (a counter, or a ring of argument records)
in a data buffer that the service reads through its own mapping.  Its installed
region is ``kept``: evaluation never removes it.  It goes on ``del``, when the
service detaches (shutdown), with a map change that takes its code, and with the
process.

A location is ``SYMBOL[+OFF]`` (a function of any mapped module's ``.symtab`` or
``.dynsym``) or ``MODULE+OFF`` (a mapped file's path or basename, the offset from its
lowest mapping, as ``dbr ctl hotspots`` prints it).  It is refused, with the reason,
when: no module or symbol has that name; it is not in executable memory; no function
symbol covers it, or decoding from the function's start does not reach it as an
instruction boundary; it overlaps a patch (a region's or another probe's) or code an
installed region copies (the copy would run instead of it, unseen); its first
instruction is shorter than 5 bytes and it is not a function's start, or something
in the module's functions branches into its bytes 1..4 (no trap-per-hit fallback is
built); its first instructions cannot be relocated (a call, a return, an indirect
branch); an ``args`` or ``latency`` probe not at a function's start; a ``latency``
probe on a host whose TSC is not invariant, in a process that can throw C++
exceptions (the exit stub has no unwind information: :func:`cxx_problem`), with a
shadow stack (:func:`shadow_stack_problem`), or on a function that returns twice
(:data:`RETURNS_TWICE`).

A latency probe's exit stub is in its trampoline's code, so removal leaves it in
quarantine until censuses find no thread's stack holding its address (threads still
inside the function return through it); its data buffer (the thread slots) stays
mapped until the session ends, as an args probe's ring does.

Regions and probes: discovery stops before patched bytes, so new regions exit to a
probed location instead of copying it; a region selected before the probe was added
is not installed if it copies one (:meth:`SessionProbes.probed_in`).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

from dbr_service.wire import protocol as P
from dbr_service.codegen.counting import inc_flags_dead
from dbr_service.codegen.probes import (RING_BYTES, Filter, args_handler, count_handler,
                                        parse_filter, probe_trampoline, read_ring)
from dbr_service.codegen.probes_latency import (DATA_BYTES, SLOTS, initial_data,
                                                latency_trampoline, read_latency)
from dbr_service.common.tsc import invariant_problem, ticks_per_ns
from dbr_service.codegen.relocate import Relocator
from dbr_service.installation.entry_sites import decode_inner
from dbr_service.common.errors import AgentError, CodegenError, DbrError, ProtocolError
from dbr_service.common.hotnames import mapped_symbols
from dbr_service.installation.installed import HELD
from dbr_service.common.procmaps import MapEntry, find_mapping, module_base
from dbr_service.installation.progress_points import CounterSpace, TrampolineCode

#: Live probes per client at most (each is a patch and some code).
PROBES_MAX = 32
#: Data buffers of args and latency probes per session at most: a removed probe's
#: buffer stays mapped (code in quarantine may still write it) until the session ends.
RINGS_MAX = 64
#: A latency probe's data buffer: its thread slots, rounded up to pages.
LATENCY_BUFFER = (DATA_BYTES + 4095) & ~4095
#: Functions that return twice, or return on a stack that is not their caller's: a
#: latency probe's exit stub would run without its entry.
RETURNS_TWICE = frozenset({
    "setjmp", "_setjmp", "__setjmp", "sigsetjmp", "__sigsetjmp", "savectx", "vfork",
    "__vfork", "getcontext", "__getcontext", "swapcontext", "__swapcontext",
    "setcontext", "__setcontext"})
#: Module basenames whose presence means C++ exceptions may unwind through a function.
CXX_RUNTIMES = ("libstdc++.so", "libc++.so", "libc++abi.so")
#: Bytes of a function decoded at most to check that a location is a boundary.
DECODE_MAX = 1 << 20
#: Bytes of a module's functions swept at most for branches into an entry site.
SWEEP_MAX = 32 << 20
#: Records ``show`` returns at most.
SHOW_MAX = 64


class ProbeRefused(DbrError):
    """A probe request refused; the message says why."""


class NoProbe(DbrError):
    """No probe with that id."""


@dataclass
class Location:
    """A resolved probe location."""

    addr: int
    module: str
    func: str | None        # the function containing it, and its start
    func_start: int | None

    def text(self) -> str:
        if self.func is None:
            return f"{os.path.basename(self.module)}+{self.addr - self.func_start:#x}" \
                if self.func_start is not None else f"{self.addr:#x}"
        off = self.addr - self.func_start
        return f"{self.func}+{off:#x}" if off else self.func


@dataclass
class Probe:
    id: int
    kind: str
    location: str
    addr: int
    module: str
    flt: Filter | None
    region_id: int
    data: Any                       # the data buffer (CodeBufferHandle)
    data_addr: int                  # counter, or ring
    site: str                       # "plain" or "entry"
    flags_saved: bool
    ticks_per_ns: float = 0.0       # latency: the TSC's rate at add
    created: float = field(default_factory=time.time)
    removed: str = ""               # why, once removed
    final: Any = None               # the data read at removal

    def read(self) -> Any:
        """The count, or the ring's bytes; the last read once removed."""
        if self.removed:
            return self.final
        if self.kind == "count":
            return self.data.read_u64(self.data_addr)
        size = SLOTS if self.kind == "latency" else RING_BYTES
        return None if self.data.mem.closed else self.data.read(self.data_addr, size)

    def to_json(self, last: int = 0) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id, "kind": self.kind, "location": self.location,
            "address": self.addr, "module": self.module,
            "filter": str(self.flt) if self.flt else None, "site": self.site,
            "flags_saved": self.flags_saved, "created": self.created,
            "state": f"removed: {self.removed}" if self.removed else "active"}
        data = self.read()
        if self.kind == "count":
            out["count"] = data
        elif self.kind == "latency":
            if data is not None:
                out.update(read_latency(data, self.ticks_per_ns))
        elif data is not None:
            n, recs = read_ring(data, last)
            out["records_total"] = n
            if last:
                out["records"] = [{"n": k, "args": args, "return": ret}
                                  for k, args, ret in recs]
        return out


def parse_location(text: str) -> tuple[str, int]:
    """``NAME`` or ``NAME+OFF`` (OFF decimal or 0x hex): (name, offset)."""
    name, plus, off = text.strip().rpartition("+")
    if not plus:
        name, off = text.strip(), "0"
    try:
        value = int(off, 0)
    except ValueError:
        raise ProbeRefused(f"location {text!r} is not SYMBOL[+OFF] or MODULE+OFF") from None
    if not name or value < 0 or value >= 1 << 47:
        raise ProbeRefused(f"location {text!r} is not SYMBOL[+OFF] or MODULE+OFF")
    return name, value


def resolve(text: str, maps: list[MapEntry], exe: str) -> Location:
    """The address ``text`` names in a client with ``maps`` (its exe's symbols first)."""
    name, off = parse_location(text)
    files = [m for m in maps if m.path.startswith("/")]
    paths = sorted({m.path for m in files}, key=lambda p: (p != exe, p))
    named = [p for p in paths if name in (p, os.path.basename(p))]
    if len(named) > 1:
        raise ProbeRefused(f"{name!r} names several mapped modules ({', '.join(named)}): "
                           f"give the path")
    if named:
        path = named[0]
        addr = module_base(maps, path) + off
    else:
        for path in paths:
            m = next(x for x in files if x.path == path)
            table = mapped_symbols(path, m.dev, m.ino)
            sym = table.by_name(name) if table is not None else None
            if sym is not None:
                addr = module_base(maps, path) + sym.start - table.first_load + off
                break
        else:
            if "/" in name or name.endswith(".so") or ".so." in name:
                raise ProbeRefused(f"the client maps no module {name!r}")
            raise ProbeRefused(f"no module or function named {name!r} in the client "
                               f"(function names come from .symtab or .dynsym)")
    m = find_mapping(maps, addr)
    if m is None or m.path != path:
        raise ProbeRefused(f"{text} ({addr:#x}) is outside {path}'s mappings")
    if not m.executable:
        raise ProbeRefused(f"{text} ({addr:#x}) is not executable ({m.perms} mapping)")
    table = mapped_symbols(path, m.dev, m.ino)
    hit = table.at_offset(addr - module_base(maps, path)) if table is not None else None
    if hit is None:
        return Location(addr, path, None, None)
    return Location(addr, path, hit[0], addr - hit[1])


def boundary_problem(code: bytes, start: int, addr: int) -> str | None:
    """Why ``addr`` is not an instruction boundary of the straight-line decoding of
    ``code`` (the function's bytes from ``start``), or None."""
    import capstone
    md = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    for a, size, _m, _o in md.disasm_lite(code, start):
        if a == addr:
            return None
        if a < addr < a + size:
            return f"{addr:#x} is inside the instruction at {a:#x}, not at its start"
    return f"the function's code does not decode up to {addr:#x}"


def branches_into(code: bytes, start: int, lo: int, hi: int) -> int | None:
    """A direct branch or call in ``code`` (at ``start``) whose target lies in
    [lo, hi); its address, or None."""
    import capstone
    md = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    for a, _size, mnem, op in md.disasm_lite(code, start):
        if (mnem[0] == "j" or mnem in ("call", "loop", "loope", "loopne")) and \
                op.startswith("0x"):
            try:
                t = int(op, 16)
            except ValueError:
                continue
            if lo <= t < hi:
                return a
    return None


def shadow_stack_problem(status: bytes | None) -> str | None:
    """Why the process whose ``/proc/PID/status`` is ``status`` cannot take a latency
    probe for its shadow stack (CET: the exit stub's ``ret`` would not match the
    hardware's copy of the return address and fault), or None."""
    for line in (status or b"").decode("ascii", "replace").splitlines():
        if line.startswith("x86_Thread_features:") and "shstk" in line.split(":", 1)[1]:
            return "the process runs with a shadow stack (CET), which the exit stub breaks"
    return None


def cxx_problem(maps: list[MapEntry], module: str) -> str | None:
    """Why a latency probe's exit stub could be met by a C++ exception's unwinder in
    a client with ``maps`` (the probed function in ``module``), or None: a C++
    runtime is mapped, or the module defines ``__cxa_throw`` (linked statically)."""
    for m in maps:
        base = os.path.basename(m.path)
        if any(base.startswith(r) for r in CXX_RUNTIMES):
            return (f"the process maps {base}: a C++ exception unwinding through the "
                    f"function would meet the exit stub, which has no unwind information")
    m = next((x for x in maps if x.path == module), None)
    table = mapped_symbols(module, m.dev, m.ino) if m is not None else None
    if table is not None and table.by_name("__cxa_throw") is not None:
        return (f"{os.path.basename(module)} defines __cxa_throw: a C++ exception "
                f"unwinding through the function would meet the exit stub")
    return None


class SessionProbes:
    """The probe part of :class:`dbr_service.session.clients.ClientSession` (a mixin)."""

    #: Probes by id (ClientSession makes it), and the data buffers of args probes'
    #: rings, kept for the session.
    probes: dict[int, Probe]
    probe_rings: list[Any]

    def probe_request(self, op: str, args: dict[str, Any]) -> Any:
        """Any thread: one ``probe_*`` verb.  add and del run on the session thread."""
        if op == "list":
            return {"pid": self.pid, "probes": [self._probe_json(p) for p in self._probe_list()
                                                if self._probe_shown(p)]}
        if op == "show":
            p = self._probe_get(args["id"])
            return self._probe_json(p, min(max(args.get("last") or 0, 0), SHOW_MAX))
        if not self.alive:
            raise ProbeRefused(f"client {self.pid} is no longer connected")
        if op == "add":
            return self.call(lambda: self.probe_add(args["location"], args["kind"],
                                                    args.get("filter")), timeout=30.0)
        return self.call(lambda: self.probe_del(args["id"]), timeout=6.0)

    def _probe_retained(self, p: Probe) -> dict[str, Any] | None:
        """What still holds a removed latency probe's code (its exit stub: threads that
        were inside the function return through it), or None once it is free."""
        inst = self.installer
        reg = inst.regions.get(p.region_id) if inst is not None else None
        return inst.space.retained(reg.chunk) if reg is not None else None

    def _probe_shown(self, p: Probe) -> bool:
        """Whether ``list`` shows ``p``: a deleted latency probe only while its exit stub
        is retained (it is forgotten then)."""
        if p.removed != "deleted":
            return True
        if self._probe_retained(p) is not None:
            return True
        with self.lock:
            self.probes.pop(p.id, None)
        return False

    def _probe_json(self, p: Probe, last: int = 0) -> dict[str, Any]:
        out = p.to_json(last)
        inst = self.installer
        reg = inst.regions.get(p.region_id) if inst is not None else None
        if reg is not None:
            out["code"] = list(reg.code_range())
        if p.kind == "latency" and p.removed:
            out["retained"] = self._probe_retained(p)
        return out

    def _probe_list(self) -> list[Probe]:
        with self.lock:
            return sorted(self.probes.values(), key=lambda p: p.id)

    def _probe_get(self, pid: int) -> Probe:
        p = self.probes.get(pid)
        if p is None:
            raise NoProbe(f"pid {self.pid} has no probe {pid}")
        self._probe_check(p)
        return p

    def _probe_check(self, p: Probe) -> None:
        """Mark ``p`` removed if its trampoline is gone (a map change took it)."""
        inst = self.installer
        reg = inst.regions.get(p.region_id) if inst is not None else None
        if not p.removed and (reg is None or reg.state not in HELD):
            p.final = p.read()
            p.removed = reg.why_removed if reg is not None and reg.why_removed else "gone"

    # ---- session thread ------------------------------------------------------------
    def probe_add(self, text: str, kind: str, flt_text: str | None) -> dict[str, Any]:
        if kind not in ("count", "args", "latency"):
            raise ProbeRefused(f"kind {kind!r} is not count, args or latency")
        flt = None
        if flt_text is not None:
            if kind != "args":
                raise ProbeRefused("--filter applies to args probes only")
            try:
                flt = parse_filter(flt_text)
            except ValueError as exc:
                raise ProbeRefused(str(exc)) from None
        probes = self.probes
        if sum(1 for p in probes.values() if not p.removed) >= PROBES_MAX:
            raise ProbeRefused(f"pid {self.pid} has {PROBES_MAX} probes already")
        self._refresh_maps()
        loc = resolve(text, list(self.maps), self.exe)
        inst = self._get_installer()
        if loc.func_start is None:
            raise ProbeRefused(f"no function symbol covers {text} ({loc.addr:#x}): whether "
                               f"it is an instruction boundary cannot be told")
        if kind in ("args", "latency") and loc.addr != loc.func_start:
            raise ProbeRefused(f"{kind} probes go at a function's start; {text} is "
                               f"{loc.addr - loc.func_start:#x} bytes into {loc.func}")
        rate = 0.0
        if kind == "latency":
            why = (f"{loc.func} returns twice or on another stack" if loc.func in
                   RETURNS_TWICE else None) or invariant_problem() or \
                cxx_problem(self.maps, loc.module) or \
                shadow_stack_problem(self.proc.read("status"))
            if why:
                raise ProbeRefused(f"no latency probe at {text}: {why}")
            try:
                rate = ticks_per_ns()
            except OSError as exc:
                raise ProbeRefused(f"no latency probe at {text}: the service cannot read "
                                   f"the TSC: {exc}") from None
        if loc.addr - loc.func_start > DECODE_MAX:
            raise ProbeRefused(f"{text} is too far into {loc.func} to decode")
        self._probe_taken(inst, loc.addr)
        for r in inst.regions.values():
            if r.state in HELD and not r.kept and any(
                    a < loc.addr + P.PATCH_LEN and loc.addr < b for a, b in r.orig_ranges):
                raise ProbeRefused(f"region {r.name} copies the code at {text}: its copy "
                                   f"would run instead, unseen; `dbr ctl unpatch {self.pid} "
                                   f"{r.name}` takes it out")
        func = self._probe_original(loc.func_start, loc.addr - loc.func_start + 64)
        why = boundary_problem(func, loc.func_start, loc.addr)
        if why:
            raise ProbeRefused(f"{text} is not an instruction boundary: {why}")
        code = func[loc.addr - loc.func_start:]
        inner = decode_inner(code, loc.addr)
        if inner is None:
            raise ProbeRefused(f"the instructions at {text} do not decode")
        if inner:
            self._probe_entry_site(inst, loc, text)
        rel = Relocator()
        dead = inc_flags_dead(code, loc.addr)

        def handler(data: int):
            if kind == "count":
                return lambda at: count_handler(at, data, dead)
            return lambda at: args_handler(at, data, flt)

        def trampoline(at: int, data: int):
            if kind == "latency":
                return latency_trampoline(code, loc.addr, at, data, rel)
            return probe_trampoline(code, loc.addr, at, handler(data), rel)
        try:
            trial = trampoline(loc.addr, loc.addr)
        except CodegenError as exc:
            raise ProbeRefused(f"the first instructions at {text} cannot be moved into a "
                               f"trampoline: {exc}") from None
        buf, data = self._probe_data(kind, loc.addr)
        pid = max(probes, default=0) + 1
        try:
            chunk = inst.reserve(len(trial.code), [loc.addr, loc.addr + trial.covered, data])
            tr = trampoline(chunk.addr, data)
            gen = TrampolineCode(tr.code, chunk.addr, {loc.addr: chunk.addr},
                                 [(chunk.addr, chunk.addr + len(tr.code), loc.addr)],
                                 list(tr.exits))
            reg = inst.install(chunk, gen, name=f"probe{pid}", module=loc.module,
                               orig_ranges=[(loc.addr, loc.addr + tr.covered)],
                               exit_ranges=[(loc.addr, loc.addr + tr.covered + 1),
                                            *((x, x + 1) for _, x in tr.exits)],
                               entry_sites={loc.addr: inner} if inner else None)
        except (CodegenError, AgentError, ProtocolError, OSError) as exc:
            raise ProbeRefused(f"probe at {text} not installed: {exc}") from None
        if reg.state not in HELD:
            why = reg.refused_sites.get(loc.addr) or reg.why_removed
            raise ProbeRefused(f"probe at {text} not installed: {why}")
        reg.kept = True
        p = Probe(pid, kind, loc.text(), loc.addr, loc.module, flt, reg.region_id, buf, data,
                  "entry" if inner else "plain", kind == "count" and not dead, rate)
        with self.lock:
            probes[pid] = p
        self.service.events.publish("probe-added", pid=self.pid, probe=pid, kind=kind,
                                    location=p.location)
        return self._probe_json(p)

    def probe_del(self, pid: int) -> dict[str, Any]:
        p = self._probe_get(pid)
        if not p.removed:
            self._probe_remove(p, "deleted")
        if p.kind != "latency" or self._probe_retained(p) is None:
            with self.lock:
                self.probes.pop(pid, None)
        return self._probe_json(p)

    def probes_remove_all(self, why: str) -> None:
        """Session thread: remove every live probe (the service detaches)."""
        for p in self._probe_list():
            if not p.removed:
                try:
                    self._probe_remove(p, why)
                except (AgentError, ProtocolError, OSError):
                    pass     # the session is ending: the agent's disconnect policy applies

    def probes_closed(self, why: str) -> None:
        """The session ends: every probe's data read one last time, marked removed."""
        for p in self._probe_list():
            if not p.removed:
                p.final, p.removed = p.read(), why

    def probed_in(self, ranges: list[tuple[int, int]]) -> bool:
        """Whether a live probe's location lies in ``ranges`` (a region copying it
        would run its copy instead of the probe)."""
        return any(a <= p.addr < b for p in self._probe_list() if not p.removed
                   for a, b in ranges)

    def _probe_remove(self, p: Probe, why: str) -> None:
        inst = self.installer
        p.final = p.read()
        reg = inst.regions.get(p.region_id) if inst is not None else None
        if reg is not None and reg.state in HELD:
            inst.uninstall(p.region_id, f"probe {why}")
        p.final = p.read()
        p.removed = why
        self.service.events.publish("probe-removed", pid=self.pid, probe=p.id, why=why)

    def _probe_data(self, kind: str, near: int) -> tuple[Any, int]:
        inst = self.installer
        if kind == "count":
            if self.counter_space is None:
                self.counter_space = CounterSpace(inst.conn)
            return self.counter_space.counter(near)
        rings = self.probe_rings
        if len(rings) >= RINGS_MAX:
            raise ProbeRefused(f"pid {self.pid} has had {RINGS_MAX} args or latency probes "
                               f"in this session; their data buffers stay until it ends")
        size = LATENCY_BUFFER if kind == "latency" else 8192
        try:
            buf = inst.conn.code_buffer(near=near, size=size, flags=P.BUFFER_F_DATA)
        except (AgentError, ProtocolError) as exc:
            raise ProbeRefused(f"no data buffer for the probe: {exc}") from None
        rings.append(buf)
        buf.write(buf.base, initial_data(size) if kind == "latency" else bytes(size))
        return buf, buf.base

    def _probe_original(self, addr: int, n: int) -> bytes:
        """The client's bytes at ``addr`` with every live patch's original bytes put
        back (a region's or probe's jmp is not the code)."""
        data = bytearray(self._read_original(addr, n))
        if len(data) < n:
            raise ProbeRefused(f"cannot read {n} bytes at {addr:#x}")
        for r in self.installer.regions.values() if self.installer else ():
            for s in [*r.patched_sites, *r.suspended_sites] if r.state in HELD else ():
                orig = bytes(s.orig)[:P.PATCH_LEN]
                for i, b in enumerate(orig):
                    if addr <= s.site + i < addr + n:
                        data[s.site + i - addr] = b
        return bytes(data)

    def _probe_taken(self, inst, addr: int) -> None:
        for r in inst.regions.values():
            if r.state not in HELD:
                continue
            for s in [*r.patched_sites, *r.suspended_sites]:
                if s.site < addr + P.PATCH_LEN and addr < s.site + P.PATCH_LEN:
                    what = f"probe {r.name[5:]}" if r.kept else f"region {r.name}"
                    raise ProbeRefused(f"{addr:#x} overlaps the patch of {what} at "
                                       f"{s.site:#x}")

    def _probe_entry_site(self, inst, loc: Location, text: str) -> None:
        """A location whose first instruction is shorter than 5 bytes: accepted only as
        an entry site (a function's start, nothing in the module's named functions
        branching into bytes 1..4, an agent that takes them); else refused."""
        if loc.addr != loc.func_start:
            raise ProbeRefused(f"the instruction at {text} is shorter than 5 bytes and it "
                               f"is not a function's start: no 5-byte site (a trap per "
                               f"hit is not built)")
        if not getattr(inst.conn.hello, "flags", 0) & P.HELLO_ENTRY_SITES:
            raise ProbeRefused(f"the instruction at {text} is shorter than 5 bytes and the "
                               f"agent does not take entry sites")
        m = find_mapping(self.maps, loc.addr)
        table = mapped_symbols(m.path, m.dev, m.ino)
        base = module_base(self.maps, m.path) - table.first_load
        total = 0
        for sym in table.symbols():
            total += sym.size
            if total > SWEEP_MAX:
                raise ProbeRefused(f"{m.path} is too large to check for branches into "
                                   f"{text}'s first 5 bytes")
            if not sym.size:
                continue
            try:
                code = self._read_original(base + sym.start, sym.size)
            except OSError:
                continue
            at = branches_into(code, base + sym.start, loc.addr + 1, loc.addr + P.PATCH_LEN)
            if at is not None:
                raise ProbeRefused(f"the code at {at:#x} branches into the first 5 bytes of "
                                   f"{text}: no 5-byte site there")

