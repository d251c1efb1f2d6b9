"""The fast paths region selection takes on big flat profiles agree with the slow ones.

* region/graphs.py (SCCs, cycles, backward reach, condensation sources/sinks on plain
  adjacency) against networkx on random graphs;
* the decoder's per-bytes instruction templates (region/decode.py): the same bytes at
  another address give the Insn a fresh capstone decode gives (direct targets and
  ``[rip+d]`` literals move with the address, absolute literals do not).
"""

from __future__ import annotations

import random

import networkx as nx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dbr_service.region import decode as D
from dbr_service.region import graphs
from dbr_service.region.memview import MappedRange, MemoryView


@st.composite
def digraphs(draw) -> nx.DiGraph:
    n = draw(st.integers(0, 24))
    g = nx.DiGraph()
    g.add_nodes_from(range(n))
    if n:
        edges = draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)),
                              max_size=3 * n))
        g.add_edges_from(edges)
    return g


def _subset(draw, g) -> set[int]:
    return set(draw(st.lists(st.sampled_from(sorted(g.nodes)), unique=True))) if len(g) else set()


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_sccs_and_cycles_match_networkx(data):
    g = data.draw(digraphs())
    nodes = _subset(data.draw, g)
    sub = g.subgraph(nodes)
    want = {frozenset(c) for c in nx.strongly_connected_components(sub)}
    got = graphs.sccs(g.succ, nodes)
    assert {frozenset(c) for c in got} == want
    assert sum(len(c) for c in got) == len(nodes)          # a partition, nothing twice
    # reverse topological order: no edge from an earlier component into a later one
    pos = {n: i for i, c in enumerate(got) for n in c}
    assert all(pos[u] >= pos[v] for u, v in sub.edges)
    want_cyc = {n for c in want if len(c) > 1 or sub.has_edge(next(iter(c)), next(iter(c)))
                for n in c}
    assert graphs.cyclic_nodes(g.succ, nodes) == want_cyc


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_reaching_matches_descendants(data):
    g = data.draw(digraphs())
    nodes = _subset(data.draw, g)
    targets = _subset(data.draw, g)
    sub = g.subgraph(nodes)
    want = {b for b in nodes
            if b in targets or any(d in targets for d in nx.descendants(sub, b))}
    assert graphs.reaching(g.pred, targets, nodes) == want


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_condensation_ends_match_networkx(data):
    g = data.draw(digraphs())
    nodes = _subset(data.draw, g)
    cond = nx.condensation(g.subgraph(nodes))
    members = lambda c: frozenset(cond.nodes[c]["members"])   # noqa: E731
    sources, sinks = graphs.condensation_ends(g.succ, graphs.sccs(g.succ, nodes))
    assert {frozenset(c) for c in sources} == {members(c) for c in cond if not cond.in_degree(c)}
    assert {frozenset(c) for c in sinks} == {members(c) for c in cond if not cond.out_degree(c)}


def test_sccs_deep_chain_does_not_recurse():
    """Iterative: a 50,000-block chain (a long straight-line function) is fine."""
    g = nx.DiGraph()
    nx.add_path(g, range(50_000))
    g.add_edge(49_999, 0)
    assert graphs.cyclic_nodes(g.succ, set(g)) == set(g)


# ---- discovery templates ------------------------------------------------------------

class _Bytes(MemoryView):
    """Read-only executable bytes at ``base`` (and nothing else)."""

    def __init__(self, base: int, code: bytes) -> None:
        super().__init__()
        self.base, self.code = base, code

    def ranges(self):
        return [MappedRange(self.base, self.base + len(self.code), "r-x", "t")]

    def _read_range(self, rng, addr, n):
        return self.code[addr - self.base: addr - self.base + n]


CASES = {
    "jmp rel32": bytes.fromhex("e9 10 00 00 00"),
    "jmp rel8 back": bytes.fromhex("eb f0"),
    "jcc rel32": bytes.fromhex("0f 85 00 01 00 00"),
    "call rel32": bytes.fromhex("e8 fb ff ff ff"),
    "jmp [rip+d]": bytes.fromhex("ff 25 00 10 00 00"),
    "call [rip+d]": bytes.fromhex("ff 15 f0 ff ff ff"),
    "jmp [abs]": bytes.fromhex("ff 24 25 00 20 40 00"),
    "jmp [rax*8+table]": bytes.fromhex("ff 24 c5 00 20 40 00"),
    "call rax": bytes.fromhex("ff d0"),
    "ret": bytes.fromhex("c3"),
    "ud2": bytes.fromhex("0f 0b"),
    "mov rax, [rip+d]": bytes.fromhex("48 8b 05 00 01 00 00"),
    "lea rdi, [rbp-8]": bytes.fromhex("48 8d 7d f8"),
    "syscall": bytes.fromhex("0f 05"),
    "int 0x80 (unsupported)": bytes.fromhex("cd 80"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_template_hit_equals_fresh_decode(name):
    code = CASES[name]
    addrs = [0x401000, 0x7f0000123456, 0x555555554abc]
    D._TEMPLATES.clear()
    fresh = []
    for a in addrs:                                   # each one decoded from scratch
        D._TEMPLATES.clear()
        fresh.append(D.Decoder(_Bytes(a, code), None).at(a))
    D._TEMPLATES.clear()
    D.Decoder(_Bytes(0x1000, code), None).at(0x1000)   # fills the template
    assert code in D._TEMPLATES
    hits = [D.Decoder(_Bytes(a, code), None).at(a) for a in addrs]
    assert hits == fresh
    assert all(not isinstance(h, str) and h.addr == a for h, a in zip(hits, addrs))


def test_template_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(D, "_KIND_CACHE_MAX", 8)
    D._TEMPLATES.clear()
    r = random.Random(1)
    for i in range(40):       # mov eax, imm32: 40 different instruction byte strings
        code = b"\xb8" + r.randbytes(4) + b"\xc3"
        D.Decoder(_Bytes(0x1000, code), None).at(0x1000)
    assert len(D._TEMPLATES) <= 8
