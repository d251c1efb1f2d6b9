"""What a client (or another local user) can make the root service do: the perf map in
/tmp (links planted there, removal at the end, stale maps of a killed service), tids
of other processes in THREAD_NEW, and hostile text in HELLO and ERROR."""

from __future__ import annotations

import mmap
import fcntl
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import pytest
from service_helpers import FakeAgent, ServiceProc, agent_path, build_example, kill, spawn_client

from dbr_service.wire import protocol as P
from dbr_service.common.clientfiles import (PERF_MAP_RECORDS, PerfMap, ProcHandle,
                                            code_buffer_problem, perf_map_path,
                                            remove_stale_perf_maps, safe_text)

needs_agent = pytest.mark.skipif(agent_path() is None, reason="libdbr_agent.so cannot be built")
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the service must run as root")

VICTIM_TEXT = "root's own file\n"


def _dbr(*argv: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dbr_service.commands.cli", *argv], env=env,
                          capture_output=True, text=True, timeout=20)


def _row(svc: ServiceProc, pid: int, all_: bool = False) -> dict | None:
    rows = svc.call("clients", {"all": all_}) if all_ else svc.call("clients")
    return next((r for r in rows if r["pid"] == pid), None)


def _patched(svc: ServiceProc, pid: int) -> bool:
    r = _row(svc, pid)
    return bool(r and r["patches_installed"] > 0)


def _snapshots(svc: ServiceProc, pid: int) -> int:
    r = _row(svc, pid)
    return r["snapshots"] if r else -1


def _wait_snapshots(svc: ServiceProc, pid: int, more: int) -> None:
    """Some more snapshots of ``pid``: each rewrites its perf map (evaluate)."""
    start = _snapshots(svc, pid)
    svc.wait_for(lambda: _snapshots(svc, pid) >= start + more, 10.0, f"{more} snapshots")


@pytest.fixture(scope="module")
def patching_service():
    svc = ServiceProc("--aggressive").wait_ready()
    yield svc
    svc.stop()


@pytest.fixture
def private_dir():
    d = tempfile.mkdtemp(prefix="dbr-victim-")   # 0700, root's
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


@needs_agent
@needs_root
def test_a_link_planted_as_the_perf_map_is_never_followed(patching_service, private_dir):
    """Links planted at /tmp/perf-PID.map before the first write: one dangling (into a
    directory only root can write), one to an existing root-owned file.  Neither is
    followed: no file appears at the dangling one's target, the victim keeps its
    bytes, both links stay as they were, and the service says why it left them."""
    svc = patching_service
    prog = build_example("hotloop")
    victim = os.path.join(private_dir, "victim")
    with open(victim, "w") as f:
        f.write(VICTIM_TEXT)
    target = os.path.join(private_dir, "created-by-the-service")
    clients, links = [], []
    try:
        for dest in (target, victim):
            c = spawn_client(svc.dir, [prog, "4000"])
            link = perf_map_path(c.pid)
            _unlink(link)
            os.symlink(dest, link)    # the map is written at the first patch, later
            clients.append(c)
            links.append((link, dest))
        for c in clients:
            svc.wait_for(lambda c=c: _patched(svc, c.pid), 20.0, "client patched")
        for c in clients:
            _wait_snapshots(svc, c.pid, 3)
        assert not os.path.lexists(target), "the service created a file through a link"
        with open(victim) as f:
            assert f.read() == VICTIM_TEXT
        for link, dest in links:
            assert os.path.islink(link) and os.readlink(link) == dest
        assert svc.output().count("exists (another writer's map, or a link): left alone") \
            >= 2, svc.output()[-3000:]
    finally:
        for c in clients:
            kill(c)
        for link, _ in links:
            _unlink(link)


