"""Eviction points (``GeneratedCode.evictions``): a thread stopped by a signal at a
replacement address ``r`` may be moved to the original instruction ``evictions[r]`` and
continue there with its state unchanged (the agent rewrites RIP only).  The points are
the starts of whole translations of one original instruction, inlined clone blocks
included (an inlined ``call`` pushes the original return address, so inside the callee
the stack is the original's), and each is proven here by differential runs in unicorn.

For the programs of ``test_codegen_emit`` (loops, an inlined call with clone blocks, a
compare chain, a cascade-translated indirect jmp, translated jump-table dispatches incl.
fused and prefixed ones, random sub-regions, forced far-exit stubs, a dropped jmp in
the chain layout, an instruction copied into two blocks) and the two-module region of
``test_codegen_far`` (an inlined PLT stub and library function, a real far exit), every
eviction point ``r -> o`` (at most MAX_POINTS of a region, clone points always kept) is
run from the same state twice, with the machinery of ``test_codegen_transfer``:

* the original from ``o`` until control leaves the region (an ``o`` in an inlined callee
  returns through the real ``ret`` to the original return address on the stack and goes
  on in the region's original code);
* the replacement from ``r`` until control leaves the replacement code *and* the region
  (after an exit it continues in original code, as the patched process would).

Both must stop at the same address with equal GPRs, arithmetic flags, data and stack
(red zone included), or both fault at the same original instruction (the states compared
too where the replacement faults at an eviction point of it, or in original code).  In
lockstep, the states are also compared at the first transfer points passed after the
start (the original at ``o'``, the replacement at ``transfers[o']``; those are proven by
``test_codegen_transfer``), so that damage done by a wrong point cannot be overwritten
before the end.

States at ``r`` are those the *replacement* has there: *natural* ones, captured where
the replacement, started at its entry from a random state as the emission tests seed it,
arrives at ``r`` (first and random later arrivals; re-entered at every patch site, as in
the patched process), one of them with random arithmetic flags; for a point the
replacement never reaches that way (behind an exit it does not come back from, in some
random sub-regions), the original's natural states at ``o`` instead.  And random ones:
``World.state`` as is for a point outside clones; for a clone point, a random state
whose rsp and stack are a natural one's (the return addresses the inlined calls pushed:
a fully random stack is no state of the replacement there).
Random states often fault or run into the instruction limit: a fault is compared at the
faulting instruction, a run hitting the limit is skipped and counted; natural states
must all leave the region.

Static properties: every key is an instruction start in the code part (never in a
far-exit stub or data), the start of an address-map range naming the value, inside a
block holding that original instruction; the values, counted, are exactly the
instructions of all blocks, clones included, less dropped jmps, the ``add``/``jmp`` of
translated dispatches and inlined ``ret``s (one point per copy: an instruction copied
twice has two); every transfer ``o -> r`` is the eviction ``r -> o``; the programs with
inlined calls do have points in clone blocks.  A negative control corrupts evictions
(each pointing at the next original instruction) and shows the differential comparison
catches it.
"""

from __future__ import annotations

import random
import zlib
from collections import Counter, defaultdict
from dataclasses import dataclass, field, replace

import pytest
import test_codegen_far as far
import test_codegen_transfer as transfer
from codegen_util import FLAG_MASK, State, linear
from test_codegen_emit import (
    FAR_DISPATCH,
    PLACES,
    PROGRAMS,
    SENTINEL,
    STACK,
    Program,
)
from test_codegen_transfer import (
    LIMIT,
    RANDOM_REGION,
    Subject,
    Tally,
    _run,
    _text_at,
    far_subject,
    world_subject,
)
from unicorn import UcError

from dbr_service.codegen.dispatch import region_dispatch_plan
from dbr_service.codegen.emit import FAR_STUB
from dbr_service.region.model import END, CloneKey, EdgeKind, NodeKey, TermKind

