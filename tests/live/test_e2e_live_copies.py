"""Real calls to live copies, end to end (tests/e2e_progs/livecopy.c: an outer loop
calling, for real, a function with a hot loop of its own; every result is checked in
the program).

* In process (the service's selection, install_regions and Installer against the
  agent, as in tests/agent/test_optimize_live.py): both loops get regions, the outer copy's call
  goes straight to the inner copy (the bytes in the client say so, and with the inner
  region's patch taken away behind the installer's back its copy is still entered);
  removing the inner region takes the outer one along; the thread, left running in
  the removed outer copy (its loop never leaves it), is moved out by the censuses of
  reclamation (EVICT) and both chunks are freed, the outer one first.  The sum of the
  results is the native run's.
* Under a host service: workers block inside a callee called from the copies; `dbr ctl
  unpatch` removes the regions; released, the workers return into the removed copies
  and would loop there for good: the service's censuses move them out and the code is
  freed within a bounded time.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dbr_service.wire import protocol as P
from dbr_service.codegen.frames import CfiSource
from dbr_service.common.config import Config
from dbr_service.installation.install import CodeSpace, InstallState, Installer
from dbr_service.installation.optimize import install_regions
from dbr_service.region.memview import LiveMemoryView
from dbr_service.region.pipeline import RegionConfig, select_regions
from dbr_service.sampling.perf import sample_ips
from harness import Client, FakeService, cfi_maps, compile_c, count_executions, read_mem
from service_helpers import ServiceProc, agent_path

E2E = Path(__file__).resolve().parent.parent / "e2e_progs"
#: inner()'s first instruction: imul eax, edi, 0x9e3779b1
INNER_HEAD = bytes.fromhex("69c7b179379e")
#: Iterations summed by the program: natively about 3 s here, longer than sampling,
#: selection and the checks below before the region are removed.
ITERS = 120_000_000


@pytest.fixture(scope="module")
def exe():
    return compile_c([E2E / "livecopy.c"], flags=["-O2", "-s"], out_name="livecopy-O2")


def _finish(client: Client) -> tuple[str, dict[str, int]]:
    client.send("quit")
    rc, _ = client.finish(timeout=60)
    lines = client.out.lines
    assert rc == 0, (rc, lines[-3:], client.err.lines[-5:])
    m = re.fullmatch(r"ok calls=(\d+) foreign=(\d+) wrong=(\d+)", lines[-1])
    assert m and lines[-2].startswith("sum "), lines[-3:]
    got = dict(zip(("calls", "foreign", "wrong"), map(int, m.groups())))
    assert got["wrong"] == 0 and got["calls"] > 0, got
    return lines[-2], got


def _native_sum(exe) -> str:
    run = subprocess.run([str(exe), str(ITERS), "1"], input="quit\n", capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    return run.stdout.splitlines()[-2]




def test_outer_copy_calls_inner_copy_and_goes_with_it(exe):
    native = _native_sum(exe)
    svc = FakeService()
    try:
        client = svc.spawn([exe, str(ITERS), "1"])
        client.out.expect("ready", timeout=10)
        pid = client.pid
        conn = svc.accept(pid=pid)
        hot = sample_ips(pid, 0.8, sample_period_us=500)
        total = sum(hot.values())
        assert total > 50, total
        cfg = RegionConfig(hot_threshold=max(1.0, Config().hot_threshold * total),
                           jumps_from_hot_limit=Config().jumps_from_hot_limit,
                           real_calls=True)
        res = select_regions(dict(hot), LiveMemoryView(pid), cfg)
        heads = {sr.id: [e for e in sr.entry_points() if read_mem(pid, e, 6) == INNER_HEAD]
                 for sr in res.regions}
        inner_sr = next((sr for sr in res.regions if heads[sr.id]), None)
        assert inner_sr is not None, [sr.entry_points() for sr in res.regions]
        entry = heads[inner_sr.id][0]
        outer_sr = next((sr for sr in res.regions if any(
            s.get("decision") == "call" and s.get("callee") == entry
            for s in sr.info.get("inline", {}).get("sites", {}).values())
            and sr is not inner_sr), None)
        assert outer_sr is not None, [sr.info.get("inline") for sr in res.regions]
        inst = Installer(conn, lambda a, n: read_mem(pid, a, n), frames=True,
                         cfi=CfiSource(lambda: cfi_maps(pid)), transfer=True,
                         evict=bool(conn.hello.flags & P.HELLO_EVICT),
                         space=CodeSpace(conn, quarantine_s=0.0))
        # the caller first: the batch is reordered callees first
        out = install_regions(inst, [outer_sr, inner_sr])
        assert len(out.installed) == 2, out.failed
        inner, outer = out.installed
        assert (inner.name, outer.name) == (inner_sr.id, outer_sr.id)
        assert outer.cfi_refused is None and outer.gen.calls
        client.send("reached?")
        assert client.out.expect("reached", timeout=10) == "reached 0", \
            "the program summed its results before the regions were installed"

        # the outer copy calls the inner copy: in the client's memory too
        copy = inner.gen.entries[entry]
        assert list(outer.gen.call_copies.values()) == [copy]
        assert outer.calls_into == [inner.region_id] and inner.chunk.users == 1
        [at] = outer.gen.call_copies
        code = read_mem(pid, at, 5)
        assert code[0] == 0xE8 and at + 5 + int.from_bytes(code[1:], "little", signed=True) \
            == copy
        assert (at, entry) in outer.gen.exits

        # the inner region's patch taken away behind the installer's back: nothing but
        # the outer copy's call enters the inner copy now, and it still runs (its d > 0
        # part: its recursive call goes to the original inner(), whose loop is the bulk).
        # The copy's entry is counted by a breakpoint: its few instructions there may
        # get no sample at all
        assert conn.unpatch(inner.patched_sites) == [P.Result.OK]
        entered = count_executions(pid, copy, 0.3)
        after = sample_ips(pid, 1.0, sample_period_us=500)
        in_orig = sum(n for ip, n in after.items()
                      if any(a <= ip < b for a, b in inner.orig_ranges))
        assert entered >= 1 and in_orig > 0, (entered, in_orig)

        # the inner region removed (not evicted): the outer one goes along
        inst.uninstall(inner.region_id, "operator")
        assert inner.state is outer.state is InstallState.REMOVED
        assert outer.why_removed == "calls the copy of %s, removed: operator" % inner.name
        assert inst.pop_cascaded() == [outer]
        assert all(read_mem(pid, s.site, 5) != code for s in outer.sites)
        # the thread loops in the removed outer copy for good: reclamation moves it out,
        # then frees both chunks, never the inner one while the outer one is held
        t0 = time.monotonic()
        for _ in range(100):
            inst.reclaim()
            q = [x.chunk for x in inst.space.quarantine]
            if inner.chunk not in q:
                assert outer.chunk not in q
            if not q:
                break
            time.sleep(0.02)
        assert inst.space.quarantine == [], [x.retention(0) for x in inst.space.quarantine]
        assert inst.threads_evicted_removed >= 1
        took = time.monotonic() - t0
        total, got = _finish(client)
        assert total == native, (total, native)
        assert got["foreign"] > 0, got
        print(f"live copies: outer {outer.name} calls inner {inner.name}'s copy at {copy:#x}; "
              f"entered {entered} times in 0.3 s, {in_orig} samples in its original code with its "
              f"patch gone; {inst.threads_evicted_removed} thread move(s) out of removed "
              f"code, freed {took:.2f} s after removal; {got}")
    finally:
        svc.close()


def _ctl_regions(svc: ServiceProc, pid: int) -> list[dict]:
    return svc.call("regions", {"pid": pid})["regions"]


def test_threads_returning_into_removed_copies_are_moved_out(exe):
    threads = 2
    # no inlining: inner() inlined into the loop's copy (where samples make its recursive
    # call look cold) is never called from a copy, and no worker would park
    svc = ServiceProc("--aggressive", "real_calls=true", "inline=false").wait_ready()
    client = None
    try:
        proc = subprocess.Popen([str(exe), "1", str(threads)],
                                env=dict(svc.env, LD_PRELOAD=agent_path()),
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)
        client = Client(proc)
        client.out.expect("ready", timeout=10)
        pid = client.pid

        def calling():
            rs = [r for r in _ctl_regions(svc, pid) if r["state"] == "installed"]
            return rs if any(r["info"].get("real_calls") for r in rs) else None

        live = svc.wait_for(calling, 30, "a region with real calls")
        # every worker blocks in note(), called by inner() called from a copy
        client.send("park")
        client.out.expect("all-parked", timeout=30)
        run = subprocess.run([sys.executable, "-m", "dbr_service.commands.cli", "ctl", "unpatch",
                              str(pid)], env=svc.env, capture_output=True, text=True,
                             timeout=30)
        assert run.returncode == 0, run.stderr
        ids = {r["id"] for r in live}

        def held():
            rs = [r for r in _ctl_regions(svc, pid) if r["id"] in ids]
            assert all(r["state"] == "removed" for r in rs), [(r["id"], r["state"]) for r in rs]
            return [r["retained"] for r in rs if "retained" in r]

        assert svc.wait_for(held, 10, "removed code retained by the parked workers")
        # released, they return into the removed copies, whose loop never ends
        client.send("release")
        client.out.expect("released", timeout=30)
        t0 = time.monotonic()
        inside = 0
        deadline = t0 + 60
        while held() and time.monotonic() < deadline:
            inside = max(inside, max((x["threads_inside"] for x in held()), default=0))
            time.sleep(0.05)
        assert held() == [], held()
        freed_after = time.monotonic() - t0
        total, got = _finish(client)
        assert got["foreign"] >= threads, got
        print(f"removed copies: freed {freed_after:.2f} s after the release (at most "
              f"{inside} thread(s) seen inside by a census); {got}")
    finally:
        if client is not None:
            client.kill()
        svc.stop()
