"""Transfer points (``GeneratedCode.transfers``): a thread stopped by a signal at an
original instruction ``o`` may be moved to ``transfers[o]`` in the replacement code and
continue there with its state unchanged.  The agent sets RIP by this map, so each point
is proven here by differential runs in unicorn.

For the programs of ``test_codegen_emit`` (loops, inlined calls with clone blocks, a
compare chain, a cascade-translated indirect jmp, translated jump-table dispatches incl.
fused and prefixed ones, random sub-regions, forced far-exit stubs) and the two-module
region of ``test_codegen_far`` (an inlined PLT call, a real far exit), every transfer
``o -> r`` is run from the same state twice:

* the original from ``o`` until control leaves the region (the first instruction that
  belongs to none of the region's blocks, clone or not; the sentinel return address);
* the replacement from ``r`` until control leaves the replacement code *and* the region
  (after an exit it continues in original code, as the patched process would).

Both must stop at the same address with equal GPRs, arithmetic flags, data and stack
(red zone included), or both fault at the same original instruction.  In lockstep, the
states are also compared at the first transfer points passed on the way (the original
at ``o'``, the replacement at ``transfers[o']``), so that damage done by a wrong point
cannot be overwritten before the end.

States at ``o``: *natural* ones, captured where the original, started at its entry from
a random state as the emission tests seed it, arrives at ``o`` (first and random later
arrivals), one of them with random arithmetic flags, and fully random ones
(``World.state`` as is, straight at ``o``).  Fully random states often fault (random
pointers) or run into the instruction limit (random loop counters): a fault is compared
at the faulting instruction, a run hitting the limit is skipped and counted; natural
states must all leave the region.

Static properties: every replacement address is an instruction start in the code part,
the start of an address-map range naming ``o``; the key set is exactly the non-clone
blocks' instructions minus dropped jmps, instructions taken over by translated
dispatches and instructions copied twice; no clone-only instruction and no translated
dispatch's jmp is a key.  A negative control corrupts transfers (each pointing at the
next instruction's replacement) and shows the differential comparison catches it.
"""

from __future__ import annotations

import random
import struct
import zlib
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import pytest
import test_codegen_far as far
from codegen_util import CS, FLAG_MASK, Machine, State, linear, random_state
from test_codegen_emit import (
    DATA_SIZE,
    FAR_DISPATCH,
    PLACES,
    PROGRAMS,
    RSP,
    SENTINEL,
    STACK,
    STACK_SIZE,
    Built,
    Program,
    World,
    _check_static,
    _compare,
    _patched_run_matches,
    _profile,
    build,
)
from unicorn import UcError
from unicorn import x86_const as U

from dbr_service.codegen.dispatch import region_dispatch_plan
from dbr_service.codegen.emit import GeneratedCode, emit_region
from dbr_service.codegen.layout import Layout, _aligned, chain_order
from dbr_service.region.model import END, START, CloneKey, EdgeKind, SuperRegion, TermKind

#: Instruction limit of a run of the original from a transfer point (a natural run
#: leaves the region after at most ~40 loop iterations); the replacement gets 4x.
LIMIT = 5000
#: Runs of the original from its entry that natural states are captured from.
CAPTURE_RUNS = 10
#: Natural states per transfer point (plus one of them with random flags).
NATURAL = 4
#: Transfer points passed after the start whose states are compared in lockstep.
SYNC = 8
#: Fully random states per transfer point.
RANDOM = 3
#: At most this many transfer points per subject (a deterministic sample).
MAX_POINTS = 40


# -- subjects -----------------------------------------------------------------------------

