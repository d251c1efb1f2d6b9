"""What the profile store keeps of a module, its JSON form, and the conversion of a
session's samples and regions into it.

Everything is in *module offsets*: an address minus the module's lowest mapped byte
(``procmaps.module_base``), the same offsets ``symbols.SymbolTable.at_offset`` names.
They hold across runs (ASLR moves only the base) for the same file.

Every value that comes from outside (an imported file, a damaged store) goes through
:func:`profile_from_json`, which checks types, ranges and sizes and raises
ProfileDataError naming what is wrong; the limits below bound what one module may
hold, so a hostile import cannot exhaust memory or the disk.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dbr_service.common.errors import DbrError
from dbr_service.profiles.modkey import MAX_BUILD_ID, valid_key
from dbr_service.common.procmaps import MapEntry, find_mapping, module_base

if TYPE_CHECKING:  # pragma: no cover
    from dbr_service.session.session_regions import RegionRecord

#: Sample counts kept per module (the lowest are dropped beyond it).
MAX_OFFSETS = 65536
#: Edge counts kept per module.
MAX_EDGES = 65536
#: Hot-text regions per module, entry sites and block ranges per region.
MAX_REGIONS = 256
MAX_REGION_ENTRIES = 64
MAX_REGION_BLOCKS = 4096
#: Original bytes kept per entry site (a patch writes 5; the agent's records hold 8).
MAX_SITE_BYTES = 16
#: Selection parameters per region, and the length of one string value.
MAX_PARAMS = 32
MAX_PARAM_TEXT = 256
#: Offsets are below this (a module is never larger).
MAX_OFFSET = 1 << 40
#: A count above this is no sample count.
MAX_COUNT = 1e15
MAX_PATH = 4096


class ProfileDataError(DbrError):
    """Profile data (an import, a stored row) is malformed or beyond the limits."""


@dataclass(frozen=True)
class EntrySite:
    """A patch site of a hot region: where a warm start would patch, and the bytes
    that must be there (compared with the live bytes before patching)."""

    offset: int
    orig: bytes


@dataclass
class HotRegion:
    """A region selected in a run: its entry sites, the original code it copies
    ([lo, hi) module-offset ranges), and the selection parameters it was made with."""

    entries: list[EntrySite]
    blocks: list[tuple[int, int]]
    params: dict[str, Any] = field(default_factory=dict)


@dataclass
class ModuleProfile:
    """A module's stored profile."""

    key: str
    path: str
    build_id: str
    #: Runs merged into it.
    runs: int
    first_seen: float
    last_seen: float
    #: Module offset -> samples (decayed: see profilestore).
    counts: dict[int, float]
    #: (from, to) module offsets -> taken-branch count.
    edges: dict[tuple[int, int], float]
    #: The last selected hot text.
    hot_text: list[HotRegion]

    def top(self, n: int) -> list[tuple[int, float]]:
        """The ``n`` hottest offsets, hottest first (ties by offset)."""
        return sorted(self.counts.items(), key=lambda kv: (-kv[1], kv[0]))[:n]


# ------------------------------------------------------------------------------ checks
def _bad(where: str, why: str) -> ProfileDataError:
    return ProfileDataError(f"{where}: {why}")


def check_int(v: object, where: str, lo: int = 0, hi: int = MAX_OFFSET) -> int:
    if type(v) is not int or not lo <= v < hi:
        raise _bad(where, f"{v!r} is not an integer in [{lo}, {hi})")
    return v


def check_count(v: object, where: str) -> float:
    if type(v) not in (int, float) or not math.isfinite(v) or not 0 <= v <= MAX_COUNT:
        raise _bad(where, f"{v!r} is not a count in [0, {MAX_COUNT:g}]")
    return float(v)


def check_text(v: object, where: str, limit: int = MAX_PATH) -> str:
    if not isinstance(v, str) or len(v) > limit or "\0" in v:
        raise _bad(where, f"not a string of at most {limit} characters without NUL")
    return v


def check_time(v: object, where: str) -> float:
    if type(v) not in (int, float) or not math.isfinite(v) or not 0 <= v < 1e11:
        raise _bad(where, f"{v!r} is not a time in seconds since 1970")
    return float(v)


