"""The agent's thread is hidden from glibc (dbr_agent/thread.c).

glibc keeps unlocked fast paths (stdio, malloc, libstdc++'s reference counts) while it
believes a process has one thread; a thread made with pthread_create ends them for good.
These tests hold the agent to its claims: glibc still sees one thread with the agent
running and in session (also in a fork child), the fallback (DBR_AGENT_THREAD=pthread)
is what it says, credentials the program drops are dropped by the agent's thread too,
and the agent library never calls the functions its hidden thread must not call.
"""

from __future__ import annotations

import ctypes
import os
import re
import resource
import subprocess
import time
from types import SimpleNamespace

import pytest

import dbr_agent
from dbr_service.wire import protocol as P
from dbr_service.common.paths import QUIET_FILE
from harness import FakeService, compile_c


@pytest.fixture(scope="module")
def alone_exe():
    return compile_c(["alone.c"])


def _run(alone_exe, mode: str, env: dict[str, str] | None = None, session: bool = True):
    env = {"DBR_AGENT_THREAD": "", **(env or {})}   # the default, whatever the caller's is
    svc = FakeService()
    try:
        if not session:
            svc.stop_listening()
        client = svc.spawn([alone_exe, mode], env=env)
        client.out.expect("ready")
        if session:
            conn = svc.accept(pid=client.pid)
            assert conn.hello.pid == client.pid
        client.send("go")
        rc, rest = client.finish(timeout=20)
        return rc, rest, (conn.hello if session else None)
    finally:
        svc.close()


def test_native_baseline(alone_exe):
    p = subprocess.run([str(alone_exe), "single"], input="go\n", capture_output=True,
                       text=True, timeout=20)
    assert p.returncode == 0 and p.stdout.splitlines()[-1] == "single 1 tasks 1"


@pytest.mark.parametrize("session", [True, False], ids=["in-session", "no-service"])
def test_glibc_sees_one_thread_with_the_agent_running(alone_exe, session):
    rc, rest, hello = _run(alone_exe, "single", session=session)
    assert rc == 0
    # the kernel lists the agent's thread; glibc never heard of it
    assert rest == ["single 1 tasks 2"]
    if session:
        assert hello.flags & P.HELLO_HIDDEN_THREAD


def test_fallback_thread_is_a_pthread(alone_exe):
    """DBR_AGENT_THREAD=pthread: the agent's thread as before (and the check above is
    one that can fail)."""
    rc, rest, hello = _run(alone_exe, "single", env={"DBR_AGENT_THREAD": "pthread"})
    assert rc == 0
    assert rest == ["single 0 tasks 2"]
    assert not hello.flags & P.HELLO_HIDDEN_THREAD


def test_fork_child_agent_thread_is_hidden_too(alone_exe):
    rc, rest, _ = _run(alone_exe, "fork")
    assert rc == 0
    assert rest == ["single 1 tasks 2"]



@pytest.mark.parametrize("thread", ["hidden", "pthread"])
@pytest.mark.parametrize("session", [True, False], ids=["in-session", "no-service"])
def test_threads_ending_do_not_wake_the_agent_thread(alone_exe, session, thread):
    """A program thread that ends used to wake the agent's thread (to see whether it was
    the last one), and each wake-up listed /proc/self/task: a program starting and
    joining many threads ran up to three times slower.  glibc does not count a hidden
    agent thread and ends the process itself, so it is left asleep; an agent pthread
    is counted, but while the main thread lives no ending thread can be the last."""
    env = {"DBR_AGENT_THREAD": "pthread"} if thread == "pthread" else None
    rc, rest, _ = _run(alone_exe, "spawn", env=env, session=session)
    assert rc == 0 and rest and rest[-1].startswith("spawn woke "), rest
    woke = int(rest[-1].split()[-1])
    assert woke < 60, f"the agent's thread woke {woke} times for 300 threads"


def test_threads_ending_after_main_wake_an_agent_pthread(alone_exe):
    """With DBR_AGENT_THREAD=pthread glibc counts the agent's thread, so once main has
    ended (pthread_exit) the agent must end the process after the last program thread:
    every ending thread wakes it from then on (and the check above is one that can
    fail).  The process still ends, with status 0, when the spawning thread returns."""
    rc, rest, _ = _run(alone_exe, "spawn-orphan", env={"DBR_AGENT_THREAD": "pthread"})
    assert rc == 0 and rest and rest[-1].startswith("spawn woke "), rest
    assert int(rest[-1].split()[-1]) >= 100, rest

