"""Selection results moved to another process of the same program.

A worker's result (super-regions, their tables, call sites, hot spots) names code by
run-time address.  Another process of the same program maps the same files elsewhere
(ASLR), so :func:`rebase` rewrites every address in such an object: an integer that
lies in a file mapping of the old process becomes the same offset of the same file in
the new one.  The rule is total and mechanical, so nothing is missed by a list of
fields:

* every integer of the object graph (attributes, dict keys and values, tuples,
  lists, sets, named tuples, networkx graphs' nodes, edges and their data) is looked
  up in the old map;
* in a file mapping whose file the new process maps too: moved by that file's
  displacement;
* in no mapping but within a rel32's reach of a file mapping (a target decoded from
  bytes that are not code): moved with the nearest such file;
* below 4 GiB or far from every file: kept (counts, sizes, offsets, indices; a
  non-PIE program below 4 GiB is mapped at its link address in every process);
* in any other mapping (heap, stack, anonymous or JIT code, a file the new process
  does not map): :class:`NoRebase`, and the caller selects anew.

Floats, strings, bytes (instruction bytes are the file's, the same in both
processes), enums and objects whose class says ``REBASE_AS_IS`` (code kept ahead,
installation/keptcode.py, which is moved when it is placed) are kept as they are.
Sharing is preserved (a memo, as ``copy.deepcopy`` keeps one), so graphs whose dicts
share structure stay consistent.
"""

from __future__ import annotations

import bisect
import copy
import enum
from typing import Any

import networkx as nx

from dbr_service.common.procmaps import MapEntry, module_base


class NoRebase(Exception):
    """The object names memory that has no counterpart in the new process."""


class _Mover:
    def __init__(self, old: list[MapEntry], new: list[MapEntry]) -> None:
        self.maps = sorted(old, key=lambda m: m.lo)
        self.los = [m.lo for m in self.maps]
        new_paths = {m.path for m in new if _a_file(m)}
        self.delta: dict[str, int] = {}
        for m in self.maps:
            if _a_file(m) and m.path in new_paths and m.path not in self.delta:
                self.delta[m.path] = module_base(new, m.path) - module_base(old, m.path)
        self.memo: dict[int, Any] = {}

    def addr(self, x: int) -> int:
        i = bisect.bisect_right(self.los, x) - 1
        if i < 0 or x >= self.maps[i].hi:
            return self._unmapped(x, i)
        d = self.delta.get(self.maps[i].path)
        if d is None:
            raise NoRebase(f"{x:#x} lies in {self.maps[i].path or 'anonymous memory'}, "
                           "which the new process does not map alike")
        return x + d

    def _unmapped(self, x: int, i: int) -> int:
        """An address in no mapping: one a rel32 could reach from a file mapping (a
        branch target decoded from bytes that are not code) moves with the nearest
        file; anything else is no address of this process's code and stays."""
        if x < 1 << 32:
            return x
        near = [m for m in self.maps[max(i, 0):i + 2] if _a_file(m)]
        if not near:
            return x
        m = min(near, key=lambda m: min(abs(x - m.lo), abs(x - m.hi)))
        if min(abs(x - m.lo), abs(x - m.hi)) > 1 << 31:
            return x
        d = self.delta.get(m.path)
        if d is None:
            raise NoRebase(f"{x:#x} lies beside {m.path}, which the new process does not map")
        return x + d

    def move(self, obj: Any) -> Any:
        if isinstance(obj, bool) or obj is None or isinstance(obj, (float, str, bytes,
                                                                     enum.Enum)):
            return obj
        if isinstance(obj, int):
            return self.addr(obj)
        if getattr(type(obj), "REBASE_AS_IS", False):
            return obj        # moved when it is used (installation/keptcode.py)
        key = id(obj)
        if key in self.memo:
            return self.memo[key]
        if isinstance(obj, tuple):
            items = [self.move(x) for x in obj]
            out = type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
        elif isinstance(obj, list):
            out = []
            self.memo[key] = out
            out.extend(self.move(x) for x in obj)
            return out
        elif isinstance(obj, dict):
            out = type(obj)() if type(obj) is not dict else {}
            self.memo[key] = out
            for k, v in obj.items():
                out[self.move(k)] = self.move(v)
            return out
        elif isinstance(obj, (set, frozenset)):
            out = type(obj)(self.move(x) for x in obj)
        elif isinstance(obj, bytearray):
            out = bytearray(obj)
        elif isinstance(obj, nx.Graph):
            # rebuilt from its nodes and edges: its cached views hold bound methods
            out = type(obj)()
            self.memo[key] = out
            out.graph.update(self.move(obj.graph))
            out.add_nodes_from((self.move(n), self.move(d)) for n, d in obj.nodes(data=True))
            out.add_edges_from((self.move(u), self.move(v), self.move(d))
                               for u, v, d in obj.edges(data=True))
            return out
        elif hasattr(obj, "__dict__") or hasattr(type(obj), "__slots__"):
            out = copy.copy(obj)
            self.memo[key] = out
            for name in _attributes(obj):
                object.__setattr__(out, name, self.move(getattr(obj, name)))
            return out
        else:
            raise NoRebase(f"cannot move a {type(obj).__name__}: {obj!r:.80}")
        self.memo[key] = out
        return out


def _a_file(m: MapEntry) -> bool:
    """A mapping of a file both processes can map alike (not a memfd, e.g. a code
    buffer, nor a file deleted since)."""
    return m.path.startswith("/") and bool(m.ino) and not m.path.startswith("/memfd:") \
        and not m.path.endswith(" (deleted)")


def _attributes(obj: Any) -> list[str]:
    names = list(getattr(obj, "__dict__", {}))
    for cls in type(obj).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for s in (slots,) if isinstance(slots, str) else slots:
            if s not in ("__dict__", "__weakref__") and hasattr(obj, s):
                names.append(s)
    return names


def rebase(obj: Any, old: list[MapEntry], new: list[MapEntry]) -> Any:
    """A copy of ``obj`` with every address of the process mapped as ``old`` moved to
    where the process mapped as ``new`` has the same file byte; NoRebase if one cannot
    be (see the module's docstring)."""
    return _Mover(old, new).move(obj)
