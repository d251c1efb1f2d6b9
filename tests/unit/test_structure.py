"""The import graph of dbr_service, its packages' order, and module sizes.

Every module is parsed (not imported) and its imports of dbr_service modules are
collected in two kinds: *module-level* (run when the module is imported; imports in
``try``/``if`` blocks and class bodies included) and *deferred* (inside a function,
or under ``if TYPE_CHECKING``).  A cycle among module-level imports is an import-order
bug waiting to happen; deferred imports break cycles, and the ones that close a cycle
are listed here exactly, so that a new one or a removed one is noticed.
"""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "dbr_service"

#: Strongly connected components of the whole import graph (module-level and deferred
#: imports together) that are allowed, each with the reason it still exists: none.
KNOWN_CYCLES: set[frozenset[str]] = set()

#: The packages of dbr_service, one per stage of the cycle, in the order of imports: a
#: module may import its own package and those before it (the top-level
#: ``dbr_service`` package, which holds the version, comes before all).  Deferred
#: imports count too.  docs/architecture.md, "Where things live", describes each.
PACKAGE_ORDER = ["common", "wire", "sampling", "codegen", "region", "stacks",
                 "installation", "session", "profiles", "daemon", "commands"]

#: Imports against that order, as (importing package, imported module): each reason.
ORDER_EXCEPTIONS: dict[tuple[str, str], str] = {
    ("codegen", "region.model"):
        "codegen translates the region model selection builds, and selection asks "
        "codegen what the code will be (relocator, dispatch and table plans, calls, "
        "CFI): the model is the data both stages share",
    ("codegen", "region.jumptable"):
        "codegen's table translation takes selection's bound on a table and its "
        "register helpers, so that it accepts exactly the tables selection found",
}

#: Lines a module of dbr_service may have.
MAX_MODULE_LINES = 600

#: What the offline tool (``dbr analyze``) must not load when it is imported.
SERVICE_MODULES = {"dbr_service.daemon.scheduler", "dbr_service.daemon.service",
                   "dbr_service.session.clients",
                   "dbr_service.commands.control", "dbr_service.daemon.snapshots",
                   "dbr_service.daemon.results",
                   "dbr_service.session.sources", "dbr_service.daemon.runtime_dir",
                   "dbr_service.session.cadence",
                   "dbr_service.session.session_threads", "dbr_service.session.session_sampling",
                   "dbr_service.session.session_regions", "dbr_service.session.session_speed",
                   "dbr_service.wire.checked_conn", "dbr_service.region.worker",
                   "dbr_service.session.budget", "dbr_service.common.events"}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_pkg: bool,
             known: dict[str, Path]) -> set[str]:
    """The dbr_service modules one import statement loads (the deepest known module
    of each name: ``from dbr_service.wire import protocol`` is dbr_service.wire.protocol)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            pkg = module.split(".") if is_pkg else module.split(".")[:-1]
            pkg = pkg[:len(pkg) - (node.level - 1)]
            base = ".".join(pkg + ([base] if base else []))
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                 for a in node.names]
    out = set()
    for name in names:
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name.startswith(PACKAGE) and name != module:
            out.add(name)
    return out


def import_graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(module-level imports, deferred imports): module -> the dbr_service modules it
    imports, for every module of the package."""
    known = _modules()
    top: dict[str, set[str]] = {m: set() for m in known}
    deferred: dict[str, set[str]] = {m: set() for m in known}
    for module, path in known.items():
        is_pkg = path.name == "__init__.py"

        def walk(body: list[ast.stmt], at_import: bool) -> None:
            for node in body:
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    (top if at_import else deferred)[module] |= _targets(
                        node, module, is_pkg, known)
                elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    walk(node.body, False)
                elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                    walk(node.body, False)
                    walk(node.orelse, at_import)
                else:
                    for field in ("body", "orelse", "finalbody", "handlers"):
                        sub = getattr(node, field, None)
                        if isinstance(sub, list):
                            walk(sub, at_import)

        walk(ast.parse(path.read_text(), str(path)).body, True)
    return top, deferred


def _graph(*edges: dict[str, set[str]]) -> nx.DiGraph:
    g = nx.DiGraph()
    for kind in edges:
        for a, bs in kind.items():
            g.add_node(a)
            g.add_edges_from((a, b) for b in bs)
    return g


