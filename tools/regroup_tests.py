#!/usr/bin/env python3
"""Group the test modules of tests/ by layer: tests/unit, tests/agent, tests/live.

    python3 tools/regroup_tests.py [--dry-run] [--explain] [--root DIR]

Run from anywhere inside a git work tree (or name it with ``--root``).  Every
``tests/test_*.py`` is placed in a layer, by ``OVERRIDES`` if it is listed there, else by
``RULE`` applied to its text (what it imports and runs):

* live: a real service: ``ServiceProc`` or ``paused_prog`` from the shared helpers, a
  ``Service``/``HostService`` built in the test, ``dbr run`` (the CLI with ``run``), or
  a benchmark run (``-m bench...``);
* agent: the C agent with a client program and no real service: ``FakeService`` (or
  the ``svc``/``client_conn`` fixtures of tests/conftest.py), ``spawn_client``,
  ``run_client``, ``agent_path``, ``dbr_agent``, ``LD_PRELOAD``, an agent connection;
* unit: none of those and no process of its own: no ``Popen``, no fork, and each
  ``subprocess`` call runs a build tool (gcc, nm, readelf, ...) or this Python;
* anything else (a program run without agent or service) the rule does not place: the
  file is reported with what was seen and nothing changes.  Place it in ``OVERRIDES``
  (with the reason) and run again.

Then each file is moved with ``git mv``, paths computed from ``__file__`` get one level
more (they still name what they named), and every reference in the tracked text files
is rewritten: ``tests/test_X.py`` and a bare ``test_X.py`` (not in quotes) become
``tests/LAYER/test_X.py``; a glob such as ``tests/test_bench_*.py`` is rewritten when all
its files are in one layer.  The Makefile gets a ``test-unit`` target.  A test module that
imports a test module of another layer refuses the move (move what they share into a
helper module of tests/).  Helpers, conftest.py and program directories stay in tests/:
the rootdir conftest puts tests/ on sys.path.  Running again on a grouped tree changes
nothing; tests/unit/test_structure.py checks that no test file is left in tests/.
"""

from __future__ import annotations

import argparse
import ast
import fnmatch
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from relayout import relayout  # noqa: E402
from restructure import git, tracked_text_files  # noqa: E402

LAYERS = ("unit", "agent", "live")

#: Files the rule does not place, or places wrongly: file name -> (layer, why).
OVERRIDES: dict[str, tuple[str, str]] = {
    # pure checks whose processes are build steps, tools, the test's own Python or a
    # program that serves one check as a target
    "test_protocol_layout.py": ("unit", "runs a compiled offsetof printer, nothing else"),
    "test_codegen_cfi.py": ("unit", "CFI parsing against readelf; one program built here "
                                    "runs a copy of its function with the CFI registered"),
    "test_region_discovery.py": ("unit", "discovery on compiled, stripped files; one "
                                         "check reads a running program's memory"),
    "test_region_hot_functions.py": ("unit", "objdump and `dbr analyze` (offline) only"),
    "test_profilestore.py": ("unit", "its other processes are Python writers of the store"),
    "test_profile_cli.py": ("unit", "`dbr profile` (offline); a Python holder of the store"),
    "test_branch_traces.py": ("unit", "synthetic programs and recorded streams; perf is "
                                      "opened on a spinning Python once"),
    "test_speedcheck.py": ("unit", "made-up progress readings; one check reads a running "
                                   "Python's progress"),
    "test_region_hot_text.py": ("unit", "the branch index and selection on a compiled "
                                        "program, offline `dbr analyze`; it runs the program "
                                        "once to check it works"),
    # real programs sampled or read while they run, without agent or service
    "test_sampling.py": ("live", "samples real programs with perf and the agent timer"),
    "test_stacks.py": ("live", "call-stack samples of real programs"),
    "test_analyze_perf.py": ("live", "`perf record` of a real program, then dbr analyze"),
    "test_procfs.py": ("live", "reads a running client whose main thread ended"),
    "test_rebase.py": ("live", "a selection moved between two running processes"),
}

#: Commands the unit layer may run: build tools and this Python.
TOOLS = {"gcc", "g++", "cc", "clang", "as", "ld", "ar", "strip", "nm", "readelf",
         "objdump", "objcopy", "sleep", "true"}
