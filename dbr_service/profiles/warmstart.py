"""Warm start: the service's side of the profile store (profiles/profilestore.py).

* **Recording.**  When a client's session ends, its samples (attributed to original
  code) are merged into the store per module, with the hot text of the regions it
  had installed (``profiledata.module_hot_text``).  A run with fewer than
  MIN_RUN_SAMPLES samples is not recorded: it says too little.
* **A warm client.**  A program is *warm* when its executable has stored hot text, or
  a recorded run of it left hot text in a module it maps (the store's programs).
  When a warm client connects, its first selection job is queued at once, a quick
  one under the service's settings, from the stored counts of every module it maps
  that has hot text (module offsets rebased to where the client maps them), instead
  of after its first sampling windows.  The job selects and installs as any other:
  discovery reads the client's live code, the agent checks every site's bytes, and
  sampling goes on to refine the choice.
* **Kept selections.**  That job's result is kept, and the program's next processes
  get it at connection with no job, moved to where each maps its files
  (profiles/rebase.py), REUSE_MAX_TIMES times within REUSE_MAX_S, until the
  selections made ahead of their files (profiles/warmprep.py, their code kept too:
  installation/keptcode.py) are ready, which come first.  A kept selection's code is
  kept too, in a worker after the job (_keep_code).  A quick job that found nothing
  with a patch site is followed by a full one, whose result is kept instead.
* **Born at once.**  A warm program's agents are told to connect at their start: the
  program's own birth age, 0, beside the service's hint (paths.program_quiet_file),
  written when a run leaves hot text and, at the service's start, for the stored
  programs whose file is still the one profiled.  Short-run learning
  (daemon/shortruns.py) treats a warm program as one that gains.

A store that cannot be opened (another service holds it, a directory that is not
safe) leaves the service without warm start, with a WARNING (at INFO for `dbr run`'s
embedded service when another holds it); it never stops it.
"""

from __future__ import annotations

import copy
import logging
import os
import queue
import sqlite3
import threading
import time
from typing import Any, Callable

from dbr_service.common.errors import DbrError
from dbr_service.profiles.modkey import ModuleKey, ModuleKeyError, key_for_build_id, module_key
from dbr_service.common.paths import program_key, program_quiet_file, write_ms_file
from dbr_service.common.procmaps import MapEntry, mapped_file, module_base
from dbr_service.profiles.profiledata import (HotRegion, ModuleProfile,
                                              ProfileDataError, module_counts,
                                              module_hot_text, selection_params)
from dbr_service.profiles.rebase import NoRebase, rebase
from dbr_service.profiles.warmprep import (WARM_KEYS, kept_codes, merge_results, patchless,
                                           prepare, warm_settings)
from dbr_service.profiles.profilestore import ProfileStore, StoreBusyError, StoreError

log = logging.getLogger("dbr.warm")

#: A run with fewer samples than this (in all its modules) is not recorded.
MIN_RUN_SAMPLES = 50
#: Modules of one run recorded at most (its most sampled ones).
MAX_RUN_MODULES = 16
#: Stored programs whose birth hint is written at the service's start, at most.
MAX_START_HINTS = 256
#: A warm job's selection is reused for the program's next processes this many times,
#: for at most this long; then a warm job selects anew from the store.
REUSE_MAX_TIMES = 20
REUSE_MAX_S = 600.0
MAX_KEPT_SELECTIONS = 64
#: Stored modules selected ahead from their files at the service's start, at most
#: (the most recently seen first).
MAX_PREPARED_AT_START = 16
#: Seconds a selection made ahead may take in a worker before it is given up.
PREPARE_TIMEOUT_S = 120.0


