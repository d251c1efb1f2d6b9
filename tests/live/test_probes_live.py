"""Dynamic probes on a real program under a real service (dbr_service/session/probes.py):
``probe add|list|show|del`` over the control socket.

tests/agent_progs/probed.c calls ``work`` (its first instruction is 7 bytes: a plain
site) N times and ``pick`` (first instruction 4 bytes: an entry site) 200 times per
"go N" line.  A count probe on ``work`` reads exactly N; an args probe on ``pick``
records its arguments and return address, and its filter keeps exactly the passes
it should; ``del`` puts the original bytes back; every bad location is refused with
its reason; a probe goes with its process; regions the service installs around a
probe neither copy it nor take its passes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import capstone
import pytest
from harness import compile_c, read_mem
from probe_helpers import Prog, paused_prog
from service_helpers import ServiceProc, agent_path, symbol_range

from dbr_service.commands.ctlclient import Code, Fault
from dbr_service.common.symbols import read_symbols

pytestmark = pytest.mark.skipif(agent_path() is None, reason="the agent cannot be built")

TEN_MILLION = 10_000_000


@pytest.fixture(scope="module")
def prog() -> str:
    return str(compile_c(["probed.c"], flags=["-fcf-protection=none"], out_name="probed"))


def _addr(pid: int, binary: str, link: int) -> int:
    """The runtime address of link-time address ``link`` in the client's executable."""
    real = os.path.realpath(binary)
    with open(f"/proc/{pid}/maps") as fh:
        lows = [int(ln.split("-")[0], 16) - int(ln.split()[2], 16)
                for ln in fh if ln.rstrip().endswith(real)]
    return min(lows) + link


def _sym(binary: str, name: str) -> tuple[int, int]:
    s = read_symbols(binary).by_name(name)
    assert s is not None, name
    return s.start, s.size


@pytest.fixture
def quiet(prog):
    """The program under a service told to leave it alone (paused: no regions)."""
    yield from paused_prog(prog)


def test_count_probe_is_exact_and_del_restores(quiet: Prog, prog: str) -> None:
    start, _ = _sym(prog, "work")
    at = _addr(quiet.pid, prog, start)
    before = read_mem(quiet.pid, at, 16)
    native = quiet.run("go 1000", "done")
    p = quiet.probe("add", location="work", kind="count")
    assert (p["site"], p["location"], p["count"]) == ("plain", "work", 0)
    assert p["address"] == at and not p["flags_saved"]
    assert read_mem(quiet.pid, at, 1) == b"\xe9"        # the 5-byte jmp
    assert quiet.run("go 1000", "done") == native
    assert quiet.probe("show", id=p["id"])["count"] == 1000
    quiet.run(f"go {TEN_MILLION}", "done")
    assert quiet.probe("show", id=p["id"])["count"] == TEN_MILLION + 1000
    listed = quiet.probe("list")["probes"]
    assert [(x["id"], x["kind"], x["state"]) for x in listed] == [(p["id"], "count", "active")]
    gone = quiet.probe("del", id=p["id"])
    assert gone["count"] == TEN_MILLION + 1000 and gone["state"] == "removed: deleted"
    assert read_mem(quiet.pid, at, 16) == before
    assert quiet.probe("list")["probes"] == []
    assert quiet.run("go 1000", "done") == native
    with pytest.raises(Fault) as ei:
        quiet.probe("show", id=p["id"])
    assert ei.value.code == Code.NO_PROBE


def test_count_probe_with_live_flags(quiet: Prog, prog: str) -> None:
    """work+0x10 is followed by a ret before any flag write: the handler saves rflags."""
    p = quiet.probe("add", location="work+0x10", kind="count")
    assert p["flags_saved"] and p["site"] == "plain"
    quiet.run("go 12345", "done")
    assert quiet.probe("show", id=p["id"])["count"] == 12345


def test_args_probe_records_and_filters(quiet: Prog, prog: str) -> None:
    p = quiet.probe("add", location="pick", kind="args")
    assert p["site"] == "entry"                  # lea is 4 bytes: the entry-site path
    quiet.run("go 0", "done")
    shown = quiet.probe("show", id=p["id"], last=16)
    assert shown["records_total"] == 200
    recs = shown["records"]
    assert [r["n"] for r in recs] == list(range(184, 200))
    for r in recs:
        i = r["n"]
        assert r["args"][:3] == [i % 7, i, (-i) & (2**64 - 1)]
    main = _sym(prog, "main")
    lo = _addr(quiet.pid, prog, main[0])
    assert all(lo <= r["return"] < lo + main[1] for r in recs)
    quiet.probe("del", id=p["id"])
    f = quiet.probe("add", location="pick", kind="args", filter="arg0==3")
    assert f["filter"] == "arg0==3"
    quiet.run("go 0", "done")
    shown = quiet.probe("show", id=f["id"], last=64)
    assert shown["records_total"] == sum(1 for i in range(200) if i % 7 == 3)
    assert {r["args"][0] for r in shown["records"]} == {3}
    g = quiet.probe("add", location="work", kind="args", filter="arg1>=600")
    quiet.run("go 1000", "done")
    assert quiet.probe("show", id=g["id"])["records_total"] == 800   # 3i >= 600: i >= 200