@dataclass
class Subject:
    """An emitted region in a machine holding the original code and the replacement."""

    name: str
    gen: GeneratedCode
    sr: SuperRegion
    m: Machine
    entry: int
    boundaries: set[int]
    #: Memory compared between runs: (data, size), (STACK, STACK_SIZE).
    ranges: list[tuple[int, int]]
    #: A random state at the entry, as the emission tests make them.
    new_state: Callable[[random.Random], State]
    #: Raises AssertionError unless two final states are the same.
    same: Callable[[State, State, str], None]
    world: World | None = None
    #: Original addresses of the instructions of all the region's blocks / of clones.
    region: set[int] = field(init=False)
    cloned: set[int] = field(init=False)
    code_end: int = field(init=False)

    def __post_init__(self) -> None:
        self.region = {a for _k, bb in self.sr.blocks() for a, _n in bb.insns}
        self.cloned = {a for _k, bb in self.sr.blocks() if bb.is_clone for a, _n in bb.insns}
        g = self.gen
        self.code_end = g.base + (g.size if g.data_start is None else g.data_start)

    def in_code(self, a: int) -> bool:
        return self.gen.base <= a < self.code_end


def world_subject(p: Program, orig: int, delta: int, seed: int | None = None,
                  name: str | None = None, chains: bool = False) -> Subject:
    """A program of test_codegen_emit: profiled (``seed`` None) as in
    ``test_emit_differential``, or a random sub-region as in ``test_emit_random_regions``.
    ``chains``: laid out in the chain order even where the original order would win."""
    rng = None if seed is None else random.Random(seed)
    b = build(p, orig, _profile(p, orig) if rng is None else None, rng)
    lay = None
    if chains:
        order = chain_order(b.sr)
        lay = Layout(order, _aligned(b.sr, order))
    return built_subject(b, orig + delta, name or p.name, lay)


def built_subject(b: Built, base: int, name: str, layout: Layout | None = None) -> Subject:
    gen = emit_region(b.sr, base, layout=layout)
    _check_static(gen, b)
    w = World(b, base, gen.size)
    w.load(gen)                    # original image unpatched, replacement in its buffer
    return Subject(name, gen, b.sr, w.m, b.entry, b.boundaries,
                   [(b.orig, DATA_SIZE), (STACK, STACK_SIZE)], w.state, _compare, w)


def far_subject() -> Subject:
    """test_codegen_far's region: main with an inlined PLT call into a library 4.5 GiB
    away whose cold side is a far exit.  r10/r11 are dead at the PLT call (ABI) and may
    differ, as in that test."""
    f = far.Far()
    gen = emit_region(f.sr, far.BASE)
    assert gen.far_exits
    m = far._machine(f, gen.size)
    m.write(far.MAIN, f.main)
    m.write(far.LIB, f.lib)
    m.write(far.BASE, gen.code)

    def new_state(rng: random.Random) -> State:
        st = random_state(rng, RSP, {far.MAIN: far.DATA, STACK: STACK_SIZE},
                          {"rsi": rng.choice([0, 1, 5, 8, 9, 17, 30])})
        st.mem[far.MAIN] = bytes(8) + struct.pack("<Q", far.LIB) + f.main[16:far.DATA]
        st.mem[RSP] = struct.pack("<Q", SENTINEL)
        return st

    return Subject("far_plt", gen, f.sr, m, f.entry, f.boundaries,
                   [(far.MAIN, far.DATA), (STACK, STACK_SIZE)], new_state, far._same)


# -- running ------------------------------------------------------------------------------

@dataclass
class Outcome:
    kind: str          # "left" (control left), "fault" (memory fault), "limit"
    rip: int           # where control left / the faulting instruction
    state: State | None
    #: (original address, state) at the first SYNC transfer points passed (see below).
    sync: list[tuple[int, State]] = field(default_factory=list)


