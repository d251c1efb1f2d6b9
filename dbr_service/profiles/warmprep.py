"""Warm selections: the rule a warm job selects by, and selections made ahead of a
client from a module's file (docs/decisions/0042-warm-selection.md).

* **The rule.**  A stored profile holds a module's samples over whole runs, and its
  hot text the regions those runs installed and kept.  A warm job selects from those
  counts under the thresholds the hot text was made with (WARM_KEYS of its regions'
  ``params``, each checked against the configuration's bounds; the service's own
  where none is recorded); where those select no region with a patch site, it
  selects again under the service's own (``ClientJob.fallback_config``), and where
  that too gives none, without the quick bounds (a full selection).  The
  service's defaults, made for a live window, select nothing in some whole-run
  profiles (zstd's loops run fewer than 16 times an entry; sqlite3's profile is flat),
  and the hot text's, in some others, nothing a client can be patched with.
* **Made ahead.**  :func:`prepare` runs that job on the module's file instead of a
  live process: the ELF mapped at PREP_BASE as the loader would map it
  (region/memview.ElfMemoryView), the file's store key checked before and its
  identity after.  The warm start (profiles/warmstart.py) keeps the result per module
  and moves it to where a client maps the same file (profiles/rebase.py), so that
  the client's first patch waits for no selection.  Its regions are marked
  ``verify_original``: installation compares every byte they copy with the client's
  live code (installation/optimize.py check_original), and the agent checks every
  patch site's bytes.
"""

from __future__ import annotations

import dataclasses
import math
import os
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from dbr_service.common.config import Config
from dbr_service.common.errors import CodegenError, DbrError
from dbr_service.common.procmaps import MapEntry, module_base
from dbr_service.profiles.modkey import ModuleKeyError, module_key
from dbr_service.profiles.profiledata import HotRegion, ModuleProfile
from dbr_service.profiles.rebase import NoRebase, rebase
from dbr_service.region.worker import ClientJob, JobResult, optimize_client

#: The selection thresholds a warm job takes from the hot text it reproduces.
WARM_KEYS = ("jumps_from_hot_limit", "hot_threshold", "min_loop_trip_count",
             "hot_function_threshold", "min_region_size")
#: Where a position-independent module is mapped for a selection made from its file
#: (any address above 4 GiB that no rel32 from below 4 GiB reaches).
PREP_BASE = 0x7E0000000000

_FIELDS = {f.name: f for f in dataclasses.fields(Config)}


def _fits(key: str, value: object) -> bool:
    """Whether a stored parameter is a valid value of the Config field ``key``."""
    f = _FIELDS[key]
    want = int if f.type in (int, "int") else float
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if want is int and not isinstance(value, int):
        return False
    if not math.isfinite(value):
        return False
    lo, hi = f.metadata.get("min"), f.metadata.get("max")
    return (lo is None or value >= lo) and (hi is None or value <= hi)


def warm_settings(config: Mapping[str, Any], hot_text: Iterable[HotRegion]) -> dict[str, Any]:
    """The configuration (a ``Config.to_dict()``) a warm job selects under: the
    service's, with WARM_KEYS as the first hot region that records a valid value
    gives them."""
    out = dict(config)
    regions = list(hot_text)
    for key in WARM_KEYS:
        for r in regions:
            if key in r.params and _fits(key, r.params[key]):
                out[key] = r.params[key]
                break
    return out


@dataclass
class FileJob(ClientJob):
    """A warm job on a module's file (mapped as ``maps`` say) instead of a live process."""

    path: str = ""
    view_base: int | None = None

    def function_entries(self):
        from dbr_service.codegen.frames import CfiSource
        from dbr_service.region.functions import FunctionEntries

        maps = [(m.lo, m.hi, m.path, m.dev, m.ino) for m in self.maps]
        return FunctionEntries(module_at=CfiSource(lambda: maps).module_at)

    def memory_view(self):
        from dbr_service.region.memview import ElfMemoryView

        return ElfMemoryView(self.path, self.view_base)