@pytest.mark.skipif(os.geteuid() != 0, reason="dropping privileges needs root")
@pytest.mark.parametrize("mode", ["creds", "creds-res", "creds-temp"])
@pytest.mark.parametrize("thread", ["hidden", "pthread"])
def test_dropped_credentials_reach_the_agent_thread(alone_exe, mode, thread):
    """Linux keeps credentials per thread and glibc changes them on the threads it knows;
    the hidden thread must not keep root after the program dropped it.  creds-temp
    drops the effective uid and takes it back through the saved uid: the hidden
    thread, without capabilities in between, must follow both ways (and not step
    aside because its first attempt at the way back was refused)."""
    env = {"DBR_AGENT_THREAD": "pthread"} if thread == "pthread" else None
    rc, rest, _ = _run(alone_exe, mode, env=env)
    assert rc == 0, rest
    assert rest == ["creds same 2"] * (2 if mode == "creds-temp" else 1)


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping privileges needs root")
def test_credentials_the_agent_thread_cannot_take_make_it_step_aside(alone_exe):
    """The program keeps capabilities across a drop (PR_SET_KEEPCAPS is per thread),
    raises CAP_SETUID and goes back to root: the hidden thread, which lost every
    capability with the drop, cannot follow.  It must not stay behind as nobody next
    to a root program, nor take the process down: it ends its session and its thread,
    and the program goes on.  (glibc's own threads would abort the process here: its
    set*id treats a thread that cannot follow as fatal; hence no pthread variant.)"""
    svc = FakeService()
    try:
        client = svc.spawn([alone_exe, "creds-fail"], env={"DBR_AGENT_THREAD": ""})
        client.out.expect("ready")
        conn = svc.accept(pid=client.pid)
        client.send("go")
        rc, rest = client.finish(timeout=20)
        assert rc == 0, (rest, client.err.lines)
        assert rest == ["creds same 2", "creds same 1"]
        rec = conn.recv(timeout=5)      # it said BYE before its thread ended
        while rec is not None and rec.type in (P.MsgType.THREAD_NEW, P.MsgType.THREAD_EXIT):
            rec = conn.recv(timeout=5)
        assert rec is not None and rec.type is P.MsgType.BYE
    finally:
        svc.close()


def test_dropped_credentials_reach_a_dormant_agent_thread(alone_exe):
    if os.geteuid() != 0:
        pytest.skip("dropping privileges needs root")
    rc, rest, _ = _run(alone_exe, "creds", session=False)
    assert rc == 0, rest
    assert rest == ["creds same 2"]


SCHED_OTHER, SCHED_BATCH = 0, 3


def _batch_nice5():
    os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    os.nice(5)


def _no_rtprio_nor_sys_nice():
    """As a prefix command (setpriv) would, but without a process image of its own
    that would load an agent too: RLIMIT_RTPRIO 0, and CAP_SYS_NICE out of the
    bounding set, so that the program, root or not, does not hold it after exec."""
    resource.setrlimit(resource.RLIMIT_RTPRIO, (0, 0))
    # PR_CAPBSET_DROP (24), CAP_SYS_NICE (23)
    if ctypes.CDLL(None, use_errno=True).prctl(24, 23, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "PR_CAPBSET_DROP")


NICE = os.getpriority(os.PRIO_PROCESS, 0)       # the tests' own (`nice make test`)
_LAUNCH = {"other": (None, SCHED_OTHER, NICE),
           "batch-nice5": (_batch_nice5, SCHED_BATCH, min(19, NICE + 5))}
BORN_RT = "agent thread born at SCHED_FIFO"
RT_BIRTH = {"DBR_AGENT_RT_BIRTH": "1"}   # opt-in since the quiet start (agent.c)
LEFT_RT = "agent thread left SCHED_FIFO"


def _log(client, pid: int, what: str, timeout: float = 10.0) -> str:
    return client.err.expect(f"dbr-agent[{pid}]: {what}", timeout=timeout)