LIVE_NAMES = {"ServiceProc", "paused_prog"}
AGENT_NAMES = {"FakeService", "spawn_client", "run_client", "agent_path", "AgentConnection",
               "listen", "run_birth"}
AGENT_FIXTURES = {"svc", "client_conn"}
DBR_RUN = re.compile(r'(?:"dbr_service\.commands\.cli"\s*,|\bDBR\s*\+\s*\[|\*DBR\s*,|'
                     r'"dbr"\s*,|/dbr"\s*,)\s*"run"')
BENCH_RUN = re.compile(r'"-m"\s*,\s*"bench(?:\.\w+)*"')


class Refused(Exception):
    """Nothing was changed, for the reason given."""


# --- the rule ----------------------------------------------------------------------------

def _call_name(node: ast.Call) -> str:
    f = node.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


def _runs_own_process(node: ast.Call) -> str | None:
    """What a subprocess call runs when it is not a build tool or this Python."""
    f = node.func
    if not (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name)
            and f.value.id == "subprocess"
            and f.attr in ("run", "call", "check_call", "check_output", "Popen")):
        return None
    argv = node.args[0] if node.args else None
    if f.attr == "Popen":
        return "Popen"
    if isinstance(argv, (ast.List, ast.Tuple)) and argv.elts:
        first = argv.elts[0]
        if isinstance(first, ast.Constant) and first.value in TOOLS:
            return None
        if isinstance(first, ast.Attribute) and ast.unparse(first) == "sys.executable":
            return None
        if isinstance(first, ast.Starred) and ast.unparse(first.value) == "DBR":
            return None
    return f"subprocess.{f.attr}({ast.unparse(argv) if argv else ''})"[:70]


def markers(text: str, where: str = "?") -> dict[str, list[str]]:
    """What the module uses, per layer: {"live": [...], "agent": [...], "process": [...]}."""
    tree = ast.parse(text, where)
    seen: dict[str, list[str]] = {"live": [], "agent": [], "process": []}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            for a in node.names:
                if a.name in LIVE_NAMES or node.module == "probe_helpers":
                    seen["live"].append(f"imports {a.name}")
                elif a.name in AGENT_NAMES and (a.name != "listen"
                                                or (node.module or "").endswith("agentconn")):
                    seen["agent"].append(f"imports {a.name}")
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "dbr_agent":
                    seen["agent"].append("imports dbr_agent")
                elif a.name == "probe_helpers":
                    seen["live"].append("imports probe_helpers")
        elif isinstance(node, ast.Call):
            name = _call_name(node)
            if name in ("Service", "HostService"):
                seen["live"].append(f"builds a {name}")
            elif name == "fork" and ast.unparse(node.func) == "os.fork":
                seen["process"].append("os.fork")
            else:
                what = _runs_own_process(node)
                if what:
                    seen["process"].append(what)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                and node.name.startswith("test"):
            for arg in node.args.args:
                if arg.arg in AGENT_FIXTURES:
                    seen["agent"].append(f"fixture {arg.arg}")
        elif isinstance(node, ast.Constant) and node.value in ("LD_PRELOAD", "dbr_agent"):
            seen["agent"].append(repr(node.value))
    if DBR_RUN.search(text):
        seen["live"].append("dbr run")
    if BENCH_RUN.search(text):
        seen["live"].append("a benchmark run")
    # a module with its own ``svc`` fixture is judged by what that fixture builds
    if re.search(r"^def svc\(|name=\"svc\"", text, re.M):
        seen["agent"] = [m for m in seen["agent"] if m != "fixture svc"]
    return {k: sorted(set(v)) for k, v in seen.items()}


def rule(text: str, where: str = "?") -> tuple[str | None, str]:
    """(layer or None, why) for a test module's text."""
    m = markers(text, where)
    if m["live"]:
        return "live", ", ".join(m["live"])
    if m["agent"]:
        return "agent", ", ".join(m["agent"])
    if m["process"]:
        return None, "runs " + "; ".join(m["process"][:3])
    return "unit", "no service, no agent, no process of its own"


def place(name: str, text: str) -> tuple[str | None, str]:
    if name in OVERRIDES:
        layer, why = OVERRIDES[name]
        return layer, f"table: {why}"
    return rule(text, name)


# --- the tree ------------------------------------------------------------------------------