@needs_agent
@needs_root
def test_the_perf_map_is_rewritten_through_its_descriptor(patching_service, private_dir):
    """Once the service made the map, it writes through the file it created, never by
    path: a map removed meanwhile (a /tmp cleaner) and replaced by a link to a
    root-owned file is not followed, and at the client's end the link is not removed
    (the path is no longer the service's file)."""
    svc = patching_service
    prog = build_example("hotloop")
    victim = os.path.join(private_dir, "victim")
    with open(victim, "w") as f:
        f.write(VICTIM_TEXT)
    c = spawn_client(svc.dir, [prog, "5000"])
    link = perf_map_path(c.pid)
    try:
        svc.wait_for(lambda: os.path.isfile(link) and not os.path.islink(link)
                     and "dbr:" in open(link).read(), 20.0, "perf map written")
        st = os.lstat(link)
        assert st.st_mode & 0o777 == 0o644 and st.st_uid == os.geteuid()
        os.unlink(link)
        os.symlink(victim, link)
        _wait_snapshots(svc, c.pid, 4)
        with open(victim) as f:
            assert f.read() == VICTIM_TEXT, "the service wrote through a link"
        kill(c)
        svc.wait_for(lambda: _row(svc, c.pid) is None, 10.0, "session ended")
        assert os.path.islink(link) and os.readlink(link) == victim
    finally:
        kill(c)
        _unlink(link)


@needs_agent
@needs_root
def test_the_perf_map_is_removed_when_the_client_ends(patching_service):
    svc = patching_service
    prog = build_example("hotloop")
    c = spawn_client(svc.dir, [prog, "5000"])
    path = perf_map_path(c.pid)
    try:
        svc.wait_for(lambda: os.path.isfile(path), 20.0, "perf map written")
        st = os.lstat(path)
        record = f"{c.pid}-{st.st_dev:x}-{st.st_ino:x}"
        records = os.path.join(svc.dir, PERF_MAP_RECORDS)
        recorded = os.path.isdir(records) and record in os.listdir(records)
        os.kill(c.pid, signal.SIGKILL)
        c.wait(5)
        svc.wait_for(lambda: _row(svc, c.pid) is None, 10.0, "session ended")
        assert not os.path.lexists(path), "the map outlived its client"
        assert recorded and record not in os.listdir(records)
    finally:
        kill(c)
        _unlink(path)


def _dead_pids(n: int) -> list[int]:
    """Pids of processes that have ended (reaped) and are not reused yet."""
    out = []
    while len(out) < n:
        p = subprocess.Popen(["true"])
        p.wait()
        if not os.path.exists(f"/proc/{p.pid}") and not os.path.lexists(perf_map_path(p.pid)):
            out.append(p.pid)
    return out


@needs_root
def test_stale_perf_maps_of_a_killed_service_are_removed(tmp_path):
    """remove_stale_perf_maps: a recorded map goes (its record too); a recorded path that
    is a link now is spared; a map dbr did not write (another format), one of a running
    process, one of another user, and a link are spared; an unrecorded map in dbr's
    format of an ended process (an older dbr's, or a killed `dbr run`'s) goes."""
    rdir = tmp_path / "run"
    rdir.mkdir()
    sleeper = subprocess.Popen(["sleep", "30"])
    recorded, relinked, foreign, legacy, other_user, link = _dead_pids(6)
    lines = ["7f0000001000 40 dbr:r1@0x401000", "7f0000001040 8 dbr:r1@0x401010"]
    made = []
    try:
        for pid in (recorded, relinked):
            pm = PerfMap(pid, rdir)
            assert pm.write(lines) is None
            os.close(pm.fd)          # a killed service: no close()
            made.append(pm.path)
        os.unlink(perf_map_path(relinked))
        os.symlink("/etc/hostname", perf_map_path(relinked))
        dbr_text = "\n".join(lines) + "\n"
        for pid, text in ((foreign, "7f00 10 java::Foo.bar\n"), (legacy, dbr_text),
                          (sleeper.pid, dbr_text), (other_user, dbr_text)):
            with open(perf_map_path(pid), "w") as f:
                f.write(text)
            made.append(perf_map_path(pid))
        os.chown(perf_map_path(other_user), 65534, 65534)
        os.symlink("/etc/hostname", perf_map_path(link))
        made += [perf_map_path(relinked), perf_map_path(link)]

        removed = remove_stale_perf_maps(rdir)   # other stale dbr maps in /tmp too
        assert {perf_map_path(recorded), perf_map_path(legacy)} <= set(removed)
        assert not os.path.lexists(perf_map_path(recorded))
        assert not os.path.lexists(perf_map_path(legacy))
        assert os.listdir(rdir / PERF_MAP_RECORDS) == []
        for pid in (relinked, foreign, sleeper.pid, other_user, link):
            assert os.path.lexists(perf_map_path(pid)), pid
        assert os.path.islink(perf_map_path(relinked)) and os.path.islink(perf_map_path(link))
        assert open("/etc/hostname").read()     # the links' target is untouched
    finally:
        kill(sleeper)
        for p in made:
            _unlink(p)