#: Runs of the replacement from its entry that natural states are captured from, and
#: at most how many while some point has none (one reached only after a rare path).
CAPTURE_RUNS, MORE_RUNS = 10, 100
#: Natural states per eviction point (plus one of them with random flags).
NATURAL = 4
#: Random states per eviction point.
RANDOM = 3
#: At most this many eviction points per subject (clone points always, the rest a
#: deterministic sample).
MAX_POINTS = 40
#: Seeds of the random sub-regions (as test_codegen_transfer).
SEEDS = 8


# -- where the points are -----------------------------------------------------------------

def block_spans(s: Subject) -> list[tuple[int, int, NodeKey]]:
    """(start, end, block) of each block's replacement code, in layout order (a block
    emptied by a dropped jmp has an empty span; loop-head padding goes with the block
    before it)."""
    g = s.gen
    blocks_end = min([*g.far_exits.values(), s.code_end])
    starts = [g.block_addr[k] for k in g.layout]
    ends = starts[1:] + [blocks_end]
    return [(a, e, k) for a, e, k in zip(starts, ends, g.layout)]


def block_of(s: Subject, r: int) -> NodeKey | None:
    for a, e, k in block_spans(s):
        if a <= r < e:
            return k
    return None


def clone_points(s: Subject, evictions: dict[int, int] | None = None) -> set[int]:
    """The eviction keys in inlined clone blocks."""
    ev = s.gen.evictions if evictions is None else evictions
    return {r for r in ev if s.sr.block(block_of(s, r)).is_clone}


# -- static properties --------------------------------------------------------------------

def expected_evictions(s: Subject) -> tuple[Counter, Counter]:
    """The eviction values the map must have, counted (one per block copying the
    instruction), derived from the region and the layout: every instruction of every
    block, clone or not, less a ``jmp`` dropped because its target is laid out next,
    the ``add``/``jmp`` of translated dispatches (the ``add`` of a split one taken over
    from the single block falling into it, when fused) and the ``ret`` of an inlined
    callee (``lea rsp`` + jump, not the ``ret``).  Also: the left-out ones by reason,
    and (``"in clones"``) how many of the expected ones are in clone blocks."""
    sr, gen = s.sr, s.gen
    nxt = dict(zip(gen.layout, gen.layout[1:] + [None]))
    flow = (EdgeKind.FLOW, EdgeKind.FALLTHROUGH)
    left: dict[NodeKey, dict[int, str]] = defaultdict(dict)
    for k, bb in sr.blocks():
        last = bb.last_insn[0]
        if bb.term is TermKind.JMP:
            t = bb.targets[0]
            vs = [v for _u, v, d in sr.g.out_edges(k, data=True)
                  if v != END and d.get("kind") in flow and sr.block(v).start == t]
            if vs and vs[0] == nxt[k]:
                left[k][last] = "dropped jmp"
        if bb.term is TermKind.RET and isinstance(k, CloneKey) and k.path:
            left[k][last] = "inlined ret"
        plan = region_dispatch_plan(sr, k)
        if plan is not None:
            left[k][plan.jmp_addr] = "dispatch jmp"
            ins = [u for u, _v in sr.g.in_edges(k)]
            if not plan.split:
                left[k][plan.add_addr] = "dispatch add"
            elif len(ins) == 1 and region_dispatch_plan(sr, ins[0]) is None:
                left[ins[0]][plan.add_addr] = "dispatch add"
    exp, why = Counter(), Counter()
    for k, bb in sr.blocks():
        for a, _n in bb.insns:
            if a in left[k]:
                why[left[k][a]] += 1
            else:
                exp[a] += 1
                why["in clones"] += bb.is_clone
    return exp, why