def _run(s: Subject, st: State, start: int, stay: Callable[[int], bool],
         limit: int, sync: Callable[[int], int | None]) -> Outcome:
    """Run from ``start`` while ``stay``; ``sync`` names the original instruction an
    address stands for when it is a synchronisation point (else None)."""
    m = s.m
    m.set_state(st)
    last = [start]
    seen: list[tuple[int, State]] = []

    def inside(a: int) -> bool:
        last[0] = a
        if len(seen) < SYNC:
            o = sync(a)
            if o is not None:
                seen.append((o, m.snapshot(s.ranges)))
        return stay(a)

    m._inside, m.steps, m.limit = inside, 0, limit
    try:
        m.uc.emu_start(start, 0)
    except UcError:
        return Outcome("fault", last[0], m.snapshot(s.ranges), seen)
    if m.steps > limit:
        return Outcome("limit", last[0], None, seen)
    return Outcome("left", m.uc.reg_read(U.UC_X86_REG_RIP), m.snapshot(s.ranges), seen)


def differential(s: Subject, o: int, r: int, st: State, ctx: str,
                 left_at: Counter | None = None, transfers: dict[int, int] | None = None,
                 lockstep: bool = True) -> str:
    """Run the original from ``o`` and the replacement from ``r``; AssertionError if they
    differ.  The outcome: "left", "fault" (state compared at the fault), "fault_at"
    (a fault inside a multi-instruction translation: only its place compared), "limit"
    (the original ran into the instruction limit: skipped).

    ``lockstep``: also compare the states at the first :data:`SYNC` points where the
    original is at a transfer key ``o'`` and the replacement at ``transfers[o']`` (or at
    ``o'`` itself, in original code after an exit): a later instruction that overwrites
    the damage of a wrong point cannot hide it."""
    tr = s.gen.transfers if transfers is None else transfers
    keys = {k for k in tr if k not in s.cloned} if lockstep else set()
    back = {v: k for k, v in tr.items() if k in keys}
    a = _run(s, st, o, lambda x: x in s.region, LIMIT,
             lambda x: x if x in keys else None)
    if a.kind == "limit":
        return "limit"
    b = _run(s, st, r, lambda x: s.in_code(x) or x in s.region, 4 * LIMIT,
             lambda x: back.get(x) if s.in_code(x) else x if x in keys else None)
    return judge(s, a, b, f"{ctx}: transfer {o:#x} -> {r:#x}", left_at,
                 lambda fo, rip: s.gen.transfers.get(fo) == rip)


def judge(s: Subject, a: Outcome, b: Outcome, ctx: str, left_at: Counter | None,
          whole_at: Callable[[int, int], bool]) -> str:
    """Compare the original's run ``a`` with the replacement's run ``b`` (AssertionError
    if they differ) and name the outcome (see :func:`differential`).  ``whole_at(fo,
    rip)``: the replacement's fault at ``rip`` is at the start of the whole translation
    of original instruction ``fo``, where the state must be the original's there."""
    for i, ((ao, ast), (bo, bst)) in enumerate(zip(a.sync, b.sync)):
        assert ao == bo, f"{ctx}: sync point {i}: replacement at {bo:#x}'s point, " \
                         f"original at {ao:#x}"
        s.same(ast, bst, f"{ctx} (sync point {i} at {ao:#x})")
    assert b.kind == a.kind, f"{ctx}: original {a.kind} at {a.rip:#x}, " \
                             f"replacement {b.kind} at {b.rip:#x}"
    assert len(a.sync) == len(b.sync), f"{ctx}: sync points differ"
    if a.kind == "left":
        assert b.rip == a.rip, f"{ctx}: left at {b.rip:#x}, original at {a.rip:#x}"
        s.same(a.state, b.state, ctx)
        if left_at is not None:
            left_at[a.rip] += 1
        return "left"
    # Both faulted: at the same original instruction.  At the start of that instruction's
    # own translation (or in original code) the state is that of the original there.
    fo = s.gen.orig_of(b.rip) if s.in_code(b.rip) else b.rip
    assert fo == a.rip, f"{ctx}: fault at {b.rip:#x} (orig {fo}), original at {a.rip:#x}"
    if not s.in_code(b.rip) or whole_at(fo, b.rip):
        s.same(a.state, b.state, ctx + " (at fault)")
        return "fault"
    return "fault_at"


