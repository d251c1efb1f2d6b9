"""Programs whose runs end too soon to gain get their agent's thread later
(dbr_service/daemon/shortruns.py; the agent's side: dbr_agent/connect.c, program_hint).

After SHORT_RUNS runs in a row that each ended within short_run_s of their start with
nothing installed, the service writes short_run_s in ms to ``agent-quiet-ms.KEY`` in
its runtime dir, and the program's next runs make their agent's thread only at that
age: one that ends as soon has no thread and no session; one that lives longer
connects then and makes the service forget the program."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import weakref
from types import SimpleNamespace

import pytest
from birth_helpers import run_birth, task_changes
from harness import compile_c
from service_helpers import ServiceProc, kill, spawn_client

from dbr_service.common.paths import (QUIET_FILE, agent_quiet, open_safe_dir, program_key,
                                      program_quiet_file, quiet_hint_ms)
from dbr_service.common.procfs import process_lives, started_boottime
from dbr_service.daemon.shortruns import SHORT_RUNS, ShortRunPrograms


@pytest.fixture(scope="module")
def birth_exe():
    return compile_c(["birth.c"])


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _memory(tmp_path, run_s=3.0, memory_s=600.0, hint_ms=1000, **kw):
    clock = Clock()
    m = ShortRunPrograms(tmp_path, run_s, memory_s, clock=clock, **kw)
    m.dir_fd = open_safe_dir(tmp_path)   # as the service gives it
    weakref.finalize(m, os.close, m.dir_fd)
    m.configure(run_s, memory_s, hint_ms)
    return m, clock


def _file(tmp_path, key: str):
    p = tmp_path / program_quiet_file(key)
    return p.read_text() if p.exists() else None


# ----------------------------------------------------------------------------- memory
def test_short_runs_in_a_row_make_a_late_birth_and_a_long_run_ends_it(tmp_path):
    m, _ = _memory(tmp_path)
    for _ in range(SHORT_RUNS - 1):
        m.ended("k1", "/bin/short", 1.6, installed=False)
    assert _file(tmp_path, "k1") is None and m.status() == []
    m.ended("k1", "/bin/short", 1.7, installed=False)
    assert _file(tmp_path, "k1") == "3000\n"
    assert m.status() == [{"exe": "/bin/short", "key": "k1", "birth_ms": 3000,
                           "forgotten_in_s": 600.0}]
    assert m.learned == 1
    m.connected("k1", 3.01)          # a run born late that lived on: long
    assert _file(tmp_path, "k1") is None and m.status() == []
    # counting starts again from nothing
    for _ in range(SHORT_RUNS - 1):
        m.ended("k1", "/bin/short", 1.6, installed=False)
    assert _file(tmp_path, "k1") is None


def test_a_long_run_breaks_the_row(tmp_path):
    m, _ = _memory(tmp_path)
    for _ in range(SHORT_RUNS - 1):
        m.ended("k1", "/bin/p", 1.0, installed=False)
    m.ended("k1", "/bin/p", 3.5, installed=False)
    for _ in range(SHORT_RUNS - 1):
        m.ended("k1", "/bin/p", 1.0, installed=False)
    assert _file(tmp_path, "k1") is None
    m.ended("k1", "/bin/p", 1.0, installed=False)
    assert _file(tmp_path, "k1") == "3000\n"


def test_a_program_with_code_installed_is_not_born_late_for_the_memory(tmp_path):
    """A short run that had a region installed: dbr does something for the program, so
    however short its runs, it is not born late for short_run_memory_s."""
    m, clock = _memory(tmp_path, memory_s=60.0)
    for _ in range(SHORT_RUNS - 1):
        m.ended("k1", "/bin/p", 1.0, installed=False)
    m.ended("k1", "/bin/p", 1.0, installed=True)
    for _ in range(2 * SHORT_RUNS):
        m.ended("k1", "/bin/p", 1.0, installed=False)
        clock.t += 5.0
    assert _file(tmp_path, "k1") is None and m.status() == []
    clock.t += 30.0                  # 60 s since the installed run
    for _ in range(SHORT_RUNS - 1):
        m.ended("k1", "/bin/p", 1.0, installed=False)
    assert _file(tmp_path, "k1") is None
    m.ended("k1", "/bin/p", 1.0, installed=False)
    assert _file(tmp_path, "k1") == "3000\n"
    # a run with a region installed ends a late birth at once (one born late connects
    # only at short_run_s, which ends it already: this is the defensive path)
    m.ended("k1", "/bin/p", 1.0, installed=True)
    assert _file(tmp_path, "k1") is None and m.status() == []


@pytest.mark.parametrize("run_s,memory_s,hint_ms", [
    (0.0, 600.0, 1000),      # short_run_s 0: never
    (1.0, 600.0, 1000),      # not later than the service's own hint
    (3.0, 0.0, 1000),        # short_run_memory_s 0: never
    (3.0, 600.0, 0),         # --aggressive: every program from its first moments
], ids=["off", "not-later", "no-memory", "aggressive"])
def test_nothing_is_learned_where_it_would_not_apply(tmp_path, run_s, memory_s, hint_ms):
    m, _ = _memory(tmp_path, run_s, memory_s, hint_ms)
    assert not m.active
    for _ in range(SHORT_RUNS + 2):
        m.ended("k1", "/bin/p", 0.5, installed=False)
    assert os.listdir(tmp_path) == [] and m.status() == []


def test_late_births_are_forgotten_after_the_memory_and_on_new_settings(tmp_path):
    m, clock = _memory(tmp_path, memory_s=60.0)
    for key in ("a", "b"):
        for _ in range(SHORT_RUNS):
            m.ended(key, f"/bin/{key}", 1.0, installed=False)
        clock.t += 30.0
    assert sorted(os.listdir(tmp_path)) == [program_quiet_file("a"), program_quiet_file("b")]
    m.expire()                       # a written 60 s ago (30 + 30), b 30 s ago
    assert os.listdir(tmp_path) == [program_quiet_file("b")]
    m.expire()
    assert os.listdir(tmp_path) == [program_quiet_file("b")]
    m.configure(4.0, 60.0, 1000)     # another short_run_s: b's file says 3000
    assert os.listdir(tmp_path) == [] and m.status() == []
    m.configure(4.0, 60.0, 1000)     # the same settings again: nothing forgotten
    for _ in range(SHORT_RUNS):
        m.ended("c", "/bin/c", 1.0, installed=False)
    m.configure(4.0, 60.0, 1000)
    assert _file(tmp_path, "c") == "4000\n"


def test_the_least_recently_seen_program_is_forgotten_first(tmp_path):
    m, _ = _memory(tmp_path, max_programs=2)
    for key in ("a", "b", "c"):
        for _ in range(SHORT_RUNS):
            m.ended(key, f"/bin/{key}", 1.0, installed=False)
    assert sorted(os.listdir(tmp_path)) == [program_quiet_file("b"), program_quiet_file("c")]


def test_stale_files_are_removed_and_a_failed_write_is_tried_again(tmp_path):
    (tmp_path / program_quiet_file("old")).write_text("3000\n")
    (tmp_path / f"{QUIET_FILE}.123.tmp").write_text("9")
    (tmp_path / QUIET_FILE).write_text("1000\n")
    m, _ = _memory(tmp_path)
    m.remove_stale()
    assert os.listdir(tmp_path) == [QUIET_FILE]      # the service's own hint stays
    # a runtime dir that cannot be written (removed under the service): logged, no
    # program born late, tried again at the next run's end
    gone = tmp_path / "gone"
    gone.mkdir()
    m2, _ = _memory(gone)
    gone.rmdir()
    for _ in range(SHORT_RUNS):
        m2.ended("k", "/bin/k", 1.0, installed=False)
    assert m2.status() == [] and m2.learned == 0
    gone.mkdir()
    m2.dir_fd = open_safe_dir(gone)
    weakref.finalize(m2, os.close, m2.dir_fd)
    m2.ended("k", "/bin/k", 1.0, installed=False)
    assert _file(gone, "k") == "3000\n"


def test_program_key_and_agent_quiet_read_the_programs_file(tmp_path, birth_exe):
    st = os.stat(birth_exe)
    key = program_key(st)
    dev, ino, mtime = (int(x, 16) for x in key.split("-"))
    assert (dev, ino, mtime) == (st.st_dev, st.st_ino, int(st.st_mtime))
    (tmp_path / QUIET_FILE).write_text("1000\n")
    assert agent_quiet({}, tmp_path, birth_exe) == (1000, True, False)
    (tmp_path / program_quiet_file(key)).write_text("3000\n")
    assert agent_quiet({}, tmp_path, birth_exe) == (3000, True, True)
    assert agent_quiet({}, tmp_path, "/bin/true") == (1000, True, False)
    (tmp_path / program_quiet_file(key)).write_text("0\n")   # a stored profile: at once
    assert agent_quiet({}, tmp_path, birth_exe) == (0, True, True)
    assert agent_quiet({"DBR_AGENT_QUIET_MS": "5"}, tmp_path, birth_exe) == (5, False, False)
    (tmp_path / QUIET_FILE).write_text("0\n")      # --aggressive: the program's is not read
    assert agent_quiet({}, tmp_path, birth_exe) == (0, True, False)


def test_process_lives_tells_an_ended_process_from_a_live_one():
    p = subprocess.Popen(["sleep", "5"])
    try:
        started = started_boottime(f"/proc/{p.pid}/stat")
        assert process_lives(p.pid, started)
        assert not process_lives(p.pid, started + 1.0)   # the pid of another process
        assert not process_lives(p.pid, None)
        p.kill()
        deadline = time.monotonic() + 5
        while process_lives(p.pid, started) and time.monotonic() < deadline:
            time.sleep(0.01)                              # a zombie until reaped
        assert not process_lives(p.pid, started)
    finally:
        p.kill()
        p.wait(5)
    assert not process_lives(p.pid, started)


# ----------------------------------------------------------------------------- the agent
def _born_at(out: list[str]) -> int | None:
    """When the agent's thread made the task count 2, in ms (birth.c), None if never."""
    return next((at for n, at in task_changes(out) if n == 2), None)


