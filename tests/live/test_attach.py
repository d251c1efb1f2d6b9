"""`dbr attach PID` and `dbr detach PID` (docs/operators.md, "Attaching to a running
process"; docs/decisions/0033-attach.md).

A multi-threaded program started without the agent (hot threads checking their own
results, a thread blocked in read(), one in nanosleep) is attached while it runs under
a real service, gets patched, answers correctly, is detached with its text as in its
file (checked here too, not only by the service), and attached again.  Then every
refusal: a static binary, a 32-bit program, a zombie, a pid that is gone, another
user's process, a process that is not dumpable, a process another tracer holds,
another mount namespace, an active agent, Yama.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from harness import LineReader, compile_c, read_mem
from service_helpers import ServiceProc, kill

from dbr_service.commands import attach as A
from dbr_service.common.procmaps import read_maps

ROOT = Path(__file__).resolve().parent.parent.parent
pytestmark = pytest.mark.skipif(os.uname().machine != "x86_64", reason="x86-64 only")


def dbr(*args: str, env: dict[str, str] | None = None,
        user: int | None = None) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "dbr_service.commands.cli", *args]
    if user is not None:
        argv = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", *argv]
    return subprocess.run(argv, env=dict(os.environ, **(env or {})), cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def start(argv: list[str], **kw) -> subprocess.Popen:
    """A target without the agent: LD_PRELOAD and DBR_* cleared."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("DBR_") and k != "LD_PRELOAD"}
    p = subprocess.Popen(argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, **kw)
    # Popen returns before the child's exec: until then the pid is a copy of this
    # interpreter (its command line is this one's), and an attach would look at the
    # wrong program.  Once exec'd, the program may exec again (unshare): any other
    # command line will do.
    mine = Path("/proc/self/cmdline").read_bytes()
    wait_until(lambda: _cmdline(p.pid) not in (None, mine) or p.poll() is not None, 10,
               f"exec of {argv[0]}")
    return p


def _cmdline(pid: int) -> bytes | None:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None


def wait_until(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.05)
    raise TimeoutError(f"timed out waiting for {what}")


def text_differences(pid: int, path: str) -> int:
    """Bytes of the executable mappings of ``path`` in ``pid`` that differ from the file."""
    st = os.stat(path)
    data = Path(path).read_bytes()
    diff = 0
    for m in read_maps(pid):
        if m.executable and m.ino == st.st_ino:
            n = min(m.hi - m.lo, len(data) - m.offset)
            have = read_mem(pid, m.lo, n)
            diff += sum(a != b for a, b in zip(have, data[m.offset:m.offset + n]))
    return diff


class Program:
    def __init__(self, path: Path, hot: int = 2) -> None:
        self.proc = start([str(path), str(hot)])
        self.out = LineReader(self.proc.stdout)
        self.out.expect("ready", timeout=10)
        self.pid = self.proc.pid
        self.hot = hot

    def send(self, line: str) -> None:
        self.proc.stdin.write((line + "\n").encode())
        self.proc.stdin.flush()

    def report(self) -> list[tuple[int, int, int]]:
        """(rounds, bad, value) per hot thread."""
        self.send("report")
        rows = []
        for _ in range(self.hot):
            f = self.out.expect("hot ").split()
            rows.append((int(f[3]), int(f[5]), int(f[7])))
        self.out.expect("end")
        return rows


@pytest.fixture(scope="module")
def mt_binary() -> Path:
    return compile_c(["attach_mt.c"], out_name="attach_mt")


@pytest.fixture
def service():
    svc = ServiceProc().wait_ready()
    os.chmod(svc.dir, 0o755)
    try:
        yield svc
    finally:
        svc.stop()


@pytest.fixture
def program(mt_binary):
    procs: list[subprocess.Popen] = []

    def make(hot: int = 2) -> Program:
        p = Program(mt_binary, hot)
        procs.append(p.proc)
        return p

    yield make
    for p in procs:
        kill(p)


def client_row(svc: ServiceProc, pid: int) -> dict | None:
    rows = svc.call("clients")
    return next((r for r in rows if r["pid"] == pid and r["state"] == "connected"), None)


