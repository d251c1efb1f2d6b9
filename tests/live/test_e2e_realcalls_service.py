"""Real calls against live threads: code space reclaimed only when no stack refers to
it, and a storm of installs and removals of a region that calls for real.

tests/e2e_progs/rc_block.c: worker threads run a hot loop (in batches) that calls a
function the region inliner does not take, so the loop's region calls it for real;
every result is checked in the program.

* Under a host service (`dbr service --aggressive -o real_calls=true`): the workers
  block inside the callee called from the copy; the operator's `dbr ctl unpatch PID`
  removes the region, whose code is then retained (`dbr ctl regions`: "retained: N
  stack refs", one return address per blocked worker) for as many censuses as they
  block, and freed only after they were released and returned through it.
* The storm (the service's region selection, emission with unwind information and
  Installer, driven in-process against the agent as in tests/agent/test_optimize_live.py): a
  region with real calls is installed and removed STORM_CYCLES times while 8 workers
  call through it, its code space reclaimed after censuses of PCs and stacks (and
  reused); no worker sees a wrong result, and calls came from the copies.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from dbr_service.wire import protocol as P
from dbr_service.codegen.frames import CfiSource
from dbr_service.common.config import Config
from dbr_service.installation.install import CodeSpace, InstallState, Installer
from dbr_service.installation.optimize import emit_with_frames, placement, region_extent
from dbr_service.region.memview import LiveMemoryView
from dbr_service.region.pipeline import RegionConfig, select_regions
from dbr_service.sampling.perf import sample_ips
from harness import Client, FakeService, cfi_maps, compile_c, read_mem
from service_helpers import ServiceProc, agent_path

E2E = Path(__file__).resolve().parent.parent / "e2e_progs"

THREADS = 4
#: install/remove cycles of the storm in the default suite; the full 10,000 run under
#: `make test-long` (test_patch_storm_full)
STORM_CYCLES = int(os.environ.get("DBR_RC_STORM_CYCLES", "300"))


@pytest.fixture(scope="module")
def exe():
    return compile_c([E2E / "rc_block.c"], flags=["-O2", "-s"], out_name="rc_block-O2")


def _spawn(argv, env) -> Client:
    proc = subprocess.Popen([str(a) for a in argv], env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    return Client(proc)


def _finish(client: Client) -> dict[str, int]:
    """quit; the program's own check: exit 0, no wrong result; its counts."""
    client.send("quit")
    rc, rest = client.finish(timeout=30)
    last = (client.out.lines or [""])[-1]
    assert rc == 0, (rc, last, client.err.lines[-5:])
    m = re.fullmatch(r"ok calls=(\d+) foreign=(\d+) wrong=(\d+)", last)
    assert m, client.out.lines[-3:]
    got = dict(zip(("calls", "foreign", "wrong"), map(int, m.groups())))
    assert got["wrong"] == 0 and got["calls"] > 0, got
    return got


# ---- unpatch while threads block in a callee of the region ----------------------

def _regions(svc: ServiceProc, pid: int) -> list[dict]:
    return svc.call("regions", {"pid": pid})["regions"]


def test_unpatched_code_is_kept_while_threads_block_in_its_callee(exe):
    svc = ServiceProc("--aggressive", "real_calls=true").wait_ready()
    client = None
    try:
        client = _spawn([exe, THREADS], dict(svc.env, LD_PRELOAD=agent_path()))
        client.out.expect("ready", timeout=10)
        pid = client.pid
        live = svc.wait_for(lambda: [r for r in _regions(svc, pid) if r["state"] == "installed"
                                     and r["info"].get("real_calls")],
                            30, "a region with real calls")
        # every worker blocks in the callee, called from the copy (the program checks)
        client.send("park")
        client.out.expect("all-parked", timeout=30)
        parked = [int(ln.split()[1]) for ln in client.out.lines if ln.startswith("parked ")]
        assert len(set(parked)) == THREADS, parked

        ctl = [sys.executable, "-m", "dbr_service.commands.cli", "ctl"]
        run = subprocess.run([*ctl, "unpatch", str(pid)], env=svc.env, capture_output=True,
                             text=True, timeout=30)
        assert run.returncode == 0, run.stderr
        ids = {r["id"] for r in live}

        def held():
            rs = [r for r in _regions(svc, pid) if r["id"] in ids]
            assert all(r["state"] == "removed" for r in rs), rs
            return [r["retained"] for r in rs if "retained" in r]

        # one return address into each removed copy per blocked worker, census after
        # census (a census comes with each sampling window): the loop's copy, and the
        # callee's own copy when it is a hot function with a region of its own
        seen = svc.wait_for(lambda: (lambda h: h if sum(x["censuses"] for x in h) >= 4
                                     else None)(held()), 30, "four censuses")
        assert seen and all(x["stack_refs"] == THREADS for x in seen), seen
        assert all(x["threads_inside"] == 0 for x in seen), seen
        text = subprocess.run([*ctl, "regions", str(pid)], env=svc.env, capture_output=True,
                              text=True, timeout=30).stdout
        for x in seen:
            assert f"removed (retained: {x['stack_refs']} stack refs)" in text, text
        # still held two censuses later: they go on finding the same words
        n = sum(x["censuses"] for x in seen)
        again = svc.wait_for(lambda: (lambda h: h if sum(x["censuses"] for x in h) >= n + 2
                                      else None)(held()), 30, "two more censuses")
        assert all(x["stack_refs"] == THREADS for x in again), again

        client.send("release")
        client.out.expect("released", timeout=30)
        t0 = time.monotonic()
        svc.wait_for(lambda: held() == [], 30, "the removed code to be freed")
        freed_after = time.monotonic() - t0
        got = _finish(client)
        assert got["foreign"] >= THREADS, got
        print(f"unpatch: {len(ids)} region(s) kept with {THREADS} stack refs over "
              f"{sum(x['censuses'] for x in again)} censuses; freed {freed_after:.2f} s "
              f"after the release; {got}")
    finally:
        if client is not None:
            client.kill()
        svc.stop()


