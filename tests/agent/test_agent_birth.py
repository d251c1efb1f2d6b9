"""The agent's thread is made when the service would look (dbr_agent/agent.c, "born
when the service would look").

Under a service's hint of N ms (paths.QUIET_FILE: its min_client_age_s), the agent makes
no thread in its constructor: a process CPU-time timer makes it once the program is N ms
old and running.  A program that ends sooner or sleeps has no second thread, and a
program asleep in a system call is not cut short by the timer's signal.  Programs that
block the signal everywhere, or take a seccomp filter, get the thread before they do;
stepping aside cancels it; a fork child plans its own.  tests/agent_progs/birth.c prints
when its task count changes."""

from __future__ import annotations

import os
import subprocess

import pytest
from birth_helpers import run_birth, task_changes
from harness import compile_c

MADE = "agent thread made by its planned birth"


@pytest.fixture(scope="module")
def birth_exe():
    return compile_c(["birth.c"])


def test_a_running_program_gets_its_thread_once_as_old_as_the_hint(birth_exe):
    """No thread before 300 ms; one, made by the planned birth and hidden from glibc,
    soon after, which then connects.  It runs its session as any agent thread."""
    rc, out, log, waited = run_birth(birth_exe, "busy", 1500, accept=True)
    assert rc == 0, (out, log)
    changes = task_changes(out)
    assert changes[0][0] == 1, (out, log)
    born = [t for n, t in changes if n == 2]
    assert len(born) == 1 and 280 <= born[0] <= 1500, (out, log)
    assert out[-1] == "end tasks 2", out
    assert any(MADE in line for line in log), log
    assert waited is not None and waited >= 0.28, waited


@pytest.mark.parametrize("hint", [None, "0"], ids=["no-hint", "hint-0"])
def test_without_a_hint_or_with_0_the_thread_is_made_at_once(birth_exe, hint):
    """No service's word (a default quiet of 50 ms), or --aggressive's 0: the thread is
    made in the constructor, as before."""
    rc, out, log, _ = run_birth(birth_exe, "busy", 200, hint=hint)
    assert rc == 0, (out, log)
    assert task_changes(out)[0][0] == 2, (out, log)
    assert not any(MADE in line for line in log), log


def test_a_program_that_ends_sooner_never_has_a_second_thread(birth_exe):
    rc, out, log, _ = run_birth(birth_exe, "busy", 100, hint="1000")
    assert rc == 0, (out, log)
    assert [n for n, _ in task_changes(out)] == [1] and out[-1] == "end tasks 1", (out, log)
    assert not any("agent thread" in line and "started" in line for line in log), log


@pytest.mark.parametrize("agent_thread", ["hidden", "pthread"])
def test_threads_started_before_the_birth_start_unwrapped(birth_exe, agent_thread):
    """While the birth is pending there is no agent thread, and the one to come is
    hidden: a thread the program starts then needs none of the wrapper's work (no
    notices, no timer, no poke at its end) and starts unwrapped, as beside a hidden
    thread out of session (the wrapper cost bench churn ~0.15 us a thread, 60000
    threads a run).  With DBR_AGENT_THREAD=pthread the agent's thread, which glibc
    counts, is made at once and every thread is wrapped: the check can fail."""
    env = {"DBR_AGENT_THREAD": "pthread"} if agent_thread == "pthread" else None
    rc, out, log, _ = run_birth(birth_exe, "starts", 700, env=env)
    assert rc == 0, (out, log)
    wrapped = int(agent_thread == "pthread")
    assert [line for line in out if line.startswith("start ")] == \
        [f"start early wrapped {wrapped}", f"start late wrapped {wrapped}"], (out, log)
    # the hidden thread was born between the two starts, the pthread before both
    assert [n for n, _ in task_changes(out)] == ([1, 2] if agent_thread == "hidden" else [2]), \
        (out, log)


def test_a_sleeping_program_is_neither_given_a_thread_nor_cut_short(birth_exe):
    """The timer counts the process's CPU time, so it does not fire while the program
    sleeps; a wall-clock timer's signal would end the nanosleep early with EINTR."""
    rc, out, log, _ = run_birth(birth_exe, "sleep", 700, hint="200")
    assert rc == 0, (out, log)
    assert out == ["slept 0 0", "end tasks 1"], (out, log)


