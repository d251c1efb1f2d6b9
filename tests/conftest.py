"""Fixtures shared by the test modules of tests/unit, tests/agent and tests/live.

pytest finds this file in their parent and, in its default import mode, puts this
directory on sys.path, so that every layer imports the helpers here by name (harness.py,
service_helpers.py and the other non-test modules).  A test module imports no test
module of another layer (tests/unit/test_structure.py checks it)."""

from __future__ import annotations

import os
import tempfile

import pytest
from harness import FakeService, compile_c, parse_sites

# Services the tests start keep their profile store here, never in the host's
# /var/lib/dbr; each test gets its own (below), module-wide services this one.
os.environ["DBR_STATE_DIR"] = tempfile.mkdtemp(prefix="dbr-state-")


@pytest.fixture(autouse=True)
def _own_state_dir(monkeypatch, tmp_path_factory):
    """A profile store of the test's own: no warm start from another test's runs of
    the same program."""
    monkeypatch.setenv("DBR_STATE_DIR", str(tmp_path_factory.mktemp("state")))


@pytest.fixture(name="svc")
def fake_service():
    """A FakeService for one test, closed (its clients killed) afterwards.  Modules
    that need another ``svc`` (a module-scoped real service) define their own."""
    s = FakeService()
    yield s
    s.close()


@pytest.fixture
def client_conn():
    """tests/agent_progs/storm.c with 4 threads, under a FakeService, connected: (svc,
    client, its agent connection, its patch sites); the client must exit 0."""
    svc = FakeService()
    exe = compile_c(["storm.c"])
    client = svc.spawn([exe, "4"])
    sites = parse_sites(client.out.expect("sites"))
    client.out.expect("ready")
    conn = svc.accept(pid=client.pid)
    yield svc, client, conn, sites
    rc, _ = client.finish()
    assert rc == 0, client.err.lines
    svc.close()