def natural_states(s: Subject, rng: random.Random, wanted: set[int]
                   ) -> dict[int, list[State]]:
    """States of the original arriving at each ``wanted`` address, from runs started at
    the entry from random states: the first arrival per run and one random later one."""
    m = s.m
    out: dict[int, list[State]] = defaultdict(list)
    for _ in range(CAPTURE_RUNS):
        st = s.new_state(rng)
        arrivals = Arrivals(s, wanted, rng)

        def inside(a: int) -> bool:
            arrivals.at(a)
            return a != SENTINEL

        m.set_state(st)
        assert m.run(s.entry, inside, limit=100000) == SENTINEL
        arrivals.add_to(out)
    return out


class Arrivals:
    """One run's states at the ``wanted`` addresses: the first arrival at each, and one
    random later one (a reservoir over the later arrivals)."""

    def __init__(self, s: Subject, wanted: set[int], rng: random.Random) -> None:
        self.s, self.wanted, self.rng = s, wanted, rng
        self.visits: Counter = Counter()
        self.first: dict[int, State] = {}
        self.later: dict[int, State] = {}

    def at(self, a: int) -> None:
        if a not in self.wanted:
            return
        self.visits[a] += 1
        n = self.visits[a]
        if n == 1:
            self.first[a] = self.s.m.snapshot(self.s.ranges)
        elif self.rng.random() < 1 / (n - 1):
            self.later[a] = self.s.m.snapshot(self.s.ranges)

    def add_to(self, out: dict[int, list[State]]) -> None:
        for a in self.first:
            out[a].append(self.first[a])
            if a in self.later:
                out[a].append(self.later[a])


@dataclass
class Tally:
    points: int = 0
    #: (state kind, outcome) -> runs
    outcomes: Counter = field(default_factory=Counter)
    #: Where the runs that left the region left it.
    left_at: Counter = field(default_factory=Counter)
    #: Points the original never arrived at from its entry (no natural state).
    unreached: int = 0


def check_transfers(s: Subject, seed: int, transfers: dict[int, int] | None = None,
                    only: list[int] | None = None, lockstep: bool = True) -> Tally:
    """The differential runs for the points of ``transfers`` (default: the region's map;
    ``only``: just those keys; at most MAX_POINTS, a deterministic sample); AssertionError
    on the first mismatch."""
    transfers = s.gen.transfers if transfers is None else transfers
    rng = random.Random(seed)
    points = sorted((o, r) for o, r in transfers.items() if only is None or o in only)
    if len(points) > MAX_POINTS:
        points = sorted(rng.sample(points, MAX_POINTS))
    nat = natural_states(s, rng, {o for o, _ in points})
    t = Tally(points=len(points))
    for o, r in points:
        t.unreached += not nat[o]
        states = [("natural", x) for x in rng.sample(nat[o], min(NATURAL, len(nat[o])))]
        if nat[o]:
            fl = rng.getrandbits(12) & FLAG_MASK & ~0x400
            states.append(("flags", replace(rng.choice(nat[o]), rflags=fl)))
        states += [("random", s.new_state(rng)) for _ in range(RANDOM)]
        for i, (kind, st) in enumerate(states):
            res = differential(s, o, r, st, f"{s.name} state {i} ({kind})", t.left_at,
                               transfers, lockstep)
            t.outcomes[(kind, res)] += 1
    assert t.unreached <= 0.1 * len(points), f"{s.name}: {t.unreached} points unreached"
    # natural states must leave the region; random flags may make a counted loop run
    # on (``dec ecx; jne`` entered with ecx = 0 and ZF clear): skipped at the limit
    assert all(res == "left" for (k, res) in t.outcomes if k == "natural"), t.outcomes
    assert all(res in ("left", "limit") for (k, res) in t.outcomes if k == "flags")
    done = sum(n for (_k, res), n in t.outcomes.items() if res != "limit")
    assert done >= 0.9 * sum(t.outcomes.values()), t.outcomes
    return t