def _cycles(g: nx.DiGraph) -> set[frozenset[str]]:
    return {frozenset(c) for c in nx.strongly_connected_components(g) if len(c) > 1}


def _describe(cycles: set[frozenset[str]], top, deferred) -> str:
    lines = []
    for c in sorted(cycles, key=sorted):
        lines.append(" <-> ".join(sorted(c)))
        for a in sorted(c):
            for b in sorted(top[a] & c):
                lines.append(f"    {a} -> {b} (module level)")
            for b in sorted(deferred[a] & c - top[a]):
                lines.append(f"    {a} -> {b} (deferred)")
    return "\n".join(lines)


def test_the_graph_covers_the_package() -> None:
    top, deferred = import_graph()
    assert "dbr_service.region.analyze" in top and "dbr_service.daemon.service" in top
    assert "dbr_service.session.clients" in top["dbr_service.daemon.service"]
    # from dbr_service import
    assert "dbr_service.wire.protocol" in top["dbr_service.session.clients"]
    assert "dbr_service.region.worker" in deferred["dbr_service.region.analyze"]


def test_no_import_cycle_among_module_level_imports() -> None:
    top, deferred = import_graph()
    cycles = _cycles(_graph(top))
    assert not cycles, "module-level import cycles:\n" + _describe(cycles, top, deferred)


def test_cycles_through_deferred_imports_are_the_known_ones() -> None:
    """A new cycle (even one broken by a deferred import) or a removed one fails here:
    update KNOWN_CYCLES with the change that made it."""
    top, deferred = import_graph()
    cycles = _cycles(_graph(top, deferred))
    assert cycles == KNOWN_CYCLES, ("new:\n" + _describe(cycles - KNOWN_CYCLES, top, deferred)
                                    + "\nno longer cycles:\n"
                                    + "\n".join(" <-> ".join(sorted(c))
                                                for c in KNOWN_CYCLES - cycles))


def test_no_import_cycle_at_all() -> None:
    """Not even through imports inside functions or for type checking: the direction
    of imports is one way."""
    top, deferred = import_graph()
    cycles = _cycles(_graph(top, deferred))
    assert not cycles, _describe(cycles, top, deferred)


