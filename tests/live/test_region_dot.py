"""Region graphs (SuperRegion.to_dot, region/dot.py): every block's node is labelled
with its address, the function holding it (``func+0x12`` from .symtab/.dynsym, else
``fn_START`` from .eh_frame) and its disassembly, left-aligned, escaped, at most
MAX_DOT_INSNS instructions and "..." beyond; as `dbr analyze --dot-dir` and
`dbr ctl region --dot` write them.  Checked by parsing the DOT text."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from service_helpers import ServiceProc, agent_path, build_example, kill, spawn_client

from dbr_service.region.dot import MAX_DOT_INSNS
from dbr_service.region.model import BasicBlock, EdgeKind, SuperRegion, TermKind, START, END

needs_agent = pytest.mark.skipif(agent_path() is None, reason="libdbr_agent.so cannot be built")
_NODE = re.compile(r'^\s*"((?:[^"\\]|\\.)*)"\s*\[label="((?:[^"\\]|\\.)*)"[^\]]*\];$')
_INSN = re.compile(r"^0x[0-9a-f]+: [a-z]")


def _lines(label: str) -> list[str]:
    """A DOT label's lines, unescaped; every line must end with \\l (left-justified)."""
    out, cur, i = [], [], 0
    while i < len(label):
        c = label[i]
        if c == "\\":
            nxt = label[i + 1]
            assert nxt in 'l"\\', f"unexpected escape \\{nxt} in {label!r}"
            if nxt == "l":
                out.append("".join(cur))
                cur = []
            else:
                cur.append(nxt)
            i += 2
            continue
        cur.append(c)
        i += 1
    assert not cur, f"label does not end its last line with \\l: {label!r}"
    return out


def parse_dot(text: str) -> dict[str, list[str]]:
    """Node id -> label lines of every block node (START and END left out)."""
    nodes = {}
    for ln in text.splitlines():
        m = _NODE.match(ln)
        if m:
            nodes[m[1]] = _lines(m[2])
    assert text.startswith("digraph ") and text.rstrip().endswith("}")
    return nodes


def _check_node(key: str, lines: list[str], want_name: str) -> None:
    assert lines[0].startswith(key + " ") and lines[0].split()[1].startswith(want_name), lines
    insns = lines[2:]
    assert insns and len(insns) <= MAX_DOT_INSNS + 1, lines
    assert all(_INSN.match(x) for x in insns[:MAX_DOT_INSNS]), lines
    if len(insns) == MAX_DOT_INSNS + 1:
        assert insns[-1] == "..."
    assert int(insns[0].split(":")[0], 16) == int(key, 16)


def _hot_program(tmp_path, flags=()) -> tuple[str, int]:
    src = tmp_path / "p.c"
    src.write_text("#include <stdlib.h>\n__attribute__((noinline)) long hot_loop(long n) {"
                   " long s = 0; for (long i = 0; i < n; i++) s += (i * 7) ^ (s >> 3);"
                   " return s; }\nint main(int c, char **v) { return (int)hot_loop(c); }\n")
    exe = tmp_path / "p"
    subprocess.run(["gcc", "-O1", "-fPIE", "-pie", "-o", str(exe), str(src)], check=True)
    syms = subprocess.run(["nm", str(exe)], capture_output=True, text=True, check=True).stdout
    lo = next(int(ln.split()[0], 16) for ln in syms.splitlines() if ln.endswith(" hot_loop"))
    if flags:
        subprocess.run(["strip", *flags, str(exe)], check=True)
    return str(exe), lo


def test_analyze_graphs_name_and_disassemble_each_block(tmp_path, capsys):
    from dbr_service.commands.cli import main

    for kind, want in (("symbols", "hot_loop"), ("stripped", "fn_")):
        d = tmp_path / kind
        d.mkdir()
        exe, lo = _hot_program(d, ("-s",) if kind == "stripped" else ())
        (d / "s.txt").write_text(f"{lo:#x} 10\n")
        assert main(["analyze", exe, "--samples", str(d / "s.txt"), "--dot-dir",
                     str(d / "dots")]) == 0, capsys.readouterr().err
        capsys.readouterr()
        [dot] = (d / "dots").glob("00-discovery-*.dot")
        nodes = parse_dot(dot.read_text())
        assert f"{lo:#x}" in nodes
        for key, lines in nodes.items():
            if lo <= int(key, 16) < lo + 0x40:          # hot_loop's own blocks
                _check_node(key, lines, want if kind == "symbols" else f"fn_{lo:x}")


def test_long_blocks_are_cut_and_labels_escaped():
    nops = 20
    bb = BasicBlock(0x1000, nops + 1, [(0x1000 + i, 1) for i in range(nops)] + [(0x1000 + nops, 1)],
                    b"\x90" * nops + b"\xc3", TermKind.RET)
    sr = SuperRegion('r"1\\')
    sr.add_block(bb)
    sr.add_edge(START, 0x1000, EdgeKind.ENTRY, 1.0)
    sr.add_edge(0x1000, END, EdgeKind.EXIT, 1.0, target=0x2000)
    text = sr.to_dot('title "with" \\ quotes', name=lambda a: 'op"erator\\x+0x1')
    assert text.splitlines()[0] == 'digraph "title \\"with\\" \\\\ quotes" {'
    lines = parse_dot(text)["0x1000"]
    assert lines[0] == '0x1000 op"erator\\x+0x1'
    assert lines[2:] == [f"{0x1000 + i:#x}: nop" for i in range(MAX_DOT_INSNS)] + ["..."]
    # without a namer: the address alone
    assert parse_dot(sr.to_dot())["0x1000"][0] == "0x1000"


@needs_agent
def test_ctl_region_dot_names_the_function(tmp_path):
    prog = build_example("hotloop")
    svc = ServiceProc("--aggressive").wait_ready()
    client = None
    try:
        client = spawn_client(svc.dir, [prog, "20000"])
        svc.wait_for(lambda: svc.call("regions", {"pid": client.pid})["regions"], timeout=20,
                     what="a region")
        rid = svc.call("regions", {"pid": client.pid})["regions"][0]["id"]
        out = tmp_path / "r.dot"
        r = subprocess.run([sys.executable, "-m", "dbr_service.commands.cli", "ctl", "region",
                            str(client.pid), rid, "--dot", str(out)], capture_output=True,
                           text=True, timeout=60, env=dict(os.environ, DBR_RUNTIME_DIR=svc.dir))
        assert r.returncode == 0, r.stderr
        nodes = parse_dot(out.read_text())
        assert nodes
        named = [k for k, lines in nodes.items() if lines[0].split()[1:2] and
                 lines[0].split()[1].startswith("mix")]
        assert named, nodes
        for key in named:
            _check_node(key, nodes[key], "mix")
    finally:
        kill(client)
        svc.stop()
