"""The profile store: what earlier runs learned about each module, kept across runs
and service restarts, so that a warm start can install regions before sampling finds
them again (docs/operators.md, "Profile store").

One SQLite file, ``profiles.db``, in the service's state directory (config
``state_dir``).  Per module (keyed by ``modkey.module_key``) it keeps sample counts
per module offset, taken-branch counts per (from, to) offset pair, the last selected
hot text (regions with their entry sites' original bytes, block ranges and selection
parameters: ``profiledata``), the runs merged, and when the module was first and last
seen.

API the service calls (all in module offsets; ``profiledata`` converts a session's
samples and regions)::

    store = ProfileStore.open_for(cfg)                    # the one writer (flock)
    mk = module_key(path)                                 # modkey.ModuleKey
    store.record_run(mk, counts, edges, hot_text)         # merge one run
    prof = store.lookup(mk.key)                           # ModuleProfile | None
    store.close()

A warm start must compare each entry site's ``orig`` with the live bytes before it
patches; the key guarantees the same file, not the same bytes in memory.

Merging: the counts already stored are multiplied by 0.5^(age / half_life) (age: the
time since the module was last seen; ``profile_half_life_s``, 7 days) and the run's
are added; counts below MIN_COUNT are dropped, and beyond ``profiledata.MAX_OFFSETS``
the lowest.  The hot text is replaced by the run's when it gives one.  Modules not
seen for ``profile_expiry_s`` (30 days) are deleted when a writer opens the store.

Safety: the directory is made and checked with ``paths.open_safe_dir`` (mode 0700,
owner, no symlinks); the database runs in WAL mode with ``synchronous=NORMAL`` and
every write is one transaction, so a killed writer leaves the last committed run.
A writer holds an exclusive ``flock`` on ``profiles.db.lock`` (which names its pid)
for as long as the store is open: a second writer (another service on the same
directory, ``dbr profile import``) is refused with StoreBusyError naming that pid.
Readers (``dbr profile list|show|export``) take no lock.  A file that is not a
database, fails ``PRAGMA quick_check`` or has another schema is renamed to
``profiles.db.corrupt-<timestamp>`` with a WARNING and a new store is made; a newer
schema version is refused (SchemaError), never overwritten.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import sqlite3
import stat
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dbr_service.common.errors import DbrError
from dbr_service.profiles.modkey import ModuleKey
from dbr_service.common.paths import open_safe_dir, resolve_state_dir
from dbr_service.profiles.profiledata import (
    MAX_OFFSETS, MAX_EDGES, HotRegion, ModuleProfile, ProfileDataError, check_counts,
    check_edges, check_hot_text, check_text, hot_text_from_json, hot_text_to_json)

log = logging.getLogger("dbr.profiles")

DB_NAME = "profiles.db"
LOCK_NAME = "profiles.db.lock"
SCHEMA_VERSION = 2
#: Defaults of the config keys profile_half_life_s and profile_expiry_s.
HALF_LIFE_S = 7 * 86400.0
EXPIRY_S = 30 * 86400.0
#: A decayed count below this is dropped.
MIN_COUNT = 0.01
#: How long a statement waits for another connection's write (ms).
BUSY_TIMEOUT_MS = 5000

_SCHEMA = """
CREATE TABLE meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE modules (key TEXT PRIMARY KEY, path TEXT NOT NULL, build_id TEXT NOT NULL,
    runs INTEGER NOT NULL, first_seen REAL NOT NULL, last_seen REAL NOT NULL,
    hot_text TEXT NOT NULL);
CREATE TABLE counts (key TEXT NOT NULL, offset INTEGER NOT NULL, count REAL NOT NULL,
    PRIMARY KEY (key, offset)) WITHOUT ROWID;
CREATE TABLE edges (key TEXT NOT NULL, src INTEGER NOT NULL, dst INTEGER NOT NULL,
    count REAL NOT NULL, PRIMARY KEY (key, src, dst)) WITHOUT ROWID;