def check_counts(counts: Mapping[int, float], where: str) -> dict[int, float]:
    if len(counts) > MAX_OFFSETS:
        raise _bad(where, f"{len(counts)} offsets, more than {MAX_OFFSETS}")
    return {check_int(o, f"{where} offset"): check_count(c, f"{where}[{o}]")
            for o, c in counts.items()}


def check_edges(edges: Mapping[tuple[int, int], float], where: str
                ) -> dict[tuple[int, int], float]:
    if len(edges) > MAX_EDGES:
        raise _bad(where, f"{len(edges)} edges, more than {MAX_EDGES}")
    out = {}
    for k, c in edges.items():
        if not isinstance(k, tuple) or len(k) != 2:
            raise _bad(where, f"{k!r} is not a (from, to) pair")
        out[(check_int(k[0], f"{where} from"), check_int(k[1], f"{where} to"))] = \
            check_count(c, f"{where}[{k}]")
    return out


def check_hot_text(regions: Iterable[HotRegion], where: str) -> list[HotRegion]:
    regions = list(regions)
    if len(regions) > MAX_REGIONS:
        raise _bad(where, f"{len(regions)} regions, more than {MAX_REGIONS}")
    for i, r in enumerate(regions):
        w = f"{where}[{i}]"
        if not isinstance(r, HotRegion):
            raise _bad(w, "not a HotRegion")
        if len(r.entries) > MAX_REGION_ENTRIES or len(r.blocks) > MAX_REGION_BLOCKS:
            raise _bad(w, f"more than {MAX_REGION_ENTRIES} entries or "
                          f"{MAX_REGION_BLOCKS} blocks")
        for e in r.entries:
            check_int(e.offset, f"{w} entry")
            if not isinstance(e.orig, bytes) or not 1 <= len(e.orig) <= MAX_SITE_BYTES:
                raise _bad(w, f"entry {e.offset:#x}: original bytes must be 1 to "
                              f"{MAX_SITE_BYTES} bytes")
        for lo, hi in r.blocks:
            check_int(lo, f"{w} block")
            check_int(hi, f"{w} block")
            if hi <= lo:
                raise _bad(w, f"block [{lo:#x}, {hi:#x}) is empty")
        _check_params(r.params, f"{w} params")
    return regions


def _check_params(params: object, where: str) -> dict[str, Any]:
    if not isinstance(params, dict) or len(params) > MAX_PARAMS:
        raise _bad(where, f"not an object of at most {MAX_PARAMS} keys")
    for k, v in params.items():
        check_text(k, where, 64)
        if v is not None and type(v) not in (bool, int, float, str):
            raise _bad(where, f"{k}: {v!r} is not a number, boolean, string or null")
        if isinstance(v, str):
            check_text(v, f"{where}.{k}", MAX_PARAM_TEXT)
        if isinstance(v, float) and not math.isfinite(v):
            raise _bad(where, f"{k}: {v!r} is not finite")
    return params


# ------------------------------------------------------------------------------ JSON
def hot_text_to_json(regions: Iterable[HotRegion]) -> list[dict[str, Any]]:
    return [{"entries": [{"offset": e.offset, "orig": e.orig.hex()} for e in r.entries],
             "blocks": [[lo, hi] for lo, hi in r.blocks], "params": dict(r.params)}
            for r in regions]


def hot_text_from_json(doc: object, where: str) -> list[HotRegion]:
    if not isinstance(doc, list):
        raise _bad(where, "not a list")
    if len(doc) > MAX_REGIONS:
        raise _bad(where, f"{len(doc)} regions, more than {MAX_REGIONS}")
    out = []
    for i, r in enumerate(doc):
        w = f"{where}[{i}]"
        if not isinstance(r, dict) or not isinstance(r.get("entries"), list) \
                or not isinstance(r.get("blocks"), list):
            raise _bad(w, "not an object with lists 'entries' and 'blocks'")
        if len(r["entries"]) > MAX_REGION_ENTRIES or len(r["blocks"]) > MAX_REGION_BLOCKS:
            raise _bad(w, f"more than {MAX_REGION_ENTRIES} entries or "
                          f"{MAX_REGION_BLOCKS} blocks")
        entries = []
        for e in r["entries"]:
            if not isinstance(e, dict):
                raise _bad(w, "an entry is not an object")
            orig = check_text(e.get("orig"), f"{w} orig", 2 * MAX_SITE_BYTES)
            try:
                raw = bytes.fromhex(orig)
            except ValueError:
                raise _bad(w, f"orig {orig!r} is not hex") from None
            entries.append(EntrySite(check_int(e.get("offset"), f"{w} entry offset"), raw))
        blocks = []
        for b in r["blocks"]:
            if not isinstance(b, list) or len(b) != 2:
                raise _bad(w, "a block is not a [lo, hi] pair")
            blocks.append((b[0], b[1]))
        out.append(HotRegion(entries, blocks, r.get("params", {})))
    return check_hot_text(out, where)