def _policies(alone_exe, preexec, session, env=None, mode="policy"):
    """alone's output once the agent's thread has settled (left SCHED_FIFO, or was
    never there): .main and .others as (policy, nice) pairs from its "policy" lines,
    .out every line, .log the agent's log, .pid."""
    svc = FakeService()
    try:
        if not session:
            svc.stop_listening()
        client = svc.spawn([alone_exe, mode], preexec=preexec,
                           env={"DBR_AGENT_THREAD": "", "DBR_AGENT_DEBUG": "1", **(env or {})})
        # the hidden thread's first log line comes after its birth and its park
        _log(client, client.pid, "agent thread hidden from glibc")
        born_rt = any(BORN_RT in line for line in client.err.lines)
        if born_rt:
            _log(client, client.pid, LEFT_RT)
        client.out.expect("ready")
        if session:
            svc.accept(pid=client.pid)
        client.send("go")
        rc, rest = client.finish(timeout=20)
        assert rc == 0, (rest, client.err.lines)
        log = client.err.lines + client.err.rest()
    finally:
        svc.close()
    pairs = [tuple(int(x) for x in line.split()[1:]) for line in rest if line.startswith("policy ")]
    return SimpleNamespace(main=pairs[0], others=pairs[1:], out=rest, log=log, pid=client.pid)


@pytest.mark.skipif(os.geteuid() != 0, reason="SCHED_FIFO needs CAP_SYS_NICE or RLIMIT_RTPRIO")
@pytest.mark.parametrize("launch", sorted(_LAUNCH))
@pytest.mark.parametrize("session", [True, False], ids=["in-session", "no-service"])
def test_agent_thread_is_born_real_time_and_takes_the_program_policy(alone_exe, launch, session):
    """thread.c, "born in the real-time class" (DBR_AGENT_RT_BIRTH=1): the agent's
    thread is born at SCHED_FIFO (so it starts with no fair-class load or utilisation
    estimate), parks there, and takes the program's policy and nice value before
    anything else, with a service or without.  The program's own thread must end as it
    started."""
    preexec, policy, nice = _LAUNCH[launch]
    r = _policies(alone_exe, preexec, session, env=RT_BIRTH)
    assert any(BORN_RT in line for line in r.log), r.log
    assert r.main == (policy, nice)
    assert r.others == [(policy, nice)]


_SCHED_KEYS = ("se.avg.load_avg", "se.avg.util_avg", "se.avg.runnable_avg", "se.load.weight",
               "se.sum_exec_runtime")


def _sched_estimates(pid: int, tid: int) -> dict[str, float]:
    out = {}
    with open(f"/proc/{pid}/task/{tid}/sched") as f:
        for line in f:
            key, _, val = line.partition(":")
            if key.strip() in _SCHED_KEYS:
                out[key.strip()] = float(val.split()[0])
    return out


def _estimates_grown_since_birth(est: dict[str, float]) -> bool:
    """Whether a thread's load and utilisation are no more than what it gained since it
    joined the fair class, with none given at birth.  Utilisation grows only while the
    thread runs, by at most 22 (of 1024) per ms of it (1024 * (1 - y), y**32 = 1/2),
    so from 0 it stays under 32 + 24 per ms the thread has run in all.  Load grows while
    the thread is runnable, running or waiting for a CPU (a loaded machine), as the
    runnable average does: from 0, the load (per unit of the thread's weight) stays
    within the runnable average.  Born with an estimate, the load starts at the full
    weight and the utilisation at half the CPU's spare capacity."""
    weight = est["se.load.weight"]
    if weight > 88761:                  # nice -20's weight, shown scaled up by 1024 (64-bit)
        weight /= 1024
    load = est["se.avg.load_avg"] * 1024 / max(weight, 1)
    return (est["se.avg.util_avg"] < 32 + 24 * est["se.sum_exec_runtime"]
            and load <= est["se.avg.runnable_avg"] + 32)


@pytest.mark.skipif(os.geteuid() != 0, reason="SCHED_FIFO needs CAP_SYS_NICE or RLIMIT_RTPRIO")
@pytest.mark.skipif(not os.path.exists("/proc/self/sched"),
                    reason="no /proc/PID/sched (kernel without CONFIG_SCHED_DEBUG)")
