"""Faults around installation: each leaves the client correct and
the service side serving.

* a service killed after writing replacement code and before patching: the client never
  ran that code, its text is untouched, a restarted service gets it back and patches;
* a client that exits in the middle of an installation: the installer reports an
  AgentError, nothing is left half-done on our side, other clients are unaffected.
(A region that does not fit its space, a buffer out of reach and a patch the agent
refuses are in tests/agent/test_install.py.)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from dbr_service.wire import protocol as P
from dbr_service.common.errors import AgentError
from dbr_service.installation.install import Installer, InstallState
from harness import (SITE_INSN, FakeService, compile_c, exit_stub, parse_sites, patch_sites,
                     read_mem, stub_gen)

DRIVER = r"""
import sys, time
sys.path.insert(0, sys.argv[1])
from harness import FakeService, exit_stub
svc = FakeService(runtime_dir=sys.argv[2])
conn = svc.accept(pid=int(sys.argv[3]))
site = int(sys.argv[4], 16)
buf = conn.code_buffer(near=site, size=4096)
exit_stub(buf, buf.base, site)          # code written ...
print("written", hex(buf.base), flush=True)
time.sleep(60)                          # ... and killed before any PATCH
"""


@pytest.fixture(scope="module")
def storm_exe():
    return compile_c(["storm.c"])


def test_service_killed_between_writing_code_and_patching(storm_exe, tmp_path):
    svc = FakeService(listening=False)   # the driver process owns the socket first
    driver = None
    try:
        client = svc.spawn([storm_exe, "4"])
        site = parse_sites(client.out.expect("sites"))[0]
        client.out.expect("ready")
        script = tmp_path / "driver.py"
        script.write_text(DRIVER)
        driver = subprocess.Popen([sys.executable, str(script),
                                   os.path.dirname(os.path.dirname(__file__)),
                                   svc.runtime_dir, str(client.pid), hex(site)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        line = driver.stdout.readline().decode()
        assert line.startswith("written"), driver.stderr.read1(4096)
        driver.send_signal(signal.SIGKILL)
        driver.wait(5)
        time.sleep(0.3)
        assert read_mem(client.pid, site, 6) == SITE_INSN, "text changed without a PATCH"
        assert client.proc.poll() is None
        # A new service on the same socket gets the client back and can patch it.
        svc.start_listening()
        conn = svc.accept(pid=client.pid, timeout=10)
        buf = conn.code_buffer(near=site, size=4096)
        ps = patch_sites(conn, client.pid, {site: exit_stub(buf, buf.base, site)})
        assert conn.patch(ps) == [P.Result.OK]
        assert conn.unpatch(ps) == [P.Result.OK]
        rc, rest = client.finish()
        assert rc == 0 and rest[-1].startswith("ok calls="), client.err.lines
    finally:
        if driver is not None and driver.poll() is None:
            driver.kill()
            driver.wait(5)
        svc.close()


def test_client_exits_mid_install_other_clients_unaffected(storm_exe):
    svc = FakeService()
    try:
        doomed = svc.spawn([storm_exe, "2"])
        d_sites = parse_sites(doomed.out.expect("sites"))
        doomed.out.expect("ready")
        d_conn = svc.accept(pid=doomed.pid)
        other = svc.spawn([storm_exe, "2"])
        o_sites = parse_sites(other.out.expect("sites"))
        other.out.expect("ready")
        o_conn = svc.accept(pid=other.pid)

        d_inst = Installer(d_conn, lambda a, n: read_mem(doomed.pid, a, n))
        chunk = d_inst.reserve(64, reach=d_sites[:2])
        gen = stub_gen(chunk.addr, d_sites[:2])
        # The client dies after its code space was reserved, before REGION/PATCH.
        doomed.proc.send_signal(signal.SIGKILL)
        doomed.proc.wait(5)
        with pytest.raises(AgentError):
            d_inst.install(chunk, gen)
        assert [q.chunk for q in d_inst.space.quarantine] == [chunk]   # space not leaked
        assert not [r for r in d_inst.regions.values() if r.state is InstallState.INSTALLED]

        # The other client is served as if nothing happened.
        o_inst = Installer(o_conn, lambda a, n: read_mem(other.pid, a, n))
        c2 = o_inst.reserve(64, reach=o_sites[:2])
        reg = o_inst.install(c2, stub_gen(c2.addr, o_sites[:2]))
        assert reg.state is InstallState.INSTALLED
        o_inst.uninstall_all("done")
        rc, rest = other.finish()
        assert rc == 0 and rest[-1].startswith("ok calls="), other.err.lines
    finally:
        svc.close()