# ---- the storm ------------------------------------------------------------------


def _drain(inst: Installer) -> int:
    """Censuses until every removed chunk is free (bounded): nothing enters removed
    code, and the workers leave a copy within a batch."""
    freed = 0
    for _ in range(200):
        freed += inst.reclaim()
        if not inst.space.quarantine:
            return freed
    raise AssertionError(f"removed code still held: "
                         f"{[q.retention(0) for q in inst.space.quarantine][:4]}")


def _storm(exe, cycles: int) -> None:
    svc = FakeService()
    try:
        client = svc.spawn([exe, "8", "nice"])
        client.out.expect("ready", timeout=10)
        conn = svc.accept(pid=client.pid)
        assert conn.hello.flags & P.HELLO_FRAMES
        hot = sample_ips(client.pid, 0.8, sample_period_us=500)
        total = sum(hot.values())
        assert total > 50, total
        # no inlining: step(x, 1) would be inlined into the loop wherever samples make
        # its recursive call look cold, and the loop's copy must call it for real
        cfg = RegionConfig(hot_threshold=max(1.0, Config().hot_threshold * total),
                           jumps_from_hot_limit=Config().jumps_from_hot_limit,
                           real_calls=True, inline=False)
        res = select_regions(dict(hot), LiveMemoryView(client.pid), cfg)
        # the batch loop's region: in the program, calling step() for real
        calling = [sr for sr in res.regions
                   if {bb.module for _, bb in sr.blocks()} == {str(exe)} and any(
                       s.get("decision") == "call"
                       for s in sr.info.get("inline", {}).get("sites", {}).values())]
        assert calling, (res.counters, [sr.entry_points() for sr in res.regions])
        sr = calling[0]
        inst = Installer(conn, lambda a, n: read_mem(client.pid, a, n), frames=True,
                         cfi=CfiSource(lambda: cfi_maps(client.pid)), transfer=False,
                         space=CodeSpace(conn, quarantine_s=0.0))
        # install_region's steps, with each address's code and unwind information
        # emitted once: the storm is about installing and removing, and chunks come
        # back to the same addresses
        # from now on the workers spend much of their time in the callee: only the
        # stack scan shows that they will come back into a removed copy
        client.send("slow")
        client.out.expect("slow", timeout=10)
        size, reach = placement(inst, sr)
        ranges, _ = region_extent(sr)
        emitted: dict[int, tuple] = {}
        freed = held = 0
        addrs: Counter = Counter()
        spent: Counter = Counter()
        t0 = time.monotonic()
        for i in range(cycles):
            t = time.monotonic()
            chunk = inst.reserve(size, reach)
            if chunk.addr not in emitted:
                emitted[chunk.addr] = emit_with_frames(inst, sr, chunk.addr)
            gen, blobs, refused = emitted[chunk.addr]
            assert gen.calls and blobs and refused is None, refused
            spent["emit"] += time.monotonic() - t
            t = time.monotonic()
            reg = inst.install(chunk, gen, name=sr.id, frames=blobs, orig_ranges=ranges,
                               exit_ranges=ranges + [(x, x + 1) for _, x in gen.exits])
            assert reg.state is InstallState.INSTALLED, reg.why_removed
            assert reg.frames == len(blobs) >= 1
            spent["install"] += time.monotonic() - t
            addrs[chunk.addr] += 1
            time.sleep(0.001 if i % 8 else 0.004)    # the workers call through it
            t = time.monotonic()
            inst.uninstall(reg.region_id, "storm")
            spent["uninstall"] += time.monotonic() - t
            t = time.monotonic()
            if i % 4 == 3:
                freed += inst.reclaim()
                held = max(held, len(inst.space.quarantine))
            if i % 50 == 49:
                # CodeSpace joins adjacent quarantined chunks into one census range, so
                # while the workers run the newest chunk the older ones stay held; a
                # pause lets them go, to be reused by the next cycles
                freed += _drain(inst)
            spent["reclaim"] += time.monotonic() - t
        took = time.monotonic() - t0
        freed += _drain(inst)
        assert inst.patches_installed == inst.patches_removed == cycles * len(reg.sites)
        got = _finish(client)
        assert got["foreign"] > 0, got
        # chunks were freed and their space used again while threads ran
        assert freed == cycles and max(addrs.values()) > 1, (freed, len(addrs))
        print(f"storm: {cycles} cycles in {took:.1f} s ({took / cycles * 1e3:.1f} ms each), "
              f"{len(addrs)} distinct code addresses, at most {held} chunks held at once; "
              f"workers: {got}; seconds spent: {dict(spent)}")
    finally:
        svc.close()


def test_patch_storm(exe):
    _storm(exe, STORM_CYCLES)


@pytest.mark.long
def test_patch_storm_full(exe):
    _storm(exe, 10_000)
