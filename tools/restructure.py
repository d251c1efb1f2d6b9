#!/usr/bin/env python3
"""Move dbr_service's flat modules into one package per stage of the cycle.

    python3 tools/restructure.py [--dry-run] [--extra FILE]... [--root DIR]

Run from anywhere inside a git work tree (or name it with ``--root``).  Each module in
``MAPPING`` is moved with ``git mv`` to its package, the packages get an ``__init__.py``
saying what stage they are, and every reference in the tracked files is rewritten:

* imports: ``from dbr_service.X import``, ``import dbr_service.X``,
  ``from dbr_service import X [as Y]`` (split per target package);
* dotted names anywhere (monkeypatch targets, ``-m dbr_service.X``, entry points,
  the CLI's command table, docstrings): ``dbr_service.X`` and ``dbr_service.X.attr``;
* paths: ``dbr_service/X.py``, and a bare ``X.py`` where no other file has that name;
* for a module whose name changes, a bare ``X.attr`` naming one of its top-level names;
* relative imports inside dbr_service become absolute before anything moves, and a
  moved module's ``Path(__file__)...parent`` chains get one more ``.parent``.

Modules the mapping does not know (added since) are listed and nothing is changed:
place each in an extra mapping file, one ``old = dbr_service.package.name`` a line
(``#`` starts a comment), and run again with ``--extra FILE``.  Running again on a moved
tree changes nothing.  The package order the moved tree must keep is tested by
tests/unit/test_structure.py.
"""

from __future__ import annotations

import argparse
import ast
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from relayout import relayout  # noqa: E402

PKG = "dbr_service"

#: The packages, in the order of imports (each may import those before it), and what
#: each one's ``__init__.py`` says.  sampling, codegen and region exist already.
PACKAGES: dict[str, str] = {
    "common": "Shared by every stage: errors, configuration, runtime paths, /proc and "
              "memory maps, ELF symbols\nand hot-spot names, lifecycles, files read and "
              "written for clients, service events.\nImports nothing else of dbr_service.",
    "wire": "The agent connection: the protocol's Python mirror (shared/dbr_protocol.h), "
            "framing and\nhandshake, and the connection as the installer uses it, "
            "replies checked.",
    "stacks": "Call stacks as a profiling aid: unwinding sampled stacks (CFI, frame "
              "pointers), naming,\nfolding, the call graph, and SVG flame graphs.",
    "installation": "Installation and evaluation (cycle steps 5-7): placement and emission of "
               "selected regions,\nthe installer and its records, code space and "
               "censuses, entry sites, speed checks,\njitdump records.",
    "session": "The per-client session (cycle steps 1, 6-8): one ClientSession and thread "
               "per client and\nits parts (threads, sampling windows, regions, speed "
               "checks), its cadence, CPU budget,\nsampling source, and the threads kept "
               "between sessions.",
    "profiles": "What earlier runs learned, kept across runs: the profile store, its data "
                "and module keys,\npprof, selections moved between processes, warm "
                "start.",
    "daemon": "The host service (cycle steps 2-4): sockets and sessions, sampling "
              "snapshots, the\nscheduler and worker pool, job results, the runtime "
              "directory, systemd notification,\nprograms whose runs end too soon.",
    "commands": "The `dbr` commands and the operator's side: the command table, one module per "
           "command,\nthe control socket's verbs and client, run reports and comparisons, "
           "attach and detach.",
}

#: Existing packages and where they sit in the order (documented in __init__.py already).
EXISTING = ("sampling", "codegen", "region")