@pytest.mark.parametrize("birth", ["real-time", "as-before"])
def test_agent_thread_starts_with_no_scheduler_estimates_in_a_session_of_its_own(alone_exe, birth):
    """What the real-time birth (DBR_AGENT_RT_BIRTH=1) is for.  In a new session (a
    scheduling autogroup of its own, as under a service manager) a thread born at any
    fair policy, SCHED_IDLE included, starts with a utilisation estimate of half its
    CPU's spare capacity, which then skews where the program's first threads are
    placed.  Born and parked in the real-time class, the agent's thread joins the fair
    class with load and utilisation 0.  The default birth shows the estimate it has
    otherwise; that is read as it was set at birth, so only while it cannot have
    decayed much."""
    svc = FakeService()
    svc.stop_listening()
    try:
        t0 = time.monotonic()
        client = svc.spawn([alone_exe, "policy"], preexec=os.setsid,
                           env={"DBR_AGENT_THREAD": "", "DBR_AGENT_DEBUG": "1",
                                **({} if birth == "as-before" else RT_BIRTH)})
        _log(client, client.pid, "agent thread hidden from glibc")
        assert (BORN_RT in "".join(client.err.lines)) == (birth == "real-time"), client.err.lines
        if birth == "real-time":
            _log(client, client.pid, LEFT_RT)
        client.out.expect("ready")
        deadline = time.monotonic() + 5
        while len(os.listdir(f"/proc/{client.pid}/task")) < 2 and time.monotonic() < deadline:
            time.sleep(0.001)
        time.sleep(0.005)   # past its first connection attempt: asleep, the estimate settled
        tid = next(int(t) for t in os.listdir(f"/proc/{client.pid}/task") if int(t) != client.pid)
        est = _sched_estimates(client.pid, tid)
        elapsed = time.monotonic() - t0
        client.send("go")
        rc, _ = client.finish(timeout=20)
        assert rc == 0
    finally:
        svc.close()
    if birth == "real-time":
        assert _estimates_grown_since_birth(est), est
    else:
        if elapsed > 0.1:
            pytest.skip(f"read {elapsed:.3f} s after the spawn: the estimate may have decayed")
        assert est["se.avg.util_avg"] >= 100, est
        assert not _estimates_grown_since_birth(est), est     # the check above can fail


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to drop a capability")
@pytest.mark.parametrize("how", ["without-sys_nice", "by-default"])
def test_agent_thread_without_the_privilege_is_born_as_before(alone_exe, how):
    """Without CAP_SYS_NICE and with RLIMIT_RTPRIO 0 (the default) a thread may not
    take SCHED_FIFO: though DBR_AGENT_RT_BIRTH=1 asks for it, the agent does not try
    (no denial for a security module to log) and its thread is born with the program's
    policy.  Without DBR_AGENT_RT_BIRTH=1 it is born so with the privilege too."""
    if how == "without-sys_nice":
        preexec, env = _no_rtprio_nor_sys_nice, RT_BIRTH
    else:
        preexec, env = None, {}
    r = _policies(alone_exe, preexec, session=False, env=env)
    assert not any("SCHED_FIFO" in line for line in r.log), r.log
    assert r.main == (SCHED_OTHER, NICE) and r.others == [(SCHED_OTHER, NICE)]


@pytest.mark.skipif(os.geteuid() != 0, reason="SCHED_FIFO needs CAP_SYS_NICE or RLIMIT_RTPRIO")
def test_fork_child_agent_thread_is_born_as_before(alone_exe):
    """A fork child may carry a seccomp filter of the thread that forked, and the calls
    of a real-time birth are ones such a filter may kill for: its agent's thread is
    born with the program's policy, while the parent's was born at SCHED_FIFO."""
    r = _policies(alone_exe, None, session=False, mode="fork-policy", env=RT_BIRTH)
    assert (r.main, r.others) == ((SCHED_OTHER, NICE), [(SCHED_OTHER, NICE)])
    by_pid: dict[int, list[str]] = {}
    for line in r.log:
        m = re.match(r"dbr-agent\[(\d+)\]: (.*)", line)
        if m:
            by_pid.setdefault(int(m.group(1)), []).append(m.group(2))
    child = [p for p in by_pid if p != r.pid]
    assert len(child) == 1, r.log
    assert BORN_RT in by_pid[r.pid]
    assert "agent thread hidden from glibc" in by_pid[child[0]]
    assert not any("SCHED_FIFO" in line for line in by_pid[child[0]]), r.log


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping privileges needs root")
def test_credentials_dropped_while_the_agent_thread_is_parked_reach_it(alone_exe):
    """A program that drops privileges first thing does so while the agent's thread
    is still parked at SCHED_FIFO: the drop waits for it, the thread follows the
    program to nobody, and leaves SCHED_FIFO all the same (that needs no privilege)."""
    r = _policies(alone_exe, None, session=False, mode="creds-early", env=RT_BIRTH)
    assert any(BORN_RT in line for line in r.log), r.log
    assert r.out == ["creds same 2"] + [f"policy {SCHED_OTHER} {NICE}"] * 2