def check_static(s: Subject) -> Counter:
    """The static properties of ``s.gen.evictions``; the left-out instructions by
    reason, and the number of clone points."""
    gen, sr = s.gen, s.sr
    ev = gen.evictions
    assert ev, f"{s.name}: no eviction points"
    starts = {i.address for i in linear(gen.code[:gen.data_start], gen.base)}
    ranges = {(a, o) for a, _e, o in gen.addr_map}
    stubs = set(gen.far_exits.values())
    for r, o in ev.items():
        ctx = f"{s.name}: {r:#x} -> {o:#x}"
        assert s.in_code(r), f"{ctx} not in the code"
        assert r in starts, f"{ctx} not an instruction start"
        assert r not in stubs and all(not a <= r < a + FAR_STUB for a in stubs), f"{ctx}: a stub"
        assert (r, o) in ranges, f"{ctx} does not start an address-map range of {o:#x}"
        assert gen.orig_of(r) == o, f"{ctx} maps to {gen.orig_of(r)}"
        assert o in s.boundaries and o in s.region, f"{ctx}: not a region instruction"
        k = block_of(s, r)
        assert k is not None, f"{ctx}: in no block"
        assert o in {a for a, _n in sr.block(k).insns}, f"{ctx}: not in its block {k}"
    for o, r in gen.transfers.items():
        assert ev.get(r) == o, f"{s.name}: transfer {o:#x} -> {r:#x} is no eviction point"
    exp, why = expected_evictions(s)
    why = +why
    got = Counter(ev.values())
    assert got == exp, (f"{s.name}: missing {sorted(map(hex, (exp - got).elements()))}, "
                        f"extra {sorted(map(hex, (got - exp).elements()))}")
    # the points in clone blocks: as many as the clone blocks' expected instructions
    clones = clone_points(s)
    assert len(clones) == why.pop("in clones", 0), f"{s.name}: clone points"
    return why + Counter(clone_points=len(clones))


# -- the differential runs ------------------------------------------------------------------

def evict_differential(s: Subject, r: int, o: int, st: State, ctx: str,
                       left_at: Counter | None = None, lockstep: bool = True) -> str:
    """Run the original from ``o`` and the replacement from ``r``; AssertionError if they
    differ.  The outcome: "left", "fault" (state compared at the fault), "fault_at" (a
    fault inside a multi-instruction translation: only its place compared), "limit"
    (the original ran into the instruction limit: skipped).

    ``lockstep``: also compare the states at the first SYNC transfer points passed after
    the start, where the original is at a transfer key ``o'`` (not in a clone) and the
    replacement at ``transfers[o']`` (or at ``o'`` itself, in original code after an
    exit)."""
    tr = s.gen.transfers
    keys = {k for k in tr if k not in s.cloned} if lockstep else set()
    back = {v: k for k, v in tr.items() if k in keys}

    def after_start(f):
        first = [True]

        def g(x: int) -> int | None:
            if first[0]:                     # the start: the same state by construction
                first[0] = False
                return None
            return f(x)
        return g

    a = _run(s, st, o, lambda x: x in s.region, LIMIT,
             after_start(lambda x: x if x in keys else None))
    if a.kind == "limit":
        return "limit"
    b = _run(s, st, r, lambda x: s.in_code(x) or x in s.region, 4 * LIMIT,
             after_start(lambda x: back.get(x) if s.in_code(x) else x if x in keys
                         else None))
    return transfer.judge(s, a, b, f"{ctx}: evict {r:#x} -> {o:#x}", left_at,
                          lambda fo, rip: s.gen.evictions.get(rip) == fo)


def natural_states(s: Subject, rng: random.Random, wanted: set[int]
                   ) -> dict[int, list[State]]:
    """States of the replacement arriving at each ``wanted`` address, from runs started
    at its entry (in turn with its other entries, if any: a run from one of those that
    faults is dropped) from random states, going on in original code after an exit as the
    patched process would (at every patch site, e.g. the return address of a call left
    an exit, back into the replacement): the first arrival per run and one random later
    one.  More runs (up to MORE_RUNS) while some point has no state."""
    m = s.m
    sites = s.gen.entries
    starts = [s.entry] + sorted(e for e in sites if e != s.entry)
    out: dict[int, list[State]] = defaultdict(list)
    for i in range(MORE_RUNS):
        if i >= CAPTURE_RUNS and wanted <= set(out):
            break
        st = s.new_state(rng)
        arrivals = transfer.Arrivals(s, wanted, rng)

        def inside(a: int) -> bool:
            arrivals.at(a)
            return a != SENTINEL and a not in sites

        m.set_state(st)
        rip = e = starts[i % len(starts)]
        steps = 0
        try:
            while rip != SENTINEL:
                rip = m.run(sites[rip], inside, limit=100000)
                steps += m.steps
                assert steps < 100000
        except UcError:
            assert e != s.entry, f"{s.name}: a run from the entry faulted"
            continue
        arrivals.add_to(out)
    return out


