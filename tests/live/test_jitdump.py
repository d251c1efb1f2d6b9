"""perf sees replacement code (dbr_agent/jitdump.c, dbr_service/installation/jitdump.py).

* End to end: a client started with DBR_JITDUMP=1 under a host service gets a
  region; `perf record -k mono`, `perf inject --jit` and `perf report` put its
  samples under `dbr:work+0x.. [rN]` (skipped only where perf is missing).
* The agent makes /tmp/jit-PID.dump only when asked, with the format's header, and
  maps it executable.
* The service writes only into the client's own regular file with one link and
  this client's header, records each region once, and stops at its size limit.
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import time

import pytest
from service_helpers import ServiceProc, agent_path, build_example, kill, spawn_client

from dbr_service.installation import jitdump as J

needs_agent = pytest.mark.skipif(agent_path() is None, reason="libdbr_agent.so cannot be built")


def _installed(svc: ServiceProc, pid: int) -> list[str]:
    return [r["id"] for r in svc.call("regions", {"pid": pid})["regions"]
            if r["state"] == "installed"]


def _header(pid: int) -> bytes:
    return J.HEADER.pack(J.JITDUMP_MAGIC, 1, J.HEADER.size, 62, 0, pid, 1, 0)


@pytest.fixture
def fake_pid():
    """A pid no process here has (so /tmp/jit-PID.dump is the test's to make)."""
    pid = 4_000_000 + os.getpid() % 100_000
    path = J.path_of(pid)
    if os.path.lexists(path):
        os.unlink(path)
    yield pid
    if os.path.lexists(path):
        os.unlink(path)


def test_records_go_only_into_the_clients_own_file(fake_pid, tmp_path):
    path = J.path_of(fake_pid)
    uid = os.getuid()
    jd = J.JitDump(fake_pid, uid)
    assert jd.load(1, "dbr:f [r1]", 0x1000, b"\x90\xc3") is None and jd.refused == "absent"
    # a link to a file elsewhere: O_NOFOLLOW refuses it
    target = tmp_path / "victim"
    target.write_bytes(_header(fake_pid))
    os.symlink(target, path)
    assert "jit-" in (J.JitDump(fake_pid, uid).load(1, "x", 0, b"\xc3") or "")
    assert target.read_bytes() == _header(fake_pid)
    os.unlink(path)
    # a hard link (two links), another pid's header, another owner: refused, unchanged
    os.link(target, path)
    assert "more than one link" in J.JitDump(fake_pid, uid).load(1, "x", 0, b"\xc3")
    os.unlink(path)
    with open(path, "wb") as fh:
        fh.write(_header(fake_pid + 1))
    assert "not this client's" in J.JitDump(fake_pid, uid).load(1, "x", 0, b"\xc3")
    assert "owned by uid" in J.JitDump(fake_pid, uid + 1).load(1, "x", 0, b"\xc3")
    assert os.path.getsize(path) == J.HEADER.size
    # the real thing: one record per region, in the format perf reads
    with open(path, "wb") as fh:
        fh.write(_header(fake_pid))
    jd = J.JitDump(fake_pid, uid)
    assert jd.load(7, "dbr:work+0x13 [r1]", 0x7000, b"\x90\x90\xc3") is None
    assert jd.load(7, "dbr:work+0x13 [r1]", 0x7000, b"\x90\x90\xc3") is None   # once
    data = open(path, "rb").read()[J.HEADER.size:]
    rid, size, _t, pid, _tid, vma, addr, n, index = J.LOAD.unpack_from(data)
    assert (rid, pid, vma, addr, n, index) == (J.JIT_CODE_LOAD, fake_pid, 0x7000, 0x7000, 3, 0)
    assert size == len(data) and data[J.LOAD.size:] == b"dbr:work+0x13 [r1]\0\x90\x90\xc3"
    # the size limit
    jd.written = J.MAX_BYTES
    assert "no more" in jd.load(8, "x", 0, b"\xc3") and jd.load(9, "x", 0, b"\xc3") is None
    jd.close()


@needs_agent
def test_the_agent_makes_the_marker_only_when_asked(tmp_path):
    prog = build_example("hotloop")
    for asked in (False, True):
        env = {"DBR_JITDUMP": "1"} if asked else {}
        p = spawn_client(str(tmp_path), [prog, "600"], env=env)
        try:
            time.sleep(0.3)
            path = J.path_of(p.pid)
            maps = open(f"/proc/{p.pid}/maps").read()
            if not asked:
                assert not os.path.exists(path) and path not in maps
                continue
            head = open(path, "rb").read()
            assert head == head[:J.HEADER.size] and len(head) == J.HEADER.size
            magic, version, size, mach, _pad, pid, _t, flags = J.HEADER.unpack(head)
            assert (magic, version, size, mach, pid, flags) == (J.JITDUMP_MAGIC, 1, 40, 62,
                                                               p.pid, 0)
            line = next(ln for ln in maps.splitlines() if ln.endswith(path))
            assert line.split()[1].startswith("r-x"), line
        finally:
            kill(p)
            if os.path.exists(J.path_of(p.pid)):
                os.unlink(J.path_of(p.pid))


@needs_agent
@pytest.mark.skipif(shutil.which("perf") is None, reason="perf is not installed "
                    "(make bench-setup installs linux-perf)")
def test_perf_reports_replacement_code_under_its_name(tmp_path):
    prog = build_example("hotloop")
    svc = ServiceProc("--aggressive").wait_ready()
    client = None
    try:
        client = spawn_client(svc.dir, [prog, "8000"], env={"DBR_JITDUMP": "1"})
        svc.wait_for(lambda: _installed(svc, client.pid), timeout=20, what="a region")
        data, jit = tmp_path / "perf.data", tmp_path / "jit.data"
        r = subprocess.run(["perf", "record", "-q", "-k", "mono", "-e", "cpu-clock",
                            "-o", str(data), "-p", str(client.pid), "--", "sleep", "1.5"],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        r = subprocess.run(["perf", "inject", "--jit", "-i", str(data), "-o", str(jit)],
                           capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        rep = subprocess.run(["perf", "report", "-i", str(jit), "--stdio", "--sort", "sym"],
                             capture_output=True, text=True, timeout=120, cwd=tmp_path).stdout
        rows = [ln.split() for ln in rep.splitlines() if ln.strip() and not ln.startswith("#")]
        named = [(float(r[0].rstrip("%")), " ".join(r[2:])) for r in rows
                 if len(r) > 2 and r[2].startswith("dbr:")]
        assert named, rep[:2000]
        share, name = max(named)
        assert name.startswith("dbr:mix+0x") and name.endswith("]") and share > 50, named
    finally:
        kill(client)
        svc.stop()
        if client is not None and os.path.exists(J.path_of(client.pid)):
            os.unlink(J.path_of(client.pid))


def test_the_header_layout_is_the_formats():
    assert J.HEADER.size == 40 and J.LOAD.size == 56
    assert struct.pack("<I", J.JITDUMP_MAGIC) == b"DTiJ"