def _identity(st: os.stat_result) -> tuple:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def file_view(path: str) -> tuple[Any, int | None, list[MapEntry]]:
    """The module file at ``path`` as the loader maps it: its memory view, the base it
    was given (None: not position independent, at its link address) and its
    mappings as /proc/PID/maps would show them.  DbrError or OSError if it cannot be."""
    from dbr_service.region.memview import ElfMemoryView, MemoryViewError

    st = os.stat(path)
    try:
        mem, base = ElfMemoryView(path, PREP_BASE), PREP_BASE
    except MemoryViewError as exc:
        if "not position independent" not in str(exc):
            raise
        mem, base = ElfMemoryView(path, None), None
    ranges = [r for r in mem.ranges() if r.module == mem.path]
    if not ranges:
        raise DbrError(f"{path}: nothing to map")
    anchor = base if base is not None else min(r.start for r in ranges)
    dev = (os.major(st.st_dev), os.minor(st.st_dev))
    maps = [MapEntry(r.start, r.end, r.perms + "p", r.start - anchor, mem.path, dev, st.st_ino)
            for r in sorted(ranges, key=lambda r: r.start)]
    return mem, base, maps


def _trusted(path: str) -> os.stat_result | None:
    """The stat of the file at ``path`` when the service may read it as a module: a
    regular file, no symlink, that it and its directory are owned by root or the
    service's user and writable by no one else (nobody else can put other bytes
    there while it is read); None otherwise."""
    own = (0, os.geteuid())
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    parent = os.stat(os.path.dirname(path) or "/")
    if not stat.S_ISREG(st.st_mode) or any(
            x.st_uid not in own or x.st_mode & 0o022 for x in (st, parent)):
        return None
    return st


def prepare(profile: ModuleProfile, path: str, config: Mapping[str, Any]
            ) -> tuple[list[MapEntry], JobResult] | None:
    """The warm job of a module's stored profile, run on its file at ``path``: (the
    mappings it was selected on, its result), or None when the file is not one the
    service may read (:func:`_trusted`), not the one profiled (store key), changed
    while it was read, or the job found nothing to select from.  DbrError or OSError
    when the file cannot be read as a module."""
    st = _trusted(path)
    if st is None or not profile.hot_text:
        return None
    try:
        if module_key(path).key != profile.key:
            return None
    except ModuleKeyError:
        return None
    _, base, maps = file_view(path)
    after = _trusted(path)
    if after is None or _identity(after) != _identity(st):
        return None                       # replaced while it was read
    lo = maps[0].lo - maps[0].offset
    ends = [(m.lo, m.hi) for m in maps if m.executable]
    counts = {lo + off: c for off, n in profile.counts.items()
              if (c := int(round(n))) > 0 and any(a <= lo + off < b for a, b in ends)}
    if not counts:
        return None
    settings = warm_settings(config, profile.hot_text)
    job = FileJob(0, 0, path, counts, dict(counts), maps, settings, quick=True,
                  fallback_config=None if settings == dict(config) else dict(config),
                  path=path, view_base=base)
    res = optimize_client(job)
    if res.regions is not None and patchless(res):
        # the quick bounds can stop short of every entry a patch could go at (an
        # interpreter's loop entered only by its dispatch): a full selection instead
        full = optimize_client(dataclasses.replace(job, quick=False))
        if full.regions is not None and not patchless(full):
            res = full
    if res.regions is None:
        raise DbrError(f"{path}: {res.region_status}")
    emitted_ahead(res.srs or [], maps)
    return maps, res


class _FileTarget:
    """What a region's emission needs of an installer, for a module's file: its unwind
    information (real calls need it), as a client that takes it has."""

    frames_enabled = True

    def __init__(self, maps: list[MapEntry]) -> None:
        from dbr_service.codegen.frames import CfiSource

        ranges = [(m.lo, m.hi, m.path, m.dev, m.ino) for m in maps]
        self.cfi = CfiSource(lambda: ranges)