@pytest.mark.parametrize("program,ms,born", [
    ("1200\n", 800, None),       # later birth: a run that ends sooner has no thread
    ("1200\n", 1800, 1200),      # one that lives longer gets it then
    ("100\n", 800, 100),         # an earlier one is taken too
    ("0\n", 800, 0),             # 0 (a stored profile, warm start): at the start
    ("soon\n", 800, 300),        # not a number: ignored (logged)
    (None, 800, 300),            # none: the service's hint
], ids=["later-short", "later-long", "earlier", "at-once", "garbage", "none"])
def test_the_agent_takes_its_programs_own_birth(birth_exe, program, ms, born):
    files = {} if program is None else \
        {program_quiet_file(program_key(os.stat(birth_exe))): program}
    rc, out, log, _ = run_birth(birth_exe, "busy", ms, "300", files=files)
    assert rc == 0, (out, log)
    at = _born_at(out)
    if born is None:
        assert at is None and out[-1] == "end tasks 1", (out, log)
    else:
        assert at is not None and born - 20 <= at <= born + 600, (out, log)
        if born < 300:       # before the service's hint, not merely within the slack
            assert at < 300, (out, log)
    if program == "soon\n":
        assert any("does not hold a number of ms" in line for line in log), log
    if program == "1200\n":
        assert any(program_quiet_file("") in line and "1200 ms" in line for line in log), log