QUIET = "agent thread quiet for"


def _first_connection(svc: FakeService, alone_exe: str, env: dict[str, str]):
    """Run `alone single` against ``svc`` (closed after): its exit status, pid, the
    seconds from its start to its agent's connection, and the agent's log."""
    try:
        t0 = time.monotonic()
        client = svc.spawn([alone_exe, "single"], env=env)
        client.out.expect("ready")
        conn = svc.accept(pid=client.pid, timeout=10)
        waited = time.monotonic() - t0
        assert conn.hello.pid == client.pid
        client.send("go")
        rc, _ = client.finish(timeout=20)
        client.err.rest()
        return rc, client.pid, waited, client.err.lines   # rest() appends to them
    finally:
        svc.close()


@pytest.mark.parametrize("quiet", [None, "0", "400"], ids=["default", "0", "400"])
def test_agent_thread_stays_quiet_before_its_first_connection(alone_exe, quiet):
    """connect.c, "quiet while the program starts": the agent's thread waits
    DBR_AGENT_QUIET_MS (default 50) before it first connects; 0 connects at once."""
    env = {"DBR_AGENT_THREAD": "", "DBR_AGENT_DEBUG": "1"}
    if quiet is not None:
        env["DBR_AGENT_QUIET_MS"] = quiet
    rc, pid, waited, log = _first_connection(FakeService(), alone_exe, env)
    assert rc == 0
    said = [line for line in log if QUIET in line]
    if quiet == "0":
        assert not said, log
    else:
        assert said == [f"dbr-agent[{pid}]: {QUIET} {quiet or 50} ms"], log
    if quiet == "400":
        assert waited >= 0.4, waited


HINT = "the service's hint"


@pytest.mark.parametrize("hint, env_quiet, said, min_wait", [
    ("0\n", None, "0 ms (the service's hint, {f})", 0.0),
    ("400\n", "0", None, 0.0),                            # the program's own setting wins
    ("soon\n", None, "50 ms", 0.0),                       # not a number: logged, default
    ("fifo", None, "50 ms", 0.0),                          # must not hold the program
], ids=["zero", "env-wins", "garbage", "fifo"])
def test_agent_thread_takes_the_services_quiet_hint(alone_exe, hint, env_quiet, said, min_wait):
    """A service writes how young a client it samples to paths.QUIET_FILE beside
    agent.sock (daemon/runtime_dir.py, write_quiet_hint); the agent reads it unless
    DBR_AGENT_QUIET_MS is set.  A FIFO there would block a plain open: the agent opens
    it non-blocking and keeps its default.  (A hint of more than 0 plans the thread's
    birth: tests/agent/test_agent_birth.py.)"""
    svc = FakeService()
    path = os.path.join(svc.runtime_dir, QUIET_FILE)
    if hint == "fifo":
        os.mkfifo(path)
    else:
        with open(path, "w") as f:
            f.write(hint)
    env = {"DBR_AGENT_THREAD": "", "DBR_AGENT_DEBUG": "1"}
    if env_quiet is not None:
        env["DBR_AGENT_QUIET_MS"] = env_quiet
    rc, _, waited, log = _first_connection(svc, alone_exe, env)
    assert rc == 0
    quiet = [line.split(f"{QUIET} ", 1)[1] for line in log if QUIET in line]
    assert quiet == ([said.format(f=path)] if said else []), log
    assert (HINT in " ".join(log)) == bool(said and HINT in said), log
    if hint in ("soon\n", "fifo"):
        assert any(f"{path} does not hold a number of ms: ignored" in line for line in log), log
    assert waited >= min_wait, waited


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping privileges needs root")
def test_credentials_dropped_while_the_agent_thread_is_quiet_reach_it_at_once(alone_exe):
    """A program that drops privileges first thing does so while the agent's thread is
    quiet: the thread takes them at once (its quiet is the wait of its backoff, which
    the drop wakes), not at the end of the quiet, and the program's drop does not wait
    for it."""
    svc = FakeService()
    svc.stop_listening()
    try:
        t0 = time.monotonic()
        client = svc.spawn([alone_exe, "creds-early"],
                           env={"DBR_AGENT_THREAD": "", "DBR_AGENT_DEBUG": "1",
                                "DBR_AGENT_QUIET_MS": "4000"})
        client.out.expect("ready", timeout=10)
        ready_after = time.monotonic() - t0
        client.send("go")
        rc, rest = client.finish(timeout=20)
        client.err.rest()
        log = client.err.lines
    finally:
        svc.close()
    assert rc == 0, (rest, log)
    assert any(f"{QUIET} 4000 ms" in line for line in log), log
    assert rest[0] == "creds same 2", (rest, log)
    assert ready_after < 2.0, ready_after