def test_refusals(quiet: Prog, prog: str) -> None:
    base = os.path.basename(prog)
    data_off = symbol_range(prog, "sink")[0]          # a variable: not executable
    cases = {
        "work+1": "not an instruction boundary",
        "work+7": "shorter than 5 bytes and it is not a function's start",
        "libnothere.so+0x10": "the client maps no module 'libnothere.so'",
        "no_such_function": "no module or function named 'no_such_function'",
        f"{base}+{data_off:#x}": "is not executable",
        "work+zz": "is not SYMBOL[+OFF] or MODULE+OFF",
    }
    for loc, why in cases.items():
        assert why in quiet.refused(loc, kind="count"), loc
    assert "args probes go at a function's start" in quiet.refused("work+0x10", kind="args")
    assert "latency probes go at a function's start" in quiet.refused("work+0x10", kind="latency")
    assert "--filter applies to args probes only" in quiet.refused("work", kind="count",
                                                                   filter="arg0==1")
    assert "is not argI OP N" in quiet.refused("pick", kind="args", filter="rdi==1")
    quiet.probe("add", location="work", kind="count")
    assert "overlaps the patch of probe 1" in quiet.refused("work", kind="count")
    assert quiet.probe("list")["probes"][0]["state"] == "active"


def test_probe_goes_with_its_process(quiet: Prog, prog: str) -> None:
    p = quiet.probe("add", location="work", kind="count")
    quiet.run("go 777", "done")
    quiet.proc.stdin.write(b"exit\n")
    quiet.proc.stdin.flush()
    assert quiet.proc.wait(10) == 0
    svc = quiet.svc
    listed = svc.wait_for(lambda: [x for x in svc.call("probe_list", {"pid": quiet.pid})[
        "probes"] if x["state"] != "active"], 10, "the probe removed with its session")
    assert listed[0]["id"] == p["id"] and listed[0]["count"] == 777


def test_probe_removed_when_the_service_stops(prog: str) -> None:
    svc = ServiceProc().wait_ready()
    p = None
    try:
        p = Prog(svc, prog)
        start, _ = _sym(prog, "work")
        at = _addr(p.pid, prog, start)
        before = read_mem(p.pid, at, 16)
        p.probe("add", location="work", kind="count")
        assert read_mem(p.pid, at, 1) == b"\xe9"
        svc.stop()                       # on_shutdown=keep: regions stay, probes do not
        assert read_mem(p.pid, at, 16) == before
        assert p.run("go 1000", "done").startswith("done")
    finally:
        if p is not None:
            p.close()
        svc.stop()


def test_probes_beside_regions(prog: str) -> None:
    """An aggressive service installs regions for the spinning loop while a count probe
    sits on work: no region copies work (the count stays exact), and a probe in code a
    region copies is refused."""
    svc = ServiceProc("--aggressive").wait_ready()
    p = None
    try:
        p = Prog(svc, prog)
        probe = p.probe("add", location="work", kind="count")
        p.proc.stdin.write(b"spin 4\n")
        p.proc.stdin.flush()
        live = svc.wait_for(lambda: [r for r in svc.call("regions", {"pid": p.pid})["regions"]
                                     if r["state"] == "installed"], 30, "a region installed")
        p.out.expect("spun", 30)
        p.out.expect("ready")
        c0 = p.probe("show", id=probe["id"])["count"]
        assert c0 > 0
        p.run(f"go {TEN_MILLION}", "done")
        assert p.probe("show", id=probe["id"])["count"] == c0 + TEN_MILLION
        # the region's first entry, then the instruction after its 5 patched bytes:
        # copied code, a boundary, not a patch (decoded from the file: the entry holds
        # the region's jmp)
        entry = live[0]["entries"][0]
        md = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
        regs = svc.call("regions", {"pid": p.pid})["regions"]
        if not any(r["id"] == live[0]["id"] and r["state"] == "installed" for r in regs):
            pytest.skip("the region was removed meanwhile (evaluation); nothing to probe in")
        base = os.path.basename(prog)
        lo = _addr(p.pid, prog, 0)
        with open(prog, "rb") as fh:
            fh.seek(entry - lo)
            file_code = fh.read(64)
        after = next(a for a, s, _m, _o in md.disasm_lite(file_code, entry) if a >= entry + 5)
        why = p.refused(f"{base}+{after - lo:#x}", kind="count")
        assert "copies the code" in why and f"dbr ctl unpatch {p.pid} r" in why, why
    finally:
        if p is not None:
            p.close()
        svc.stop()


def test_dbr_ctl_probe(quiet: Prog) -> None:
    """`dbr ctl probe add|list|show|del`: tables, JSON, and a refusal's message and
    exit status."""
    def ctl(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "dbr_service.commands.cli", "ctl", "--timeout",
                               "40", "probe", *argv], capture_output=True, text=True,
                              timeout=60, env=dict(os.environ, DBR_RUNTIME_DIR=quiet.svc.dir))
    pid = str(quiet.pid)
    r = ctl("add", pid, "work", "--kind", "count", "--json")
    assert r.returncode == 0, r.stderr
    pid_id = str(json.loads(r.stdout)["id"])
    quiet.run("go 4242", "done")
    r = ctl("show", pid, pid_id)
    assert r.returncode == 0 and "count: 4242" in r.stdout, r.stdout
    r = ctl("list", pid)
    assert "work" in r.stdout and "4242" in r.stdout and "active" in r.stdout, r.stdout
    r = ctl("add", pid, "pick+2")
    assert r.returncode == 1 and "not an instruction boundary" in r.stderr, r.stderr
    r = ctl("add", pid, "pick", "--kind", "args", "--filter", "arg0>=5")
    assert r.returncode == 0 and "filter arg0>=5" in r.stdout, r.stdout
    quiet.run("go 0", "done")
    r = ctl("show", pid, "2", "--last", "2")
    assert "records: " in r.stdout and r.stdout.count("arg0=") == 2, r.stdout
    r = ctl("del", pid, pid_id)
    assert r.returncode == 0 and "removed: deleted" in r.stdout, r.stdout