def test_perf_map_rewrites_in_place_and_removes_only_its_own_file(tmp_path):
    pid = _dead_pids(1)[0]
    pm = PerfMap(pid, tmp_path)
    try:
        assert pm.write([]) is None and not os.path.lexists(pm.path)   # nothing live: no file
        assert pm.write(["1000 20 dbr:r1@0x400000", "1020 8 dbr:r2@0x400100"]) is None
        ino = os.lstat(pm.path).st_ino
        assert pm.write(["1000 20 dbr:r1@0x400000"]) is None
        assert open(pm.path).read() == "1000 20 dbr:r1@0x400000\n"
        assert os.lstat(pm.path).st_ino == ino
        os.unlink(pm.path)
        with open(pm.path, "w") as f:            # another writer's map now
            f.write("other\n")
        pm.close()
        assert open(pm.path).read() == "other\n"
    finally:
        _unlink(pm.path)


# --------------------------------------------------------------------------- THREAD_NEW
def _perf_fds(pid: int) -> int:
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") == "anon_inode:[perf_event]":
                n += 1
        except OSError:
            pass
    return n


class Agent(FakeAgent):
    """A fake agent that answers nothing and can wait for an ACK (a round trip)."""

    def sync(self, req_id: int) -> None:
        """MAP_CHANGED (kind MUNMAP, req_id) and wait for its ACK: every message sent
        before it has been handled."""
        self.send(P.MsgType.MAP_CHANGED, P.MapChanged(req_id=req_id, kind=P.MapKind.MUNMAP,
                                                      lo=0x10000, hi=0x11000))
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            m = self.recv_or_eof(5)
            assert m is not None, "session closed"
            if m.type is P.MsgType.ACK and m.body.req_id == req_id:
                return
        raise TimeoutError("no ACK")


@needs_root
def test_thread_new_of_another_process_opens_no_perf_event():
    """A fake agent (this process) announces the tid of a `sleep` it does not own: the
    root service opens no perf event on it (its perf descriptors do not change),
    counts the refusal, and goes on serving the session; its own thread is taken."""
    svc = ServiceProc("--aggressive", "patching=false",
                      "continuous_sampling=true").wait_ready()
    sleeper = subprocess.Popen(["sleep", "30"])
    agent = Agent(svc.dir)
    stop = threading.Event()
    mine = threading.Thread(target=stop.wait, args=(30,))
    mine.start()
    try:
        assert agent.hello(flags=0).type is P.MsgType.HELLO_ACK
        me = os.getpid()
        svc.wait_for(lambda: (_row(svc, me) or {}).get("snapshots", 0) >= 2, 10.0,
                     "sampled")
        svc_pid = svc.proc.pid
        agent.sync(1)
        before = _perf_fds(svc_pid)
        assert before > 0     # its events on this process's threads
        agent.send(P.MsgType.THREAD_NEW, P.Thread(tid=sleeper.pid))
        agent.sync(2)
        after = _perf_fds(svc_pid)
        assert after == before, f"perf events {before} -> {after}: one on a foreign tid"
        row = _row(svc, me)
        assert row["foreign_tids"] == 1 and row["state"] == "connected"
        agent.send(P.MsgType.THREAD_NEW, P.Thread(tid=mine.native_id))
        agent.sync(3)
        assert _row(svc, me)["foreign_tids"] == 1
        assert _perf_fds(svc_pid) >= before
    finally:
        stop.set()
        mine.join()
        agent.close()
        kill(sleeper)
        svc.stop()