#: old flat module (dbr_service/NAME.py) -> its new dotted path.  No package is named
#: like a module that moves (dbr_service.X would then mean two things).
MAPPING: dict[str, str] = {
    # common
    "errors": "common.errors", "paths": "common.paths", "config": "common.config",
    "procfs": "common.procfs", "procmaps": "common.procmaps", "symbols": "common.symbols",
    "hotnames": "common.hotnames", "states": "common.states",
    "clientfiles": "common.clientfiles", "events": "common.events",
    # wire
    "protocol": "wire.protocol", "agentconn": "wire.agentconn",
    "checked_conn": "wire.checked_conn",
    # region selection: the worker's job is selection's entry point
    "worker": "region.worker",
    # stacks
    "unwind": "stacks.unwind", "stackprof": "stacks.stackprof",
    "flamegraph": "stacks.flamegraph",
    # installation (generation, installation, evaluation)
    "install": "installation.install", "installed": "installation.installed",
    "codespace": "installation.codespace", "entry_sites": "installation.entry_sites",
    "optimize": "installation.optimize", "speedcheck": "installation.speedcheck",
    "jitdump": "installation.jitdump",
    # session
    "clients": "session.clients", "session_regions": "session.session_regions",
    "session_sampling": "session.session_sampling",
    "session_speed": "session.session_speed",
    "session_threads": "session.session_threads", "cadence": "session.cadence",
    "budget": "session.budget", "sources": "session.sources", "reuse": "session.reuse",
    # profiles
    "profilestore": "profiles.profilestore", "profiledata": "profiles.profiledata",
    "modkey": "profiles.modkey", "pprof": "profiles.pprof", "rebase": "profiles.rebase",
    "warmstart": "profiles.warmstart",
    # daemon
    "service": "daemon.service", "scheduler": "daemon.scheduler",
    "snapshots": "daemon.snapshots", "results": "daemon.results",
    "runtime_dir": "daemon.runtime_dir", "notify": "daemon.notify",
    "shortruns": "daemon.shortruns",
    # commands
    "cli": "commands.cli", "control": "commands.control", "ctlclient": "commands.ctlclient",
    "report": "commands.report", "compare": "commands.compare", "demo": "commands.demo",
    "waiting": "commands.waiting", "stackjobs": "commands.stackjobs", "attach": "commands.attach",
    "textcheck": "commands.textcheck", "cmd_agent_path": "commands.cmd_agent_path",
    "cmd_attach": "commands.cmd_attach", "cmd_ctl": "commands.cmd_ctl",
    "cmd_detach": "commands.cmd_detach", "cmd_flame": "commands.cmd_flame",
    "cmd_profile": "commands.cmd_profile", "cmd_run": "commands.cmd_run",
    "cmd_service": "commands.cmd_service",
}

IDENT = re.compile(r"^[A-Za-z_]\w*$")


class Refused(Exception):
    """Nothing was changed, for the reason given."""


def read_extra(path: Path) -> dict[str, str]:
    out = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        old, sep, new = (s.strip() for s in line.partition("="))
        new = new.removeprefix(PKG + ".")
        parts = new.split(".")
        if not sep or not IDENT.match(old) or len(parts) != 2 or not all(
                IDENT.match(p) for p in parts):
            raise Refused(f"{path}:{n}: expected 'old = {PKG}.package.name', got {line!r}")
        out[old] = new
    return out


def check_mapping(mapping: dict[str, str], root: Path) -> None:
    packages = set(PACKAGES) | set(EXISTING)
    seen: dict[str, str] = {}
    for old, new in mapping.items():
        pkg, _, name = new.partition(".")
        if pkg not in packages:
            raise Refused(f"{old} -> {PKG}.{new}: no package {pkg!r} "
                          f"(known: {', '.join(sorted(packages))})")
        if new in seen:
            raise Refused(f"{old} and {seen[new]} both go to {PKG}.{new}")
        seen[new] = old
        if pkg in mapping:
            raise Refused(f"package {pkg!r} is named like the module {PKG}/{pkg}.py, "
                          "which moves: choose another package name")
        if (root / PKG / f"{old}.py").exists() and (root / PKG / pkg / f"{name}.py").exists():
            raise Refused(f"{PKG}/{old}.py and {PKG}/{pkg}/{name}.py both exist")


def git(root: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, check=True, capture_output=True,
                          text=True).stdout


def tracked_text_files(root: Path, skip: set[Path]) -> list[Path]:
    out = []
    for rel in git(root, "ls-files", "-z").split("\0"):
        path = root / rel
        if not rel or path in skip or path.is_symlink() or not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" in data:
            continue
        try:
            data.decode()
        except UnicodeDecodeError:
            continue
        out.append(path)
    return out


# --- relative imports and __file__ ---------------------------------------------------

def absolutize(path: Path, dotted: str, is_pkg: bool) -> tuple[str, list[str]]:
    """The module's text with ``from .x import y`` made absolute (its old location)."""
    text = path.read_text()
    lines = text.splitlines(keepends=True)
    notes = []
    for node in ast.walk(ast.parse(text, str(path))):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = dotted.split(".") if is_pkg else dotted.split(".")[:-1]
            base = base[:len(base) - (node.level - 1)]
            target = ".".join(base + ([node.module] if node.module else []))
            i = node.lineno - 1
            rel = "." * node.level + (node.module or "")
            new, n = re.subn(rf"\bfrom\s+{re.escape(rel)}\s+import\b",
                             f"from {target} import", lines[i], count=1)
            if not n:
                notes.append(f"{path}:{node.lineno}: relative import not rewritten")
            lines[i] = new
    return "".join(lines), notes


FILE_CHAIN = re.compile(r"Path\(__file__\)(\.resolve\(\))?((?:\.parent\b)+)")
DIRNAME = re.compile(r"os\.path\.dirname\((os\.path\.(?:abspath|realpath)\(__file__\))\)")