def _code_place(sr: Any, maps: list[MapEntry]) -> tuple[int, tuple[int, int], bool] | None:
    """Where ``sr``'s code is kept from (a page GAP beyond its module), its module's
    span and whether the module moves between processes (mapped above 4 GiB: a
    position-independent one; one at its link address below does not move); None
    when its lowest block is in no file mapping."""
    from dbr_service.installation.keptcode import GAP, anchor_of

    at = anchor_of(sr)
    m = next((m for m in maps if m.lo <= at < m.hi), None)
    if m is None or not m.path.startswith("/"):
        return None
    mine = [x for x in maps if x.path == m.path]
    lo, hi = min(x.lo for x in mine), max(x.hi for x in mine)
    return (hi + GAP + 0xFFF) & ~0xFFF, (lo, hi), module_base(maps, m.path) >= 1 << 32


def kept_codes(srs: list[Any], maps: list[MapEntry]) -> list[Any]:
    """Each region's code kept with its moving fields (installation/keptcode.py),
    emitted on the mappings ``maps`` it was selected on (a module's file as prepare
    maps it, or a process), or None for a region whose code cannot be kept."""
    from dbr_service.installation.keptcode import keep
    from dbr_service.installation.optimize import emit_with_frames

    target = _FileTarget(maps)
    shifted: dict[int, tuple[list[MapEntry], _FileTarget]] = {}

    def emit(sr: Any, at: int, shift: int) -> Any:
        if not shift:
            return emit_with_frames(target, sr, at)
        if shift not in shifted:
            there = [m._replace(lo=m.lo + shift, hi=m.hi + shift) for m in maps]
            shifted[shift] = (there, _FileTarget(there))
        there, tgt = shifted[shift]
        try:
            moved = rebase(sr, maps, there)
        except NoRebase as exc:
            raise CodegenError(f"{sr.id}: {exc}") from None
        return emit_with_frames(tgt, moved, at)

    out = []
    for sr in srs:
        place = _code_place(sr, maps)
        out.append(None if place is None else keep(sr, place[0], place[1], place[2], emit))
    return out


def emitted_ahead(srs: list[Any], maps: list[MapEntry]) -> None:
    """Keep with each region what its emission near its patch sites gives placement
    (installation/optimize.py Provisional), so that a client emits it once, at its
    place; not for a region whose unwind information cannot be made here (its size
    would be that of a copy without real calls).  Keep its code too (kept_codes), so
    that a client places it without emitting it."""
    from dbr_service.installation.optimize import provisional

    target = _FileTarget(maps)
    for sr, kept in zip(srs, kept_codes(srs, maps)):
        try:
            pre, why = provisional(target, sr)
        except DbrError:
            continue
        if why is None:
            sr.info["provisional"] = pre
        if kept is not None:
            sr.info["kept_code"] = kept


def patchless(res: Any) -> bool:
    """A selection nothing can be patched with: no region, or none with a patch site."""
    return all(d["transfer_only"] for d in (res.regions or []))


def merge_results(parts: list[JobResult], session_id: int, pid: int) -> JobResult:
    """One result of the selections of several modules (region ids kept distinct)."""
    out = JobResult(session_id, pid, [], [], "", srs=[])
    seen: set[str] = set()
    for res in parts:
        for d, sr in zip(res.regions or [], res.srs or []):
            rid, n = d["id"], 1
            while rid in seen:
                n += 1
                rid = f"{d['id']}.{n}"
            seen.add(rid)
            d["id"] = sr.id = rid
            out.regions.append(d)
            out.srs.append(sr)
    out.region_status = f"{len(out.regions)} region(s) selected ahead from stored profiles"
    return out