def test_attach_patch_detach_reattach(service, program, mt_binary):
    prog = program(hot=2)
    env = {"DBR_RUNTIME_DIR": service.dir}
    r = dbr("attach", str(prog.pid), env=env)
    assert r.returncode == 0, r.stderr
    assert f"agent loaded into pid {prog.pid}" in r.stdout and "is served" in r.stdout

    row = service.wait_for(lambda: (x := client_row(service, prog.pid)) and
                           x["patches_installed"] > 0 and x, timeout=60, what="a patch")
    assert row["attached"] is True and row["thread_notices"] == "none (attached)"
    assert row["agent_thread"] == "pthread"
    assert text_differences(prog.pid, str(mt_binary)) > 0      # a jump is in the text
    before = prog.report()
    time.sleep(1.0)
    prog.send("ping")
    assert prog.out.expect("reader got") == "reader got 1"
    after = prog.report()
    for (r0, bad0, v0), (r1, bad1, v1) in zip(before, after):
        assert r1 > r0 and bad1 == 0 and v1 == v0 == after[0][2]   # patched rounds agree

    # a SIGTRAP action the program installs (no hook sees it) is taken back into the
    # agent's chain at the next patch batch: the detach's unpatching
    prog.send("trap")
    prog.out.expect("trap set")

    r = dbr("detach", str(prog.pid), env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 differ, 0 not compared" in r.stdout
    prog.send("raise")
    assert prog.out.expect("traps") == "traps 1 handler other"   # chained by the agent
    assert text_differences(prog.pid, str(mt_binary)) == 0
    # dormant: no new session within a second
    time.sleep(1.0)
    assert client_row(service, prog.pid) is None
    assert prog.report()[0][1] == 0

    r = dbr("attach", str(prog.pid), env=env)
    assert r.returncode == 0, r.stderr
    assert f"agent woken again in pid {prog.pid}" in r.stdout
    assert sum(os.path.basename(m.path) == A.AGENT_NAME and m.offset == 0
               for m in read_maps(prog.pid)) == 1                   # loaded once
    r = dbr("attach", str(prog.pid), env=env)
    assert r.returncode == 1 and "carries an active agent already" in r.stderr
    service.wait_for(lambda: (x := client_row(service, prog.pid)) and x["patches_installed"],
                     timeout=60, what="a patch after attaching again")
    prog.send("ping")
    assert prog.out.expect("reader got") == "reader got 2"
    assert all(bad == 0 for _r, bad, _v in prog.report())
    prog.send("stop")
    assert prog.out.expect("done")
    assert prog.proc.wait(10) == 0


# ------------------------------------------------------------------ refusals
def refused(pid: int, *, user: int | None = None) -> str:
    r = dbr("attach", str(pid), env={"DBR_RUNTIME_DIR": tempfile.gettempdir() + "/no-dbr"},
            user=user)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    return r.stderr


def test_refuses_a_static_binary(tmp_path):
    src = tmp_path / "spin.c"
    src.write_text("int main(void) { for (;;) __asm__ volatile(\"\"); }\n")
    exe = tmp_path / "spin"
    if subprocess.run(["gcc", "-static", "-O1", "-o", str(exe), str(src)]).returncode:
        pytest.skip("no static libc to link a static test program with")
    p = start([str(exe)])
    try:
        assert "no dynamic loader mapped (a statically linked program)" in refused(p.pid)
    finally:
        kill(p)


def test_refuses_a_zombie_and_a_pid_that_is_gone():
    p = subprocess.Popen(["true"])
    wait_until(lambda: A._status(p.pid).get("State", "").startswith("Z"), 5, "a zombie")
    assert "is a zombie" in refused(p.pid)
    p.wait()
    assert f"no process {p.pid} (ESRCH)" in refused(p.pid)


def test_refuses_another_users_process(program):
    if shutil.which("setpriv") is None or os.geteuid() != 0:
        pytest.skip("needs root and setpriv to run the target and dbr as two other users")
    p = start(["sleep", "30"], user=65533, group=65533)
    try:
        msg = refused(p.pid, user=65534)
        assert f"pid {p.pid} (sleep) runs as uid 65533" in msg and "you are uid 65534" in msg
    finally:
        kill(p)


def test_refuses_a_process_that_is_not_dumpable():
    """Its owner may not trace it: prctl(PR_SET_DUMPABLE, 0) closes its /proc entries
    and ptrace to all but CAP_SYS_PTRACE."""
    if shutil.which("setpriv") is None or os.geteuid() != 0:
        pytest.skip("needs root and setpriv to run the target and dbr as another user")
    p = start(["/usr/bin/python3", "-c", "import ctypes, time\n"
               "assert ctypes.CDLL(None).prctl(4, 0, 0, 0, 0) == 0\n"
               "print('ready', flush=True)\ntime.sleep(30)\n"], user=65534, group=65534)
    try:
        assert p.stdout.readline().strip() == b"ready"
        msg = refused(p.pid, user=65534)
        assert f"pid {p.pid} (python3) is not dumpable" in msg, msg
    finally:
        kill(p)


def test_refuses_a_32_bit_process(tmp_path):
    src = tmp_path / "pause32.s"
    src.write_text(".globl _start\n_start:\n mov $29, %eax\n int $0x80\n jmp _start\n")
    exe = tmp_path / "pause32"
    if (subprocess.run(["as", "--32", "-o", str(tmp_path / "p.o"), str(src)]).returncode
            or subprocess.run(["ld", "-m", "elf_i386", "-o", str(exe),
                               str(tmp_path / "p.o")]).returncode):
        pytest.skip("binutils cannot build an i386 program here")
    p = start([str(exe)])
    try:
        wait_until(lambda: A._status(p.pid).get("State", "").startswith("S"), 5, "pause")
        assert "is not an x86-64 process (a 32-bit one?)" in refused(p.pid)
    finally:
        kill(p)


def test_refuses_a_process_another_tracer_holds():
    p = start(["sleep", "30"])
    tracer = subprocess.Popen([sys.executable, "-c", f"""
import ctypes, sys, time
libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.argtypes = [ctypes.c_long] * 4
assert libc.ptrace(0x4206, {p.pid}, 0, 0) == 0, ctypes.get_errno()
print("traced", flush=True)
time.sleep(30)
"""], stdout=subprocess.PIPE, text=True)
    try:
        assert tracer.stdout.readline().strip() == "traced"
        msg = refused(p.pid)
        assert f"is already traced by pid {tracer.pid}" in msg
    finally:
        kill(tracer)
        kill(p)


def test_refuses_another_mount_namespace():
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs root and unshare(1) for a mount namespace")
    p = start(["unshare", "-m", "sleep", "30"])
    try:
        wait_until(lambda: os.readlink(f"/proc/{p.pid}/exe").endswith("sleep"), 5, "exec")
        assert "is in another mount namespace" in refused(p.pid)
    finally:
        kill(p)


@pytest.mark.parametrize("scope,needle", [
    (1, "ptrace_scope is 1: only a parent may trace"),
    (2, "ptrace_scope is 2: only a process with CAP_SYS_PTRACE"),
    (3, "ptrace_scope is 3: ptrace is disabled")])
def test_yama_says_what_is_missing(monkeypatch, scope, needle):
    """Each ptrace_scope names what is missing; 3 (and 2 without CAP_SYS_PTRACE) are
    refused before any ptrace, 1 when the kernel answers EPERM."""
    assert needle in A._yama_message(1, scope)
    if scope == 1:
        return
    p = start(["sleep", "30"])
    try:
        monkeypatch.setattr(A, "yama_scope", lambda: scope)
        monkeypatch.setattr(A, "_has_cap_sys_ptrace", lambda: False)
        with pytest.raises(A.AttachError, match=needle):
            A.check_target(p.pid)
    finally:
        kill(p)


def test_dlopen_failure_reports_dlerror(tmp_path):
    """A library that dlopen refuses (one that needs a library that does not exist):
    the target's own dlerror() string is reported, and the target runs on."""
    lib = tmp_path / "libdbr_agent.so"
    dep = tmp_path / "libmissing_dep.so"
    (tmp_path / "dep.c").write_text("int dep(void) { return 1; }\n")
    (tmp_path / "a.c").write_text("int dep(void);\nint dbr_agent_activate(const char *d)"
                                  " { (void)d; return dep(); }\n")
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(dep), str(tmp_path / "dep.c")],
                   check=True)
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(lib), str(tmp_path / "a.c"),
                    f"-L{tmp_path}", "-lmissing_dep"], check=True)
    dep.unlink()
    p = start(["sleep", "30"])
    try:
        with pytest.raises(A.AttachError, match="libmissing_dep.so: cannot open shared"):
            A.attach(p.pid, str(lib), str(tmp_path))
        assert p.poll() is None and A._status(p.pid)["TracerPid"] == "0"
    finally:
        kill(p)