# -- static properties --------------------------------------------------------------------

def expected_keys(sr: SuperRegion, gen: GeneratedCode) -> tuple[set[int], dict[int, str]]:
    """The transfer keys the map must have, derived from the region and the layout: each
    instruction of a non-clone block, less a ``jmp`` dropped because its target is laid
    out next, the ``add``/``jmp`` of translated dispatches (the ``add`` of a split one
    only when fused: taken over from the single block falling into it), and instructions
    copied into two non-clone blocks.  Also: why each left-out instruction is left out."""
    copies: Counter = Counter()
    why: dict[int, str] = {}
    nxt = dict(zip(gen.layout, gen.layout[1:] + [None]))
    flow = (EdgeKind.FLOW, EdgeKind.FALLTHROUGH)
    for k, bb in sr.blocks():
        assert bb.is_clone == isinstance(k, CloneKey)
        if bb.is_clone:
            continue
        copies.update(a for a, _n in bb.insns)
        if bb.term is TermKind.JMP:
            t = bb.targets[0]
            vs = [v for _u, v, d in sr.g.out_edges(k, data=True)
                  if v != END and d.get("kind") in flow and sr.block(v).start == t]
            if vs and vs[0] == nxt[k]:
                why[bb.last_insn[0]] = "dropped jmp"
        plan = region_dispatch_plan(sr, k)
        if plan is not None:
            why[plan.jmp_addr] = "dispatch jmp"
            ins = [u for u, _v in sr.g.in_edges(k)]
            if not plan.split or (len(ins) == 1 and region_dispatch_plan(sr, ins[0]) is None):
                why[plan.add_addr] = "dispatch add"
    why.update((a, "copied twice") for a, n in copies.items() if n > 1)
    return set(copies) - set(why), why


def check_static(s: Subject) -> Counter:
    """The static properties of ``s.gen.transfers``; the reasons of the left-out
    instructions of non-clone blocks, counted."""
    gen, sr = s.gen, s.sr
    tr = gen.transfers
    assert tr, f"{s.name}: no transfer points"
    starts = {i.address for i in linear(gen.code[:gen.data_start], gen.base)}
    ranges = {(a, o) for a, _e, o in gen.addr_map}
    for o, r in tr.items():
        ctx = f"{s.name}: {o:#x} -> {r:#x}"
        assert gen.base <= r < s.code_end, f"{ctx} not in the code"
        assert r in starts, f"{ctx} not an instruction start"
        assert gen.orig_of(r) == o, f"{ctx} maps to {gen.orig_of(r)}"
        assert (r, o) in ranges, f"{ctx} does not start an address-map range of {o:#x}"
        assert o in s.boundaries, f"{ctx}: not an original instruction"
    assert len(set(tr.values())) == len(tr)
    plain = {a for _k, bb in sr.blocks() if not bb.is_clone for a, _n in bb.insns}
    cloned = {a for _k, bb in sr.blocks() if bb.is_clone for a, _n in bb.insns}
    assert not (set(tr) & (cloned - plain)), f"{s.name}: transfer into a clone"
    for k, _bb in sr.blocks():
        plan = region_dispatch_plan(sr, k)
        if plan is not None:
            assert plan.jmp_addr not in tr, f"{s.name}: dispatch jmp {plan.jmp_addr:#x}"
    exp, why = expected_keys(sr, gen)
    # every non-clone block's first instruction has a point, unless it is a dropped jmp,
    # a dispatch's add/jmp or copied twice
    for _k, bb in sr.blocks():
        if not bb.is_clone:
            assert bb.start in tr or bb.start in why, f"{s.name}: block {bb.start:#x}"
    assert set(tr) == exp, (f"{s.name}: missing {sorted(map(hex, exp - set(tr)))}, "
                            f"extra {sorted(map(hex, set(tr) - exp))}")
    return Counter(why.values())


# -- the tests ----------------------------------------------------------------------------