CREATE INDEX modules_last_seen ON modules (last_seen);
CREATE TABLE programs (key TEXT PRIMARY KEY, path TEXT NOT NULL, last_seen REAL NOT NULL);
"""
_TABLES = {"meta", "modules", "counts", "edges", "programs"}
#: Version 1 had no programs table; it is added in place.
_V1_TABLES = {"meta", "modules", "counts", "edges"}


class StoreError(DbrError):
    """The profile store cannot be used (its directory, its file)."""


class StoreBusyError(StoreError):
    """Another writer holds the store."""


class SchemaError(StoreError):
    """The store was written by a newer dbr."""


class _Corrupt(Exception):
    pass


class _Empty(Exception):
    """A reader found a file without tables: an empty store."""


@dataclass(frozen=True)
class ModuleSummary:
    """A row of ``dbr profile list``."""

    key: str
    path: str
    build_id: str
    runs: int
    first_seen: float
    last_seen: float
    offsets: int
    samples: float
    regions: int


def _json_dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


class ProfileStore:
    """The store in ``state_dir``; ``readonly``: a reader (no lock, nothing created:
    a missing store is an empty one)."""

    def __init__(self, state_dir: str | Path, *, readonly: bool = False,
                 half_life_s: float = HALF_LIFE_S, expiry_s: float = EXPIRY_S) -> None:
        if not half_life_s > 0 or expiry_s < 0:
            raise StoreError(f"half-life {half_life_s} s must be above 0 and expiry "
                             f"{expiry_s} s not below 0")
        self.dir = Path(os.path.abspath(state_dir))
        self.path = self.dir / DB_NAME
        self.readonly = readonly
        self.half_life_s = half_life_s
        self.expiry_s = expiry_s
        self._lock = threading.Lock()
        self._dfd: int | None = None
        self._lock_fd: int | None = None
        self._db: sqlite3.Connection | None = None
        try:
            self._open()
        except BaseException:
            self.close()
            raise

    @classmethod
    def open_for(cls, cfg: Any, *, readonly: bool = False,
                 state_dir: str | Path | None = None) -> ProfileStore:
        """The store a service Config names (``state_dir`` overrides its directory)."""
        where = state_dir if state_dir is not None else resolve_state_dir(cfg.state_dir)
        return cls(where, readonly=readonly, half_life_s=cfg.profile_half_life_s,
                   expiry_s=cfg.profile_expiry_s)

    # ---------------------------------------------------------------- opening
    def _open(self) -> None:
        if self.readonly:
            if not os.path.lexists(self.path):
                return              # an empty store
        try:
            self._dfd = open_safe_dir(self.dir, create=not self.readonly, mode=0o700)
        except OSError as exc:
            raise StoreError(f"profile store directory {self.dir}: {exc}") from None
        if self.readonly:
            try:
                self._db = self._connect(check=True)
            except _Empty:
                self._db = None
            return
        self._take_lock()
        try:
            self._db = self._connect(check=True)
        except _Corrupt as exc:
            self._move_aside(str(exc))
            self._db = self._connect(check=True)
        if self.expiry_s > 0:
            self.expire()

    def _take_lock(self) -> None:
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
        try:
            fd = os.open(LOCK_NAME, flags, 0o600, dir_fd=self._dfd)
        except OSError as exc:
            raise StoreError(f"{self.dir / LOCK_NAME}: {exc.strerror}") from None
        self._lock_fd = fd
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise StoreError(f"{self.dir / LOCK_NAME} is not a regular file of uid "
                             f"{os.geteuid()}")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise StoreError(f"{self.dir / LOCK_NAME}: {exc.strerror}") from None
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
            raise StoreBusyError(
                f"profile store {self.path} is in use by pid {holder} (a dbr service or "
                "`dbr profile import|forget`); one writer at a time: stop it, or give "
                "this one another state_dir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)

    def _connect(self, check: bool) -> sqlite3.Connection:
        """A connection to the checked file; _Corrupt when it is no store of ours."""
        try:
            st = os.stat(DB_NAME, dir_fd=self._dfd, follow_symlinks=False)
        except FileNotFoundError:
            st = None
        if st is not None and (not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid()):
            self._corrupt("not a regular file of this user")
        uri = f"file:{self.path}" + ("?mode=ro" if self.readonly else "")
        try:
            db = sqlite3.connect(uri, uri=True, isolation_level=None,
                                 check_same_thread=False, timeout=BUSY_TIMEOUT_MS / 1000)
        except sqlite3.Error as exc:
            raise StoreError(f"{self.path}: {exc}") from None
        try:
            db.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
            if check:
                self._check(db)
            if not self.readonly:
                if db.execute("PRAGMA journal_mode=WAL").fetchone()[0].lower() != "wal":
                    raise StoreError(f"{self.path}: WAL journal mode refused")
                db.execute("PRAGMA synchronous=NORMAL")
        except sqlite3.DatabaseError as exc:
            db.close()
            self._corrupt(str(exc))
            raise               # not reached: _corrupt raises
        except BaseException:
            db.close()
            raise
        return db

    def _corrupt(self, why: str) -> None:
        if self.readonly:
            raise StoreError(f"profile store {self.path} is damaged ({why}); the next "
                             "writer (the service, `dbr profile import`) moves it aside "
                             "and starts a new one")
        raise _Corrupt(why)

    def _check(self, db: sqlite3.Connection) -> None:
        tables = {r[0] for r in db.execute(
            "SELECT name FROM sqlite_master WHERE type='table'")}
        if not tables:
            if self.readonly:
                raise _Empty
            with self._transaction(db):
                for stmt in filter(str.strip, _SCHEMA.split(";")):
                    db.execute(stmt)
                db.execute("INSERT INTO meta VALUES ('schema_version', ?)",
                           (str(SCHEMA_VERSION),))
            return
        row = db.execute("PRAGMA quick_check").fetchone()
        if row is None or row[0] != "ok":
            self._corrupt(f"quick_check: {row[0] if row else 'no answer'}")
        if "meta" not in tables:
            self._corrupt("no schema version")
        got = db.execute("SELECT value FROM meta WHERE name='schema_version'").fetchone()
        try:
            version = int(got[0]) if got else -1
        except ValueError:
            version = -1
        if version > SCHEMA_VERSION:
            raise SchemaError(f"profile store {self.path} has schema version {version}, "
                              f"newer than this dbr's {SCHEMA_VERSION}: use a newer dbr, "
                              "or another state_dir")
        if version == 1 and _V1_TABLES <= tables and not self.readonly:
            with self._transaction(db):
                db.execute("CREATE TABLE IF NOT EXISTS programs (key TEXT PRIMARY KEY, "
                           "path TEXT NOT NULL, last_seen REAL NOT NULL)")
                db.execute("UPDATE meta SET value=? WHERE name='schema_version'",
                           (str(SCHEMA_VERSION),))
            log.info("profile store %s: schema 1 upgraded to %d", self.path, SCHEMA_VERSION)
            return
        if version == 1 and _V1_TABLES <= tables:
            return           # a reader of a version 1 store: it has no programs yet
        if version != SCHEMA_VERSION or not _TABLES <= tables:
            self._corrupt(f"schema version {version} with tables {sorted(tables)}")

    def _move_aside(self, why: str) -> None:
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        aside = f"{DB_NAME}.corrupt-{stamp}"
        n = 1
        while os.path.lexists(self.dir / aside):
            n += 1
            aside = f"{DB_NAME}.corrupt-{stamp}.{n}"
        os.rename(DB_NAME, aside, src_dir_fd=self._dfd, dst_dir_fd=self._dfd)
        for suffix in ("-wal", "-shm"):
            with contextlib.suppress(FileNotFoundError):
                os.rename(DB_NAME + suffix, aside + suffix, src_dir_fd=self._dfd,
                          dst_dir_fd=self._dfd)
        log.warning("profile store %s is damaged (%s): moved to %s, starting a new one",
                    self.path, why, self.dir / aside)

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None
            for attr in ("_lock_fd", "_dfd"):
                fd = getattr(self, attr)
                if fd is not None:
                    os.close(fd)            # closing the lock file releases the flock
                    setattr(self, attr, None)

    def __enter__(self) -> ProfileStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- helpers
    @contextlib.contextmanager
    def _transaction(self, db: sqlite3.Connection | None = None):
        db = db or self._db
        if db is None or self.readonly:
            raise StoreError("the profile store is open read-only")
        db.execute("BEGIN IMMEDIATE")
        try:
            yield db
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")

    def _rows(self, sql: str, args: tuple = ()) -> list[tuple]:
        if self._db is None:
            return []
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    # ---------------------------------------------------------------- writing
    def record_run(self, module: ModuleKey, counts: Mapping[int, float],
                   edges: Mapping[tuple[int, int], float] | None = None,
                   hot_text: Iterable[HotRegion] | None = None,
                   now: float | None = None) -> None:
        """Merge one run of ``module``: its samples per module offset, its taken-branch
        counts per (from, to) offsets, and the hot text it selected (None keeps the
        stored one).  ProfileDataError for data beyond the limits (nothing written)."""
        now = time.time() if now is None else now
        self._merge(module.key, module.path, module.build_id, check_counts(counts, "counts"),
                    check_edges(edges or {}, "edges"),
                    None if hot_text is None else check_hot_text(hot_text, "hot_text"),
                    at=now, runs=1, first_seen=now)

    def merge_profile(self, prof: ModuleProfile, now: float | None = None, *,
                      with_hot_text: bool = True) -> None:
        """Merge a whole profile (an import): the older side's counts decay to the
        newer's time, and the newer side's hot text is kept (``with_hot_text`` false:
        the stored one, for a source without hot text).  A time in the future counts
        as now."""
        now = time.time() if now is None else now
        hot = check_hot_text(prof.hot_text, "hot_text") if with_hot_text else None
        self._merge(prof.key, prof.path, prof.build_id, check_counts(prof.counts, "counts"),
                    check_edges(prof.edges, "edges"), hot,
                    at=min(prof.last_seen, now), runs=prof.runs,
                    first_seen=min(prof.first_seen, now))

    def _merge(self, key: str, path: str, build_id: str, counts: dict[int, float],
               edges: dict[tuple[int, int], float], hot_text: list[HotRegion] | None, *,
               at: float, runs: int, first_seen: float) -> None:
        check_text(path, "path")
        with self._lock, self._transaction() as db:
            row = db.execute("SELECT last_seen, first_seen FROM modules WHERE key=?",
                             (key,)).fetchone()
            hot = None if hot_text is None else _json_dumps(hot_text_to_json(hot_text))
            if row is None:
                db.execute("INSERT INTO modules VALUES (?, ?, ?, ?, ?, ?, ?)",
                           (key, path, build_id, runs, first_seen, at, hot or "[]"))
                old_factor = 1.0
                new_factor = 1.0
            else:
                last = row[0]
                old_factor = self.decay(max(0.0, at - last))
                new_factor = self.decay(max(0.0, last - at))
                newer = at >= last
                db.execute("UPDATE modules SET path=CASE WHEN ? THEN ? ELSE path END, "
                           "runs=runs+?, first_seen=MIN(first_seen, ?), "
                           "last_seen=MAX(last_seen, ?), "
                           "hot_text=CASE WHEN ? IS NOT NULL AND ? THEN ? ELSE hot_text END "
                           "WHERE key=?", (newer, path, runs, first_seen, at, hot, newer,
                                           hot, key))
            for table in ("counts", "edges"):
                if old_factor != 1.0:
                    db.execute(f"UPDATE {table} SET count=count*? WHERE key=?",
                               (old_factor, key))
            db.executemany("INSERT INTO counts VALUES (?, ?, ?) ON CONFLICT (key, offset) "
                           "DO UPDATE SET count=count+excluded.count",
                           ((key, o, c * new_factor) for o, c in counts.items()))
            db.executemany("INSERT INTO edges VALUES (?, ?, ?, ?) ON CONFLICT "
                           "(key, src, dst) DO UPDATE SET count=count+excluded.count",
                           ((key, s, d, c * new_factor) for (s, d), c in edges.items()))
            self._trim(db, key)

    def _trim(self, db: sqlite3.Connection, key: str) -> None:
        for table, cols, limit in (("counts", "offset", MAX_OFFSETS),
                                   ("edges", "src, dst", MAX_EDGES)):
            db.execute(f"DELETE FROM {table} WHERE key=? AND count<?", (key, MIN_COUNT))
            n = db.execute(f"SELECT COUNT(*) FROM {table} WHERE key=?", (key,)).fetchone()[0]
            if n > limit:
                db.execute(f"DELETE FROM {table} WHERE key=? AND ({cols}) IN (SELECT {cols} "
                           f"FROM {table} WHERE key=? ORDER BY count ASC LIMIT ?)",
                           (key, key, n - limit))

    def decay(self, age_s: float) -> float:
        """The factor counts ``age_s`` seconds old are multiplied by."""
        return 0.5 ** (age_s / self.half_life_s)

    def expire(self, now: float | None = None) -> int:
        """Delete the modules not seen for ``expiry_s``; how many."""
        if self.expiry_s <= 0:
            return 0
        cutoff = (time.time() if now is None else now) - self.expiry_s
        with self._lock, self._transaction() as db:
            keys = [r[0] for r in db.execute("SELECT key FROM modules WHERE last_seen<?",
                                             (cutoff,))]
            for key in keys:
                self._delete(db, key)
            db.execute("DELETE FROM programs WHERE last_seen<?", (cutoff,))
        if keys:
            log.info("profile store: %d module(s) not seen for %.0f days expired",
                     len(keys), self.expiry_s / 86400)
        return len(keys)

    # ---------------------------------------------------------------- programs
    def mark_program(self, key: str, path: str, now: float | None = None) -> None:
        """Record that a run of the program whose executable has store key ``key``
        left hot text in some module it maps (warm start: profiles/warmstart.py)."""
        check_text(path, "path")
        now = time.time() if now is None else now
        with self._lock, self._transaction() as db:
            db.execute("INSERT INTO programs VALUES (?, ?, ?) ON CONFLICT(key) DO UPDATE "
                       "SET path=excluded.path, last_seen=excluded.last_seen",
                       (key, path, now))

    def programs(self) -> dict[str, str]:
        """Programs marked so: store key of the executable -> its path."""
        try:
            return dict(self._rows("SELECT key, path FROM programs ORDER BY last_seen DESC"))
        except sqlite3.OperationalError:      # a reader of a version 1 store
            return {}

    def forget(self, key: str) -> bool:
        """Delete one module's profile; whether there was one."""
        with self._lock, self._transaction() as db:
            return self._delete(db, key)

    @staticmethod
    def _delete(db: sqlite3.Connection, key: str) -> bool:
        for table in ("counts", "edges", "programs"):
            db.execute(f"DELETE FROM {table} WHERE key=?", (key,))
        return db.execute("DELETE FROM modules WHERE key=?", (key,)).rowcount > 0

    # ---------------------------------------------------------------- reading
    def keys(self) -> list[str]:
        return [r[0] for r in self._rows("SELECT key FROM modules ORDER BY key")]

    def lookup(self, key: str) -> ModuleProfile | None:
        """The stored profile of the module with store key ``key``, or None.  A row
        that does not pass the import checks (a store edited by hand) is None too,
        with a WARNING."""
        if self._db is None:
            return None
        with self._lock:
            db = self._db
            db.execute("BEGIN")         # one snapshot for the three reads
            try:
                row = db.execute("SELECT path, build_id, runs, first_seen, last_seen, "
                                 "hot_text FROM modules WHERE key=?", (key,)).fetchone()
                if row is None:
                    return None
                counts = dict(db.execute("SELECT offset, count FROM counts WHERE key=?",
                                         (key,)).fetchall())
                edges = {(s, d): c for s, d, c in db.execute(
                    "SELECT src, dst, count FROM edges WHERE key=?", (key,))}
            finally:
                db.execute("COMMIT")
        try:
            hot = hot_text_from_json(json.loads(row[5]), f"module {key} hot_text")
        except (ValueError, ProfileDataError) as exc:
            log.warning("profile store: module %s: stored hot text ignored: %s", key, exc)
            hot = []
        return ModuleProfile(key=key, path=row[0], build_id=row[1], runs=row[2],
                             first_seen=row[3], last_seen=row[4], counts=counts,
                             edges=edges, hot_text=hot)

    def summaries(self) -> list[ModuleSummary]:
        """Every module, most recently seen first."""
        rows = self._rows(
            "SELECT m.key, m.path, m.build_id, m.runs, m.first_seen, m.last_seen, "
            "COUNT(c.offset), COALESCE(SUM(c.count), 0), json_array_length(m.hot_text) "
            "FROM modules m LEFT JOIN counts c ON c.key = m.key GROUP BY m.key "
            "ORDER BY m.last_seen DESC, m.key")
        return [ModuleSummary(*r) for r in rows]

    def integrity(self) -> str:
        """``PRAGMA integrity_check``'s answer ("ok" for a sound file)."""
        rows = self._rows("PRAGMA integrity_check")
        return "ok" if not rows and self._db is None else "; ".join(r[0] for r in rows)
