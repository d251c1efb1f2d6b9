"""Hot-code discovery (patent fig. 10, docs/architecture.md) against ground truth from
real compiled code.

Programs in ``tests/region_progs`` are compiled at -O0/-O2/-O3, non-PIE and PIE,
then stripped; discovery runs on the stripped file.  Ground truth comes from the
unstripped build: function symbols, a linear disassembly of every function, and
an exact profile obtained by executing the hot functions under unicorn
(instruction counts and every taken transition).  Samples are taken from that
profile deterministically, one every ``PERIOD`` executed instructions, as a
periodic timer would.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import capstone
import networkx as nx
import pytest

from dbr_service.region.discovery import hot_code_discovery
from dbr_service.region.memview import ElfMemoryView, LiveMemoryView, parse_maps
from dbr_service.region.model import END, START, CloneKey, EdgeKind, SuperRegion, TermKind

unicorn = pytest.importorskip("unicorn")
lief = pytest.importorskip("lief")
from unicorn import x86_const as UX  # noqa: E402 - after the importorskip above

PROGS = Path(__file__).resolve().parent.parent / "region_progs"
PERIOD = 7
PIE_BASE = 0x555555554000
NORETURN_IMPORTS = {"exit", "abort", "__stack_chk_fail"}

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None or shutil.which("strip") is None,
                                reason="needs gcc and strip")


# ---------------------------------------------------------------------------
# Builds
# ---------------------------------------------------------------------------

@dataclass
class Build:
    """One compiled program: the unstripped build (truth) and its stripped copy."""

    name: str
    full: Path
    stripped: Path
    pie: bool
    opt: str
    #: Hot functions run under unicorn, with their argument.
    hot: dict[str, int]


_C_BUILDS = {
    # key: (sources, opt, pie, extra flags, hot functions)
    "loops-O0": (["loops.c"], "-O0", False, [], None),
    "loops-O2": (["loops.c"], "-O2", False, [], None),
    "loops-O3": (["loops.c"], "-O3", False, [], None),
    "loops-O2-pie": (["loops.c"], "-O2", True, [], None),
    "switch-O0": (["switch.c"], "-O0", False, ["-fstack-protector-all"], None),
    "switch-O2": (["switch.c"], "-O2", False, ["-fstack-protector-all"], None),
    "switch-O3": (["switch.c"], "-O3", False, ["-fstack-protector-all"], None),
    "switch-O0-pie": (["switch.c"], "-O0", True, ["-fstack-protector-all"], None),
    "switch-O2-pie": (["switch.c"], "-O2", True, ["-fstack-protector-all"], None),
    "asm": (["asmcases.S", "asmmain.c"], "-O2", False, [], None),
    "e2e-O0": (["e2e.c"], "-O0", False, [], None),
    "e2e-O2": (["e2e.c"], "-O2", False, [], None),
    "e2e-O3": (["e2e.c"], "-O3", False, [], None),
}
HOT = {
    "loops": {"nested": 20, "calls_in_loop": 64, "fib": 10, "fptr_loop": 50, "tail_loop": 40,
              "hook_loop": 30},
    "switch": {"switch_loop": 45, "checked_loop": 40},
    "asm": {"ovl": 40, "junk": 40, "tiny": 64, "part": 40},
    "e2e": {"single": 200, "nest2": 12},
}


def _compile(out: Path, sources: list[str], opt: str, pie: bool, extra: list[str]) -> None:
    flags = ["-fpie", "-pie"] if pie else ["-fno-pie", "-no-pie"]
    cmd = ["gcc", opt, *flags, *extra, "-o", str(out), *[str(PROGS / s) for s in sources]]
    subprocess.run(cmd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="session")
def builds(tmp_path_factory) -> dict[str, Build]:
    d = tmp_path_factory.mktemp("region_progs")
    out = {}
    for key, (srcs, opt, pie, extra, _) in _C_BUILDS.items():
        full = d / key
        _compile(full, srcs, opt, pie, extra)
        stripped = d / (key + ".stripped")
        subprocess.run(["strip", "-o", str(stripped), str(full)], check=True, timeout=60)
        out[key] = Build(key, full, stripped, pie, opt, HOT[key.split("-")[0]])
    return out


# ---------------------------------------------------------------------------
# Ground truth: symbols, linear disassembly, an exact profile under unicorn
# ---------------------------------------------------------------------------

_cs = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
_cs.detail = True


@dataclass
class Truth:
    funcs: dict[str, tuple[int, int]]            # name -> [lo, hi)
    boundaries: set[int]                         # linear disassembly of functions + PLT
    insn: dict[int, object]                      # addr -> capstone insn (linear)
    plt: dict[int, str]                          # PLT stub address -> imported name
    executed: Counter = field(default_factory=Counter)
    #: (from insn, to insn) for every control transfer instruction and every jump
    transitions: Counter = field(default_factory=Counter)
    samples: dict[int, float] = field(default_factory=dict)

    def func_at(self, addr: int) -> str | None:
        for n, (lo, hi) in self.funcs.items():
            if lo <= addr < hi:
                return n
        return None

    def branch_samples(self) -> dict[int, dict[int, float]]:
        """Exact edge counts of every control transfer (what LBR would give)."""
        out: dict[int, dict[int, float]] = defaultdict(dict)
        for (a, b), n in self.transitions.items():
            out[a][b] = out[a].get(b, 0) + n
        return dict(out)


def _is_transfer(ins) -> bool:
    return any(ins.group(g) for g in (capstone.CS_GRP_JUMP, capstone.CS_GRP_CALL,
                                       capstone.CS_GRP_RET))


def _truth(b: Build, base: int = 0) -> Truth:
    elf = lief.ELF.parse(str(b.full))
    funcs = {}
    for s in elf.symbols:
        if s.type == lief.ELF.Symbol.TYPE.FUNC and s.size and s.value:
            funcs[s.name] = (base + s.value, base + s.value + s.size)
    boundaries: set[int] = set()
    insns: dict[int, object] = {}
    data = {}
    for sec in elf.sections:
        if sec.name in (".plt", ".plt.sec", ".plt.got", ".text", ".init", ".fini"):
            data[sec.name] = (base + sec.virtual_address, bytes(sec.content))

    def lin(lo: int, hi: int) -> None:
        for s, blob in data.values():
            if s <= lo and hi <= s + len(blob):
                for ins in _cs.disasm(blob[lo - s: hi - s], lo):
                    boundaries.add(ins.address)
                    insns[ins.address] = ins
    for lo, hi in funcs.values():
        lin(lo, hi)
    for name in (".plt", ".plt.sec", ".plt.got"):
        if name in data:
            s, blob = data[name]
            lin(s, s + len(blob))
    got = {base + r.address: r.symbol.name for r in elf.pltgot_relocations if r.symbol}
    plt = {}
    for a, ins in insns.items():
        if ins.mnemonic.split()[-1] == "jmp" and "rip" in ins.op_str:
            slot = a + ins.size + ins.operands[0].mem.disp
            if slot in got:
                endbr = insns.get(a - 4) is not None and insns[a - 4].mnemonic == "endbr64"
                stub = a - 4 if endbr else a
                plt[stub] = got[slot]
    return Truth(funcs, boundaries, insns, plt)


RET_MAGIC = 0x7EAD0000
STACK = 0x7FFF00000000
TLS = 0x7FFE00000000


def _profile(b: Build, t: Truth, mem: ElfMemoryView, base: int = 0) -> None:
    """Run every hot function under unicorn; fill executed, transitions, samples."""
    uc = unicorn.Uc(unicorn.UC_ARCH_X86, unicorn.UC_MODE_64)
    mapped = set()
    for r in mem.ranges():
        lo, hi = r.start & ~0xFFF, (r.end + 0xFFF) & ~0xFFF
        for p in range(lo, hi, 0x1000):
            if p not in mapped:
                uc.mem_map(p, 0x1000)
                mapped.add(p)
        uc.mem_write(r.start, mem.read(r.start, r.end - r.start))
    uc.mem_map(STACK - 0x100000, 0x101000)
    uc.mem_map(TLS, 0x1000)
    uc.mem_map(RET_MAGIC, 0x1000)
    uc.reg_write(UX.UC_X86_REG_FS_BASE, TLS)
    uc.mem_write(TLS + 0x28, (0x1234567890ABCD00).to_bytes(8, "little"))
    state = {"prev": None, "prev_end": None, "n": 0}
    transfers = {a for a, ins in t.insn.items() if _is_transfer(ins)}

    def hook(uc_, addr, size, _):
        prev = state["prev"]
        if prev is not None and (addr != state["prev_end"] or prev in transfers):
            t.transitions[(prev, addr)] += 1
        t.executed[addr] += 1
        state["n"] += 1
        if state["n"] % PERIOD == 3:
            t.samples[addr] = t.samples.get(addr, 0.0) + 1.0
        state["prev"], state["prev_end"] = addr, addr + size

    uc.hook_add(unicorn.UC_HOOK_CODE, hook)
    for name, arg in b.hot.items():
        lo, _ = t.funcs[name]
        sp = STACK - 0x1000
        uc.mem_write(sp, RET_MAGIC.to_bytes(8, "little"))
        uc.reg_write(UX.UC_X86_REG_RSP, sp)
        uc.reg_write(UX.UC_X86_REG_RDI, arg)
        state["prev"] = None
        uc.emu_start(lo, RET_MAGIC, count=400_000)
        assert uc.reg_read(UX.UC_X86_REG_RIP) == RET_MAGIC, f"{name} did not return"
    # The return into RET_MAGIC is not a transition of the program.
    for k in [k for k in t.transitions if k[1] == RET_MAGIC]:
        del t.transitions[k]


@dataclass
class Case:
    build: Build
    truth: Truth
    mem: ElfMemoryView
    sr: SuperRegion


_cases: dict[tuple[str, int], Case] = {}


def _case(builds, key: str, base: int = 0, **kw) -> Case:
    ck = (key, base)
    if ck in _cases and not kw:
        return _cases[ck]
    b = builds[key]
    truth = _truth(b, base if b.pie else 0)
    mem = ElfMemoryView(str(b.stripped), base=base if b.pie else None)
    _profile(b, truth, mem, base)
    sr = hot_code_discovery(truth.samples, mem, **kw)
    c = Case(b, truth, mem, sr)
    if not kw:
        _cases[ck] = c
    return c


C_KEYS = [k for k in _C_BUILDS if k != "asm" and not k.startswith("e2e")]


def _succ_addrs(sr: SuperRegion, k) -> set[int]:
    return {v for v in sr.g.successors(k) if v not in (START, END)}


# ---------------------------------------------------------------------------
# Generic agreement with ground truth, every build
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("key", C_KEYS)
def test_blocks_lie_in_real_functions_at_real_boundaries(builds, key):
    c = _case(builds, key)
    assert len(c.sr) > 5
    for k, bb in c.sr.blocks():
        for a, size in bb.insns:
            assert a in c.truth.boundaries, f"{key}: {a:#x} in block {k:#x} is no real boundary"
            assert c.truth.insn[a].size == size
        if bb.known_exec:
            f = c.truth.func_at(bb.start)
            inplt = bb.start in c.truth.plt or any(
                s <= bb.start < s + 16 for s in c.truth.plt)
            assert f is not None or inplt, f"{key}: known-exec block {k:#x} outside functions"
            if f is not None:
                _, hi = c.truth.funcs[f]
                assert bb.end <= hi, f"{key}: block {k:#x} runs past the end of {f}"
        assert bb.data == c.mem.read(bb.start, bb.size)
        assert bb.module == str(c.build.stripped.resolve())


@pytest.mark.parametrize("key", C_KEYS)
def test_hot_loops_all_found(builds, key):
    """Every instruction of a loop (run at least twice per call of its function, and
    at least 3 times) is a boundary of a discovered block."""
    c = _case(builds, key)
    t = c.truth
    found = {a for _, bb in c.sr.blocks() for a, _ in bb.insns}
    in_loops = set()
    for a, n in t.executed.items():
        f = t.func_at(a)
        calls = t.executed.get(t.funcs[f][0], 0) if f else 0
        if n >= 3 and f and n >= 2 * max(calls, 1):
            in_loops.add(a)
    assert len(in_loops) > 10
    missing = sorted(in_loops - found)
    assert not missing, f"{key}: loop instructions not found: {[hex(a) for a in missing[:10]]}"


@pytest.mark.parametrize("key", C_KEYS)
def test_edges_agree_with_profile(builds, key):
    c = _case(builds, key)
    sr, t = c.sr, c.truth
    blocks = dict(sr.blocks())
    by_last = {bb.last_insn[0]: k for k, bb in blocks.items()}
    # every edge is a possible successor of the block's last instruction
    for u, v, d in sr.body_edges():
        bu = blocks[u]
        assert v in set(bu.targets) | {bu.fallthrough}, f"{key}: edge {u:#x}->{v:#x}"
        if d["kind"] == EdgeKind.FALLTHROUGH:
            assert v == bu.end
    # every observed transfer between discovered blocks is represented
    for (a, b) in t.transitions:
        u = by_last.get(a)
        if u is None or b not in blocks:
            continue
        bu = blocks[u]
        if bu.term == TermKind.ICALL and b not in bu.targets:
            assert bu.unknown_target and a in sr.g.edges[u, END]["exits"]
        elif bu.term in (TermKind.CALL, TermKind.ICALL):
            assert sr.g.has_edge(START, b), f"{key}: call {a:#x}->{b:#x} has no entry edge"
            if bu.term == TermKind.CALL:
                assert b in sr.g.edges[u, END]["exits"]
        elif bu.term == TermKind.RET:
            assert a in sr.g.edges[u, END]["exits"]
        else:
            assert sr.g.has_edge(u, b), f"{key}: observed {a:#x}->{b:#x} is not an edge"
    # sequential flow out of a block ending without transfer reaches the next block
    for k, bb in blocks.items():
        if bb.term == TermKind.FALLTHROUGH:
            assert sr.g.has_edge(k, bb.end) or bb.end in sr.g.edges[k, END]["exits"]


@pytest.mark.parametrize("key", C_KEYS)
def test_samples_and_known_exec(builds, key):
    c = _case(builds, key)
    total = sum(bb.samples for _, bb in c.sr.blocks())
    assert total == pytest.approx(sum(c.truth.samples.values()))
    assert c.sr.info["discovery"].samples_unplaced == 0
    for k, bb in c.sr.blocks():
        if bb.samples > 0:
            assert bb.known_exec and bb.jfh == 0
        if bb.known_exec:
            assert bb.unpatchable_why in ("",) or bb.unpatchable_why.startswith("overlaps")
        else:
            assert bb.unpatchable
        assert bb.jfh < 2


# ---------------------------------------------------------------------------
# Specific shapes
# ---------------------------------------------------------------------------

def _ijmp_in(c: Case, func: str):
    lo, hi = c.truth.funcs[func]
    return [(k, bb) for k, bb in c.sr.blocks() if lo <= k < hi and bb.term == TermKind.IJMP]


@pytest.mark.parametrize("key", [k for k in C_KEYS if k.startswith("switch")])
def test_jump_table_targets_all_found(builds, key):
    c = _case(builds, key)
    ij = _ijmp_in(c, "dispatch")
    assert len(ij) == 1, f"{key}: expected one table dispatch, got {ij}"
    k, bb = ij[0]
    observed = {b for (a, b) in c.truth.transitions if a == bb.last_insn[0]}
    assert len(observed) >= 7                          # cases 0..7 ran (gcc may share one)
    assert set(bb.targets) == observed
    assert not bb.unknown_target
    assert not c.sr.g.has_edge(k, END)
    for tgt in observed:
        assert c.sr.g.has_edge(k, tgt)
    assert c.sr.info["discovery"].jump_tables == 1
    # with branch samples too, a bounded read-only table stays complete
    c2 = _case(builds, key, branch_samples=c.truth.branch_samples())
    bb2 = c2.sr.block(k)
    assert set(bb2.targets) == observed and not bb2.unknown_target
    for tgt in observed:
        assert c2.sr.g.edges[k, tgt]["count"] == c.truth.transitions[(bb.last_insn[0], tgt)]


@pytest.mark.parametrize("key", [k for k in C_KEYS if k.startswith("switch")])
def test_noreturn_calls_have_no_fallthrough(builds, key):
    c = _case(builds, key, jumps_from_hot_limit=3)     # reach the cold abort() paths
    seen = Counter()
    for k, bb in c.sr.blocks():
        if bb.term != TermKind.CALL:
            continue
        name = c.truth.plt.get(bb.targets[0])
        if name in NORETURN_IMPORTS:
            seen[name] += 1
            assert bb.fallthrough is None, f"{key}: call {name} at {k:#x} falls through"
            assert set(c.sr.g.successors(k)) == {END}
        else:
            assert bb.fallthrough == bb.end
    assert seen["__stack_chk_fail"] >= 1
    assert seen["abort"] >= 1
    assert seen["exit"] >= 1                            # die() -> exit, reached from checked()


@pytest.mark.parametrize("key", [k for k in C_KEYS if k.startswith("loops")])
def test_recursion_tail_calls_and_calls(builds, key):
    c = _case(builds, key)
    sr, t = c.sr, c.truth
    fib = t.funcs["fib"][0]
    assert sr.g.has_edge(START, fib)                     # recursive call enters fib
    calls_to_fib = [k for k, bb in sr.blocks() if bb.term == TermKind.CALL
                    and bb.targets == [fib]]
    assert calls_to_fib
    for k in calls_to_fib:
        assert fib in sr.g.edges[k, END]["exits"]
        assert not sr.g.has_edge(k, fib)                 # never a body edge into the callee
        bb = sr.block(k)
        assert len(bb.insns) == 1                        # calls sit in their own block
    for k, bb in sr.blocks():
        if bb.term in (TermKind.CALL, TermKind.ICALL, TermKind.RET, TermKind.IJMP):
            assert len(bb.insns) == 1
    small, large = t.funcs["small"][0], t.funcs["large"][0]
    assert sr.g.has_edge(START, small) and sr.g.has_edge(START, large)
    if c.build.opt != "-O0":                             # gcc turns it into a jump
        target = t.funcs["tail_target"][0]
        jumps = [k for k, bb in sr.blocks() if bb.term == TermKind.JMP and bb.targets == [target]
                 and t.func_at(k) == "tail_caller"]
        assert jumps and all(sr.g.has_edge(k, target) for k in jumps)


@pytest.mark.parametrize("key", ["loops-O0", "loops-O2"])
def test_function_pointer_targets(builds, key):
    c = _case(builds, key)
    lo, hi = c.truth.funcs["fptr_loop"]
    calls = [(k, bb) for k, bb in c.sr.blocks() if lo <= k < hi and bb.term == TermKind.ICALL]
    assert len(calls) == 1
    k, bb = calls[0]
    assert bb.unknown_target and bb.targets == []       # table in writable .data: not trusted
    # with branch samples (as LBR or IBS give) the sampled targets are used
    c2 = _case(builds, key, branch_samples=c.truth.branch_samples())
    bb2 = c2.sr.block(k)
    inc, dbl = c.truth.funcs["inc"][0], c.truth.funcs["dbl"][0]
    assert set(bb2.targets) == {inc, dbl} and bb2.unknown_target
    assert c2.sr.g.has_edge(START, inc) and c2.sr.g.has_edge(START, dbl)
    assert c2.sr.g.edges[k, END]["exits"][inc] > 0


@pytest.mark.parametrize("key", ["loops-O0", "loops-O2", "loops-O2-pie"])
def test_pointer_in_writable_memory_trusted_only_when_sampled(builds, key):
    c = _case(builds, key)
    lo, hi = c.truth.funcs["hook_loop"]
    inc = c.truth.funcs["inc"][0]
    calls = [bb for k, bb in c.sr.blocks() if lo <= k < hi and bb.term == TermKind.ICALL]
    assert len(calls) == 1
    assert calls[0].targets == [inc] and calls[0].unknown_target   # inc ran, so was sampled
    assert c.sr.g.has_edge(START, inc)
    unsampled = {a: n for a, n in c.truth.samples.items() if a != inc}
    sr = hot_code_discovery(unsampled, c.mem)
    bb = sr.block(calls[0].start)
    assert bb.targets == [] and bb.unknown_target


def test_branch_samples_give_edge_counts(builds):
    c = _case(builds, "loops-O2")
    bs = c.truth.branch_samples()
    c2 = _case(builds, "loops-O2", branch_samples=bs)
    for u, v, d in c2.sr.body_edges():
        bu = c2.sr.block(u)
        a = bu.last_insn[0]
        if bu.term in (TermKind.JCC, TermKind.JMP):
            assert d["count"] == bs.get(a, {}).get(v, 0)
        elif bu.term == TermKind.FALLTHROUGH:
            assert d["count"] == 0                         # fall-through-only: a later pass


def test_pie_at_a_base_is_the_same_code_shifted(builds):
    c0 = _case(builds, "switch-O2-pie")
    c1 = _case(builds, "switch-O2-pie", base=PIE_BASE)
    assert c1.mem.ranges()[0].start >= PIE_BASE
    k0 = sorted(k for k, _ in c0.sr.blocks())
    k1 = sorted(k for k, _ in c1.sr.blocks())
    assert [k + PIE_BASE for k in k0] == k1
    ij = _ijmp_in(c1, "dispatch")
    assert len(ij) == 1 and len(ij[0][1].targets) == 8


def test_jumps_from_hot_limit_bounds_exploration(builds):
    b = builds["switch-O2"]
    t = _truth(b)
    mem = ElfMemoryView(str(b.stripped))
    _profile(b, t, mem)
    sizes = []
    for limit in (1, 2, 4):
        sr = hot_code_discovery(t.samples, mem, jumps_from_hot_limit=limit)
        assert all(bb.jfh < limit for _, bb in sr.blocks())
        sizes.append(len(sr))
    assert sizes[0] < sizes[1] <= sizes[2]


def test_seed_min_seeds_only_hotter_ips_but_keeps_their_neighbours_samples(builds):
    """With seed_min, single-sample IPs start no search of their own; the code found
    from the hotter seeds is a subset of the full discovery, and every sample that
    lies in it is still counted (nothing is lost inside the blocks found)."""
    b = builds["switch-O2"]
    t = _truth(b)
    mem = ElfMemoryView(str(b.stripped))
    _profile(b, t, mem)
    samples = dict(t.samples)
    # flatten the profile: scatter singletons over code the full search would start at
    full = hot_code_discovery(samples, mem, jumps_from_hot_limit=2)
    starts = sorted(bb.start for _, bb in full.blocks())
    for a in starts[::3]:
        samples.setdefault(a, 1)
    full = hot_code_discovery(samples, mem, jumps_from_hot_limit=2)
    seeded = hot_code_discovery(samples, mem, jumps_from_hot_limit=2, seed_min=2)
    lone = [a for a, n in samples.items() if n == 1]
    assert lone and any(n >= 2 for n in samples.values())
    full_blocks = {(bb.start, bb.size) for _, bb in full.blocks()}
    covered = set()
    for _, bb in seeded.blocks():
        covered.update(range(bb.start, bb.start + bb.size))
    assert len(seeded) < len(full)
    assert all(any(s <= bb.start < s + n for s, n in full_blocks) for _, bb in seeded.blocks())
    # every IP with >= 2 samples lies in a block; singletons count where reached
    for a, n in samples.items():
        if n >= 2:
            assert a in covered, hex(a)
    in_blocks = sum(n for a, n in samples.items() if a in covered)
    assert sum(bb.samples for _, bb in seeded.blocks()) == pytest.approx(in_blocks)
    assert any(a in covered for a in lone), "singletons inside reached code still count"


def test_max_blocks_stops_following_jumps_but_keeps_every_seed(builds):
    """A block budget: once discovery has made max_blocks blocks it follows no more
    jumps (the rest leaves the region, as beyond the jumps-from-hot limit); every
    seed is still disassembled and the pipeline makes consistent regions of it."""
    b = builds["switch-O2"]
    t = _truth(b)
    mem = ElfMemoryView(str(b.stripped))
    _profile(b, t, mem)
    full = hot_code_discovery(t.samples, mem, jumps_from_hot_limit=4)
    small = hot_code_discovery(t.samples, mem, jumps_from_hot_limit=4, max_blocks=3)
    assert len(small) < len(full)
    from dbr_service.region.pipeline import RegionConfig, run_pipeline

    res = run_pipeline(small, mem, RegionConfig(hot_threshold=1.0))
    assert not res.failures, res.failures
    for sr in res.regions:      # the pipeline makes whole regions of a truncated discovery
        sr.verify()
    covered = set()
    for _, bb in small.blocks():
        covered.update(range(bb.start, bb.start + bb.size))
    assert all(a in covered for a, n in t.samples.items() if n > 0)
    assert all(any(f.start <= bb.start < f.end for _, f in full.blocks())
               for _, bb in small.blocks())
    # a budget above what discovery needs changes nothing
    same = hot_code_discovery(t.samples, mem, jumps_from_hot_limit=4, max_blocks=10**6)
    assert sorted(bb.start for _, bb in same.blocks()) == \
        sorted(bb.start for _, bb in full.blocks())


# ---------------------------------------------------------------------------
# Hand-written assembly: overlap, data after noreturn, tiny blocks, partial blocks
# ---------------------------------------------------------------------------

def _sym(c: Case, name: str) -> int:
    elf = lief.ELF.parse(str(c.build.full))
    return next(s.value for s in elf.symbols if s.name == name)


def test_overlapping_instructions(builds):
    c = _case(builds, "asm")
    l0, mid, join = (_sym(c, n) for n in ("ovl_l0", "ovl_mid", "ovl_join"))
    sr = c.sr
    a, b = sr.block(l0), sr.block(mid)
    assert a.insns == [(l0, 5)] and a.end == join       # mov $imm, %edx
    assert [x for x, _ in b.insns] == [mid, mid + 2, mid + 3] and b.end == join
    assert a.unpatchable and a.unpatchable_why.startswith("overlaps")
    assert b.unpatchable and b.unpatchable_why.startswith("overlaps")
    assert sr.g.has_edge(l0, join) and sr.g.has_edge(mid, join)
    assert not sr.block(join).unpatchable
    bounds = [x for _, bb in sr.blocks() for x, _ in bb.insns]
    assert len(bounds) == len(set(bounds))               # disjoint instruction boundaries


def test_data_after_a_call_that_does_not_return(builds):
    c = _case(builds, "asm")
    data = _sym(c, "junk_data")
    sr = c.sr
    assert data in sr.info["unsupported"]
    assert all(not bb.contains(data) for _, bb in sr.blocks())
    call = data - 5
    bb = sr.block(call)
    assert bb.term == TermKind.CALL and bb.fallthrough == data
    assert data in sr.g.edges[call, END]["exits"]        # the fall-through stays an exit
    halts = [bb for _, bb in sr.blocks() if bb.term == TermKind.HALT]
    assert halts and all(h.last_insn[0] in sr.g.edges[h.start, END]["exits"] for h in halts)


def test_tiny_block_that_samples_miss(builds):
    c = _case(builds, "asm")
    inc, skip = _sym(c, "tiny_inc"), _sym(c, "tiny_skip")
    samples = {a: n for a, n in c.truth.executed.items() if a != inc}
    assert c.truth.executed[inc] > 0
    sr = hot_code_discovery(samples, c.mem)
    bb = sr.block(inc)
    assert bb.size == 2 and bb.samples == 0 and bb.jfh == 1
    assert bb.known_exec and not bb.unpatchable
    assert sr.g.has_edge(inc, skip)
    sr1 = hot_code_discovery(samples, c.mem, jumps_from_hot_limit=1)
    assert inc not in sr1.g
    jcc = next(k for k, b in sr1.blocks() if b.fallthrough == inc)
    assert inc in sr1.g.edges[jcc, END]["exits"]         # pending CFE kept as an exit


def test_partly_executed_block_is_split(builds):
    c = _case(builds, "asm")
    call, after, add = (_sym(c, n) for n in ("part_call", "part_after", "part_add"))
    samples = {a: n for a, n in c.truth.executed.items() if a != after}
    sr = hot_code_discovery(samples, c.mem)
    top, rest = sr.block(after), sr.block(add)
    assert top.insns == [(after, 2)] and top.unpatchable
    assert top.unpatchable_why == "top of a partly executed block" and not top.known_exec
    assert rest.known_exec and not rest.unpatchable and rest.samples > 0
    assert sr.g.has_edge(after, add) and sr.g.edges[after, add]["kind"] == EdgeKind.FALLTHROUGH
    assert sr.block(call).known_exec


def test_merge_entry_extends_a_sampled_block_backwards(builds):
    c = _case(builds, "asm")
    head = c.truth.funcs["tiny"][0] + 4                   # .Lt_head: test $3, %edi
    skip = _sym(c, "tiny_skip")
    # a sample in the middle of the real block [skip: add; dec; jnz] comes first
    samples = {skip + 2: 5.0, head: 1.0}
    sr = hot_code_discovery(samples, c.mem)
    assert skip in sr.g and skip + 2 not in sr.g
    assert sr.block(skip).insns[0] == (skip, 2)
    assert sr.info["discovery"].merges >= 1


def test_discovery_stops_at_patched_bytes(builds):
    c = _case(builds, "asm")
    skip = _sym(c, "tiny_skip")
    mem = ElfMemoryView(str(c.build.stripped))
    mem.exclude(skip + 2, 5)                              # an installed patch at `dec`
    samples = {a: n for a, n in c.truth.executed.items() if not skip + 2 <= a < skip + 7}
    sr = hot_code_discovery(samples, mem)
    for _, bb in sr.blocks():
        assert not (bb.start < skip + 7 and skip + 2 < bb.end), f"block {bb.start:#x} patched"
    bb = sr.block(skip)
    assert bb.term == TermKind.STOP and bb.fallthrough == skip + 2
    assert skip + 2 in sr.g.edges[skip, END]["exits"]
    sr2 = hot_code_discovery(samples, ElfMemoryView(str(c.build.stripped)),
                             patched=lambda a: skip + 2 <= a < skip + 7)
    assert sr2.block(skip).term == TermKind.STOP


# ---------------------------------------------------------------------------
# Shared library through the PLT: file view and live process
# ---------------------------------------------------------------------------

LIB_BASE = 0x7F0000000000


@pytest.fixture(scope="session")
def plt_build(tmp_path_factory):
    d = tmp_path_factory.mktemp("plt")
    lib = d / "libhot.so"
    subprocess.run(["gcc", "-O2", "-fpic", "-shared", "-o", str(lib), str(PROGS / "libhot.c")],
                   check=True, capture_output=True, timeout=60)
    exe = d / "pltmain"
    subprocess.run(["gcc", "-O2", "-fno-pie", "-no-pie", "-o", str(exe), str(PROGS / "pltmain.c"),
                    f"-L{d}", "-lhot", f"-Wl,-rpath,{d}", "-Wl,-z,now,-z,relro"],
                   check=True, capture_output=True, timeout=60)
    subprocess.run(["strip", str(exe)], check=True, timeout=60)
    return exe, lib


def _lib_work(lib: Path) -> tuple[int, int]:
    elf = lief.ELF.parse(str(lib))          # keep the binary alive while using its symbols
    s = next(s for s in elf.symbols if s.name == "lib_work")
    return s.value, s.size


def _hot_samples(mem, lo: int, hi: int) -> dict[int, float]:
    insns = list(_cs.disasm(mem.read(lo, hi - lo), lo))
    return {i.address: 1.0 for i in insns}


def _main_loop_call(mem, exe_text) -> int:
    """Address of main's call to lib_work through the PLT."""
    lo, hi = exe_text
    for ins in _cs.disasm(mem.read(lo, hi - lo), lo):
        if ins.mnemonic != "call" or ins.operands[0].type != capstone.x86.X86_OP_IMM:
            continue
        stub = ins.operands[0].imm
        for j in _cs.disasm(mem.read(stub, 16), stub, 2):
            if j.mnemonic.split()[-1] == "jmp" and j.operands[0].type == capstone.x86.X86_OP_MEM:
                slot = j.address + j.size + j.operands[0].mem.disp
                if mem.import_name(slot) == "lib_work":
                    return ins.address
    raise AssertionError("no call to lib_work@plt in main")


