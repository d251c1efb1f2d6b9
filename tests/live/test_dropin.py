"""docs/dbr-dropin.conf, the drop-in that puts a systemd service under dbr: systemd
accepts it beside a unit, and a program started with its Environment= becomes a client
of the host service (the service's runtime dir moved to a temporary one)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from service_helpers import ServiceProc, agent_path, build_example, kill

DROPIN = Path(__file__).resolve().parent.parent.parent / "docs" / "dbr-dropin.conf"


def _environment(text: str) -> dict[str, str]:
    """The Environment= assignments of the [Service] section (systemd repeats the key,
    which configparser cannot keep)."""
    out, section = {}, ""
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("["):
            section = line
        elif section == "[Service]" and line.startswith("Environment="):
            k, _, v = line.removeprefix("Environment=").partition("=")
            out[k] = v
    return out


def test_the_dropin_names_the_agent_and_the_service():
    text = DROPIN.read_text()
    env = _environment(text)
    assert env == {"LD_PRELOAD": "AGENT", "DBR_RUNTIME_DIR": "/run/dbr"}, env
    assert "After=dbr-service.service" in text and "Wants=dbr-service.service" in text


@pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                    reason="systemd-analyze is not installed here")
def test_systemd_accepts_the_dropin(tmp_path):
    unit = tmp_path / "demo.service"
    unit.write_text("[Unit]\nDescription=a program put under dbr\n\n[Service]\n"
                    "ExecStart=/bin/true\n")
    d = tmp_path / "demo.service.d"
    d.mkdir()
    (d / "dbr.conf").write_text(DROPIN.read_text().replace("AGENT", agent_path() or "/x.so"))
    svc = tmp_path / "dbr-service.service"
    svc.write_text("[Unit]\nDescription=dbr\n\n[Service]\nExecStart=/bin/true\n")
    r = subprocess.run(["systemd-analyze", "verify", "--man=no", str(unit)],
                       capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 0, r.stderr


@pytest.mark.skipif(agent_path() is None, reason="libdbr_agent.so cannot be built")
def test_a_program_started_with_the_dropins_environment_is_served():
    prog = build_example("hotloop")
    svc = ServiceProc().wait_ready()
    p = None
    try:
        env = _environment(DROPIN.read_text())
        env["LD_PRELOAD"] = env["LD_PRELOAD"].replace("AGENT", agent_path())
        env["DBR_RUNTIME_DIR"] = svc.dir        # the unit's /run/dbr, moved for the test
        p = subprocess.Popen([prog, "3000"], env=dict(os.environ, **env),
                             stdout=subprocess.DEVNULL)
        svc.wait_for(lambda: any(c["pid"] == p.pid for c in svc.call("clients")),
                     timeout=20, what="the program as a client")
    finally:
        kill(p)
        svc.stop()