def test_files(root: Path) -> tuple[list[Path], dict[str, str]]:
    """(test modules still in tests/, name -> layer of those already in a layer)."""
    flat = sorted((root / "tests").glob("test_*.py"))
    placed = {}
    for layer in LAYERS:
        for p in sorted((root / "tests" / layer).glob("test_*.py")):
            placed[p.name] = layer
    return flat, placed


def test_imports(text: str, where: str) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(text, where)):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("test_")}
        elif isinstance(node, ast.ImportFrom) and not node.level \
                and (node.module or "").startswith("test_"):
            out.add(node.module)
    return out


FILE_CHAIN = re.compile(r"Path\(__file__\)(\.resolve\(\)|\.absolute\(\))?"
                        r"(?:((?:\.parent\b)+)|\.parents\[(\d+)\])")
DIRNAME = re.compile(r"os\.path\.dirname\(((?:os\.path\.(?:abspath|realpath)\()?__file__\)?)\)")


def deepen_file_refs(text: str) -> tuple[str, int]:
    """One level more for every path computed from ``__file__`` (the module moved down
    one directory, what it named did not)."""
    def chain(m: re.Match) -> str:
        if m[2]:
            return f"Path(__file__){m[1] or ''}{m[2]}.parent"
        return f"Path(__file__){m[1] or ''}.parents[{int(m[3]) + 1}]"
    text, a = FILE_CHAIN.subn(chain, text)
    text, b = DIRNAME.subn(lambda m: f"os.path.dirname(os.path.dirname({m[1]}))", text)
    return text, a + b


class Rewriter:
    """``tests/test_X.py``, bare ``test_X.py`` and globs of them to their layer's path."""

    PATH = re.compile(r"(?<![\w/.\-])tests/(test_[\w*]+\.py)\b")
    BARE = re.compile(r"(?<![\w/.\-\"'*])(test_\w+\.py)\b")

    def __init__(self, layer_of: dict[str, str]) -> None:
        self.layer_of = layer_of
        self.notes: list[str] = []

    def _path(self, m: re.Match, where: str) -> str:
        name = m[1]
        if "*" in name:
            layers = {v for k, v in self.layer_of.items() if fnmatch.fnmatch(k, name)}
            if not layers:
                self.notes.append(f"{where}: tests/{name} names no test file: not rewritten")
                return m[0]
            return f"tests/{layers.pop() if len(layers) == 1 else '*'}/{name}"
        if name not in self.layer_of:
            self.notes.append(f"{where}: tests/{name} names no test file: not rewritten")
            return m[0]
        return f"tests/{self.layer_of[name]}/{name}"

    def _bare(self, m: re.Match) -> str:
        name = m[1]
        return f"tests/{self.layer_of[name]}/{name}" if name in self.layer_of else m[0]

    def rewrite(self, line: str, where: str) -> str:
        line = self.PATH.sub(lambda m: self._path(m, where), line)
        return self.BARE.sub(self._bare, line)


MAKE_TARGET = """
# the unit layer alone (pure Python: no service, no agent, no program of its own; seconds)
test-unit: build
\t$(PY) -m pytest -q -p no:cacheprovider tests/unit
"""


def makefile_target(text: str) -> str:
    """The Makefile with a ``test-unit`` target after ``test-long`` (once)."""
    if re.search(r"^test-unit:", text, re.M):
        return text
    text = re.sub(r"^(\.PHONY:.*?\btest-long\b)", r"\1 test-unit", text, count=1, flags=re.M)
    m = re.search(r"^test-long:.*\n(?:\t.*\n)*", text, re.M)
    if not m:
        raise Refused("Makefile: no test-long target to put test-unit after")
    return text[:m.end()] + MAKE_TARGET + text[m.end():]


# --- the run -------------------------------------------------------------------------------

def plan(root: Path) -> tuple[dict[str, tuple[str, str]], list[str], dict[str, str]]:
    """(moves: name -> (layer, why), names not placed (with why), placed already)."""
    flat, placed = test_files(root)
    moves, unplaced = {}, []
    for path in flat:
        if path.name in placed:
            raise Refused(f"tests/{path.name} and tests/{placed[path.name]}/{path.name} "
                          "both exist")
        text = path.read_text()
        layer, why = place(path.name, text)
        if path.name in OVERRIDES and rule(text, path.name)[0] == layer:
            print(f"note: OVERRIDES places {path.name} where the rule does: remove it",
                  file=sys.stderr)
        if layer is None:
            unplaced.append(f"tests/{path.name}: {why}")
        else:
            moves[path.name] = (layer, why)
    return moves, unplaced, placed