# ----------------------------------------------------------------------------- the service
def _clients_seen(svc) -> int:
    return svc.call("status")["clients_seen"]


def test_the_service_learns_a_short_running_program_and_forgets_it_when_it_runs_long(
        birth_exe):
    """Three runs of 0.6 s (born at 0.3 s, connected, ended, nothing installed: no
    window opens) make the service write short_run_s for the program; the fourth run
    of 0.6 s has no thread and no session.  A run of 1.6 s is born at 1 s, connects,
    and the program is forgotten."""
    svc = ServiceProc("min_client_age_s=0.3", "short_run_s=1.0", "snapshot_interval_s=30",
                      "snapshot_window_s=0.05").wait_ready()
    procs = []
    key = program_key(os.stat(birth_exe))
    path = os.path.join(svc.dir, program_quiet_file(key))
    try:
        for i in range(SHORT_RUNS):
            p = spawn_client(svc.dir, [birth_exe, "busy", "600"])
            procs.append(p)
            out, err = p.communicate(timeout=30)
            assert p.returncode == 0 and out.splitlines()[-1] == "end tasks 2", (out, err)
            svc.wait_for(lambda i=i: _clients_seen(svc) == i + 1 and
                         not svc.call("clients"), 10.0, f"run {i + 1}'s session ending")
        svc.wait_for(lambda: os.path.exists(path), 5.0, "the program's late birth")
        with open(path) as f:
            assert f.read() == f"{quiet_hint_ms(1.0)}\n"
        learned = svc.call("status")["short_runs"]
        assert [(x["exe"], x["key"], x["birth_ms"]) for x in learned] == \
            [(os.path.realpath(birth_exe), key, 1000)], learned
        out = subprocess.run([sys.executable, "-m", "dbr_service.commands.cli", "ctl", "status"],
                             env=svc.env, capture_output=True, text=True, timeout=30)
        assert f"born late (1000 ms, short_run_s): {os.path.realpath(birth_exe)}" in \
            out.stdout, out
        # the next short run: no thread, no session
        p = spawn_client(svc.dir, [birth_exe, "busy", "600"])
        procs.append(p)
        out, err = p.communicate(timeout=30)
        assert p.returncode == 0 and out.splitlines()[-1] == "end tasks 1", (out, err)
        time.sleep(0.3)
        assert _clients_seen(svc) == SHORT_RUNS
        # a long run: born at 1 s, connects, and the program is forgotten
        p = spawn_client(svc.dir, [birth_exe, "busy", "1600"])
        procs.append(p)
        out, err = p.communicate(timeout=30)
        assert p.returncode == 0 and out.splitlines()[-1] == "end tasks 2", (out, err)
        born = _born_at(out.splitlines())
        assert born is not None and born >= 980, out
        assert not os.path.exists(path)
        assert svc.call("status")["short_runs"] == []
    finally:
        for p in procs:
            kill(p)
        svc.stop()
    assert not os.path.exists(path)       # and none left behind at stop