def deepen_file_refs(text: str) -> tuple[str, int]:
    """One level more for every path computed from ``__file__`` (the module moved down
    one directory, what it named did not)."""
    text, a = FILE_CHAIN.subn(lambda m: f"Path(__file__){m[1] or ''}{m[2]}.parent", text)
    text, b = DIRNAME.subn(lambda m: f"os.path.dirname(os.path.dirname({m[1]}))", text)
    return text, a + b


# --- reference rewriting ---------------------------------------------------------------

class Rewriter:
    def __init__(self, mapping: dict[str, str], root: Path, others: set[str]):
        self.mapping = mapping
        self.root = root
        names = "|".join(sorted(mapping, key=len, reverse=True))
        self.dotted = re.compile(rf"(?<![\w.]){PKG}\.({names})(?!\w)")
        self.path = re.compile(rf"(?<![\w.]){PKG}/({names})\.py\b")
        # a bare X.py: only names no other file has, never right after a quote (a
        # file the code makes) or a path
        bare = [n for n in mapping if f"{n}.py" not in others]
        self.bare_names = bare
        self.bare = re.compile(rf"(?<![\w/.\-\"'])({'|'.join(bare)})\.py\b") if bare else None
        # bare X.attr for modules whose name changes: attr must be one of its names
        self.renamed: dict[str, tuple[str, set[str]]] = {}
        for old, new in mapping.items():
            if new.rpartition(".")[2] != old:
                src = root / PKG / (new.replace(".", "/") + ".py")
                if not src.exists():
                    src = root / PKG / f"{old}.py"
                self.renamed[old] = (new.rpartition(".")[2], top_level_names(src))
        self.from_import = re.compile(
            rf"^([ \t]*)from {PKG} import (\w+(?: as \w+)?(?:,[ \t]*\w+(?: as \w+)?)*)"
            r"([ \t]*(?:#.*)?)$", re.M)
        self.from_import_inline = re.compile(rf"\bfrom {PKG} import (\w+)(?: as (\w+))?\b")
        self.notes: list[str] = []

    def _dotted(self, m: re.Match) -> str:
        return f"{PKG}.{self.mapping[m[1]]}"

    def _from_import(self, m: re.Match) -> str:
        indent, names, tail = m[1], m[2], m[3]
        groups: dict[str, list[str]] = {}
        for item in (s.strip() for s in names.split(",")):
            name, _, alias = item.partition(" as ")
            if name in self.mapping:
                pkg, _, new = self.mapping[name].partition(".")
                alias = alias or (name if new != name else "")
                groups.setdefault(f"{PKG}.{pkg}", []).append(
                    new + (f" as {alias}" if alias else ""))
            else:
                groups.setdefault(PKG, []).append(item)
        if list(groups) == [PKG]:
            return m[0]
        lines = [f"{indent}from {src} import {', '.join(items)}"
                 for src, items in groups.items()]
        lines[-1] += tail
        return "\n".join(lines)

    def _from_import_inline(self, m: re.Match) -> str:
        name, alias = m[1], m[2]
        if name not in self.mapping:
            return m[0]
        pkg, _, new = self.mapping[name].partition(".")
        alias = alias or (name if new != name else "")
        return f"from {PKG}.{pkg} import {new}" + (f" as {alias}" if alias else "")

    def _bare(self, m: re.Match) -> str:
        return self.mapping[m[1]].replace(".", "/") + ".py"

    def rewrite(self, text: str, where: Path) -> str:
        """One line (or any text without multi-line constructs) rewritten."""
        if re.search(rf"\bfrom {PKG} import \(", text):
            self.notes.append(f"{where}: 'from {PKG} import (' spanning lines is not "
                              "rewritten: make it one line per package and run again")
        # dotted names first: what the from-import rules write must not be read again
        text = self.dotted.sub(self._dotted, text)
        text = self.from_import.sub(self._from_import, text)
        text = self.from_import_inline.sub(self._from_import_inline, text)
        text = self.path.sub(lambda m: f"{PKG}/{self.mapping[m[1]].replace('.', '/')}.py",
                             text)
        if self.bare:
            text = self.bare.sub(self._bare, text)
        for old, (new, names) in self.renamed.items():
            if names:
                text = re.sub(rf"(?<![\w./]){old}\.({'|'.join(sorted(names))})\b",
                              rf"{new}.\1", text)
        return text


def top_level_names(path: Path) -> set[str]:
    if not path.exists():
        return set()
    out = set()
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                if isinstance(t, ast.Name):
                    out.add(t.id)
    return out


# --- the run -----------------------------------------------------------------------------

def plan(root: Path, mapping: dict[str, str]) -> tuple[list[tuple[str, str]], list[str]]:
    """(moves still to do, flat modules the mapping does not place)."""
    flat = sorted(p.stem for p in (root / PKG).glob("*.py") if p.stem != "__init__")
    unknown = [m for m in flat if m not in mapping]
    moves = [(m, mapping[m]) for m in flat if m in mapping]
    return moves, unknown


