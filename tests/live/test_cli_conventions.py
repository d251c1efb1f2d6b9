"""The `dbr` command's conventions: --version, output paths checked before anything
runs, `--report -` on standard output, a reader that goes away, signals named."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from service_helpers import ServiceProc

DBR = [sys.executable, "-m", "dbr_service.commands.cli"]


def _dbr(*args: str, env: dict[str, str] | None = None, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([*DBR, *args], capture_output=True, text=True, timeout=120,
                          env=env or dict(os.environ), **kw)


def test_version():
    import dbr_service

    r = _dbr("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"dbr {dbr_service.__version__}"


def test_a_report_path_that_cannot_be_written_is_refused_before_the_program_runs(tmp_path):
    marker = tmp_path / "ran"
    r = _dbr("run", "--embedded", "--report", "/nonexistent/r.json", "--",
             "sh", "-c", f"touch {marker}")
    assert r.returncode == 2 and "no directory /nonexistent" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not marker.exists()
    r = _dbr("run", "--embedded", "--report", str(tmp_path), "--", "true")
    assert r.returncode == 2 and "is a directory" in r.stderr


def test_report_dash_is_standard_output_and_the_exit_code_is_the_programs(tmp_path):
    r = _dbr("run", "--embedded", "--quiet", "--report", "-", "--", "sh", "-c", "exit 7",
             cwd=tmp_path)
    assert r.returncode == 7, r.stderr
    rep = json.loads(r.stdout)
    assert rep["schema"] == "dbr.run/1" and rep["exit_code"] == 7
    assert not (tmp_path / "-").exists()


def test_a_program_killed_by_a_signal_is_said_so():
    r = _dbr("run", "--embedded", "--", "sh", "-c", "kill -SEGV $$")
    assert r.returncode == 128 + signal.SIGSEGV
    assert "killed by SIGSEGV" in r.stderr and "exited 139" not in r.stderr, r.stderr


def test_a_reader_that_goes_away_is_no_traceback():
    svc = ServiceProc().wait_ready()
    try:
        env = dict(os.environ, DBR_RUNTIME_DIR=svc.dir)
        # `dbr ctl --json status | true`: the reader is gone before dbr writes (it
        # starts in ~0.1 s)
        p = subprocess.Popen([*DBR, "ctl", "--json", "status"], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        p.stdout.close()
        err = p.stderr.read().decode()
        rc = p.wait(timeout=30)
        assert "Traceback" not in err and "BrokenPipe" not in err, err
        assert rc in (0, 128 + signal.SIGPIPE)
    finally:
        svc.stop()


def test_a_dot_path_that_cannot_be_written_is_refused_before_asking():
    r = _dbr("ctl", "region", "1", "r1", "--dot", "/nonexistent/x.dot",
             env=dict(os.environ, DBR_RUNTIME_DIR="/nonexistent-dbr"))
    assert r.returncode == 2 and "cannot write /nonexistent/x.dot" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("code,text", [(0, "exited 0"), (3, "exited 3"),
                                       (128 + 9, "killed by SIGKILL"),
                                       (128 + 64, "killed by SIGRTMAX"),
                                       (128 + 65, "exited 193")])
def test_how_it_ended(code, text):
    from dbr_service.commands.report import how_it_ended

    assert how_it_ended(code) == text


def _installed(svc, pid: int) -> list[str]:
    return [r["id"] for r in svc.call("regions", {"pid": pid})["regions"]
            if r["state"] == "installed"]


def test_an_operators_unpatch_sticks_until_resume():
    """`dbr ctl unpatch PID` used to be followed by the same region's install within a
    second; now nothing is installed in that client until `dbr ctl resume PID`."""
    from service_helpers import build_example, kill, spawn_client

    prog = build_example("hotloop")
    svc = ServiceProc("--aggressive").wait_ready()
    client = None
    try:
        client = spawn_client(svc.dir, [prog, "20000"])
        svc.wait_for(lambda: _installed(svc, client.pid), timeout=20, what="a region")
        env = dict(os.environ, DBR_RUNTIME_DIR=svc.dir)
        r = _dbr("ctl", "unpatch", str(client.pid), env=env)
        assert r.returncode == 0 and "stays out until `dbr ctl resume" in r.stdout, r.stdout
        t_end = time.monotonic() + 3.0          # several aggressive snapshots and jobs
        while time.monotonic() < t_end:
            assert not _installed(svc, client.pid)
            time.sleep(0.1)
        row = next(c for c in svc.call("clients") if c["pid"] == client.pid)
        assert row["operator_hold"] == "all"
        r = _dbr("ctl", "resume", str(client.pid), env=env)
        assert r.returncode == 0 and "patching allowed again" in r.stdout, r.stdout
        svc.wait_for(lambda: _installed(svc, client.pid), timeout=20,
                     what="a region after resume")
    finally:
        kill(client)
        svc.stop()


def test_the_run_summary_counts_regions_by_their_state():
    """The summary used to print '1 patches, 1 regions installed' beside 'regions: 0
    region(s) selected' (the last job's status): it now counts the region records."""
    from dbr_service.commands.report import format_report, run_report

    client = {"pid": 5, "exe": "/bin/x", "samples": 100, "samples_in_replacement": 45,
              "samples_after_first_patch": 50, "time_to_first_patch_s": 0.3,
              "patches_installed": 1, "sampling_source": "perf", "hotspots": [],
              "region_status": "0 region(s) selected",
              "regions": [{"id": "r1", "state": "installed"}, {"id": "r2", "state": "removed"},
                          {"id": "r3", "state": "removed"}]}
    text = format_report(run_report(["x"], 0, 1.0, [client]))
    assert "regions: 1 installed, 2 removed" in text and "0 region(s)" not in text
    assert "first patch after 0.30 s; 90% of the 50 samples since then in replacement" in text


def test_analyze_says_why_samples_miss_a_pie_binary(tmp_path):
    """Run-time samples of a PIE analysed at link addresses: exit 2 with the load
    address to pass; with that --base the same samples are placed."""
    src = tmp_path / "p.c"
    src.write_text("int main(int c, char **v) { long s = 0;"
                   " for (long i = 0; i < c * 1000; i++) s += i; return (int)s; }\n")
    exe = tmp_path / "p"
    subprocess.run(["gcc", "-O2", "-pie", "-fPIE", "-o", str(exe), str(src)], check=True)
    from dbr_service.region.memview import ElfMemoryView
    text = next(r for r in ElfMemoryView(str(exe)).ranges() if "x" in r.perms)
    base = 0x555555554000
    samples = tmp_path / "s.txt"
    samples.write_text(f"{base + text.start:#x} 10\n")
    r = subprocess.run(DBR + ["analyze", str(exe), "--samples", str(samples)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "position-independent" in r.stderr and f"--base {base:#x}" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    ok = subprocess.run(DBR + ["analyze", str(exe), "--base", hex(base), "--samples",
                               str(samples)], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    assert "0 samples not placed" in ok.stdout, ok.stdout


def test_the_run_summary_folds_quiet_clients_into_one_line():
    """A script's short-lived children (shells, readlink) share one line instead of a
    block each; the busiest client and every client dbr patched keep their blocks."""
    from dbr_service.commands.report import format_report, run_report

    def client(pid, exe, samples, patches=0, regions=()):
        return {"pid": pid, "exe": exe, "samples": samples, "patches_installed": patches,
                "samples_in_replacement": 0, "samples_after_first_patch": 0,
                "sampling_source": "perf" if samples else None, "hotspots": [],
                "regions": [{"id": r, "state": "installed"} for r in regions]}

    clients = [client(10, "/usr/bin/bash", 1), client(11, "/usr/bin/bash", 0),
               client(12, "/usr/bin/readlink", 0), client(13, "/usr/bin/python3", 900),
               client(14, "/usr/bin/bash", 0), client(15, "/opt/worker", 40, 2, ["r1"])]
    text = format_report(run_report(["sh", "-c", "a\nb"], 0, 2.0, clients))
    lines = text.splitlines()
    assert "sh -c 'a\\nb' exited 0" in lines[0], lines[0]
    assert [ln for ln in lines if "pid " in ln] == [
        ln for ln in lines if "pid 13 " in ln or "pid 15 " in ln]
    assert lines[-1] == ("dbr:   4 other clients, nothing hot, not patched: bash x3, "
                         "readlink (1 samples in all)"), lines[-1]
    # a run of one quiet program keeps its own block, and nothing is folded
    one = format_report(run_report(["x"], 0, 1.0, [client(20, "/bin/x", 3)]))
    assert "pid 20 /bin/x: 3 samples" in one and "other clients" not in one
    # one quiet child beside the program: shown, not folded
    two = format_report(run_report(["x"], 0, 1.0, [client(20, "/bin/x", 30),
                                                   client(21, "/bin/sh", 0)]))
    assert "pid 21 /bin/sh" in two and "other clients" not in two


def test_json_after_the_verb_and_events_follow():
    """`--json` is taken after the verb as before it; `dbr ctl events --follow` prints
    events as they happen (a client's session, its region's install) and ends with
    exit 0 on SIGINT; every verb's arguments have help."""
    from service_helpers import build_example, kill, spawn_client

    for verb in ("hotspots", "regions", "region", "unpatch", "pause", "resume"):
        r = _dbr("ctl", verb, "--help")
        assert r.returncode == 0 and "--json" in r.stdout, r.stderr
        assert "the client's process id" in r.stdout, r.stdout
    r = _dbr("ctl", "region", "--help")
    assert "the region's id (r1, ...)" in r.stdout and "--follow" in _dbr(
        "ctl", "events", "--help").stdout
    prog = build_example("hotloop")
    svc = ServiceProc("--aggressive").wait_ready()
    env = dict(os.environ, DBR_RUNTIME_DIR=svc.dir)
    follow = client = None
    try:
        before, after = _dbr("ctl", "--json", "status", env=env), \
            _dbr("ctl", "status", "--json", env=env)
        assert before.returncode == after.returncode == 0, after.stderr
        assert json.loads(before.stdout)["pid"] == json.loads(after.stdout)["pid"]
        follow = subprocess.Popen([*DBR, "ctl", "events", "--follow", "--json"], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        client = spawn_client(svc.dir, [prog, "20000"])
        svc.wait_for(lambda: _installed(svc, client.pid), timeout=20, what="a region")
        # regions name their entries after the function that holds them
        r = _dbr("ctl", "regions", str(client.pid), env=env)
        assert r.returncode == 0 and "mix+0x" in r.stdout, r.stdout
        time.sleep(1.0)                                   # two polls of --follow
        follow.send_signal(signal.SIGINT)
        out, err = follow.communicate(timeout=10)
        assert follow.returncode == 0 and "Traceback" not in err, err
        events = [json.loads(line) for line in out.splitlines()]
        kinds = [e["event"] for e in events]
        assert "patch-installed" in kinds, kinds
        seqs = [e["seq"] for e in events]
        assert seqs == sorted(set(seqs)), seqs              # each event once, in order
    finally:
        if follow is not None and follow.poll() is None:
            follow.kill()
            follow.wait()
        kill(client)
        svc.stop()
