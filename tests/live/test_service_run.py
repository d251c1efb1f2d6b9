"""`dbr run`: exit status, signals, LD_PRELOAD, report JSON, forks/execs, host vs embedded."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from service_helpers import ServiceProc, agent_path, build_example, symbol_range

from dbr_service.common.paths import QUIET_FILE, program_key, program_quiet_file

pytestmark = pytest.mark.skipif(agent_path() is None, reason="libdbr_agent.so cannot be built")


def _run(*argv: str, env: dict[str, str] | None = None, timeout: float = 60):
    return subprocess.run([sys.executable, "-m", "dbr_service.commands.cli", "run", *argv],
                          env=env or dict(os.environ), capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture
def noservice_env(tmp_path):
    """An environment whose DBR_RUNTIME_DIR has no service: dbr run goes embedded."""
    return dict(os.environ, DBR_RUNTIME_DIR=str(tmp_path / "none"))


def test_exit_status_and_signals(noservice_env):
    assert _run("--", "sh", "-c", "exit 7", env=noservice_env).returncode == 7
    assert _run("--", "sh", "-c", "kill -TERM $$", env=noservice_env).returncode == 128 + 15
    r = _run("--", "/nonexistent/prog", env=noservice_env)
    assert r.returncode == 127 and "cannot run" in r.stderr


def test_ld_preload_prepended(noservice_env, tmp_path):
    other = build_example("hotloop")  # any existing file name; only the value is printed
    env = dict(noservice_env, LD_PRELOAD="")
    r = _run("--", "sh", "-c", "echo \"$LD_PRELOAD|$DBR_RUNTIME_DIR\"", env=env)
    preload, rdir = r.stdout.strip().split("|")
    assert preload == agent_path() and rdir and rdir != noservice_env["DBR_RUNTIME_DIR"]
    assert not os.path.exists(rdir), "embedded runtime dir left behind"
    del other


def test_aggressive_runs_have_the_agent_connect_at_once(noservice_env):
    """The agent's thread stays quiet for its first 50 ms (dbr_agent/connect.c); `dbr run
    --embedded --aggressive` wants optimization from PROG's first moments: its service
    is up before PROG and tells the agent to connect at once (paths.QUIET_FILE, 0); a
    DBR_AGENT_QUIET_MS the user set reaches PROG unchanged (the agent prefers it)."""
    show = ["--", "sh", "-c", f"cat \"$DBR_RUNTIME_DIR/{QUIET_FILE}\" 2>/dev/null || echo none;"
            " echo \"q=${DBR_AGENT_QUIET_MS-unset}\""]
    r = _run("--embedded", "--aggressive", "--quiet", *show, env=noservice_env)
    assert r.returncode == 0 and r.stdout.split() == ["0", "q=unset"], (r.stdout, r.stderr)
    r = _run("--embedded", "--quiet", *show, env=noservice_env)
    assert r.stdout.split() == ["none", "q=unset"], (r.stdout, r.stderr)
    r = _run("--embedded", "--aggressive", "--quiet", *show,
             env=dict(noservice_env, DBR_AGENT_QUIET_MS="20"))
    assert r.stdout.split() == ["0", "q=20"], (r.stdout, r.stderr)


@pytest.mark.parametrize("aggressive", [False, True], ids=["beside", "first"])
def test_signals_to_dbr_run_reach_prog(noservice_env, aggressive):
    """SIGTERM to `dbr run` goes to PROG, whether the embedded service started beside
    PROG (after dbr run's forwarding handlers) or before it: the embedded service never
    takes the process's signal handlers."""
    script = 'trap "echo got TERM; exit 3" TERM; echo ready $$; while :; do sleep 0.05; done'
    argv = [sys.executable, "-m", "dbr_service.commands.cli", "run", "--embedded", "--quiet",
            *(["--aggressive"] if aggressive else []), "--", "sh", "-c", script]
    p = subprocess.Popen(argv, env=noservice_env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    prog = None
    try:
        word, prog = p.stdout.readline().split()
        assert word == "ready"
        time.sleep(0.5)   # the service beside PROG is up by now
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=20)
        assert "got TERM" in out and p.returncode == 3, (out, err, p.returncode)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(5)
        if prog is not None:   # PROG outlives a dbr run that did not forward
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(prog), signal.SIGKILL)


def test_report_embedded_follows_forks_and_execs(noservice_env, tmp_path):
    prog = build_example("hotloop")
    rep_path = tmp_path / "rep.json"
    r = _run("--embedded", "--aggressive", "--report", str(rep_path), "--", "sh", "-c",
             f"{prog} 1200; {prog} 1200; true", env=noservice_env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("check ") == 2
    rep = json.loads(rep_path.read_text())
    assert rep["schema"] == "dbr.run/1" and rep["exit_code"] == 0 and rep["wall_s"] > 2.0
    assert rep["program"][:2] == ["sh", "-c"]
    for k in ("pid", "exe", "samples", "samples_after_first_patch", "samples_in_replacement",
              "time_to_first_patch_s", "patches_installed", "patches_removed", "regions",
              "regions_went_live", "threads_transferred"):
        assert all(k in c for c in rep["clients"]), k
    loops = [c for c in rep["clients"] if c["exe"] == prog]
    assert len(loops) == 2, [c["exe"] for c in rep["clients"]]   # both children followed
    lo, hi = symbol_range(prog, "mix")
    for c in loops:
        assert c["samples"] > 10   # CPU time of a loaded 2-core machine: keep it low
        assert lo <= c["hotspots"][0]["offset"] < hi, c["hotspots"][:3]
    assert rep["totals"]["samples"] == sum(c["samples"] for c in rep["clients"])
    for k in ("patches_installed", "regions_went_live", "threads_transferred"):
        assert rep["totals"][k] == sum(c[k] for c in rep["clients"]), k
    for c in rep["clients"]:
        assert c["samples_in_replacement"] <= c["samples_after_first_patch"] <= c["samples"]
        # the first region to go live (by a patch or a thread moved in) sets it
        assert (c["time_to_first_patch_s"] is None) == (c["regions_went_live"] == 0)
        assert c["regions_went_live"] > 0 or c["patches_installed"] == 0
    assert "dbr:" in r.stderr and "samples" in r.stderr


def test_uses_host_service():
    svc = ServiceProc("--aggressive").wait_ready()
    try:
        prog = build_example("hotloop")
        r = _run("--", prog, "500", env=svc.env)
        assert r.returncode == 0, r.stderr
        assert "(host service)" in r.stderr
        seen = svc.call("clients", {"all": True})
        assert any(c["exe"] == prog and c["samples"] > 0 for c in seen), seen
    finally:
        svc.stop()


def test_a_program_gone_within_the_agent_quiet_start_is_explained():
    """Under a host service (min_client_age_s 1 s, its hint file) the agent makes its
    thread only once PROG is 1000 ms old and running: `true` exits before, and a PROG
    that sleeps past it never runs again; the report says why rather than blaming a
    static program or a cleared LD_PRELOAD."""
    svc = ServiceProc().wait_ready()
    try:
        r = _run("--", "true", env=svc.env)
        assert r.returncode == 0, r.stderr
        assert "(host service)" in r.stderr
        assert "PROG ended within its agent's quiet start (1000 ms" in r.stderr, r.stderr
        # a program the service found to run too short to gain (daemon/shortruns.py): its file
        key = program_key(os.stat(shutil.which("true")))
        with open(os.path.join(svc.dir, program_quiet_file(key)), "w") as f:
            f.write("3000\n")
        r = _run("--", "true", env=svc.env)
        assert "PROG ended within its agent's quiet start (3000 ms: the service's " \
            "short_run_s" in r.stderr, r.stderr
        r = _run("--", "sleep", "1.3", env=svc.env)
        assert r.returncode == 0, r.stderr
        assert "PROG's agent makes its thread only once PROG is 1000 ms old" in r.stderr, \
            r.stderr
        r = _run("--", "sh", "-c", "sleep 0.2",
                 env=dict(svc.env, DBR_AGENT_DISABLE="1", DBR_AGENT_QUIET_MS="0"))
        assert "no agent connected" in r.stderr, r.stderr
    finally:
        svc.stop()


def test_run_starts_prog_without_importing_the_service():
    """`dbr run` on the host-service path imports neither the region/codegen code nor
    the session code before PROG starts (they cost 0.2 s of every run), and the report
    module it uses after PROG exits stays light too."""
    probe = ("import sys, dbr_service.commands.cli as c\n"
             "p = c.build_parser('run'); a = p.parse_args(['run', '--', 'true'])\n"
             "import dbr_service.commands.report\n"
             "heavy = sorted(m for m in ('networkx', 'capstone', 'keystone', 'lief', 'zmq',\n"
             "               'dbr_service.common.config', 'logging',\n"
             "               'dbr_service.session.clients', 'dbr_service.daemon.service',\n"
             "               'dbr_service.region.model', 'dbr_service.codegen.emit')\n"
             "               if m in sys.modules)\n"
             "print(','.join(heavy) or 'none')\n")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "none"


def test_report_installed_state_matches_region_state():
    from dbr_service.commands import report
    from dbr_service.session.session_regions import RegionState

    assert report.INSTALLED == RegionState.INSTALLED.value


def test_embedded_service_failing_to_start_leaves_prog_running(noservice_env, tmp_path):
    """PROG starts before the embedded service (so the service's start-up overlaps the
    program): a service that then fails to start is reported, and PROG runs to its own
    exit status, unoptimized."""
    out = tmp_path / "rep.json"
    r = _run("--embedded", "-o", "socket_group=no-such-group-dbr", "--report", str(out),
             "--", "sh", "-c", "echo ran; exit 3", env=noservice_env)
    assert r.returncode == 3 and r.stdout == "ran\n"
    assert "cannot start the embedded service" in r.stderr
    assert "no-such-group-dbr" in r.stderr
    rep = json.loads(out.read_text())
    assert rep["exit_code"] == 3 and rep["clients"] == []


def test_stale_host_socket_means_embedded(tmp_path):
    """A host runtime dir whose agent.sock nobody listens on (a crashed service) is not
    taken for a running service: the run goes embedded and PROG is still served."""
    import socket

    rdir = tmp_path / "rt"
    rdir.mkdir()
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.bind(str(rdir / "agent.sock"))
    s.close()                                       # the file stays, nobody listens
    out = tmp_path / "rep.json"
    r = _run("--report", str(out), "--", "true", env=dict(os.environ, DBR_RUNTIME_DIR=str(rdir)))
    assert r.returncode == 0, r.stderr
    assert json.loads(out.read_text())["service"] == "embedded"


def test_short_commands_of_a_script_are_not_warned_about(noservice_env):
    """A shell script's commands exit (or exec) while the service answers their HELLO:
    routine, not a refusal worth a warning per command (it was one line per command)."""
    r = _run("--embedded", "--", "sh", "-c",
             "for i in $(seq 40); do /bin/true; done; exec /bin/true", env=noservice_env)
    assert r.returncode == 0, r.stderr
    assert "WARNING" not in r.stderr and "refused" not in r.stderr, r.stderr


def test_unshare_user_namespace_works_under_dbr_run(noservice_env):
    """`unshare -U` needs a single-threaded process; the agent steps aside for it."""
    import shutil
    if not shutil.which("unshare"):
        pytest.skip("util-linux unshare is not installed")
    native = subprocess.run(["unshare", "-Ur", "id", "-u"], capture_output=True, text=True,
                            timeout=30)
    if native.returncode != 0:
        pytest.skip(f"user namespaces are refused here natively: {native.stderr.strip()}")
    r = _run("--embedded", "--", "unshare", "-Ur", "id", "-u", env=noservice_env)
    assert (r.returncode, r.stdout) == (0, native.stdout), r.stderr


def test_a_program_gone_before_the_embedded_service_is_explained(noservice_env, tmp_path):
    """By default the embedded service starts beside PROG: `true` exits long before
    the service takes its agent's connection, and the report says so instead of
    leaving a bare "0 client(s)"."""
    rep_path = tmp_path / "rep.json"
    r = _run("--embedded", "--report", str(rep_path), "--", "true", env=noservice_env)
    assert r.returncode == 0, r.stderr
    rep = json.loads(rep_path.read_text())
    assert rep["clients"] == [] and "as the embedded service" in rep["note"]
    assert "as the embedded service" in r.stderr
    # no agent at all: a different reason
    env = dict(noservice_env, DBR_AGENT_DISABLE="1")
    r = _run("--embedded", "--aggressive", "--report", str(rep_path), "--", "sleep", "0.3",
             env=env)
    assert r.returncode == 0, r.stderr
    rep = json.loads(rep_path.read_text())
    assert rep["clients"] == [] and rep["note"].startswith("no agent connected")