def check_imports(root: Path, layer_of: dict[str, str]) -> None:
    bad = []
    for name, layer in sorted(layer_of.items()):
        path = root / "tests" / name
        if not path.exists():
            path = root / "tests" / layer / name
        for mod in sorted(test_imports(path.read_text(), name)):
            other = layer_of.get(mod + ".py")
            if other and other != layer:
                bad.append(f"{name} ({layer}) imports {mod} ({other})")
    if bad:
        raise Refused("test modules import test modules of another layer (move what they "
                      "share into a helper module of tests/):\n  " + "\n  ".join(bad))


def run(root: Path, dry_run: bool, explain: bool, skip: set[Path]) -> int:
    moves, unplaced, placed = plan(root)
    if unplaced:
        print("test files the rule does not place (nothing changed); add each to OVERRIDES "
              "in tools/regroup_tests.py:", file=sys.stderr)
        for line in unplaced:
            print(f"  {line}", file=sys.stderr)
        return 2
    layer_of = {**placed, **{n: lay for n, (lay, _) in moves.items()}}
    check_imports(root, layer_of)
    for name, (layer, why) in sorted(moves.items()):
        print(f"move tests/{name} -> tests/{layer}/{name}" + (f"  ({why})" if explain else ""))
    counts = {lay: sum(v == lay for v in layer_of.values()) for lay in LAYERS}
    print("layers: " + ", ".join(f"{lay} {n}" for lay, n in counts.items()))
    if dry_run:
        return 0

    notes: list[str] = []
    for name, (layer, _) in sorted(moves.items()):
        (root / "tests" / layer).mkdir(exist_ok=True)
        git(root, "mv", f"tests/{name}", f"tests/{layer}/{name}")
        for pyc in (root / "tests" / "__pycache__").glob(f"{name[:-3]}.*.pyc"):
            pyc.unlink()                # stale; never imported without its source
        dst = root / "tests" / layer / name
        lines = dst.read_text().splitlines(keepends=True)
        chunks = [deepen_file_refs(line)[0] for line in lines]
        if chunks != lines:
            text, n = relayout(lines, chunks, f"tests/{layer}/{name}")
            notes += n
            dst.write_text(text)
        text = dst.read_text()
        for i, line in enumerate(text.splitlines(), 1):
            if "__file__" in line and not FILE_CHAIN.search(line) \
                    and "dirname(os.path.dirname(" not in line:
                notes.append(f"tests/{layer}/{name}:{i}: __file__ used, check: "
                             f"{line.strip()}")

    rw = Rewriter(layer_of)
    rewritten = []
    for path in tracked_text_files(root, skip):
        where = str(path.relative_to(root))
        text = path.read_text()
        if path.name == "Makefile" and path.parent == root:
            text = makefile_target(text)
        lines = text.splitlines(keepends=True)
        chunks = [rw.rewrite(line, where) for line in lines]
        if path.suffix == ".py" and chunks != lines:
            new, n = relayout(lines, chunks, where)
            notes += n
        else:
            new = "".join(chunks)
        if new != path.read_text():
            path.write_text(new)
            rewritten.append(where)
    notes += sorted(set(rw.notes))
    print(f"{len(moves)} test files moved, {len(rewritten)} files rewritten")
    for note in notes:
        print("check:", note, file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=Path, help="the work tree (default: the one here)")
    ap.add_argument("--dry-run", action="store_true", help="say what would move")
    ap.add_argument("--explain", action="store_true", help="say why each file goes where")
    args = ap.parse_args(argv)
    try:
        root = args.root or Path(git(Path.cwd(), "rev-parse", "--show-toplevel").strip())
        root = root.resolve()
        if not (root / "tests" / "conftest.py").is_file():
            raise Refused(f"{root}: no tests/conftest.py here")
        here = Path(__file__).resolve()
        return run(root, args.dry_run, args.explain, {here})
    except Refused as e:
        print(f"regroup_tests: {e}", file=sys.stderr)
        return 2
    except (OSError, SyntaxError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or ""
        print(f"regroup_tests: {e} {detail}".strip(), file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