def test_plt_call_into_a_shared_library_file_view(plt_build):
    exe, lib = plt_build
    mem = ElfMemoryView(str(exe), libs=[(str(lib), LIB_BASE)])
    off, size = _lib_work(lib)
    samples = _hot_samples(mem, LIB_BASE + off, LIB_BASE + off + size)
    sr = hot_code_discovery(samples, mem)
    mods = {bb.module for _, bb in sr.blocks()}
    assert mods == {str(lib.resolve())}
    loops = [k for k, bb in sr.blocks() if bb.term == TermKind.JCC and bb.targets[0] <= k]
    assert loops                                           # the library's loop back edge
    # GOT in the file is unrelocated: a call through the PLT stays an unknown exit
    text = next(r for r in mem.ranges() if r.perms == "r-x" and r.module == str(exe.resolve()))
    call = _main_loop_call(mem, (text.start, text.end))
    sr2 = hot_code_discovery({call: 1.0}, mem)
    stub = sr2.block(call).targets[0]
    assert sr2.g.has_edge(START, stub)
    assert sr2.block(stub).term == TermKind.IJMP and sr2.block(stub).unknown_target


@pytest.mark.timeout(60)
def test_live_memory_view_and_resolved_plt(plt_build):
    exe, lib = plt_build
    p = subprocess.Popen([str(exe), "50"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert p.stdout.readline().strip()
        mem = LiveMemoryView(p.pid)
        libr = [r for r in mem.ranges() if r.module and r.module.endswith("libhot.so")]
        assert libr and any(r.perms == "r-x" for r in libr)
        base = min(r.start for r in libr)
        off, size = _lib_work(lib)
        on_disk = lib.read_bytes()
        elf = lief.ELF.parse(str(lib))
        file_off = elf.virtual_address_to_offset(off)
        assert mem.read(base + off, size) == on_disk[file_off: file_off + size]
        assert mem.is_exec(base + off) and mem.is_readonly(base + off)
        assert mem.module_of(base + off) == str(lib.resolve())
        assert mem.is_file_backed(base + off)
        # BIND_NOW + RELRO: the GOT is read-only, so the PLT stub's target is trusted
        text = next(r for r in mem.ranges() if r.perms == "r-x" and r.module == str(exe.resolve()))
        call = _main_loop_call(mem, (text.start, text.end))
        sr = hot_code_discovery({call: 1.0}, mem)
        stub = sr.block(call).targets[0]
        sb = sr.block(stub)
        assert sb.term == TermKind.IJMP and sb.targets == [base + off] and not sb.unknown_target
        assert sr.g.has_edge(stub, base + off)
        mem.invalidate()
        assert mem.read(base + off, 4) == on_disk[file_off: file_off + 4]
        mem.close()
    finally:
        p.stdin.close()
        p.wait(timeout=10)


def test_parse_maps_and_view_errors(tmp_path):
    rs = parse_maps("00400000-00401000 r-xp 00000000 08:01 42 /bin/x\n"
                    "7ffd0000-7ffd1000 rw-p 00000000 00:00 0 [stack]\n")
    assert rs[0].perms == "r-x" and rs[0].file_backed and rs[0].module == "/bin/x"
    assert (rs[0].dev, rs[0].inode, rs[0].offset) == ((8, 1), 42, 0)
    assert not rs[1].file_backed
    from dbr_service.common.errors import MemoryViewError
    (tmp_path / "t.txt").write_text("hello")
    with pytest.raises(MemoryViewError, match="not an ELF"):
        ElfMemoryView(str(tmp_path / "t.txt"))
    with pytest.raises(MemoryViewError, match="no such file"):
        ElfMemoryView(str(tmp_path / "nope"))
    with pytest.raises(MemoryViewError, match="not mapped"):
        ElfMemoryView(sys.executable).read(0x7 << 60, 4)


# ---------------------------------------------------------------------------
# dbr analyze
# ---------------------------------------------------------------------------

def test_analyze_command(builds, tmp_path, capsys):
    from dbr_service.commands.cli import main
    c = _case(builds, "switch-O2")
    sfile = tmp_path / "s.txt"
    lines = ["# samples from the unicorn profile"]
    lines += [f"{a:#x} {n:g}" for a, n in sorted(c.truth.samples.items())]
    for a, tg in sorted(c.truth.branch_samples().items()):
        lines += [f"{a:#x} -> {b:#x} {n:g}" for b, n in tg.items()]
    sfile.write_text("\n".join(lines) + "\n")
    dots = tmp_path / "dots"
    rc = main(["analyze", str(c.build.stripped), "--samples", str(sfile), "--dot-dir", str(dots),
               "--svg"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert "discovery:" in out.out and "super-region(s)" in out.out
    assert (dots / "00-discovery-sr").parent.exists()
    assert any(p.name.startswith("00-discovery") for p in dots.iterdir())
    if shutil.which("dot") is None:
        assert "graphviz" in out.err
    # errors: malformed line with its number, not ELF, not x86-64, missing file
    bad = tmp_path / "bad.txt"
    bad.write_text("0x401000 3\n# ok\nnot-an-address\n")
    assert main(["analyze", str(c.build.stripped), "--samples", str(bad)]) == 2
    assert "bad.txt:3: malformed" in capsys.readouterr().err
    assert main(["analyze", str(sfile), "--samples", str(sfile)]) == 2
    assert "not an ELF" in capsys.readouterr().err
    arm = tmp_path / "arm"
    blob = bytearray(c.build.stripped.read_bytes())
    blob[18:20] = (183).to_bytes(2, "little")              # EM_AARCH64
    arm.write_bytes(bytes(blob))
    assert main(["analyze", str(arm), "--samples", str(sfile)]) == 2
    assert "not an x86-64" in capsys.readouterr().err
    assert main(["analyze", str(c.build.stripped), "--samples", str(tmp_path / "none")]) == 2
    assert "cannot read samples" in capsys.readouterr().err


def test_analyze_uses_the_service_settings():
    """`dbr analyze` selects with what the service would use on as many samples (it
    used the pipeline's own defaults: half the service's discovery reach, a quarter of
    its loop trip count), and -o still overrides a key."""
    from dbr_service.common.config import Config
    from dbr_service.region import pipeline
    from dbr_service.region.analyze import _load_config
    from dbr_service.region.worker import region_config

    cfg, want = _load_config([], pipeline, 1000), region_config(Config(), 1000)
    for key in ("jumps_from_hot_limit", "hot_threshold", "min_loop_trip_count",
                "min_region_size", "inline_budget"):
        assert getattr(cfg, key) == getattr(want, key), key
    assert cfg.jumps_from_hot_limit == Config().jumps_from_hot_limit
    assert cfg.keep_stages
    assert _load_config(["jumps_from_hot_limit=3"], pipeline, 1000).jumps_from_hot_limit == 3
    from dbr_service.common.errors import ConfigError
    with pytest.raises(ConfigError, match="unknown configuration key"):
        _load_config(["no_such_key=1"], pipeline, 1000)


# ---------------------------------------------------------------------------
# End to end: discovery, then the rest of the pipeline (run_pipeline)
# ---------------------------------------------------------------------------

try:
    from dbr_service.region import pipeline as _pipeline
except ImportError:          # written by another engineer; may not exist yet
    _pipeline = None

needs_pipeline = pytest.mark.skipif(
    _pipeline is None, reason="dbr_service.region.pipeline (run_pipeline) is not available yet")


def _regions(c: Case, *, full_profile: bool):
    """Pipeline regions from samples (periodic, or every executed instruction) plus
    exact branch samples, as an LBR-capable host would give."""
    samples = dict(c.truth.executed) if full_profile else c.truth.samples
    sr = hot_code_discovery(samples, c.mem, branch_samples=c.truth.branch_samples())
    res = _pipeline.run_pipeline(sr, c.mem, _pipeline.RegionConfig())
    assert not res.failures, res.failures
    return res.regions


def _orig(k) -> int:
    return k.start if isinstance(k, CloneKey) else k


def _loops(sr: SuperRegion) -> list[set]:
    body = sr.g.subgraph(sr.body_nodes())
    return [scc for scc in nx.strongly_connected_components(body)
            if len(scc) > 1 or any(body.has_edge(n, n) for n in scc)]


@needs_pipeline
@pytest.mark.parametrize("key", ["loops-O2", "loops-O3", "switch-O2", "switch-O0-pie",
                                 "e2e-O0", "e2e-O2", "e2e-O3"])
def test_pipeline_patch_points_and_loops(builds, key):
    c = _case(builds, key)
    t = c.truth
    regions = _regions(c, full_profile=key.startswith("e2e"))
    assert regions, f"{key}: no region selected"
    backward_targets = {b for (a, b) in t.transitions if b <= a and t.func_at(a) == t.func_at(b)}
    for sr in regions:
        sr.verify()
        points = sr.entry_points()
        assert points
        for v, _ in sr.entry_edges():
            assert not isinstance(v, CloneKey), f"{key}: patch point in an inlined clone"
            bb = sr.block(v)
            assert not bb.unpatchable and bb.known_exec
            assert bb.insns[0][1] >= 5, f"{key}: patch at {v:#x} is shorter than 5 bytes"
            assert v in t.boundaries and t.executed[v] > 0     # a real, executed instruction
        idom = nx.immediate_dominators(sr.g, START)

        def dominated_by(n, p, idom=idom) -> bool:
            while n != START:
                if n == p:
                    return True
                n = idom[n]
            return False
        loops = _loops(sr)
        assert loops, f"{key}: region {sr.id} has no loop"
        for loop in loops:
            # a real loop: it holds the target of a taken backward jump seen in the profile
            assert {_orig(n) for n in loop} & backward_targets, f"{key}: {sr.id} fake loop"
            # covered by a patch point inside it or dominating all of it
            assert any(p in loop or all(dominated_by(n, p) for n in loop) for p in points), \
                f"{key}: loop {sorted(map(str, loop))} not covered by {points}"


def _expected_patch(t: Truth, func: str) -> int:
    """Ground truth: the outermost executed instruction of >= 5 bytes (not a call)
    that dominates the function's outermost loop, from a linear disassembly."""
    lo, hi = t.funcs[func]
    g = nx.DiGraph()
    for a in sorted(x for x in t.insn if lo <= x < hi):
        ins = t.insn[a]
        g.add_node(a)
        tgt = None
        if ins.group(capstone.CS_GRP_JUMP) and ins.operands[0].type == capstone.x86.X86_OP_IMM:
            tgt = ins.operands[0].imm
            if lo <= tgt < hi:
                g.add_edge(a, tgt)
        if ins.mnemonic != "jmp" and not ins.group(capstone.CS_GRP_RET):
            g.add_edge(a, a + ins.size)
    dom = nx.immediate_dominators(g, lo)
    headers = [b for a, b in g.edges if b <= a]
    outer = min(headers, key=lambda h: _depth(dom, h, lo))
    chain = []
    n = outer
    while True:
        chain.append(n)
        if n == lo:
            break
        n = dom[n]
    for a in reversed(chain):            # from the function entry towards the loop
        ins = t.insn[a]
        if ins.size >= 5 and t.executed[a] > 0 and not ins.group(capstone.CS_GRP_CALL):
            return a
    raise AssertionError(f"no patchable dominator of {func}'s loop")


def _depth(dom, n, root) -> int:
    d = 0
    while n != root:
        n, d = dom[n], d + 1
    return d


@needs_pipeline
@pytest.mark.parametrize("key", ["e2e-O0", "e2e-O2", "e2e-O3"])
def test_pipeline_minimal_patch_points_exact(builds, key):
    """One loop nest per function, everything sampled: exactly one patch point per
    function, as far out as possible (the outermost >= 5-byte dominator of its loops)."""
    c = _case(builds, key)
    t = c.truth
    regions = _regions(c, full_profile=True)
    for func in ("single", "nest2"):
        lo, hi = t.funcs[func]
        mine = [sr for sr in regions if any(lo <= _orig(k) < hi for k in sr.body_nodes())]
        assert len(mine) == 1, f"{key}: {func} in {len(mine)} regions"
        assert mine[0].entry_points() == [_expected_patch(t, func)], \
            f"{key}: {func} patch points {[hex(p) for p in mine[0].entry_points()]}"
    if key != "e2e-O0":
        lo, hi = t.funcs["nest2"]
        nest = next(sr for sr in regions if any(lo <= _orig(k) < hi for k in sr.body_nodes()))
        assert len(_loops(nest)) == 1                # the outer SCC holds the inner loop


def test_instructions_codegen_cannot_relocate_are_unsupported():
    """Discovery stops before what the relocator refuses, so regions exit there."""
    import capstone

    from dbr_service.region.decode import InsnKind, _classify

    md = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    md.detail = True

    def kind(code: bytes) -> InsnKind:
        return _classify(next(md.disasm(code, 0x401000))).kind

    assert kind(bytes.fromhex("ff28")) is InsnKind.UNSUPPORTED          # jmp far [rax]
    assert kind(bytes.fromhex("ff18")) is InsnKind.UNSUPPORTED          # call far [rax]
    assert kind(bytes.fromhex("67488b0510000000")) is InsnKind.UNSUPPORTED  # mov rax,[eip+16]
    assert kind(bytes.fromhex("ff542408")) is InsnKind.UNSUPPORTED      # call [rsp+8]
    assert kind(bytes.fromhex("488b0510000000")) is InsnKind.PLAIN      # mov rax,[rip+16]
    assert kind(bytes.fromhex("ffe0")) is InsnKind.IJMP                 # jmp rax


def test_jump_table_with_base_hoisted_out_of_the_loop(tmp_path):
    """gcc -O2 -fPIE hoists the table base (`lea r8,[rip+T]`) out of an interpreter
    loop, into code discovery never reaches; the base is then guessed from the
    bytes before the loop and believed only with a sampled target as evidence."""
    import subprocess

    from dbr_service.region.discovery import hot_code_discovery
    from dbr_service.region.model import TermKind

    src = Path(__file__).parent.parent / "e2e_progs" / "interp.c"
    full, stripped = tmp_path / "interp", tmp_path / "interp.s"
    subprocess.run(["gcc", "-O2", "-fPIE", "-pie", "-o", str(full), str(src)], check=True)
    subprocess.run(["strip", "-o", str(stripped), str(full)], check=True)
    elf = lief.ELF.parse(str(full))   # keep it alive while its symbols are used
    run = next(s for s in elf.symbols if s.name.split(".")[0] == "run")  # run.constprop.0
    md = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    base = 0x555555554000
    mem = ElfMemoryView(str(stripped), base=base)
    code = mem.read(base + run.value, run.size)
    samples = {i.address: 1.0 for i in md.disasm(code, base + run.value)}
    sr = hot_code_discovery(samples, mem)
    ijmps = [bb for _, bb in sr.blocks() if bb.term == TermKind.IJMP
             and run.value <= bb.start - base < run.value + run.size]
    assert len(ijmps) == 1
    assert len(set(ijmps[0].targets)) >= 8 and not ijmps[0].unknown_target
    assert all(run.value <= t - base < run.value + run.size for t in ijmps[0].targets)
    # the table base rides along, and code generation can translate the dispatch
    # (the jmp has a block of its own; the add before it ends its only predecessor)
    from dbr_service.codegen.dispatch import region_dispatch_plan
    rodata = next(s for s in elf.sections if s.name == ".rodata")
    assert ijmps[0].table_base is not None
    assert rodata.virtual_address <= ijmps[0].table_base - base < \
        rodata.virtual_address + rodata.size
    plan = region_dispatch_plan(sr, ijmps[0].start)
    assert plan is not None and plan.split and plan.base == ijmps[0].table_base
    assert set(plan.targets) == set(ijmps[0].targets)
    # Without evidence (no sampled case block) the guess is not believed.
    head = {a: n for a, n in samples.items()
            if ijmps[0].start - 32 <= a <= ijmps[0].start and a not in ijmps[0].targets}
    sr2 = hot_code_discovery(head, mem, jumps_from_hot_limit=1)
    [ij] = [bb for _, bb in sr2.blocks() if bb.start == ijmps[0].start]
    assert ij.unknown_target


@pytest.mark.parametrize("path", ["/lib/x86_64-linux-gnu/libc.so.6", "/usr/bin/gzip"])
def test_elf_got_names_agree_with_lief(path):
    """The live view's small ELF reader names the same GOT slots as lief."""
    import os

    from dbr_service.region.memview import elf_got_names

    if not os.path.exists(path):
        pytest.skip(f"{path} not on this machine")
    elf = lief.ELF.parse(path)
    want = {r.address: r.symbol.name for r in list(elf.pltgot_relocations)
            + list(elf.dynamic_relocations) if r.symbol is not None and r.symbol.name}
    assert elf_got_names(path) == want
