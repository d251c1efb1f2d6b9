"""dbr profile — the profile store: what earlier runs learned per module.

Verbs: list, show KEY, forget KEY, export [--format json|pprof] [--output FILE|-]
[KEY...], import FILE.  A KEY is a module's store key (its build id in hex, or
path-<hex> for a module without one), a unique prefix of it, or the path of a module
file (its key is computed from the file).  The store is the one in --state-dir, else
the configured state_dir (docs/operators.md, "Profile store").  list, show and export
only read it; import and forget write it and are refused while a service holds it.
Exit status: 0 ok, 1 the store or the input refused, 2 usage error.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import stat
import sys
import time
from typing import Any

from dbr_service.common.errors import DbrError

EPILOG = """examples:
  dbr profile list
  dbr profile show 4f2a9c                        # a key prefix, or a module path
  dbr profile export --output hosts.json         # every module, with hot text
  dbr profile export --format pprof -o p.pb.gz   # counts only
  dbr profile import hosts.json                  # on another host; merges
  dbr profile forget /usr/bin/prog
"""

#: Bytes of an import file read at most.
MAX_IMPORT_FILE = 256 << 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--state-dir", metavar="DIR",
                        help="the store's directory (default: the configured state_dir)")
    common.add_argument("-c", "--config", metavar="FILE",
                        help="configuration file (default /etc/dbr/dbr.toml if present)")
    sub = parser.add_subparsers(dest="verb", metavar="VERB", required=True)

    def verb(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=help, parents=[common])

    p = verb("list", "the modules the store holds, most recently seen first")
    p.add_argument("--json", action="store_true", help="print JSON")
    p = verb("show", "one module: path, key, runs merged, last seen, hottest offsets "
                     "(named where the module file is still the same), hot text")
    p.add_argument("key", help="store key, unique key prefix, or module path")
    p.add_argument("--top", type=int, default=20, metavar="N",
                   help="how many offsets, hottest first (default 20)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p = verb("forget", "delete one module's profile")
    p.add_argument("key", help="store key, unique key prefix, or module path")
    p = verb("export", "write profiles for another host: json (counts, edges and hot "
                       "text) or pprof (gzipped profile.proto: counts only, no edges, no "
                       "hot text)")
    p.add_argument("keys", nargs="*", metavar="KEY", help="modules (default: all)")
    p.add_argument("--format", choices=("json", "pprof"), default="json",
                   help="json (default: counts, edges and hot text) or pprof (sample "
                        "counts only: no edges, no hot text)")
    p.add_argument("-o", "--output", default="-", metavar="FILE",
                   help="where to write (default -: standard output)")
    p = verb("import", "merge an export (json, or pprof counts) into the store")
    p.add_argument("file", help="the file dbr profile export wrote ('-': standard input)")


def _fail(msg: str, code: int = 1) -> int:
    print(f"dbr profile: {msg}", file=sys.stderr)
    return code


def _open(args: argparse.Namespace, readonly: bool):
    from dbr_service.common.config import load_config
    from dbr_service.profiles.profilestore import ProfileStore

    cfg = load_config(args.config)
    return ProfileStore.open_for(cfg, readonly=readonly, state_dir=args.state_dir)


def _resolve(store, text: str) -> str:
    """The key a KEY argument names (DbrError when none or several)."""
    from dbr_service.profiles.modkey import module_key, valid_key

    if "/" in text:
        return module_key(text).key
    keys = store.keys()
    if text in keys:
        return text
    hits = [k for k in keys if k.startswith(text)] if text else []
    if len(hits) == 1:
        return hits[0]
    if hits:
        raise DbrError(f"{text!r} is the start of {len(hits)} keys: {', '.join(hits[:5])}")
    if valid_key(text):
        return text
    raise DbrError(f"no module with key {text!r} in {store.path}")


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _names(prof) -> dict[int, str]:
    """Function names of a profile's offsets, when its file is still the same one."""
    from dbr_service.profiles.modkey import ModuleKeyError, module_key
    from dbr_service.common.symbols import describe, symbols_of

    try:
        if not prof.path or module_key(prof.path).key != prof.key:
            return {}
    except ModuleKeyError:
        return {}
    table = symbols_of(prof.path)
    return {off: describe(table, prof.path, off) for off in prof.counts}


def _list(args: argparse.Namespace, store) -> int:
    rows = store.summaries()
    if args.json:
        print(json.dumps([r.__dict__ for r in rows], indent=1))
        return 0
    if not rows:
        print(f"no profiles in {store.path}")
        return 0
    print(f"{'KEY':<42} {'RUNS':>5} {'LAST SEEN':<19} {'OFFSETS':>7} {'SAMPLES':>10} "
          f"{'REGIONS':>7}  PATH")
    for r in rows:
        print(f"{r.key:<42} {r.runs:>5} {_when(r.last_seen):<19} {r.offsets:>7} "
              f"{r.samples:>10.0f} {r.regions:>7}  {r.path}")
    return 0