def profile_to_json(p: ModuleProfile) -> dict[str, Any]:
    return {"key": p.key, "path": p.path, "build_id": p.build_id, "runs": p.runs,
            "first_seen": p.first_seen, "last_seen": p.last_seen,
            "counts": [[o, c] for o, c in sorted(p.counts.items())],
            "edges": [[s, d, c] for (s, d), c in sorted(p.edges.items())],
            "hot_text": hot_text_to_json(p.hot_text)}


def profile_from_json(doc: object, where: str = "module") -> ModuleProfile:
    """A ModuleProfile from its JSON form, every field checked (ProfileDataError)."""
    if not isinstance(doc, dict):
        raise _bad(where, "not an object")
    key = doc.get("key")
    if not valid_key(key):
        raise _bad(where, f"key {key!r} is neither a build id in hex nor path-<32 hex>")
    where = f"module {key}"
    build_id = check_text(doc.get("build_id", ""), f"{where} build_id", 2 * MAX_BUILD_ID)
    if build_id and build_id != key:
        raise _bad(where, f"build_id {build_id!r} is not its key")
    counts, edges = doc.get("counts", []), doc.get("edges", [])
    if not isinstance(counts, list) or len(counts) > MAX_OFFSETS:
        raise _bad(where, f"counts: not a list of at most {MAX_OFFSETS} pairs")
    if not isinstance(edges, list) or len(edges) > MAX_EDGES:
        raise _bad(where, f"edges: not a list of at most {MAX_EDGES} triples")
    cdict: dict[int, float] = {}
    for c in counts:
        if not isinstance(c, list) or len(c) != 2:
            raise _bad(where, "counts: an entry is not an [offset, count] pair")
        off = check_int(c[0], f"{where} counts offset")
        cdict[off] = cdict.get(off, 0.0) + check_count(c[1], f"{where} counts[{off}]")
    edict: dict[tuple[int, int], float] = {}
    for e in edges:
        if not isinstance(e, list) or len(e) != 3:
            raise _bad(where, "edges: an entry is not a [from, to, count] triple")
        k = (check_int(e[0], f"{where} edge from"), check_int(e[1], f"{where} edge to"))
        edict[k] = edict.get(k, 0.0) + check_count(e[2], f"{where} edge")
    first = check_time(doc.get("first_seen", doc.get("last_seen")), f"{where} first_seen")
    last = check_time(doc.get("last_seen"), f"{where} last_seen")
    return ModuleProfile(key=key, path=check_text(doc.get("path", ""), f"{where} path"),
                         build_id=build_id,
                         runs=check_int(doc.get("runs", 1), f"{where} runs", 1, 1 << 40),
                         first_seen=min(first, last), last_seen=last, counts=cdict,
                         edges=edict,
                         hot_text=hot_text_from_json(doc.get("hot_text", []),
                                                     f"{where} hot_text"))


#: The ``format`` of a JSON export.
EXPORT_FORMAT = "dbr.profiles/1"
#: Modules one import may hold.
MAX_IMPORT_MODULES = 100_000


def profiles_to_doc(profiles: Iterable[ModuleProfile], now: float) -> dict[str, Any]:
    """A JSON export (``dbr profile export --format json``) of ``profiles``."""
    return {"format": EXPORT_FORMAT, "exported_at": now,
            "modules": [profile_to_json(p) for p in profiles]}


def profiles_from_doc(doc: object) -> list[ModuleProfile]:
    """The profiles of a JSON export, every one checked (ProfileDataError)."""
    if not isinstance(doc, dict) or doc.get("format") != EXPORT_FORMAT:
        raise ProfileDataError(f"not a dbr profile export (format {EXPORT_FORMAT!r})")
    mods = doc.get("modules")
    if not isinstance(mods, list) or len(mods) > MAX_IMPORT_MODULES:
        raise ProfileDataError(f"modules: not a list of at most {MAX_IMPORT_MODULES}")
    return [profile_from_json(m, f"modules[{i}]") for i, m in enumerate(mods)]