# The hidden thread runs most of the agent.  While glibc sees one thread its heap and
# stdio take no locks, so the agent must allocate without malloc and print without
# stdio; opendir and qsort allocate with malloc.
FORBIDDEN = {
    "malloc", "calloc", "realloc", "free", "posix_memalign", "aligned_alloc", "memalign",
    "valloc", "strdup", "strndup", "opendir", "fdopendir", "readdir", "closedir", "scandir",
    "qsort", "fopen", "fdopen", "fclose", "fprintf", "printf", "vfprintf", "fputs", "puts",
    "fwrite", "fread", "fgets", "getline", "sscanf", "asprintf", "vasprintf", "pthread_exit",
}


def test_agent_library_imports_nothing_its_hidden_thread_must_not_call():
    out = subprocess.run(["nm", "-D", "--undefined-only", dbr_agent.agent_path()],
                         capture_output=True, text=True, timeout=30, check=True).stdout
    imported = {re.sub(r"@.*", "", ln.split()[-1]) for ln in out.splitlines() if ln.strip()}
    assert "clock_gettime" in imported   # the listing is what it seems
    assert not imported & FORBIDDEN, sorted(imported & FORBIDDEN)


# ---- seccomp filters bind the agent's thread too ----------------------------

@pytest.fixture(scope="module")
def seccomp_exe():
    return compile_c(["seccomp.c"])


def test_seccomp_filter_with_tsync_steps_the_agent_aside(seccomp_exe):
    """A filter installed with SECCOMP_FILTER_FLAG_TSYNC binds every thread; this one
    kills the process at the next poll, which the agent's thread makes every 0.25 s in
    session.  The agent steps aside first (BYE, its thread ends) and the program lives."""
    native = subprocess.run([str(seccomp_exe), "tsync"], input="go\n", capture_output=True,
                            text=True, timeout=20)
    if native.returncode != 0:
        pytest.skip(f"seccomp filters are refused here natively: {native.stdout.strip()}")
    svc = FakeService()
    try:
        client = svc.spawn([seccomp_exe, "tsync"])
        client.out.expect("ready")
        conn = svc.accept(pid=client.pid)
        client.send("go")
        rc, rest = client.finish(timeout=20)
        assert rc == 0, (rc, rest)
        assert rest == ["alive, threads 1"]
        rec = conn.recv(timeout=5)
        while rec is not None and rec.type in (P.MsgType.THREAD_NEW, P.MsgType.THREAD_EXIT):
            rec = conn.recv(timeout=5)
        assert rec is not None and rec.type is P.MsgType.BYE
    finally:
        svc.close()


def test_inherited_seccomp_filter_leaves_the_agent_inert(seccomp_exe, alone_exe):
    """A filter inherited across exec (systemd's SystemCallFilter=) may kill at any call
    the agent makes; this one kills at membarrier, which the agent calls as it loads.
    The agent sees the filter and stays inert: no thread, no session, program intact."""
    native = subprocess.run([str(seccomp_exe), "inherited", str(alone_exe), "single"],
                            input="go\n", capture_output=True, text=True, timeout=20)
    if native.returncode != 0:
        pytest.skip(f"seccomp filters are refused here natively: {native.stdout.strip()}")
    assert native.stdout.splitlines()[-1] == "single 1 tasks 1"
    svc = FakeService()
    try:
        client = svc.spawn([seccomp_exe, "inherited", alone_exe, "single"])
        client.out.expect("ready")
        client.send("go")
        rc, rest = client.finish(timeout=20)
        assert rc == 0, (rc, rest)
        assert rest == ["single 1 tasks 1"]
    finally:
        svc.close()