@dataclass
class EvictTally(Tally):
    clone_points: int = 0
    #: Points given the original's natural states (the replacement never got there).
    from_original: int = 0
    #: (state kind, outcome) -> runs, at clone points only
    clone_outcomes: Counter = field(default_factory=Counter)


def _random_state(s: Subject, rng: random.Random, clone: bool,
                  nat: list[State]) -> State | None:
    st = s.new_state(rng)
    if not clone:
        return st
    if not nat:
        return None
    n = rng.choice(nat)              # the stack the inlined calls built, all else random
    st.regs["rsp"] = n.regs["rsp"]
    st.mem[STACK] = n.mem[STACK]
    return st


def check_evictions(s: Subject, seed: int, evictions: dict[int, int] | None = None,
                    only: list[int] | None = None, lockstep: bool = True) -> EvictTally:
    """The differential runs for the points of ``evictions`` (default: the region's map;
    ``only``: just those keys; at most MAX_POINTS, clone points first, the rest a
    deterministic sample); AssertionError on the first mismatch."""
    ev = s.gen.evictions if evictions is None else evictions
    rng = random.Random(seed)
    clones = clone_points(s, ev)
    points = sorted((r, o) for r, o in ev.items() if only is None or r in only)
    if len(points) > MAX_POINTS:
        keep = [p for p in points if p[0] in clones]
        rest = [p for p in points if p[0] not in clones]
        points = sorted(keep + rng.sample(rest, max(0, MAX_POINTS - len(keep))))
    nat = natural_states(s, rng, {r for r, _ in points})
    # a point the replacement does not reach from its entry (behind an exit it never
    # comes back from, e.g. the path after a random sub-region's first exit): the
    # original's states at ``o`` stand in for the replacement's at ``r``
    missing = {o for r, o in points if not nat[r]}
    onat = transfer.natural_states(s, rng, missing) if missing else {}
    t = EvictTally(points=len(points))
    for r, o in points:
        clone = r in clones
        t.clone_points += clone
        kind = "natural"
        if not nat[r] and onat.get(o):
            nat[r], kind = onat[o], "natural-orig"
            t.from_original += 1
        t.unreached += not nat[r]
        states = [(kind, x) for x in rng.sample(nat[r], min(NATURAL, len(nat[r])))]
        if nat[r]:
            fl = rng.getrandbits(12) & FLAG_MASK & ~0x400
            states.append(("flags", replace(rng.choice(nat[r]), rflags=fl)))
        for _ in range(RANDOM):
            x = _random_state(s, rng, clone, nat[r])
            if x is not None:
                states.append(("random", x))
        for i, (kind, st) in enumerate(states):
            res = evict_differential(s, r, o, st, f"{s.name} state {i} ({kind})",
                                     t.left_at, lockstep)
            t.outcomes[(kind, res)] += 1
            if clone:
                t.clone_outcomes[(kind, res)] += 1
    assert t.unreached <= 0.1 * len(points), f"{s.name}: {t.unreached} points unreached"
    assert all(res == "left" for (k, res) in t.outcomes if k.startswith("natural")), \
        t.outcomes
    # random flags may make a counted loop run on (``dec ecx; jne`` entered with ecx = 0)
    # or, from a state entered at a patch site with a random index (the overlap test's
    # second entry), take a branch into a load that faults (compared there)
    assert all(res in ("left", "limit", "fault")
               for (k, res) in t.outcomes if k == "flags"), t.outcomes
    done = sum(n for (_k, res), n in t.outcomes.items() if res != "limit")
    assert done >= 0.9 * sum(t.outcomes.values()), t.outcomes
    return t


# -- the tests ----------------------------------------------------------------------------