def test_only_the_end_of_a_programs_own_run_is_counted(tmp_path):
    """Service._count_run: a session whose process lives on (an agent that stepped
    aside), a fork child of a live client of the same program, and a session the
    service ended are not runs of the program; the ended process of a session is."""
    from dbr_service.common.config import ConfigSources
    from dbr_service.commands.control import ControlServer
    from dbr_service.daemon.service import Service

    svc = Service(ConfigSources(env=dict(os.environ, DBR_RUNTIME_DIR=str(tmp_path))),
                  control_server=ControlServer, embedded=True)
    svc._prepare_runtime_dir()       # what start() does first: the files go there
    svc._configure_short_runs(1000)
    ended = subprocess.Popen(["true"])
    ended_boot = started_boottime(f"/proc/{ended.pid}/stat")
    ended.wait(5)
    me_boot = started_boottime(f"/proc/{os.getpid()}/stat")

    def session(pid, boot, ppid=1, key="k1", reason="agent said BYE", patched=None):
        return SimpleNamespace(pid=pid, ppid=ppid, exe_key=key, exe="/bin/p",
                               close_reason=reason, started_boot=boot,
                               started_mono=time.monotonic() - 0.5,
                               first_patch_mono=patched)

    def learned():
        return [x["key"] for x in svc.short_runs.status()]

    parent = session(os.getpid(), me_boot, key="k1")
    svc.sessions[1] = parent
    for _ in range(SHORT_RUNS):
        svc._count_run(session(os.getpid(), me_boot))                # lives on
        svc._count_run(session(ended.pid, ended_boot, ppid=os.getpid()))   # fork child
        svc._count_run(session(ended.pid, ended_boot, reason="service shutting down"))
        svc._count_run(session(ended.pid, ended_boot, key=""))       # /proc/PID/exe unread
    assert learned() == []
    for _ in range(SHORT_RUNS):      # a child of a client of another program: a run
        svc._count_run(session(ended.pid, ended_boot, ppid=os.getpid(), key="k2"))
    assert learned() == ["k2"]
    del svc.sessions[1]
    for _ in range(SHORT_RUNS):      # the parent gone from sessions and history: a run
        svc._count_run(session(ended.pid, ended_boot, ppid=os.getpid()))
    assert learned() == ["k2", "k1"]
    svc.stopping = True              # a stopping service counts nothing
    svc._count_run(session(ended.pid, ended_boot, key="k2", patched=1.0))
    assert learned() == ["k2", "k1"]
    svc.short_runs.forget_all()
    assert os.listdir(tmp_path) == []