class WarmStart:
    """The store as the service uses it; called from session threads and the control
    thread (one lock around the store)."""

    def __init__(self, store: ProfileStore, config: Any,
                 runner: Callable[..., Any] | None = None) -> None:
        self.store = store
        self.config = config
        #: runner(fn, *args) -> a Future of fn(*args) in a worker process (the
        #: service's pool, at the workers' niceness); None: nothing is selected ahead.
        self.runner = runner
        #: Called (on the thread that selects ahead) when a selection made ahead is kept.
        self.on_prepared: Callable[[], None] | None = None
        self._lock = threading.Lock()
        #: (path, dev, ino, mtime_ns) -> its ModuleKey (None: not an ELF file we read).
        self._keys: dict[tuple, ModuleKey | None] = {}
        self.runs_recorded = 0
        self.warm_jobs = 0
        self.errors = 0
        self._closed = False
        #: exe store key -> the first warm job's result for a process of it, the maps
        #: it was selected on, when, and how often it was reused.
        self._results: dict[str, list] = {}
        #: session id -> (exe store key, maps, settings) of a warm job queued and not
        #: done.
        self._pending: dict[int, tuple[str, list[MapEntry], dict[str, Any]]] = {}
        #: Store keys of executables a recorded run of which left hot text in some
        #: module (warm even when it is not the executable's: libpython for python3);
        #: the store's programs table, mirrored.
        self._programs: set[str] = set(self._call("list programs", store.programs) or ())
        self.reuses = 0
        #: module store key -> (the mappings it was selected on, the result) of a
        #: selection made ahead from the module's file (profiles/warmprep.py).
        self._prepared: dict[str, tuple[list[MapEntry], Any]] = {}
        self._prep_queue: queue.SimpleQueue = queue.SimpleQueue()
        self._prep_thread: threading.Thread | None = None
        self.prepared_used = 0
        #: Modules queued for a selection ahead and not done (kept, found patchless or
        #: failed).
        self.prepare_pending = 0
        #: Regions of warm jobs' kept selections whose code was kept (_keep_code).
        self.codes_kept = 0
        #: session id -> the settings its warm selection was made under, which its
        #: run's hot text records (the next warm selections take them again).
        self._selected_under: dict[int, dict[str, Any]] = {}

    @classmethod
    def open(cls, config: Any, embedded: bool = False,
             runner: Callable[..., Any] | None = None) -> WarmStart | None:
        """The store of ``config``, or None.  An embedded service (`dbr run`) whose
        store a host service or another run holds goes without, quietly: that is
        routine for it.  ``runner``: see the attribute."""
        if not config.warm_start:
            return None
        try:
            store = ProfileStore.open_for(config)
        except StoreBusyError as exc:
            (log.info if embedded else log.warning)("no warm start: %s", exc)
            return None
        except (StoreError, OSError) as exc:
            log.warning("no warm start: the profile store cannot be opened: %s", exc)
            return None
        # an embedded service serves one program: nothing is selected ahead there
        return cls(store, config, None if embedded else runner)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self.store.close()
        self._prep_queue.put(None)

    def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        """``fn()`` on the store under the lock; None (logged, counted) if it fails or
        the store was closed meanwhile (a session that ends after the service)."""
        try:
            with self._lock:
                return None if self._closed else fn()
        except (StoreError, ProfileDataError, OSError, sqlite3.Error) as exc:
            self.errors += 1
            log.warning("profile store: cannot %s: %s", what, exc)
            return None

    def status(self) -> dict[str, Any]:
        return {"store": str(self.store.path), "runs_recorded": self.runs_recorded,
                "warm_jobs": self.warm_jobs, "reused_selections": self.reuses,
                "prepared_selections": len(self._prepared),
                "prepared_used": self.prepared_used,
                "prepare_pending": self.prepare_pending, "codes_kept": self.codes_kept,
                "errors": self.errors}

    # ---------------------------------------------------------------- module keys
    def _key(self, path: str, maps: list[MapEntry]) -> ModuleKey | None:
        """The store key of the file a client maps at ``path``, if it is still that
        file (the mapping's device and inode)."""
        m = next((m for m in maps if m.path == path), None)
        if m is None:
            return None
        try:
            st = mapped_file(path, m.dev, m.ino)
        except OSError:
            return None
        if st is None:
            return None
        k = (path, m.dev, m.ino, st.st_mtime_ns)
        if k not in self._keys:
            try:
                self._keys[k] = module_key(path)
            except ModuleKeyError as exc:
                log.debug("no store key for %s: %s", path, exc)
                self._keys[k] = None
            if len(self._keys) > 4096:
                self._keys.pop(next(iter(self._keys)))
        return self._keys[k]

    def _lookup(self, key: str) -> ModuleProfile | None:
        return self._call(f"read {key}", lambda: self.store.lookup(key))

    # ---------------------------------------------------------------- recording
    def record(self, s: Any) -> bool:
        """Session thread, at the session's end: merge its run into the store.  Whether
        the program is warm now (its executable has hot text stored)."""
        maps = list(s.maps)
        with s.lock:
            ips = dict(s.ip_counts)
        per_module = module_counts(ips, maps)
        if sum(sum(c.values()) for c in per_module.values()) < MIN_RUN_SAMPLES:
            return self.is_warm(s)
        # the next runs must not get again what this one may not install again (found
        # slower or not effective) nor what the operator took out
        book = s.region_book
        kept = [] if book.operator_hold_all else [
            r for r in list(book.regions.values())
            if r.id not in book.blocked_regions and r.id not in book.operator_held]
        params = selection_params(self.config)
        params.update(self._selected_under.pop(s.session_id, {}))
        hot = module_hot_text(kept, maps, params)
        ranked = sorted(per_module, key=lambda p: -sum(per_module[p].values()))
        keys = [(path, mk) for path in ranked[:MAX_RUN_MODULES]
                if (mk := self._key(path, maps)) is not None]
        exe = self._exe_key(s)
        mark = bool(exe) and any(hot.values())

        def write() -> int:
            # one hold of the lock: a service stopping meanwhile closes the store after
            # the whole run is in, never between its modules and its program mark
            for path, mk in keys:
                self.store.record_run(mk, per_module[path], None, hot.get(path))
            if mark and keys:
                self.store.mark_program(exe, s.exe)
            return len(keys)

        recorded = self._call(f"record the run of pid {s.pid}", write) or 0
        if recorded:
            self.runs_recorded += 1
            log.info("pid %d (%s): profile of %d module(s) stored", s.pid, s.exe, recorded)
            if mark:
                self._programs.add(exe)
        return self.is_warm(s)

    # ---------------------------------------------------------------- warm clients
    def _exe_key(self, s: Any) -> str | None:
        if s.build_id:
            return key_for_build_id(s.build_id)
        mk = self._key(s.exe, s.maps) if s.maps else None
        return None if mk is None else mk.key

    def is_warm(self, s: Any) -> bool:
        """Whether the client's program is warm: its executable has stored hot text, or
        a run of it recorded by this service left hot text in a module it maps (a
        library, as libpython for python3)."""
        key = self._exe_key(s)
        if not key:
            return False
        if key in self._programs:
            return True
        prof = self._lookup(key)
        return prof is not None and bool(prof.hot_text)

    def job_input(self, s: Any) -> tuple[dict[int, int], dict[str, Any]]:
        """Session thread, when a warm client connects (its map read): the samples by
        address its first job selects from, the stored counts of the modules it maps
        that have hot text (those of the hot text's code alone are too few to select
        from: one or two blocks a region), and the configuration it selects under:
        the service's, with the thresholds the hot text was selected under
        (profiles/warmprep.py, warm_settings)."""
        maps = list(s.maps)
        out: dict[int, int] = {}
        hot: list[HotRegion] = []
        for path in sorted({m.path for m in maps if m.executable and m.path.startswith("/")}):
            mk = self._key(path, maps)
            prof = self._lookup(mk.key) if mk is not None else None
            if prof is None or not prof.hot_text:
                continue
            hot.extend(prof.hot_text)
            base = module_base(maps, path)
            ends = [m for m in maps if m.path == path and m.executable]
            for off, n in prof.counts.items():
                addr, c = base + off, int(round(n))
                if c > 0 and any(m.lo <= addr < m.hi for m in ends):
                    out[addr] = out.get(addr, 0) + c
        return out, warm_settings(self.config.to_dict(), hot)

    # ---------------------------------------------------------------- selections kept
    def selected_under(self, s: Any, settings: dict[str, Any]) -> None:
        """Session ``s``'s warm selection was made under the configuration ``settings``."""
        if settings:
            self._selected_under[s.session_id] = {k: settings[k] for k in WARM_KEYS}
        while len(self._selected_under) > 4096:          # sessions that never ended
            self._selected_under.pop(next(iter(self._selected_under)))

    def job_queued(self, s: Any, maps: list[MapEntry], settings: dict[str, Any],
                   quick: bool = True) -> None:
        """Control thread: a warm job of session ``s`` selects on ``maps`` under the
        configuration ``settings``, a quick one or not."""
        self.selected_under(s, settings)
        key = self._exe_key(s)
        if key:
            self._pending[s.session_id] = (key, list(maps), dict(settings), quick)
            while len(self._pending) > MAX_KEPT_SELECTIONS:   # jobs lost on the way
                self._pending.pop(next(iter(self._pending)))

    def job_done(self, session_id: int, res: Any) -> bool:
        """Control thread, before the result is installed: keep a warm job's result (a
        copy: installation annotates the regions it emits) to reuse for the next
        processes of the program.  True when it was a quick job that selected nothing
        with a patch site: a full selection should follow (the quick bounds can stop
        short of every entry a patch could go at), and this one is not kept."""
        key, maps, settings, quick = self._pending.pop(session_id, (None,) * 4)
        if not key or res is None or res.regions is None:
            return False
        if quick and patchless(res):
            return True
        # kept also when it selected nothing: the next processes get that at once
        # instead of a job each that selects nothing again
        kept = self._results[key] = [maps, copy.deepcopy(res), time.monotonic(), 0, settings]
        while len(self._results) > MAX_KEPT_SELECTIONS:
            self._results.pop(next(iter(self._results)))
        if getattr(res, "srs", None) and self.runner is not None and not self._closed:
            self._queue_side(self._keep_code, key, kept)
        return False

    def kept_selection(self, s: Any) -> tuple[Any, str]:
        """Session thread, when a warm client connects (its map read): a selection to
        install at once, and the timeline mark that names it: those made ahead of its
        files (prepared_result), else the kept one of its program (reused_result);
        (None, "") when there is none.  A kept selection stood in for those made ahead
        while they were not ready (its job ran first); once they are, it gives way to
        them (their code is kept, installation/keptcode.py) and is dropped."""
        key = self._exe_key(s)
        res = self.prepared_result(s)
        if res is not None:
            if key:
                self._results.pop(key, None)
            return res, "warm_selection_prepared"
        res = self.reused_result(s, key)
        return (res, "warm_selection_reused") if res is not None else (None, "")

    def reused_result(self, s: Any, key: str | None) -> Any:
        """Session thread, when a warm client connects (its map read): the kept
        selection of its program moved to where this process maps its files
        (profiles/rebase.py), ready to install; None when there is none, it is stale
        (REUSE_MAX_S, REUSE_MAX_TIMES) or names memory this process has no
        counterpart of.  ``key``: its executable's store key (_exe_key)."""
        kept = self._results.get(key) if key else None
        if kept is None:
            return None
        maps, res, since, uses, settings = kept
        if uses >= REUSE_MAX_TIMES or time.monotonic() - since > REUSE_MAX_S:
            self._results.pop(key, None)
            return None
        try:
            moved = rebase(res, maps, list(s.maps))
        except NoRebase as exc:
            log.info("pid %d: the kept selection of %s cannot be moved: %s", s.pid, s.exe, exc)
            self._results.pop(key, None)
            return None
        kept[3] += 1
        self.reuses += 1
        moved.session_id, moved.pid = s.session_id, s.pid
        moved.cpu_s = moved.elapsed_s = 0.0
        moved.decode_cached = moved.decode_new = 0
        _moved_here(moved)
        self.selected_under(s, settings)
        return moved

    # ---------------------------------------------------------------- made ahead
    def prepare_stored(self) -> int:
        """At the service's start: queue the selection ahead of the stored modules with
        hot text (MAX_PREPARED_AT_START, the most recently seen first; one whose file
        is no longer the one profiled is left out by prepare); how many were queued."""
        if self.runner is None:
            return 0
        summaries = self._call("list it", self.store.summaries) or []
        n = 0
        for sm in sorted(summaries, key=lambda x: -x.last_seen):
            if n >= MAX_PREPARED_AT_START:
                break
            if sm.regions and sm.path.startswith("/"):
                self.prepare_ahead(sm.key, sm.path)
                n += 1
        return n

    def prepare_ahead(self, key: str, path: str) -> None:
        """Select the module with store key ``key`` (its file at ``path``) ahead of its
        clients, one module at a time, in a worker (``runner``): a thread of the
        service waits for each."""
        if self._closed or self.runner is None:
            return
        with self._lock:
            self.prepare_pending += 1
        self._queue_side(self._prepare_one, key, path)

    def _queue_side(self, fn: Callable[..., None], *args: Any) -> None:
        """``fn(*args)`` on the thread that waits for the work done ahead in workers,
        one item at a time."""
        self._prep_queue.put((fn, args))
        if self._prep_thread is None:
            self._prep_thread = threading.Thread(target=self._prepare_loop, daemon=True,
                                                 name="dbr-warm-prepare")
            self._prep_thread.start()

    def _prepare_loop(self) -> None:
        while (item := self._prep_queue.get()) is not None and not self._closed:
            fn, args = item
            fn(*args)

    def _keep_code(self, key: str, kept: list) -> None:
        """A warm job's kept selection ``kept`` gets its regions' code kept
        (warmprep.kept_codes, in a worker), so that the next processes place it
        without emitting it; replaced whole, as session threads may be moving it."""
        maps, res = kept[0], kept[1]
        try:
            codes = self.runner(kept_codes, res.srs or [], maps).result(
                timeout=PREPARE_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - logged, the selection is kept as it is
            log.info("no code kept for a warm job's selection: %s", exc or type(exc).__name__)
            return
        if self._results.get(key) is not kept or not any(codes):
            return
        out = copy.copy(res)
        out.srs = []
        for sr, code in zip(res.srs or [], codes):
            if code is not None:
                sr = copy.copy(sr)
                sr.info = dict(sr.info, kept_code=code)
            out.srs.append(sr)
        kept[1] = out
        self.codes_kept += sum(c is not None for c in codes)

    def _prepare_one(self, key: str, path: str) -> None:
        """The selection ahead of one module (prepare_ahead), kept when it has a region
        with a patch site."""
        try:
            self._prepare_module(key, path)
        finally:
            with self._lock:
                self.prepare_pending -= 1

    def _prepare_module(self, key: str, path: str) -> None:
        prof = self._lookup(key)
        if prof is None or not prof.hot_text:
            return
        t0 = time.monotonic()
        try:
            got = self.runner(prepare, prof, path, self.config.to_dict()).result(
                timeout=PREPARE_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - one module's file: logged, go on
            log.info("no selection ahead for %s: %s", path, exc or type(exc).__name__)
            got = None
        if got is None or patchless(got[1]):
            # nothing a client could be patched with (no region, or none with a
            # patch site): its clients get a warm job (job_input)
            self._prepared.pop(key, None)
            return
        self._prepared[key] = got
        while len(self._prepared) > MAX_KEPT_SELECTIONS:
            self._prepared.pop(next(iter(self._prepared)))
        log.info("%s: %d region(s) selected ahead in %.0f ms", path,
                 len(got[1].regions), (time.monotonic() - t0) * 1e3)
        if self.on_prepared is not None:
            self.on_prepared()

    def prepared_result(self, s: Any) -> Any:
        """Session thread, when a warm client connects (its map read): the selections
        made ahead of the files it maps (each the very file selected: its store key),
        moved to where it maps them and merged; None when there is none."""
        maps = list(s.maps)
        parts, settings = [], None
        for path in sorted({m.path for m in maps if m.executable and m.path.startswith("/")}):
            mk = self._key(path, maps)
            got = self._prepared.get(mk.key) if mk is not None else None
            if got is None:
                continue
            try:
                parts.append(rebase(got[1], got[0], maps))
            except NoRebase as exc:
                log.info("pid %d: the selection ahead of %s cannot be moved: %s",
                         s.pid, path, exc)
                continue
            prof = self._lookup(mk.key)
            if settings is None and prof is not None:
                settings = warm_settings(self.config.to_dict(), prof.hot_text)
        if not parts:
            return None
        moved = merge_results(parts, s.session_id, s.pid)
        _moved_here(moved)
        self.prepared_used += 1
        if settings is not None:
            self.selected_under(s, settings)
        return moved

    # ---------------------------------------------------------------- birth hints
    def write_hint(self, exe_key: str, dir_fd: int) -> None:
        """The program's agents connect at their start (its own birth age 0)."""
        if not exe_key or dir_fd < 0:
            return
        try:
            write_ms_file(program_quiet_file(exe_key), 0, dir_fd=dir_fd)
        except OSError as exc:
            log.warning("cannot write the warm start hint for %s: %s", exe_key, exc)

    def write_start_hints(self, dir_fd: int) -> int:
        """At the service's start: hints for the stored modules with hot text whose
        file at their path is still the one profiled (a library's hint names a file no
        process runs as its program: harmless); how many were written."""
        summaries = self._call("list it", self.store.summaries) or []
        progs = self._call("list programs", self.store.programs) or {}
        n = 0
        for key, path in list(progs.items())[:MAX_START_HINTS]:
            try:
                st = os.stat(path)
                if module_key(path).key != key:
                    continue
            except (OSError, ModuleKeyError, DbrError):
                continue
            self.write_hint(program_key(st), dir_fd)
            n += 1
        for sm in sorted(summaries, key=lambda x: -x.last_seen)[:MAX_START_HINTS]:
            if not sm.regions:
                continue
            try:
                st = os.stat(sm.path)
                if module_key(sm.path).key != sm.key:
                    continue
            except (OSError, ModuleKeyError, DbrError):
                continue
            self.write_hint(program_key(st), dir_fd)
            n += 1
        return n


def _moved_here(res: Any) -> None:
    """A selection moved from where it was made to a client: its regions' every copied
    byte is compared with the client's code before they are installed
    (installation/optimize.py), and its DOT labels, which name the other addresses,
    are dropped."""
    for d in res.regions or []:
        d["dot"] = None
    for sr in res.srs or []:
        sr.info["verify_original"] = True