def _check(s: Subject, seed_text: str) -> EvictTally:
    why = check_static(s)
    t = check_evictions(s, zlib.crc32(seed_text.encode()))
    assert t.clone_points == why["clone_points"]         # every clone point is run
    print(f"{s.name}: {t.points} points ({t.clone_points} in clones, {t.unreached} "
          f"unreached, {t.from_original} with the original's states), "
          f"{sorted(t.outcomes.items())}, at clone points {sum(t.clone_outcomes.values())}"
          f", static: {dict(why)}")
    return t


@pytest.mark.parametrize("orig,delta", PLACES, ids=["low", "high"])
@pytest.mark.parametrize("p", PROGRAMS, ids=[p.name for p in PROGRAMS])
def test_evictions_differential(p: Program, orig: int, delta: int) -> None:
    s = world_subject(p, orig, delta)
    t = _check(s, f"evict {p.name}@{orig:#x}")
    if p.inline and "call" in p.name:
        # the inlined callee's instructions are eviction points, reached naturally and
        # run (its ret is not one)
        assert t.clone_points >= 4, t.clone_points
        nat = sum(n for (k, res), n in t.clone_outcomes.items() if k == "natural")
        assert nat >= 2 * t.clone_points, t.clone_outcomes
        assert SENTINEL in t.left_at
        assert _callee_entries_see_return_address(s) == 1
    if p.name == "loop_cond":
        # its `jmp next` falls into `next` in the chain order: no point for the dropped
        # jmp, checked in that layout
        c = world_subject(p, orig, delta, name=f"{p.name}/chains", chains=True)
        assert "dropped jmp" in expected_evictions(c)[1]
        _check(c, f"evict {p.name}/chains@{orig:#x}")


@pytest.mark.parametrize("seed", range(SEEDS))
@pytest.mark.parametrize("p", RANDOM_REGION, ids=lambda p: p.name)
def test_evictions_random_regions(p: Program, seed: int) -> None:
    """Random sub-regions with random edge counts (other layouts, inverted jcc, dropped
    jmps, blocks left out: exits, in clones too) as in test_emit_random_regions."""
    orig, delta = PLACES[seed % 2]
    s = world_subject(p, orig, delta, seed=seed, name=f"{p.name}/seed{seed}")
    _check(s, f"evict {p.name}/{seed}")


@pytest.mark.parametrize("p", FAR_DISPATCH, ids=[p.name for p in FAR_DISPATCH])
def test_evictions_with_far_exit_stubs(p: Program, monkeypatch) -> None:
    """Every exit forced through a far-exit stub, with a translated dispatch: no point
    in the stubs, runs from the points leave through them."""
    import dbr_service.codegen.emit as emit_mod
    monkeypatch.setattr(emit_mod, "_near", lambda t, lo, hi: False)
    s = world_subject(p, *PLACES[0], name=f"{p.name}/far")
    assert s.gen.far_exits
    t = _check(s, f"evict {p.name}/far")
    assert set(t.left_at) & set(s.gen.far_exits), "no run left through a far-exit stub"


def test_evictions_far_module() -> None:
    """The inlined PLT stub (its ABI cascade: a whole translation) and the library
    function are clone points; the stack holds main's original return address."""
    s = far_subject()
    t = _check(s, "evict far_plt")
    assert set(t.left_at) & set(s.gen.far_exits), "no run left through the far exit"
    assert t.clone_points >= 4
    plt = [r for r in clone_points(s) if _text(s, s.gen.evictions[r]).startswith("jmp")]
    assert len(plt) == 1 and plt[0] not in s.gen.transfers.values()
    assert _callee_entries_see_return_address(s) == 1


def _text(s: Subject, o: int) -> str:
    """The original instruction at ``o``."""
    return _text_at(s.m.read(o, 15), o)


def _callee_entries_see_return_address(s: Subject) -> int:
    """At the eviction point of an inlined callee's first instruction, the replacement's
    natural states have the call's original return address at [rsp] (what the real
    ``ret`` of the original callee pops after an eviction).  The number of callees."""
    sr, n = s.sr, 0
    calls = {bb.last_insn[0]: sum(bb.last_insn) for _k, bb in sr.blocks()
             if bb.term is TermKind.CALL}
    for u, v, d in sr.g.edges(data=True):
        if d.get("kind") is not EdgeKind.CALL:
            continue
        r = next(r for r in clone_points(s) if r == s.gen.block_addr[v])
        assert s.gen.evictions[r] == sr.block(v).start
        ret = calls[v.path[-1]]
        nat = natural_states(s, random.Random(r), {r})[r]
        assert nat, f"{s.name}: callee {v} not reached"
        for st in nat:
            off = st.regs["rsp"] - STACK
            assert int.from_bytes(st.mem[STACK][off:off + 8], "little") == ret
        n += 1
    return n