def test_offline_analyze_does_not_load_the_service() -> None:
    """``dbr analyze`` (dbr_service.region.analyze) runs without a service: importing it
    must not load the scheduler, the service or its sessions (it may import them inside
    the functions that need them)."""
    top, _ = import_graph()
    loaded = nx.descendants(_graph(top), "dbr_service.region.analyze")
    assert not loaded & SERVICE_MODULES, sorted(loaded & SERVICE_MODULES)
    # the same, by importing it in a fresh interpreter
    code = ("import sys, dbr_service.region.analyze; "
            f"print(sorted(m for m in sys.modules if m in {sorted(SERVICE_MODULES)!r}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, check=True).stdout.strip()
    assert out == "[]", out


def _package_of(module: str) -> str | None:
    """A module's package below dbr_service ("" for dbr_service itself); None for a
    module directly in dbr_service."""
    parts = module.split(".")
    if len(parts) == 1:
        return ""
    if (ROOT / PACKAGE / parts[1]).is_dir():
        return parts[1]
    return None


def _against_the_order(top, deferred) -> dict[tuple[str, str], list[str]]:
    """(importing package, imported module) -> the importing modules, for every import
    that goes from a package to a later one."""
    rank = {"": -1, **{p: i for i, p in enumerate(PACKAGE_ORDER)}}
    out: dict[tuple[str, str], list[str]] = {}
    for a in top:
        for b in top[a] | deferred[a]:
            pa, pb = _package_of(a), _package_of(b)
            if pa in rank and pb in rank and rank[pb] > rank[pa]:
                out.setdefault((pa, b.removeprefix(PACKAGE + ".")), []).append(a)
    return out


def test_every_module_is_in_a_declared_package() -> None:
    top, _ = import_graph()
    loose = sorted(m for m in top if _package_of(m) is None)
    assert not loose, f"modules directly in {PACKAGE}/ (move them into a package): {loose}"
    packages = {p.name for p in (ROOT / PACKAGE).iterdir() if (p / "__init__.py").exists()}
    assert packages == set(PACKAGE_ORDER), (
        f"packages not in PACKAGE_ORDER: {sorted(packages - set(PACKAGE_ORDER))}, "
        f"in it but gone: {sorted(set(PACKAGE_ORDER) - packages)}")


def test_imports_follow_the_package_order() -> None:
    """No module imports a later package, even inside a function, but for the listed
    exceptions."""
    top, deferred = import_graph()
    bad = {k: v for k, v in _against_the_order(top, deferred).items()
           if k not in ORDER_EXCEPTIONS}
    assert not bad, "imports against PACKAGE_ORDER:\n" + "\n".join(
        f"    {', '.join(sorted(v))} -> {PACKAGE}.{m} ({p} before {m.split('.')[0]})"
        for (p, m), v in sorted(bad.items()))


def test_every_order_exception_is_used() -> None:
    top, deferred = import_graph()
    unused = set(ORDER_EXCEPTIONS) - set(_against_the_order(top, deferred))
    assert not unused, f"ORDER_EXCEPTIONS no longer needed (remove them): {sorted(unused)}"


def test_the_order_check_sees_a_violation() -> None:
    """A module of an early package importing a later one is found (checked on a
    made-up graph, so that the check cannot pass by seeing nothing)."""
    top = {f"{PACKAGE}.common.errors": {f"{PACKAGE}.commands.ctlclient"},
           f"{PACKAGE}.commands.ctlclient": set()}
    deferred = {m: set() for m in top}
    assert _against_the_order(top, deferred) == {("common", "commands.ctlclient"):
                                                 [f"{PACKAGE}.common.errors"]}
    assert _against_the_order(deferred, top) == _against_the_order(top, deferred)


def test_no_module_is_too_long() -> None:
    long = {str(p.relative_to(ROOT)): n for p in (ROOT / PACKAGE).rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split them): {long}"


# --- the test layers ---------------------------------------------------------------------

def _regroup():
    """tools/regroup_tests.py, the rule and table that place each test file."""
    spec = importlib.util.spec_from_file_location("regroup_tests",
                                                  ROOT / "tools" / "regroup_tests.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_test_file_is_in_a_layer() -> None:
    """Test modules live in tests/unit, tests/agent or tests/live, never in tests/ itself
    or elsewhere below it (helpers, conftest.py and program directories stay in tests/);
    tools/regroup_tests.py moves any added in tests/."""
    layers = _regroup().LAYERS
    stray = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
                   if p.parent.parent != ROOT / "tests" or p.parent.name not in layers)
    assert not stray, f"test files outside tests/{{{','.join(layers)}}}/: {stray}"
    names = [p.name for p in (ROOT / "tests").rglob("test_*.py")]
    assert len(names) == len(set(names)), "two test files of one name (pytest imports "\
        "them by name)"


def test_every_test_file_is_in_the_layer_its_rule_gives() -> None:
    """Where a test file is agrees with the rule of tools/regroup_tests.py or its table,
    and no test module imports one of another layer."""
    rg = _regroup()
    layer_of = {}
    wrong = []
    for layer in rg.LAYERS:
        for p in sorted((ROOT / "tests" / layer).glob("test_*.py")):
            layer_of[p.name] = layer
            want, why = rg.place(p.name, p.read_text())
            if want != layer:
                wrong.append(f"tests/{layer}/{p.name}: the rule says {want} ({why})")
    assert layer_of and not wrong, "\n".join(wrong)
    rg.check_imports(ROOT, layer_of)


def test_the_layer_rule_sees_each_layer() -> None:
    """The rule on made-up modules, so that the check above cannot pass by placing
    everything in one layer."""
    rule = _regroup().rule
    assert rule("from service_helpers import ServiceProc\n")[0] == "live"
    dbr_run = 'DBR = ["x"]\nsubprocess.run(DBR + [' + '"run", "--", "p"])\n'
    assert rule(dbr_run)[0] == "live"        # (split, or this file would be "live")
    assert rule("from harness import FakeService, compile_c\n")[0] == "agent"
    assert rule("def test_x(svc):\n    pass\n")[0] == "agent"
    assert rule("import subprocess\nsubprocess.Popen(['./prog'])\n")[0] is None
    assert rule("import subprocess\nsubprocess.run(['gcc', 'p.c'])\n")[0] == "unit"
    assert rule("import math\n")[0] == "unit"