# ------------------------------------------------------------------------------ conversion
def _module_of(maps: list[MapEntry], addr: int) -> MapEntry | None:
    """The executable file mapping holding ``addr``, or None (anonymous memory, a
    code buffer, [vdso], a deleted file)."""
    m = find_mapping(maps, addr)
    if m is None or not m.executable or not m.path.startswith("/") or \
            m.path.endswith(" (deleted)"):
        return None
    return m


def module_counts(ip_counts: Mapping[int, int], maps: list[MapEntry]
                  ) -> dict[str, dict[int, int]]:
    """A client's samples by address (``SampleAggregator.ips[pid]``,
    ``ClientSession.ip_counts``, ``selection_input()``) as module path -> module
    offset -> samples, for the client's ``maps`` (``procmaps.read_maps``).  Samples
    outside executable file mappings are left out."""
    out: dict[str, dict[int, int]] = {}
    bases: dict[str, int] = {}
    for ip, n in ip_counts.items():
        m = _module_of(maps, ip)
        if m is None or n <= 0:
            continue
        base = bases.setdefault(m.path, module_base(maps, m.path))
        per = out.setdefault(m.path, {})
        per[ip - base] = per.get(ip - base, 0) + n
    return out


def module_edges(branches: Mapping[int, Mapping[int, int]], maps: list[MapEntry]
                 ) -> dict[str, dict[tuple[int, int], int]]:
    """Taken-branch counts (``SampleAggregator.branch_counts(pid)``: {from: {to: n}})
    as module path -> (from, to) module offsets -> count; only branches within one
    module are kept."""
    out: dict[str, dict[tuple[int, int], int]] = {}
    bases: dict[str, int] = {}
    for src, dsts in branches.items():
        m = _module_of(maps, src)
        if m is None:
            continue
        base = bases.setdefault(m.path, module_base(maps, m.path))
        for dst, n in dsts.items():
            d = _module_of(maps, dst)
            if d is None or d.path != m.path or n <= 0:
                continue
            per = out.setdefault(m.path, {})
            k = (src - base, dst - base)
            per[k] = per.get(k, 0) + n
    return out


#: The service's configuration keys that decide what region selection selects.
SELECTION_KEYS = ("jumps_from_hot_limit", "hot_threshold", "min_loop_trip_count",
                  "hot_function_threshold", "min_region_size", "inline", "inline_budget",
                  "real_calls", "transfer", "entry_sites")


def selection_params(cfg: Any) -> dict[str, Any]:
    """The selection parameters of the service Config ``cfg`` a hot region records."""
    return {k: getattr(cfg, k) for k in SELECTION_KEYS}


def module_hot_text(records: Iterable[RegionRecord], maps: list[MapEntry],
                    params: Mapping[str, Any]) -> dict[str, list[HotRegion]]:
    """The hot text of a client's regions (``RegionBook.regions.values()``) as
    module path -> regions, for its ``maps``.  Only regions with patched sites count
    (their ``sites`` hold the original bytes the agent verified); their blocks are
    their ``orig_ranges``.  ``params``: :func:`selection_params` of the service's
    configuration."""
    out: dict[str, list[HotRegion]] = {}
    for rec in records:
        if not rec.sites or not rec.module.startswith("/"):
            continue
        base = module_base(maps, rec.module)
        spans = [(m.lo, m.hi) for m in maps if m.path == rec.module]
        if not spans:
            continue
        # a region that also copies another module's code (a tail jump into a
        # library) is not the module's alone: left out, not stored as bad offsets
        if not all(any(a <= lo and hi <= b for a, b in spans) for lo, hi in rec.orig_ranges):
            continue
        entries = [EntrySite(s.site - base, bytes(s.orig[:max(1, min(s.len, 8))]))
                   for s in rec.sites]
        blocks = [(lo - base, hi - base) for lo, hi in rec.orig_ranges]
        if any(e.offset < 0 for e in entries) or any(lo < 0 for lo, _ in blocks):
            continue
        regions = out.setdefault(rec.module, [])
        if len(regions) < MAX_REGIONS:
            regions.append(HotRegion(entries[:MAX_REGION_ENTRIES],
                                     blocks[:MAX_REGION_BLOCKS], dict(params)))
    return out
