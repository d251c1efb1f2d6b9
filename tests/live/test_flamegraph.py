"""Flame graphs: the SVG drawn from folded stacks (parsed back with xml.etree), and
`dbr ctl flamegraph` against a real service profiling CPython."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections import Counter

import pytest

from service_helpers import ServiceProc, agent_path, kill, spawn_client

from dbr_service.commands.cmd_flame import hottest
from dbr_service.stacks.flamegraph import build_tree, render_svg
from dbr_service.sampling.perf import probe_event
from dbr_service.sampling.perf_abi import EVENTS
from dbr_service.stacks.stackprof import parse_folded

NS = {"s": "http://www.w3.org/2000/svg"}
FOLDED = Counter({("main", "run", "hot"): 60, ("main", "run", "warm"): 25,
                  ("main", "idle"): 10, ("main", "<evil & \"name\">"): 5})


def _frames(svg: str) -> list[dict]:
    root = ET.fromstring(svg)
    out = []
    for g in root.iter("{http://www.w3.org/2000/svg}g"):
        if g.get("class") != "frame":
            continue
        rect = g.find("s:rect", NS)
        title = g.find("s:title", NS)
        text = g.find("s:text", NS)
        assert rect is not None and title is not None
        out.append({"title": title.text, "x": float(rect.get("x")), "y": float(rect.get("y")),
                    "w": float(rect.get("width")), "n": int(rect.get("data-samples")),
                    "text": text.text if text is not None else None})
    return out


def test_svg_frames_and_widths():
    svg = render_svg(FOLDED, "test graph")
    frames = _frames(svg)
    # every node of the merged tree is a frame: all, main, run, hot, warm, idle, evil
    assert len(frames) == 7
    tree = build_tree(FOLDED)
    assert tree.count == 100
    by_name = {f["title"].split(" (")[0]: f for f in frames}
    root = by_name["all"]
    assert root["n"] == 100
    scale = root["w"] / 100
    for f in frames:
        assert abs(f["w"] - f["n"] * scale) < 0.02
    # children side by side within their parent, their widths summing to at most it
    run, main = by_name["run"], by_name["main"]
    assert abs(by_name["hot"]["w"] + by_name["warm"]["w"] - run["w"]) < 0.05
    assert by_name["hot"]["y"] < run["y"] < main["y"] < root["y"]
    assert run["x"] <= by_name["hot"]["x"] and \
        by_name["warm"]["x"] + by_name["warm"]["w"] <= run["x"] + run["w"] + 0.05
    # the hottest frames are named in their rectangle and their tooltip
    assert by_name["hot"]["text"] == "hot"
    assert "60 samples, 60.00%" in by_name["hot"]["title"]
    # names from a client's files are escaped, not markup
    assert '<evil & "name">' in by_name
    assert "<evil" not in svg


def test_svg_leaves_out_frames_too_narrow():
    folded = Counter({("main", "big"): 100_000, ("main", "tiny"): 1})
    frames = _frames(render_svg(folded, "t", min_width=0.5))
    assert {f["title"].split(" (")[0] for f in frames} == {"all", "main", "big"}


def test_hottest_and_folded_round_trip():
    lines = [f"{';'.join(s)} {n}" for s, n in FOLDED.items()]
    assert parse_folded(lines) == FOLDED
    top = hottest(FOLDED, 2)
    assert top == [("hot", 60, 60), ("warm", 25, 25)]


# --------------------------------------------------------------------------- live
perf_ok, perf_why = probe_event(EVENTS["cpu-clock"])


def _real_python() -> str | None:
    """The interpreter behind a pyenv shim (bench/suite.py does the same)."""
    exe = shutil.which("python3")
    if exe is None:
        return None
    out = subprocess.run([exe, "-c", "import sys; print(sys.executable)"],
                         capture_output=True, text=True, timeout=30).stdout.strip()
    return out if out and os.path.exists(out) else None


PYTHON = _real_python()
BENCH = ("import time\nt = time.monotonic()\n"
         "while time.monotonic() - t < 60:\n    sum(i * i for i in range(20000))\n")


def _ctl(svc: ServiceProc, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dbr_service.commands.cli", "ctl", *argv],
                          env={**os.environ, "DBR_RUNTIME_DIR": svc.dir},
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.skipif(not perf_ok, reason=f"no perf sampling here: {perf_why}")
@pytest.mark.skipif(PYTHON is None, reason="no python3 interpreter found")
@pytest.mark.skipif(agent_path() is None, reason="the agent cannot be built here")
def test_cpython_flamegraph(tmp_path):
    svc = ServiceProc().wait_ready()
    client = None
    try:
        client = spawn_client(svc.dir, [PYTHON, "-S", "-c", BENCH])
        svc.wait_for(lambda: any(c["pid"] == client.pid for c in svc.call("clients")),
                     15, "the client")
        # output paths are checked before anything is sampled
        bad = _ctl(svc, "flamegraph", str(client.pid), "--svg", str(tmp_path / "no/x.svg"))
        assert bad.returncode == 2 and "cannot write" in bad.stderr
        assert "Traceback" not in bad.stderr
        bad = _ctl(svc, "flamegraph", str(client.pid), "--seconds", "100")
        assert bad.returncode == 2 and "at most 60" in bad.stderr
        # only clients of the service
        bad = _ctl(svc, "flamegraph", str(os.getpid()))
        assert bad.returncode == 1 and "no live client" in bad.stderr

        svg, folded = tmp_path / "py.svg", tmp_path / "py.folded"
        t0 = time.monotonic()
        r = _ctl(svc, "flamegraph", str(client.pid), "--seconds", "2", "--svg", str(svg),
                 "--folded", str(folded))
        assert r.returncode == 0, r.stderr + svc.output()[-2000:]
        assert 2 <= time.monotonic() - t0 < 30
        stacks = parse_folded(folded.read_text().splitlines())
        total = sum(stacks.values())
        assert total >= 100
        # the interpreter's stacks are whole: from _start through its main to the
        # evaluation loop, in nearly every sample
        whole = sum(n for s, n in stacks.items()
                    if s[0] == "_start" and "Py_RunMain" in s and "_PyEval_EvalFrameDefault" in s)
        assert whole >= 0.9 * total, folded.read_text()[:3000]
        frames = _frames(svg.read_text())
        names = {f["title"].split(" (")[0]: f for f in frames}
        assert names["all"]["n"] == total
        # the hottest frames are named: the evaluation loop is in nearly every stack
        ev = names["_PyEval_EvalFrameDefault"]
        assert ev["text"] and ev["text"].startswith("_PyEval")
        assert sum(f["n"] for f in frames if f["title"].startswith("_PyEval_EvalFrameDefault ")
                   ) >= 0.9 * total
        assert "_PyEval_EvalFrameDefault" in r.stdout        # the summary's table
    finally:
        kill(client)
        svc.stop()


def test_attribution_remembers_regions_removed_meanwhile():
    """Replacement-code addresses fold to original ones while the region lives and
    after it is removed during the collection (threads may still return into it)."""
    from types import SimpleNamespace

    from dbr_service.commands.stackjobs import _Attributer

    class Reg:
        def original_of(self, a):
            return 0x401000 + (a - 0x7000_0000) if 0x7000_0000 <= a < 0x7000_0100 else None

    reg = Reg()

    class Inst:
        live = ((0x7000_0000, 0x7000_0100, reg),)

        def attribute(self, a):
            for lo, hi, r in self.live:
                if lo <= a < hi:
                    return r.original_of(a), r
            return a, None

    inst = Inst()
    attr = _Attributer(SimpleNamespace(installer=inst))
    assert attr(0x7000_0010) == 0x401010
    assert attr(0x5000) == 0x5000
    inst.live = ()                           # removed
    assert attr(0x7000_0020) == 0x401020
    assert _Attributer(SimpleNamespace(installer=None))(0x7000_0020) == 0x7000_0020


def test_answer_bounded_by_lines_and_bytes():
    from dbr_service.commands.stackjobs import bound_lines

    lines = [f"main;f{i} {i + 1}" for i in range(100)]
    assert bound_lines(lines) == lines
    few = bound_lines(lines, max_lines=10)
    assert len(few) == 11 and few[-1] == f"[other] {sum(range(1, 91))}"
    assert "main;f99 100" in few and "main;f0 1" not in few
    small = bound_lines(lines, max_bytes=60)
    assert sum(len(x) + 1 for x in small[:-1]) <= 60 and small[-1].startswith("[other] ")
    assert sum(int(x.rpartition(" ")[2]) for x in small) == sum(range(1, 101))