def run(root: Path, mapping: dict[str, str], dry_run: bool, skip: set[Path]) -> int:
    check_mapping(mapping, root)
    moves, unknown = plan(root, mapping)
    if unknown:
        print("modules the mapping does not place (nothing changed):", file=sys.stderr)
        for m in unknown:
            print(f"  {PKG}/{m}.py", file=sys.stderr)
        print("place each in a file of 'old = dbr_service.package.name' lines and run "
              "again with --extra FILE", file=sys.stderr)
        return 2
    for old, new in moves:
        print(f"move {PKG}/{old}.py -> {PKG}/{new.replace('.', '/')}.py")
    if dry_run:
        return 0

    # everything that can refuse is done before anything changes
    ours = {root / PKG / f"{old}.py" for old in mapping}
    ours |= {root / PKG / (new.replace(".", "/") + ".py") for new in mapping.values()}
    others = {p.name for p in tracked_text_files(root, skip) if p not in ours}
    rw = Rewriter(mapping, root, others)
    notes: list[str] = []
    # relative imports are made absolute where the modules still are
    for path in sorted((root / PKG).rglob("*.py")):
        rel = path.relative_to(root).with_suffix("").parts
        is_pkg = rel[-1] == "__init__"
        dotted = ".".join(rel[:-1] if is_pkg else rel)
        text, n = absolutize(path, dotted, is_pkg)
        notes += n
        if text != path.read_text():
            path.write_text(text)
            print(f"absolute imports: {path.relative_to(root)}")

    for pkg, doc in PACKAGES.items():
        init = root / PKG / pkg / "__init__.py"
        if not init.exists():
            init.parent.mkdir(exist_ok=True)
            init.write_text(f'"""{doc}\n"""\n')
            git(root, "add", str(init.relative_to(root)))
    for old, new in moves:
        src = root / PKG / f"{old}.py"
        dst = root / PKG / (new.replace(".", "/") + ".py")
        git(root, "mv", str(src.relative_to(root)), str(dst.relative_to(root)))
        for pyc in (root / PKG / "__pycache__").glob(f"{old}.*.pyc"):
            pyc.unlink()                # stale; never imported without its source
        text, n = deepen_file_refs(dst.read_text())
        if n:
            dst.write_text(text)
            print(f"{dst.relative_to(root)}: {n} path(s) from __file__ one level deeper")
        if "__file__" in text.replace("__name__", ""):
            for i, line in enumerate(text.splitlines(), 1):
                if "__file__" in line and not FILE_CHAIN.search(line) \
                        and "dirname(os.path.dirname(" not in line:
                    notes.append(f"{dst.relative_to(root)}:{i}: __file__ used, check: "
                                 f"{line.strip()}")

    files = tracked_text_files(root, skip)
    rewritten = []
    for path in files:
        text = path.read_text()
        lines = text.splitlines(keepends=True)
        chunks = [rw.rewrite(line, path.relative_to(root)) for line in lines]
        if path.suffix == ".py" and chunks != lines:
            new, n = relayout(lines, chunks, str(path.relative_to(root)))
            notes += n
        else:
            new = "".join(chunks)
        if new != text:
            path.write_text(new)
            rewritten.append(path)
    notes += rw.notes
    if any(p.name in ("pyproject.toml", "setup.py", "setup.cfg") for p in rewritten):
        print("entry points changed: run `make build` again (it reinstalls dbr into .venv)")
    skipped = sorted(set(mapping) - set(rw.bare_names))
    print(f"{len(moves)} modules moved, {len(rewritten)} files rewritten")
    if skipped:
        print("bare 'X.py' not rewritten (another file has that name): "
              + ", ".join(f"{n}.py" for n in skipped))
    for note in notes:
        print("check:", note, file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=Path, help="the work tree (default: the one here)")
    ap.add_argument("--extra", type=Path, action="append", default=[],
                    help="more 'old = dbr_service.package.name' lines (repeatable)")
    ap.add_argument("--dry-run", action="store_true", help="say what would move")
    args = ap.parse_args(argv)
    try:
        root = args.root or Path(subprocess.run(
            ["git", "rev-parse", "--show-toplevel"], check=True, capture_output=True,
            text=True).stdout.strip())
        root = root.resolve()
        if not (root / PKG / "__init__.py").exists():
            raise Refused(f"{root}: no {PKG}/ here")
        mapping = {k: v for k, v in MAPPING.items()}
        for path in args.extra:
            mapping.update(read_extra(path))
        here = Path(__file__).resolve()
        skip = {here, here.with_name("relayout.py"), *(p.resolve() for p in args.extra)}
        return run(root, mapping, args.dry_run, skip)
    except Refused as e:
        print(f"restructure: {e}", file=sys.stderr)
        return 2
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or ""
        print(f"restructure: {e} {detail}".strip(), file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