def test_injector_restores_every_register():
    """A call on a stopped thread leaves it where it was: its registers before the
    stop and after the detach are the same (read while stopped again)."""
    p = start(["sleep", "30"])
    try:
        time.sleep(0.2)
        maps = read_maps(p.pid)
        getpid = A._symbol(maps, "getpid", ("libc.so",))
        with A.Injector(p.pid, p.pid) as inj:
            before = bytes(inj.saved)
            rax, _ = inj.call(getpid)
            assert rax == p.pid
        with A.Injector(p.pid, p.pid) as inj:
            after = bytes(inj.saved)
        assert p.poll() is None
        regs_before = A.Regs.from_buffer_copy(before)
        regs_after = A.Regs.from_buffer_copy(after)
        for name, _t in A.Regs._fields_:
            if name not in ("rax", "rip", "orig_rax", "rcx", "r11"):   # the nanosleep restart
                assert getattr(regs_before, name) == getattr(regs_after, name), name
        assert ctypes.sizeof(A.Regs) == 27 * 8
    finally:
        kill(p)


def test_agent_timer_samples_threads_started_after_attach(program):
    """With the agent-timer sampler (perf refused or not chosen), a thread started after
    the attach, which no pthread_create hook announced, is sampled: every window's
    SAMPLER_START arms the threads /proc/self/task lists then."""
    svc = ServiceProc("sampling_source=agent-timer").wait_ready()
    try:
        prog = program(hot=1)
        r = dbr("attach", str(prog.pid), env={"DBR_RUNTIME_DIR": svc.dir})
        assert r.returncode == 0, r.stderr
        svc.wait_for(lambda: client_row(svc, prog.pid), timeout=10, what="the client")
        before = set(os.listdir(f"/proc/{prog.pid}/task"))
        prog.send("spawn")
        prog.out.expect("spawned")
        new = set(os.listdir(f"/proc/{prog.pid}/task")) - before
        assert len(new) == 1
        tid = new.pop()
        svc.wait_for(lambda: svc.call("hotspots", {"pid": prog.pid})["threads"].get(tid),
                     timeout=30, what=f"samples of thread {tid}, started after the attach")
        assert client_row(svc, prog.pid)["source"] == "agent-timer"
    finally:
        svc.stop()