# --------------------------------------------------------------------------- text
HOSTILE = b"/x/\x1b[2J\x1b]0;owned\x07\x9b31m\xff\xfe\xe2\x80\xae" + b"B" * 200


def _no_escapes(text: str) -> None:
    assert "\x1b" not in text and "\x07" not in text and "\x9b" not in text \
        and "\u202e" not in text, repr(text[:500])


def test_safe_text_is_printable_and_bounded():
    s = safe_text(HOSTILE + b"\n" * 4096)
    _no_escapes(s)
    assert s.isprintable() and len(s) <= 300 and s.endswith("...")
    assert safe_text(b"/usr/bin/python3") == "/usr/bin/python3"
    assert safe_text("a\\b") == "a\\\\b"


def test_hostile_exe_and_error_text_are_escaped():
    """A HELLO claiming an exe full of terminal escapes and bytes that are not UTF-8: the
    session lists the kernel's exe, keeps the claim escaped and bounded, flags the
    mismatch; `dbr ctl clients` and the service log carry no escape character.  A
    HELLO whose exe is not NUL-terminated, or of 4 KiB, is refused.  An ERROR from
    the agent ends the session with its text escaped."""
    svc = ServiceProc("patching=false").wait_ready()
    agent = Agent(svc.dir)
    try:
        me = os.getpid()
        h = P.Hello(pid=me, ppid=os.getppid(), uid=os.getuid(), n_threads=1,
                    page_size=4096, exe=HOSTILE)
        agent.send(P.MsgType.HELLO, h)
        assert agent.recv().type is P.MsgType.HELLO_ACK
        svc.wait_for(lambda: _row(svc, me), 5.0, "listed")
        row = _row(svc, me)
        assert row["exe"].startswith(os.readlink("/proc/self/exe") + " (claims /x/\\x1b[2J")
        assert row["exe_mismatch"] is True
        _no_escapes(row["exe_claimed"])
        assert row["exe_claimed"].startswith("/x/\\x1b[2J") and len(row["exe_claimed"]) <= 300
        r = _dbr("ctl", "clients", env=svc.env)
        assert r.returncode == 0, r.stderr
        _no_escapes(r.stdout)
        agent.send(P.MsgType.ERROR, P.Error(code=-12, msg=b"\x1b[31mbad\x1b[0m\x07"))
        svc.wait_for(lambda: _row(svc, me) is None, 5.0, "session ended")
        ended = _row(svc, me, all_=True)
        assert "\\x1b[31mbad" in ended["close_reason"]
        _no_escapes(ended["close_reason"])

        # exe without its NUL, and a 4 KiB HELLO: refused
        bad = Agent(svc.dir)
        raw = bytearray(P.pack(P.Hello(pid=me, page_size=4096), P.MsgType.HELLO, 1))
        off = P.Hello.exe.offset
        raw[off:off + P.EXE_MAX] = b"\x1b" * P.EXE_MAX
        bad.sock.send(bytes(raw))
        assert bad.recv_or_eof().type is P.MsgType.HELLO_ACK
        assert bad.recv_or_eof().type is P.MsgType.ERROR
        assert bad.recv_or_eof() is None
        bad.close()
        big = Agent(svc.dir)
        hdr = P.make_hdr(P.MsgType.HELLO, 4096, 1)
        big.sock.send(bytes(hdr) + b"\x1b" * (4096 - len(bytes(hdr))))
        assert big.recv_or_eof() is None
        big.close()
        time.sleep(0.3)
        _no_escapes(svc.output())
    finally:
        agent.close()
        svc.stop()