# ----------------------------------------------------------------------------- dbr ctl waiting
def test_agent_socket_of_resolves_as_the_agent_does():
    from dbr_service.commands.waiting import agent_socket_of

    assert agent_socket_of({"DBR_RUNTIME_DIR": "/x"}, 1000) == "/x/agent.sock"
    assert agent_socket_of({"DBR_RUNTIME_DIR": ""}, 0) == "/run/dbr/agent.sock"
    assert agent_socket_of({"XDG_RUNTIME_DIR": "/run/user/7"}, 7) == \
        "/run/user/7/dbr/agent.sock"
    assert agent_socket_of({}, 7) is None


def test_waiting_lists_processes_that_carry_the_agent_without_a_session(birth_exe, tmp_path):
    """Under a hint of 500 ms: a running program younger than its (learned, later) birth
    age, a sleeping one past its age, one whose agent is disabled; not a program of
    another service's, nor one without the agent, nor a connected client."""
    svc = ServiceProc("min_client_age_s=0.5", "snapshot_interval_s=30").wait_ready()
    procs = {}
    try:
        other = tmp_path / "other"
        other.mkdir()
        key = program_key(os.stat(birth_exe))
        with open(os.path.join(svc.dir, program_quiet_file(key)), "w") as f:
            f.write("3000\n")          # as if learned: daemon/shortruns.py
        sleep_exe = subprocess.run(["sh", "-c", "command -v sleep"], capture_output=True,
                                   text=True).stdout.strip()
        procs["young"] = spawn_client(svc.dir, [birth_exe, "busy", "2500"])
        procs["asleep"] = spawn_client(svc.dir, [sleep_exe, "20"])
        procs["disabled"] = spawn_client(svc.dir, [sleep_exe, "20"],
                                         env={"DBR_AGENT_DISABLE": "1"})
        procs["other"] = spawn_client(str(other), [sleep_exe, "20"])
        procs["native"] = subprocess.Popen([sleep_exe, "20"])
        procs["client"] = spawn_client(svc.dir, [sleep_exe, "20"],
                                       env={"DBR_AGENT_QUIET_MS": "0"})
        svc.wait_for(lambda: any(c["pid"] == procs["client"].pid
                                 for c in svc.call("clients")), 10.0, "the client")
        time.sleep(0.8)                # the sleeper past 500 ms
        rows = {r["pid"]: r for r in svc.call("waiting")}
        mine = {name: rows.get(p.pid) for name, p in procs.items()}
        assert mine["other"] is None and mine["native"] is None and mine["client"] is None, \
            rows
        young = mine["young"]
        assert young and young["birth_ms"] == 3000 and \
            young["exe"] == os.path.realpath(birth_exe), rows
        assert young["why"].startswith("younger than its agent's birth age (3000 ms, "
                                       "short_run_s"), young
        asleep = mine["asleep"]
        assert asleep and asleep["birth_ms"] == 500 and asleep["age_s"] >= 0.5, rows
        assert "once it runs past 500 ms (min_client_age_s): it has slept since" in \
            asleep["why"], asleep
        assert mine["disabled"] and "disabled" in mine["disabled"]["why"], rows
        out = subprocess.run([sys.executable, "-m", "dbr_service.commands.cli", "ctl", "waiting"],
                             env=svc.env, capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        assert out.stdout.splitlines()[0].split() == ["PID", "AGE", "EXE", "WHY"], out.stdout
        assert any(line.split()[0] == str(procs["young"].pid) for line in
                   out.stdout.splitlines()[1:]), out.stdout
    finally:
        for p in procs.values():
            kill(p)
        svc.stop()
