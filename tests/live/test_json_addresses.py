"""Every address in every JSON dbr prints is a JSON integer (docs/control-api.md,
"Addresses in JSON").

The rule this test applies to a document: a string that is a hex number (``0x...``)
is an address in the other format wherever it appears; and a field whose key names
an address (ADDRESS_KEYS, or a key ending in ``_addr``) must hold an integer, a list
of integers or null.  The documents are those of a real `dbr run --report` of a
program dbr patches, `dbr ctl --json` clients, regions, region, hotspots and events
about a live client, `dbr analyze --json` and `dbr run --compare --json`."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import capstone
import pytest
from service_helpers import ServiceProc, agent_path, build_example, kill, spawn_client

from dbr_service.region.memview import ElfMemoryView

DBR = [sys.executable, "-m", "dbr_service.commands.cli"]
needs_agent = pytest.mark.skipif(agent_path() is None, reason="libdbr_agent.so cannot be built")

#: Keys whose values are addresses (or offsets into a module, counted the same way).
ADDRESS_KEYS = {"ip", "entries", "code_at", "lo", "hi", "offset", "start", "clone_path",
                "base", "target", "load_addr"}
HEX = re.compile(r"^0x[0-9a-fA-F]+$")


def _is_address_key(key: str) -> bool:
    return key in ADDRESS_KEYS or key.endswith("_addr")


def violations(doc, where: str = "$") -> list[tuple[str, object]]:
    """(path, value) of every address in ``doc`` that is not in the integer format."""
    out: list[tuple[str, object]] = []
    if isinstance(doc, dict):
        for k, v in doc.items():
            at = f"{where}.{k}"
            if _is_address_key(str(k)):
                ok = v is None or (isinstance(v, int) and not isinstance(v, bool)) or (
                    isinstance(v, list) and all(isinstance(x, int) for x in v))
                if not ok:
                    out.append((at, v))
            out += violations(v, at)
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += violations(v, f"{where}[{i}]")
    elif isinstance(doc, str) and HEX.match(doc):
        out.append((where, doc))
    return out


def addresses(doc) -> set[str]:
    """The address keys ``doc`` holds with a value (so the check is not vacuous)."""
    if isinstance(doc, dict):
        got = {k for k, v in doc.items() if _is_address_key(str(k)) and v not in (None, [])}
        return got.union(*(addresses(v) for v in doc.values()))
    if isinstance(doc, list):
        return set().union(*(addresses(v) for v in doc))
    return set()


def test_the_rule_catches_both_kinds():
    assert violations({"a": ["0x7f12ab"], "ip": "4096"}) == [("$.a[0]", "0x7f12ab"),
                                                             ("$.ip", "4096")]
    assert violations({"entries": [1, 2], "info": {"code_at": 5, "why": "at 0x10-0x20"},
                       "offset": None}) == []


def _dbr(*args: str, env=None, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([*DBR, *args], capture_output=True, text=True, timeout=timeout,
                          env=env or dict(os.environ))


@needs_agent
def test_dbr_run_report_and_compare(tmp_path):
    prog = build_example("hotloop")
    report = tmp_path / "r.json"
    r = _dbr("run", "--embedded", "--aggressive", "--quiet", "--report", str(report), "--",
             prog, "2500")
    assert r.returncode == 0, r.stderr
    doc = json.loads(report.read_text())
    assert violations(doc) == []
    installed = [g for c in doc["clients"] for g in c["regions"] if g["state"] == "installed"]
    assert installed, doc["clients"]
    assert {"ip", "offset", "entries", "code_at"} <= addresses(doc)
    cmp = _dbr("run", "--embedded", "--compare", "1", "--json", "--report", str(report), "--",
               "true")
    assert cmp.returncode == 0, cmp.stderr
    doc = json.loads(report.read_text())
    assert doc["schema"] == "dbr.compare/1" and violations(doc) == []


@needs_agent
def test_dbr_ctl_json(tmp_path):
    prog = build_example("hotloop")
    svc = ServiceProc("--aggressive").wait_ready()
    client = None
    try:
        client = spawn_client(svc.dir, [prog, "20000"])
        svc.wait_for(lambda: any(g["state"] == "installed" for g in
                                 svc.call("regions", {"pid": client.pid})["regions"]),
                     timeout=20, what="an installed region")
        env = dict(os.environ, DBR_RUNTIME_DIR=svc.dir)
        seen: set[str] = set()
        regions = None
        for verb in (["clients"], ["regions", str(client.pid)], ["hotspots", str(client.pid)],
                     ["events"]):
            r = _dbr("ctl", "--json", *verb, env=env)
            assert r.returncode == 0, (verb, r.stderr)
            doc = json.loads(r.stdout)
            assert violations(doc) == [], verb
            seen |= addresses(doc)
            if verb[0] == "regions":
                regions = doc
        rid = regions["regions"][0]["id"]
        r = _dbr("ctl", "--json", "region", str(client.pid), rid, env=env)
        assert r.returncode == 0 and violations(json.loads(r.stdout)) == [], r.stderr
        assert {"entries", "code_at", "ip", "offset"} <= seen, seen
    finally:
        kill(client)
        svc.stop()


def test_dbr_analyze_json(tmp_path):
    src = tmp_path / "p.c"
    src.write_text("__attribute__((noinline)) long f(long n) { long s = 0;"
                   " for (long i = 0; i < n; i++) s += i ^ (s >> 3); return s; }\n"
                   "int main(int c, char **v) { return (int)f(c * 100000000L); }\n")
    exe = tmp_path / "p"
    subprocess.run(["gcc", "-O1", "-o", str(exe), str(src)], check=True)
    nm = subprocess.run(["nm", "-S", str(exe)], capture_output=True, text=True,
                        check=True).stdout
    lo, size = next((int(f[0], 16), int(f[1], 16)) for f in map(str.split, nm.splitlines())
                    if f[-1] == "f")
    code = ElfMemoryView(str(exe)).read(lo, size)
    insns = list(capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64).disasm_lite(code, lo))
    back = next((a, int(o, 16)) for a, _n, m, o in insns        # the loop's backward branch
                if m.startswith("j") and o.startswith("0x") and int(o, 16) < a)
    samples = tmp_path / "s.txt"        # the loop hot, the rest of f cold
    samples.write_text("".join(f"{a:#x} {100 if back[1] <= a <= back[0] else 1}\n"
                               for a, _n, _m, _o in insns))
    r = _dbr("analyze", str(exe), "--samples", str(samples), "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["regions"] and violations(doc) == []
    assert {"start", "entries"} <= addresses(doc)