@needs_agent
def test_an_executable_named_with_escapes_is_listed_escaped(patching_service, tmp_path):
    """Any user can name a program with terminal escapes and run it under the agent;
    the root operator's `dbr ctl clients` and the service log show it escaped."""
    svc = patching_service
    exe = tmp_path / "\x1b]0;owned\x07\x1b[2Jprog"
    shutil.copy(build_example("hotloop"), exe)
    c = spawn_client(svc.dir, [str(exe), "3000"])
    try:
        svc.wait_for(lambda: _row(svc, c.pid), 10.0, "listed")
        row = _row(svc, c.pid)
        assert "\\x1b]0;owned\\x07" in row["exe"] and not row["exe_mismatch"]
        r = _dbr("ctl", "clients", env=svc.env)
        _no_escapes(r.stdout)
        _no_escapes(svc.output())
    finally:
        kill(c)


@needs_root
def test_a_service_removes_a_killed_services_perf_maps_at_start(tmp_path):
    """The service calls remove_stale_perf_maps when it starts on its runtime dir."""
    rdir = tmp_path / "run"
    rdir.mkdir()
    pid = _dead_pids(1)[0]
    pm = PerfMap(pid, rdir)
    assert pm.write(["7f0000001000 40 dbr:r1@0x401000"]) is None
    os.close(pm.fd)                  # a killed service: no close()
    svc = ServiceProc(runtime_dir=str(rdir))
    try:
        svc.wait_ready()
        # (not its log line: any service starting meanwhile may have removed it first)
        assert not os.path.lexists(perf_map_path(pid))
    finally:
        svc.stop()
        _unlink(perf_map_path(pid))


# --------------------------------------------------------------------------- code buffers
def test_a_code_buffer_must_be_the_clients_own_mapping_of_the_fd_it_sent():
    """code_buffer_problem, with this process as the client: its own memfd mapped at the
    base passes; a size other than the request's, another file at the base, an fd of
    another size, an unmapped or kernel address do not."""
    size = 1 << 16

    def sealed(name: str, n: int) -> int:
        f = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(f, n)
        fcntl.fcntl(f, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        return f

    fd = sealed("dbr-code-test", size)
    other = sealed("other", size)
    big = sealed("big", size * 2)
    unsealed = os.memfd_create("unsealed", os.MFD_CLOEXEC)
    proc = ProcHandle(os.getpid())
    try:
        os.ftruncate(unsealed, size)
        mem = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        base = next(m.lo for m in proc.maps() if m.path.startswith("/memfd:dbr-code-test"))
        assert code_buffer_problem(proc, fd, base, size, size - 100) is None
        assert "size" in code_buffer_problem(proc, fd, base, size, size * 4)
        assert "size" in code_buffer_problem(proc, fd, base, 1 << 40, size)
        # a data buffer is rounded up to whole pages, not to the 2 MiB code granule
        assert code_buffer_problem(proc, fd, base, size, size - 100, data=True) is None
        assert "size" in code_buffer_problem(proc, fd, base, size, size // 2, data=True)
        assert "another file" in code_buffer_problem(proc, other, base, size, size)
        assert "not mapped" in code_buffer_problem(proc, fd, 0x10000, size, size)
        assert "user memory" in code_buffer_problem(proc, fd, 0xFFFFFFFF81000000, size, size)
        assert "not a file of" in code_buffer_problem(proc, big, base, size, size)
        # a client could shrink it under the service's mapping: SIGBUS in the service
        assert "not sealed" in code_buffer_problem(proc, unsealed, base, size, size)
        mem.close()
    finally:
        proc.close()
        for f in (fd, other, big, unsealed):
            os.close(f)