def _check(s: Subject, seed_text: str) -> Tally:
    why = check_static(s)
    t = check_transfers(s, zlib.crc32(seed_text.encode()))
    print(f"{s.name}: {t.points} points ({t.unreached} unreached), "
          f"{sorted(t.outcomes.items())}, left out: {dict(why)}")
    return t


@pytest.mark.parametrize("orig,delta", PLACES, ids=["low", "high"])
@pytest.mark.parametrize("p", PROGRAMS, ids=[p.name for p in PROGRAMS])
def test_transfers_differential(p: Program, orig: int, delta: int) -> None:
    s = world_subject(p, orig, delta)
    if p.inline and "call" in p.name:
        assert any(bb.is_clone for _k, bb in s.sr.blocks())
    t = _check(s, f"{p.name}@{orig:#x}")
    if p.name == "loop_cond":
        # its `jmp next` falls into `next` in the chain order (the original order wins
        # the cost comparison here): the dropped jmp's points, checked in that layout
        c = world_subject(p, orig, delta, name=f"{p.name}/chains", chains=True)
        assert "dropped jmp" in expected_keys(c.sr, c.gen)[1].values()
        _check(c, f"{p.name}/chains@{orig:#x}")
    assert SENTINEL in t.left_at or not p.inline or p.stop_before_ret
    # the machine the points were run in still runs the patched program like the
    # original (test_codegen_emit's check; it patches the image, so it comes last)
    rng = random.Random(t.points)
    for i in range(2):
        _patched_run_matches(s.world, s.gen, s.world.state(rng), f"{s.name} patched {i}")


RANDOM_REGION = [PROGRAMS[i] for i in (0, 1, 3, 4, 8, 11)]


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("p", RANDOM_REGION, ids=lambda p: p.name)
def test_transfers_random_regions(p: Program, seed: int) -> None:
    """Random sub-regions with random edge counts (other layouts, inverted jcc, dropped
    jmps, blocks left out) as in test_emit_random_regions."""
    orig, delta = PLACES[seed % 2]
    s = world_subject(p, orig, delta, seed=seed, name=f"{p.name}/seed{seed}")
    _check(s, f"{p.name}/{seed}")


@pytest.mark.parametrize("p", FAR_DISPATCH, ids=[p.name for p in FAR_DISPATCH])
def test_transfers_with_far_exit_stubs(p: Program, monkeypatch) -> None:
    """Every exit forced through a far-exit stub, with a translated dispatch."""
    import dbr_service.codegen.emit as emit_mod
    monkeypatch.setattr(emit_mod, "_near", lambda t, lo, hi: False)
    s = world_subject(p, *PLACES[0], name=f"{p.name}/far")
    assert s.gen.far_exits
    t = _check(s, f"{p.name}/far")
    assert set(t.left_at) & set(s.gen.far_exits), "no run left through a far-exit stub"


def test_transfers_far_module() -> None:
    s = far_subject()
    t = _check(s, "far_plt")
    assert set(t.left_at) & set(s.gen.far_exits), "no run left through the far exit"
    assert any(bb.is_clone for _k, bb in s.sr.blocks())       # the inlined PLT and lib


def test_dispatch_shapes_covered() -> None:
    """The dispatch programs do give the cases the map must leave out: a translated
    dispatch (non-split), a fused one (the add taken from the block before) and prefixed
    targets; and their transfer keys exclude exactly those instructions."""
    from dbr_service.codegen.emit import _Dispatches
    seen = Counter()
    for p in PROGRAMS:
        if not p.name.startswith("reltable"):
            continue
        s = world_subject(p, *PLACES[0])
        d = _Dispatches(s.sr)
        assert d.plan, p.name
        for k, plan in d.plan.items():
            assert plan.jmp_addr not in s.gen.transfers
            seen["fused" if k in d.fused.values() else "split" if plan.split else "plain"] += 1
            if k in d.fused.values() or not plan.split:
                assert plan.add_addr not in s.gen.transfers
        for v in d.prefixed:
            seen["prefixed"] += 1
            # a prefixed target's transfer is after the dispatch's add copied before it
            start = s.sr.block(v).start
            assert s.gen.transfers[start] > s.gen.block_addr[v]
    assert seen["fused"] and seen["plain"] and seen["prefixed"], seen