def _show(args: argparse.Namespace, store) -> int:
    from dbr_service.profiles.profiledata import hot_text_to_json

    key = _resolve(store, args.key)
    prof = store.lookup(key)
    if prof is None:
        return _fail(f"no profile of {args.key} ({key}) in {store.path}")
    names = _names(prof)
    top = prof.top(max(0, args.top))
    total = sum(prof.counts.values()) or 1.0
    if args.json:
        print(json.dumps({"key": prof.key, "path": prof.path, "build_id": prof.build_id,
                          "runs": prof.runs, "first_seen": prof.first_seen,
                          "last_seen": prof.last_seen, "samples": sum(prof.counts.values()),
                          "offsets": len(prof.counts), "edges": len(prof.edges),
                          "top": [{"offset": o, "count": c, "name": names.get(o)}
                                  for o, c in top],
                          "hot_text": hot_text_to_json(prof.hot_text)}, indent=1))
        return 0
    print(f"module     {prof.path}\nkey        {prof.key}"
          f"{'  (build id)' if prof.build_id else ''}\nruns       {prof.runs}\n"
          f"first seen {_when(prof.first_seen)}\nlast seen  {_when(prof.last_seen)}\n"
          f"samples    {sum(prof.counts.values()):.0f} at {len(prof.counts)} offsets, "
          f"{len(prof.edges)} edges")
    if not names:
        print("(the file at that path is not this module: offsets are not named)")
    print(f"\n{'OFFSET':>10} {'COUNT':>10} {'SHARE':>6}  NAME")
    for off, c in top:
        print(f"{off:>#10x} {c:>10.1f} {100 * c / total:>5.1f}%  {names.get(off, '')}")
    print(f"\nhot text: {len(prof.hot_text)} region(s)")
    for i, r in enumerate(prof.hot_text):
        ents = ", ".join(f"{e.offset:#x} [{e.orig.hex()}]" for e in r.entries)
        print(f"  {i + 1}: entries {ents}; {len(r.blocks)} block range(s), "
              f"{sum(hi - lo for lo, hi in r.blocks)} bytes")
    return 0


def _export(args: argparse.Namespace, store) -> int:
    from dbr_service.profiles import pprof
    from dbr_service.profiles.profiledata import profiles_to_doc

    keys = [_resolve(store, k) for k in args.keys] if args.keys else store.keys()
    profiles = []
    for k in keys:
        p = store.lookup(k)
        if p is None:
            return _fail(f"no profile of {k} in {store.path}")
        profiles.append(p)
    if args.format == "pprof":
        data = pprof.encode(profiles, {p.key: _names(p) for p in profiles})
    else:
        data = json.dumps(profiles_to_doc(profiles, time.time())).encode() + b"\n"
    if args.output == "-":
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()
    else:
        tmp = f"{args.output}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, args.output)
        except BaseException:
            os.unlink(tmp)
            raise
        print(f"{len(profiles)} module(s) written to {args.output} ({args.format}, "
              f"{len(data)} bytes)", file=sys.stderr)
    return 0


def _read_input(name: str) -> bytes:
    if name == "-":
        data = sys.stdin.buffer.read(MAX_IMPORT_FILE + 1)
    else:
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise DbrError(f"{name}: not a regular file")
            data = f.read(MAX_IMPORT_FILE + 1)
    if len(data) > MAX_IMPORT_FILE:
        raise DbrError(f"{name}: larger than {MAX_IMPORT_FILE} bytes")
    return data


def parse_import(data: bytes, now: float) -> tuple[list[Any], bool, int]:
    """(profiles, whether they carry hot text, mappings left out) of an export."""
    from dbr_service.profiles import pprof
    from dbr_service.profiles.profiledata import ProfileDataError, profiles_from_doc

    if data.lstrip()[:1] != b"{":
        try:
            profiles, skipped = pprof.to_profiles(pprof.decode(data), now)
        except pprof.PprofError as exc:
            raise pprof.PprofError(f"neither a JSON export nor a pprof profile: {exc}") \
                from None
        return profiles, False, skipped
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise ProfileDataError(f"not JSON: {exc}") from None
    return profiles_from_doc(doc), True, 0


def _import(args: argparse.Namespace, store) -> int:
    data = _read_input(args.file)
    profiles, hot, skipped = parse_import(data, time.time())
    for p in profiles:
        store.merge_profile(p, with_hot_text=hot)
    expired = store.expire()
    print(f"{len(profiles)} module(s) merged into {store.path}"
          + (f", {skipped} mapping(s) without a build id left out" if skipped else "")
          + (f", {expired} expired" if expired else ""), file=sys.stderr)
    return 0


def run(args: argparse.Namespace) -> int:
    verbs = {"list": _list, "show": _show, "export": _export, "forget": None,
             "import": _import}
    if args.verb == "show" and args.top < 0:
        return _fail("--top must be 0 or more", 2)
    try:
        with _open(args, readonly=args.verb in ("list", "show", "export")) as store:
            if args.verb == "forget":
                key = _resolve(store, args.key)
                if not store.forget(key):
                    return _fail(f"no profile of {args.key} ({key}) in {store.path}")
                print(f"forgot {key}", file=sys.stderr)
                return 0
            return verbs[args.verb](args, store)
    except DbrError as exc:
        return _fail(str(exc))
    except sqlite3.Error as exc:
        return _fail(f"profile store: {exc}")
    except BrokenPipeError:
        raise                   # cli.main: the reader went away
    except OSError as exc:
        where = f"{exc.filename}: " if exc.filename else ""
        return _fail(f"{where}{exc.strerror or exc}")
