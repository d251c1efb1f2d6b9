"""Selection results moved between processes of one program (dbr_service/profiles/rebase.py)."""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass

import networkx as nx
import pytest
from harness import compile_c

from dbr_service.common.procmaps import MapEntry, module_base, read_maps
from dbr_service.profiles.rebase import NoRebase, rebase
from dbr_service.region.model import CloneKey

OLD = [MapEntry(0x5555_5555_4000, 0x5555_5555_5000, "r--p", 0, "/bin/prog", (8, 1), 7),
       MapEntry(0x5555_5555_5000, 0x5555_5555_9000, "r-xp", 0x1000, "/bin/prog", (8, 1), 7),
       MapEntry(0x5555_5556_0000, 0x5555_5558_0000, "rw-p", 0, "[heap]", (0, 0), 0),
       MapEntry(0x7f00_0000_0000, 0x7f00_0010_0000, "r-xp", 0, "/lib/libc.so", (8, 1), 9)]
D_PROG, D_LIBC = 0x1111_0000, -0x100_0000_0000


def _new() -> list[MapEntry]:
    return [m._replace(lo=m.lo + (D_PROG if m.path == "/bin/prog" else D_LIBC),
                       hi=m.hi + (D_PROG if m.path == "/bin/prog" else D_LIBC))
            for m in OLD if m.path != "[heap]"]


@dataclass(frozen=True)
class Site:
    addr: int
    raw: bytes


def test_every_address_moves_by_its_files_displacement_and_sharing_is_kept():
    a, b, call = 0x5555_5555_5010, 0x5555_5555_5020, 0x7f00_0000_0040
    g = nx.DiGraph()
    g.add_node(a, size=16)
    g.add_node(CloneKey((a,), b), size=8)
    g.add_edge(a, CloneKey((a,), b), exits={call: 2.5}, count=3.0)
    shared = [a]
    obj = {"g": g, "sites": (Site(b, b"\xe9\0\0\0\0"),), "again": shared, "same": shared,
           "small": [0, 5, 4096, -1], "name": "0x5555", "ratio": 0.5, "flag": True}
    out = rebase(obj, OLD, _new())
    assert set(out["g"].nodes) == {a + D_PROG, CloneKey((a + D_PROG,), b + D_PROG)}
    assert out["g"].edges[a + D_PROG, CloneKey((a + D_PROG,), b + D_PROG)]["exits"] == \
        {call + D_LIBC: 2.5}
    assert list(out["g"].successors(a + D_PROG)) == [CloneKey((a + D_PROG,), b + D_PROG)]
    assert out["sites"] == (Site(b + D_PROG, b"\xe9\0\0\0\0"),)
    assert out["again"] is out["same"] and out["again"] == [a + D_PROG]
    assert out["small"] == [0, 5, 4096, -1] and out["flag"] is True
    assert (out["name"], out["ratio"]) == ("0x5555", 0.5)
    assert g.has_node(a) and not g.has_node(a + D_PROG)      # the original is untouched


def test_memory_without_a_counterpart_is_refused():
    with pytest.raises(NoRebase, match="heap"):
        rebase([0x5555_5556_0010], OLD, _new())
    gone = [m for m in _new() if m.path != "/lib/libc.so"]
    with pytest.raises(NoRebase, match="libc"):
        rebase({"t": 0x7f00_0000_0040}, OLD, gone)


WORK_C = r"""
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
__attribute__((noinline)) unsigned long mix(unsigned long x, long n) {
    for (long i = 0; i < n; i++) {
        x ^= x << 13; x ^= x >> 7;
        x = x * 1103515245UL + 12345; x += (unsigned long)i;
        if ((x & 15) == 3) x += 7;
    }
    return x;
}
int main(void) { unsigned long x = 1; for (;;) { x = mix(x, 1000); if (x == 42) puts(""); } }
"""


def _norm(v, seen=()):
    """``v`` with sets and dicts in sorted order and objects as their fields (an object
    met again inside itself, a parent link, as its type), so that equal contents have
    equal reprs."""
    if isinstance(v, (set, frozenset)):
        return sorted((_norm(x, seen) for x in v), key=repr)
    if isinstance(v, dict):
        return sorted(((_norm(k, seen), _norm(x, seen)) for k, x in v.items()), key=repr)
    if isinstance(v, (list, tuple)):
        return [_norm(x, seen) for x in v]
    if hasattr(v, "__dict__") and not isinstance(v, type):
        if id(v) in seen:
            return type(v).__name__
        return (type(v).__name__, _norm(vars(v), (*seen, id(v))))
    return v


def _canon(srs) -> list:
    out = []
    for sr in srs:
        blocks = sorted((repr(k), bb.start, bb.size, tuple(bb.insns), bytes(bb.data),
                         tuple(bb.targets), bb.fallthrough, bb.table_base, bb.term)
                        for k, bb in sr.blocks())
        edges = sorted((repr(u), repr(v), d["kind"], sorted(d.get("exits", {}).items()))
                       for u, v, d in sr.g.edges(data=True))
        info = {k: repr(_norm(v)) for k, v in sr.info.items()}
        assert not any(" at 0x" in v for v in info.values()), info   # comparable by repr
        out.append((blocks, edges, sorted(sr.entry_points()), sorted(info.items())))
    return out


def test_a_selection_moved_to_another_process_is_the_one_selected_there(tmp_path):
    """The pipeline run in two processes of one PIE program (other bases) on the same
    samples: the first one's regions moved to the second equal the second's own."""
    from dbr_service.common.config import Config
    from dbr_service.region.worker import ClientJob, optimize_client

    src = tmp_path / "w.c"
    src.write_text(WORK_C)
    prog = str(compile_c([src], flags=["-O1", "-fPIE", "-pie"], out_name="rebasework"))
    procs = [subprocess.Popen([prog]) for _ in range(2)]
    try:
        time.sleep(0.3)
        maps = [read_maps(p.pid) for p in procs]
        bases = [module_base(m, prog) for m in maps]
        assert bases[0] != bases[1]            # ASLR: the test means something
        from harness import symbols
        lo, hi = symbols(prog)["mix"]
        offsets = {o: 50 for o in range(lo, hi, 4)}
        results = []
        for p, m, base in zip(procs, maps, bases):
            sel = {base + o: n for o, n in offsets.items()}
            job = ClientJob(1, p.pid, prog, sel, sel, m, Config().to_dict())
            res = optimize_client(job)
            assert res.srs, res.region_status
            results.append(res)
        moved = rebase(results[0], maps[0], maps[1])
        assert _canon(moved.srs) == _canon(results[1].srs)
        assert [d["entries"] for d in moved.regions] == \
            [d["entries"] for d in results[1].regions]
    finally:
        for p in procs:
            p.kill()
            p.wait(5)


@dataclass(frozen=True)
class _AsIs:
    """Something that moves itself when it is used (as installation/keptcode.py's
    KeptCode): its addresses stay those of where it was made."""

    REBASE_AS_IS = True
    at: int


def test_an_object_that_says_rebase_as_is_is_kept_as_it_is():
    kept = _AsIs(0x5555_5555_5010)
    moved = rebase({"kept": kept, "at": kept.at}, OLD, _new())
    assert moved["kept"] is kept and moved["at"] == kept.at + D_PROG