def test_negative_control_corrupted_transfer() -> None:
    """A map pointing one instruction too far is caught: one precise corruption (the
    table load of loop_cond skipped), then each point of two programs redirected in
    turn, caught by the end states alone in most cases and always in lockstep."""
    s = world_subject(PROGRAMS[0], *PLACES[0])           # loop_cond
    load = next(o for o in sorted(s.gen.transfers)
                if "[r11 + r8*4]" in _text_at(s.m.read(o, 15), o))
    bad = dict(s.gen.transfers)
    bad[load] = _next_repl(s, load)
    for lockstep in (False, True):
        with pytest.raises(AssertionError, match=f"transfer {load:#x} -> {bad[load]:#x}"):
            check_transfers(s, 1, bad, [load], lockstep)
    check_transfers(s, 1, s.gen.transfers, [load])      # the true point passes
    # the sweep over every point of loop_cond and reltable_lone (a fused dispatch)
    detected, total = Counter(), 0
    subjects = (s, world_subject(PROGRAMS[11], *PLACES[0]))
    for s in subjects:
        for o in sorted(s.gen.transfers):
            r = _next_repl(s, o)
            if r is None:
                continue
            total += 1
            bad = {**s.gen.transfers, o: r}
            for lockstep in (False, True):
                try:
                    check_transfers(s, o, bad, [o], lockstep)
                except AssertionError:
                    detected[lockstep] += 1
    print(f"negative control: {total} corrupted points, caught by end states "
          f"{detected[False]}, in lockstep {detected[True]}")
    assert total >= 30
    assert detected[True] == total
    assert detected[False] >= 0.8 * total, (detected, total)


def _next_repl(s: Subject, o: int) -> int | None:
    """The replacement address of the next original instruction that has one."""
    later = [a for a in s.gen.transfers if a > o]
    return s.gen.transfers[min(later)] if later else None


def test_twice_copied_instruction_has_no_transfer() -> None:
    """Overlapping blocks (one entered in the middle of another, as before discovery
    splits them) copy the shared instructions twice: those have no transfer point, the
    rest of the region keeps its points and they still hold."""
    s, shared, x_start, a2 = overlap_subject()
    assert shared and not (shared & set(s.gen.transfers))
    assert x_start in s.gen.transfers and a2 in s.gen.entries
    _check(s, "overlap")


def overlap_subject() -> tuple[Subject, set[int], int, int]:
    """loop_cond with its ``sub eax, edx`` block entered a second time at its second
    instruction, by a block of its own: (the subject, the instructions the two blocks
    share, the first block's start, the second's)."""
    orig, delta = PLACES[0]
    p = PROGRAMS[0]                                       # loop_cond
    b = build(p, orig, _profile(p, orig))
    sr = b.sr
    x = next(bb for _k, bb in sr.blocks() if _text_at(bb.data, bb.start) == "sub eax, edx")
    a2 = x.insns[1][0]
    off = a2 - x.start
    y = replace(x, start=a2, size=x.size - off, insns=x.insns[1:], data=x.data[off:])
    sr.add_block(y, a2)
    sr.add_edge(START, a2, EdgeKind.ENTRY, 1)
    sr.add_edge(a2, x.fallthrough, EdgeKind.FALLTHROUGH, 1)
    sr.verify()
    s = built_subject(b, orig + delta, "loop_cond/overlap")
    return s, {a for a, _n in y.insns}, x.start, a2


def _text_at(data: bytes, addr: int) -> str:
    i = next(CS.disasm(data, addr))
    return f"{i.mnemonic} {i.op_str}"