def test_blocking_every_signal_makes_the_thread_at_once(birth_exe):
    """A program that blocks the timer's signal in every thread (signalfd, sigwait
    loops) would never get one: its pthread_sigmask makes the thread first."""
    rc, out, log, _ = run_birth(birth_exe, "block", 300, hint="1000")
    assert rc == 0, (out, log)
    assert task_changes(out)[0][0] == 2, (out, log)
    assert any("a program thread blocks the agent's signal: the agent's thread made now" in line
               for line in log), log


def test_a_fork_child_plans_its_own_birth(birth_exe):
    """The parent forks at 200 ms, before its birth (timers are not inherited): the
    child makes its thread 300 ms after the fork, while it runs.  The parent waits for
    the child meanwhile, asleep: 800 ms later, well past its own 300 ms, it still has
    none (the child looks; the parent's own few instructions after waitpid could
    still end a timer step)."""
    rc, out, log, _ = run_birth(birth_exe, "fork", 400, hint="300")
    assert rc == 0, (out, log)
    assert [n for n, _ in task_changes(out)] == [1], (out, log)
    child = task_changes(out, "child ")
    assert child[0][0] == 1 and [n for n, _ in child[1:]] == [2], (out, log)
    assert 280 <= child[1][1] <= 800, (out, log)
    assert "child end tasks 2" in out and "parent tasks 1" in out, (out, log)


def test_a_fork_child_of_a_parent_with_its_thread_plans_its_own_too(birth_exe):
    """The parent has its thread by the time it forks (at 800 ms): the child still
    makes its own only once it is 300 ms old and running, as any program (the
    patches it may inherit need no thread)."""
    rc, out, log, _ = run_birth(birth_exe, "fork-late", 400, hint="300")
    assert rc == 0, (out, log)
    assert [n for n, _ in task_changes(out)] == [1, 2], (out, log)
    child = task_changes(out, "child ")
    assert child[0][0] == 1 and [n for n, _ in child[1:]] == [2], (out, log)
    assert 280 <= child[1][1] <= 800, (out, log)
    assert "child end tasks 2" in out and "parent tasks 2" in out, (out, log)


def test_stepping_aside_before_the_birth_cancels_it(birth_exe):
    """unshare(CLONE_NEWUSER) needs a single-threaded process (agent.md, "Calls that
    need a single-threaded process"): with the birth still pending there is no thread
    to end, and none is made after."""
    native = subprocess.run([birth_exe, "unshare", "1"], capture_output=True, text=True,
                            timeout=30)
    if "unshare 0" not in native.stdout:
        pytest.skip(f"unshare(CLONE_NEWUSER) fails here natively: {native.stdout!r}")
    rc, out, log, _ = run_birth(birth_exe, "unshare", 600, hint="200")
    assert rc == 0, (out, log)
    assert out[0] == "unshare 0" and out[-1] == "end tasks 1", (out, log)
    assert [n for n, _ in task_changes(out)] == [1], (out, log)
    assert any("the agent's thread will not be made" in line for line in log), log


@pytest.mark.parametrize("mode", ["seccomp", "seccomp-sys"])
def test_a_seccomp_filter_on_main_is_not_passed_to_the_agent_thread(birth_exe, mode):
    """A filter binds the thread that installs it and the threads it makes later: the
    agent's thread is made before main's prctl(PR_SET_SECCOMP), or its
    syscall(SYS_seccomp) without TSYNC (libseccomp's way), and has none."""
    rc, out, log, _ = run_birth(birth_exe, mode, 300, hint="1000")
    assert rc == 0, (out, log)
    assert out[0] == "seccomp 0", (out, log)
    assert task_changes(out)[0][0] == 2, (out, log)
    assert "agent seccomp 0" in out, (out, log)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to pin one")
def test_a_thread_made_on_a_pinned_thread_takes_the_programs_cpus(birth_exe):
    """The birth runs on whichever program thread was running, here main pinned to CPU
    0: the agent's thread takes the CPUs the program started with."""
    rc, out, log, _ = run_birth(birth_exe, "pinned", 700, hint="200")
    assert rc == 0, (out, log)
    cpus = [line.split(" ", 1)[1] for line in out if line.startswith("cpus ")]
    assert len(cpus) == 1, (out, log)
    allowed = set()
    for part in cpus[0].split(","):
        lo, _, hi = part.partition("-")
        allowed.update(range(int(lo), int(hi or lo) + 1))
    assert allowed == os.sched_getaffinity(0), (out, log)