def test_clone_points_static() -> None:
    """Clone blocks contribute eviction points (and no transfer points), for every
    program with an inlined call; the inlined ``ret`` is none, the pseudo-call is."""
    seen = Counter()
    for p in PROGRAMS:
        s = world_subject(p, *PLACES[0])
        clones = clone_points(s)
        has_clones = any(bb.is_clone for _k, bb in s.sr.blocks())
        assert bool(clones) == has_clones, p.name
        if not has_clones:
            continue
        seen[p.name] = len(clones)
        assert not clones & set(s.gen.transfers.values())
        for k, bb in s.sr.blocks():
            if bb.is_clone and bb.term is TermKind.RET:
                assert bb.last_insn[0] not in {s.gen.evictions[r] for r in clones}
            if not bb.is_clone and bb.term is TermKind.CALL and p.inline:
                assert bb.last_insn[0] in s.gen.evictions.values()
    assert seen.get("loop_call", 0) >= 4, seen


def test_twice_copied_instruction_has_two_eviction_points() -> None:
    """Overlapping blocks (one entered in the middle of another) copy the shared
    instructions twice: no transfer point, but an eviction point in each copy, and
    both hold."""
    s, shared, _x, _a2 = transfer.overlap_subject()
    got = Counter(s.gen.evictions.values())
    assert shared and all(got[a] == 2 for a in shared)
    assert not shared & set(s.gen.transfers)
    _check(s, "evict overlap")
    twice = [r for r, o in s.gen.evictions.items() if o in shared]
    t = check_evictions(s, 3, only=twice)
    assert t.points == len(twice) == 2 * len(shared)


def _next_orig(s: Subject, o: int) -> int | None:
    """The original instruction after ``o``."""
    later = [a for a in s.boundaries if a > o]
    return min(later) if later else None


def test_negative_control_corrupted_eviction() -> None:
    """A map pointing one instruction too far is caught: one precise corruption (the
    inlined callee's ``imul`` skipped), then each point of loop_cond, loop_call and the
    far module (clones included) redirected in turn, caught by the end states alone in
    most cases and always in lockstep."""
    s = world_subject(PROGRAMS[1], *PLACES[0])            # loop_call
    imul = next(r for r in clone_points(s)
                if _text(s, s.gen.evictions[r]).startswith("imul eax, edi"))
    o = s.gen.evictions[imul]
    bad = {**s.gen.evictions, imul: _next_orig(s, o)}
    for lockstep in (False, True):
        with pytest.raises(AssertionError, match=f"evict {imul:#x} -> {bad[imul]:#x}"):
            check_evictions(s, 1, bad, [imul], lockstep)
    check_evictions(s, 1, None, [imul])                   # the true point passes
    detected, total, clones = Counter(), 0, 0
    for s in (world_subject(PROGRAMS[0], *PLACES[0]), s, far_subject()):
        cl = clone_points(s)
        for r, o in sorted(s.gen.evictions.items()):
            n = _next_orig(s, o)
            if n is None or n == far.LIB:    # the PLT jmp's next instruction is its
                continue                     # target: no corruption at all
            total += 1
            clones += r in cl
            bad = {**s.gen.evictions, r: n}
            for lockstep in (False, True):
                try:
                    check_evictions(s, r, bad, [r], lockstep)
                except AssertionError:
                    detected[lockstep] += 1
    print(f"negative control: {total} corrupted points ({clones} in clones), caught by "
          f"end states {detected[False]}, in lockstep {detected[True]}")
    assert total >= 45 and clones >= 9
    assert detected[True] == total
    assert detected[False] >= 0.8 * total, (detected, total)
