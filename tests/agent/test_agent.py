"""libdbr_agent.so driven by the fake service (tests/harness.py).

Live patching of a multi-threaded program, the patch storm for every protocol
variant and site offset, dlclose, fork and service death, the PC census, and refusal
of bad input.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from dbr_service.wire import protocol as P
from dbr_service.wire.agentconn import jmp_rel32, make_site
from harness import (SITE_INSN, SITE_LEN, FakeService, assemble, compile_c, exit_stub,
                     parse_sites, patch_sites, read_mem)

STORM_CYCLES = int(os.environ.get("DBR_STORM_CYCLES", "10000"))
#: Cycles of the storm under `make test`, for every variant: the int3 one (the
#: installer's) takes 3.5 ms a cycle, so its full STORM_CYCLES run, like the
#: others', is under `make test-long`.
STORM_CYCLES_SHORT = min(STORM_CYCLES, 2500)


@pytest.fixture(scope="module")
def storm_exe():
    return compile_c(["storm.c"])


def start_storm(svc: FakeService, exe, *args: str, env=None):
    client = svc.spawn([exe, *args], env=env)
    sites = parse_sites(client.out.expect("sites"))
    client.out.expect("ready")
    conn = svc.accept(pid=client.pid)
    return client, conn, sites


def finish_storm(client, originals: dict[int, bytes]) -> None:
    """The storm survived, every site holds its original bytes again, and it ends well
    (exit 0, every result it checked correct, some calls made)."""
    assert client.proc.poll() is None, client.err.lines
    for s, orig in originals.items():
        assert read_mem(client.pid, s, len(orig)) == orig
    rc, rest = client.finish()
    assert rc == 0, (rc, client.err.lines)
    assert int(rest[-1].split("=")[1]) > 0


# ---- membarrier SYNC_CORE: registered when code is about to be written -------

REGISTERED = "membarrier SYNC_CORE registered"


def test_sync_core_is_registered_at_the_first_code_buffer_not_at_load(svc, storm_exe):
    """A process registered for membarrier SYNC_CORE serialises the core each time one
    of its threads comes back to a CPU from the idle task, a cost to every client
    that is never patched.  The agent registers after answering its first code
    buffer request (the service writes code meanwhile) and before any patch; HELLO
    says only that the kernel offers it."""
    client, conn, sites = start_storm(svc, storm_exe, "2", "print",
                                      env={"DBR_AGENT_DEBUG": "1"})
    assert conn.hello.flags & P.HELLO_SYNC_CORE
    client.out.expect("v 3007")
    client.err.expect(f"dbr-agent[{client.pid}]: session ", timeout=5)
    with pytest.raises(TimeoutError):   # dormant and connected: not registered
        client.err.expect(f"dbr-agent[{client.pid}]: {REGISTERED}", timeout=0.5)
    site = sites[0]
    buf = conn.code_buffer(near=site, size=4096)
    client.err.expect(f"dbr-agent[{client.pid}]: {REGISTERED}", timeout=5)
    buf.write(buf.base, assemble("imul eax, edi, 1000; add eax, 8; ret", buf.base))
    ps = patch_sites(conn, client.pid, {site: buf.base})
    assert conn.patch(ps) == [P.Result.OK]
    client.out.expect("v 3008", timeout=5)
    assert conn.unpatch(ps) == [P.Result.OK]
    client.out.expect("v 3007", timeout=5)
    # once is enough: a second buffer does not register again
    conn.code_buffer(near=site, size=4096)
    rc, rest = client.finish()
    assert rc == 0 and rest[-1].startswith("ok calls=")
    assert sum(REGISTERED in line for line in client.err.rest() + client.err.lines) == 1


# ---- 2: a function patched into replacement code, then restored ------------

def test_patch_changes_output_then_unpatch_restores_bytes(svc, storm_exe):
    client, conn, sites = start_storm(svc, storm_exe, "4", "print")
    site = sites[0]
    original = read_mem(client.pid, site, 16)
    client.out.expect("v 3007")
    buf = conn.code_buffer(near=site, size=4096)
    assert abs(buf.base - site) < 2**31 and abs(buf.base + buf.size - site) < 2**31
    # Replacement: x*1000 + 8 instead of + 7.
    buf.write(buf.base, assemble("imul eax, edi, 1000; add eax, 8; ret", buf.base))
    ps = patch_sites(conn, client.pid, {site: buf.base})
    assert conn.patch(ps) == [P.Result.OK]
    assert read_mem(client.pid, site, 5) == jmp_rel32(site, buf.base)
    client.out.expect("v 3008", timeout=5)
    assert conn.unpatch(ps) == [P.Result.OK]
    client.out.expect("v 3007", timeout=5)
    assert read_mem(client.pid, site, 16) == original
    rc, rest = client.finish()
    assert rc == 0 and rest[-1].startswith("ok calls=")


def test_client_mapping_of_code_buffer_is_never_writable(svc, storm_exe):
    client, conn, sites = start_storm(svc, storm_exe, "1")
    buf = conn.code_buffer(near=sites[0], size=8192)
    maps = open(f"/proc/{client.pid}/maps").read().splitlines()
    mine = [m for m in maps if int(m.split("-")[0], 16) == buf.base]
    assert mine, "code buffer not found in the client's maps"
    assert mine[0].split()[1].startswith("r-x"), mine[0]
    assert buf.size >= 8192
    rc, _ = client.finish()
    assert rc == 0


# ---- 3: the patch storm ----------------------------------------------------

def usable(variant: int, site: int) -> bool:
    off = site % 8
    if variant == P.Variant.SINGLE:
        return off <= 3
    if variant == P.Variant.SELF_BRANCH:
        return off != 7
    return True


@pytest.mark.parametrize("variant,cycles", [
    (P.Variant.INT3, STORM_CYCLES_SHORT),
    (P.Variant.SELF_BRANCH, STORM_CYCLES_SHORT), (P.Variant.SINGLE, STORM_CYCLES_SHORT),
    pytest.param(P.Variant.INT3, STORM_CYCLES, marks=pytest.mark.long),
    pytest.param(P.Variant.SELF_BRANCH, STORM_CYCLES, marks=pytest.mark.long),
    pytest.param(P.Variant.SINGLE, STORM_CYCLES, marks=pytest.mark.long)],
    ids=lambda v: v.name.lower() if isinstance(v, P.Variant) else str(v))
def test_patch_storm(svc, storm_exe, variant, cycles):
    """8 threads run through 8 sites (every offset mod 8) while the sites are patched
    and unpatched ``cycles`` times; original and replacement compute the same.  The
    full storm of every variant runs under `make test-long`."""
    client, conn, sites = start_storm(svc, storm_exe, "8")
    assert sorted(s % 8 for s in sites) == list(range(8))
    originals = {s: read_mem(client.pid, s, 8) for s in sites}
    buf = conn.code_buffer(near=sites[0], size=4096)
    targets = {s: exit_stub(buf, buf.base + 64 * k, s) for k, s in enumerate(sites)}
    all_sites = patch_sites(conn, client.pid, targets, variant)
    first = conn.patch(all_sites)
    for s, r in zip(sites, first):
        assert r == (P.Result.OK if usable(variant, s) else P.Result.E_ALIGN), (hex(s), r)
    good = [ps for ps in all_sites if usable(variant, ps.site)]
    assert conn.unpatch(good) == [P.Result.OK] * len(good)
    for _ in range(cycles):
        assert conn.patch(good) == [P.Result.OK] * len(good)
        assert conn.unpatch(good) == [P.Result.OK] * len(good)
    finish_storm(client, originals)


def test_int3_batches_spare_threads_that_block_sigtrap(svc, storm_exe):
    """Workers block SIGTRAP by a raw system call (the agent's hooks never see it), so a
    CC they met would kill them.  Every batch of int3 sites must then use the
    self-branch protocol where it fits and refuse the site at offset 7 (E_BUSY), and
    every worker must keep computing correct results through a storm of batches."""
    client, conn, sites = start_storm(svc, storm_exe, "8", "blocktrap")
    deadline = time.monotonic() + 10
    while sum(ln.startswith("blocked ") for ln in client.out.lines) < 8:
        assert time.monotonic() < deadline, client.out.lines[-5:]
        client.out.expect("blocked ", timeout=max(0.1, deadline - time.monotonic()))
    blocked = [int(ln.split()[1]) for ln in client.out.lines if ln.startswith("blocked ")]
    for tid in blocked:   # the premise: the kernel agrees SIGTRAP is blocked there
        sigblk = next(ln for ln in open(f"/proc/{client.pid}/task/{tid}/status")
                      if ln.startswith("SigBlk:"))
        assert int(sigblk.split()[1], 16) & (1 << (signal.SIGTRAP - 1)), sigblk
    originals = {s: read_mem(client.pid, s, 8) for s in sites}
    buf = conn.code_buffer(near=sites[0], size=4096)
    targets = {s: exit_stub(buf, buf.base + 64 * k, s) for k, s in enumerate(sites)}
    all_sites = patch_sites(conn, client.pid, targets, P.Variant.INT3)
    expect = [P.Result.E_BUSY if s % 8 == 7 else P.Result.OK for s in sites]
    good = [ps for ps in all_sites if ps.site % 8 != 7]
    for _ in range(max(200, STORM_CYCLES // 20)):
        assert conn.patch(all_sites) == expect
        assert conn.unpatch(good) == [P.Result.OK] * len(good)
    finish_storm(client, originals)


def _mapped_span(pid: int, path) -> tuple[int, int] | None:
    spans = [tuple(int(x, 16) for x in ln.split()[0].split("-"))
             for ln in open(f"/proc/{pid}/maps") if ln.rstrip().endswith(str(path))]
    return (min(a for a, _ in spans), max(b for _, b in spans)) if spans else None


def test_dlopen_notice_covers_the_new_library_and_code_buffers_are_not_news(dl_exes):
    """The agent's thread finds new objects in /proc/self/maps (not dl_iterate_phdr,
    whose loader lock program threads take without atomics beside a hidden thread).
    Its own code buffers, memfd mappings, must not count as objects."""
    svc = FakeService(map_wait_ms=300)
    try:
        exe, lib = dl_exes
        client = svc.spawn([exe, lib])
        client.out.expect("ready")
        conn = svc.accept(pid=client.pid)
        conn.code_buffer(near=_mapped_span(client.pid, lib)[0], size=4096)
        assert recv_skipping_advisory(conn, timeout=1.0) is None  # 4 poll ticks: no news
        client.send("close")          # nothing patched in it: no DLCLOSE notice
        client.out.expect("closed 0", timeout=5)
        time.sleep(0.6)               # a poll sees it gone (the same address comes back)
        client.send("open")
        client.out.expect("hot(5)=", timeout=5)
        lo, hi = _mapped_span(client.pid, lib)
        rec = recv_skipping_advisory(conn, timeout=5)
        assert rec is not None and rec.type is P.MsgType.MAP_CHANGED, rec
        mc = rec.msg.body
        assert mc.kind == P.MapKind.DLOPEN and (mc.lo, mc.hi) == (lo, hi)
        rc, rest = client.finish()
        assert rc == 0 and rest[-1] == "ok", client.err.lines
    finally:
        svc.close()


# ---- PC census -------------------------------------------------------------

def test_pc_census_reports_every_thread(svc, storm_exe):
    client, conn, sites = start_storm(svc, storm_exe, "3")
    entries = conn.census(timeout_ms=500)
    tids = {int(t) for t in os.listdir(f"/proc/{client.pid}/task")}
    assert {e.tid for e in entries} == tids
    states = [e.state for e in entries]
    assert states.count(P.CENSUS_AGENT) == 1
    ok = [e for e in entries if e.state == P.CENSUS_OK]
    assert len(ok) == len(tids) - 1  # main + 3 workers answer
    assert all(e.pc != 0 for e in ok)
    rc, _ = client.finish()
    assert rc == 0


# ---- 4: dlclose, fork, service death ----------------------------------------

ADVISORY = (P.MsgType.THREAD_NEW, P.MsgType.THREAD_EXIT)


def recv_skipping_advisory(conn, timeout: float):
    """The next message that is not a thread notice (None on timeout)."""
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        rec = conn.recv(timeout=left)
        if rec is None or rec.type not in ADVISORY:
            return rec
    return None


@pytest.fixture(scope="module")
def dl_exes():
    return compile_c(["dl.c"]), compile_c(["hotlib.c"], shared=True, out_name="libhot")


@pytest.mark.parametrize("service_answers", [True, False], ids=["service-acks", "agent-times-out"])
def test_dlclose_of_patched_library(dl_exes, service_answers):
    svc = FakeService(map_wait_ms=300)
    try:
        exe, lib = dl_exes
        client = svc.spawn([exe, lib])
        hot = int(client.out.expect("hot").split()[1], 16)
        client.out.expect("ready")
        conn = svc.accept(pid=client.pid)
        buf = conn.code_buffer(near=hot, size=4096)
        ps = patch_sites(conn, client.pid, {hot: exit_stub(buf, buf.base, hot)})
        assert conn.patch(ps) == [P.Result.OK]
        client.send("close")
        rec = recv_skipping_advisory(conn, timeout=5)
        assert rec is not None and rec.type is P.MsgType.MAP_CHANGED, rec
        mc = rec.msg.body
        assert mc.kind == P.MapKind.DLCLOSE and mc.lo <= hot < mc.hi
        if service_answers:
            assert conn.unpatch(ps) == [P.Result.OK]
            conn.ack(mc.req_id, P.Result.OK)
        client.out.expect("closed 0", timeout=5)
        # Either way the patch is gone: patching it again is refused as not patched.
        assert conn.unpatch(ps) == [P.Result.E_NOT_PATCHED]
        client.send("open")
        assert client.out.expect("hot(5)=", timeout=5) == "hot(5)=5007"
        rc, rest = client.finish()
        assert rc == 0 and rest[-1] == "ok", client.err.lines
    finally:
        svc.close()


def test_fork_child_keeps_private_code_and_opens_own_session(svc):
    exe = compile_c(["forker.c"])
    client = svc.spawn([exe])
    site = parse_sites(client.out.expect("sites"))[0]
    client.out.expect("ready")
    conn = svc.accept(pid=client.pid)
    buf = conn.code_buffer(near=site, size=4096)
    ps = patch_sites(conn, client.pid, {site: exit_stub(buf, buf.base, site)})
    assert conn.patch(ps) == [P.Result.OK]
    client.send("fork")
    child_pid = int(client.out.expect("child pid").split()[2])
    child_conn = svc.accept(pid=child_pid)
    assert child_conn.hello.flags & P.HELLO_FORKED
    assert child_conn.hello.ppid == client.pid
    # The child inherited the patch.
    assert read_mem(child_pid, site, 5) == jmp_rel32(site, buf.base)
    # Parent: unpatch, wait until no thread is inside the buffer, then wreck the
    # buffer.  The child must not notice: its copy of the code is private.
    assert conn.unpatch(ps) == [P.Result.OK]
    clean, deadline = 0, time.monotonic() + 5
    while clean < 2:
        assert time.monotonic() < deadline, "threads never left the replacement code"
        census = conn.census(timeout_ms=300)
        inside = [e for e in census if e.state == P.CENSUS_NO_REPLY
                  or (e.state == P.CENSUS_OK and buf.contains(e.pc))]
        clean = 0 if inside else clean + 1
    buf.write(buf.base, b"\x0f\x0b" * 32)  # ud2
    assert client.out.expect("child ok", timeout=10)
    assert client.out.expect("child exit") == "child exit 0"
    rc, rest = client.finish()
    assert rc == 0 and rest[-1] == "ok", client.err.lines


KILLED_DRIVER = r"""
import sys, time
sys.path.insert(0, sys.argv[1])
from harness import FakeService, exit_stub, patch_sites
svc = FakeService(runtime_dir=sys.argv[2])
conn = svc.accept(pid=int(sys.argv[3]))
sites = [int(a, 16) for a in sys.argv[4:]]
buf = conn.code_buffer(near=sites[0], size=4096)
ps = patch_sites(conn, int(sys.argv[3]),
                 {s: exit_stub(buf, buf.base + 64 * k, s) for k, s in enumerate(sites)})
print("patched", conn.patch(ps), flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("policy", ["keep", "revert"])
def test_service_killed_mid_session(storm_exe, tmp_path, policy):
    """SIGKILL of the service: the client finishes correctly under both policies."""
    svc = FakeService(listening=False)      # the driver process is the service
    c = svc.spawn([storm_exe, "8"], env={"DBR_ON_DISCONNECT": policy})
    client = c.proc
    rt = svc.runtime_dir
    driver = None
    try:
        sites = parse_sites(c.out.expect("sites"))
        c.out.expect("ready")
        script = tmp_path / "driver.py"
        script.write_text(KILLED_DRIVER)
        driver = subprocess.Popen(
            [sys.executable, str(script), os.path.dirname(os.path.dirname(__file__)), rt,
             str(client.pid),
             *[hex(s) for s in sites[:4]]], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
        line = driver.stdout.readline().decode()
        assert line.startswith("patched [0, 0, 0, 0]"), (line, driver.stderr.read1(4096))
        patched = {s: read_mem(client.pid, s, 5) for s in sites[:4]}
        assert all(b[0] == 0xE9 for b in patched.values())
        time.sleep(0.2)
        driver.send_signal(signal.SIGKILL)
        driver.wait(5)
        deadline = time.monotonic() + 3
        want_original = policy == "revert"
        while time.monotonic() < deadline:
            now = [read_mem(client.pid, s, 6) == SITE_INSN for s in sites[:4]]
            if all(now) == want_original and (want_original or not any(now)):
                break
            time.sleep(0.05)
        for s in sites[:4]:
            if want_original:
                assert read_mem(client.pid, s, SITE_LEN) == SITE_INSN
            else:
                assert read_mem(client.pid, s, 5) == patched[s]
        time.sleep(0.3)  # keep running through the (kept or reverted) sites
        rc, rest = c.finish()
        assert rc == 0, c.err.lines
        assert rest[-1].startswith("ok calls=")
    finally:
        if driver and driver.poll() is None:
            driver.kill()
            driver.wait(5)
        svc.close()


def test_agent_dormant_without_service_then_connects(storm_exe):
    svc = FakeService()
    try:
        svc.stop_listening()
        client = svc.spawn([storm_exe, "2"])
        client.out.expect("ready")
        time.sleep(0.5)  # nobody answers: the agent retries with backoff
        assert client.proc.poll() is None
        svc.start_listening()
        conn = svc.accept(pid=client.pid, timeout=10)
        assert conn.hello.pid == client.pid
        rc, rest = client.finish()
        assert rc == 0
    finally:
        svc.close()


# ---- the process ends when its program threads have ended -------------------

@pytest.fixture(scope="module")
def mainexit_exe():
    return compile_c(["mainexit.c"])


@pytest.mark.parametrize("thread", ["hidden", "pthread"])
@pytest.mark.parametrize("args, session", [
    (("3", "1000"), True), (("3", "300"), False), (("0", "0"), False),
], ids=["workers-outlive-main-in-session", "workers-outlive-main-no-service", "main-alone"])
def test_process_ends_when_its_last_program_thread_ends(mainexit_exe, args, session, thread):
    """main() ends with pthread_exit: glibc exits the process (status 0, atexit handlers
    run) when the last thread ends.  The agent's thread counts as a thread to glibc, so
    the agent must end the process itself; before it did, the process lived on as the
    agent's thread alone, deaf to SIGTERM."""
    native = subprocess.run([str(mainexit_exe), *args], capture_output=True, text=True, timeout=20)
    assert native.returncode == 0 and "atexit ran" in native.stdout
    svc = FakeService()
    try:
        if not session:
            svc.stop_listening()
        client = svc.spawn([mainexit_exe, *args],
                           env={"DBR_AGENT_THREAD": "pthread" if thread == "pthread" else ""})
        client.out.expect("ready")
        if session:
            conn = svc.accept(pid=client.pid)
            assert conn.hello.pid == client.pid
        t0 = time.monotonic()
        rc, rest = client.finish(timeout=10)
        took = time.monotonic() - t0
        assert rc == 0
        assert sorted(["ready", *rest]) == sorted(native.stdout.splitlines())
        assert took < 5.0, f"the process took {took:.1f}s to end after its threads"
    finally:
        svc.close()


# ---- calls the kernel refuses to a multi-threaded process -------------------

@pytest.fixture(scope="module")
def nsalone_exe():
    return compile_c(["nsalone.c"])


@pytest.mark.parametrize("what", ["user", "mnt", "mnt0", "fork-user"])
def test_agent_steps_aside_for_calls_that_need_one_thread(nsalone_exe, what):
    """unshare(CLONE_NEWUSER) and setns into a mount namespace fail with EINVAL in a
    process with another thread: rootless containers, bwrap and `unshare -U` failed
    under the agent.  The agent now ends its session (BYE) and its thread first."""
    _steps_aside(nsalone_exe, what, acked=True)


def test_agent_steps_aside_mid_handshake(nsalone_exe):
    """The call comes while the agent's thread still waits for HELLO_ACK: the service
    has the session (it read HELLO) and must still hear BYE, not a bare EOF.  CI caught
    this as a race: the fake service's HELLO_ACK was sent but not yet read."""
    _steps_aside(nsalone_exe, "user", acked=False)


def _steps_aside(nsalone_exe, what: str, acked: bool) -> None:
    native = subprocess.run([str(nsalone_exe), what], input="go\n", capture_output=True,
                            text=True, timeout=20)
    if native.returncode != 0:
        pytest.skip(f"{what} is refused here even natively: {native.stdout.strip()}")
    svc = FakeService()
    try:
        client = svc.spawn([nsalone_exe, what])
        client.out.expect("ready")
        conn = svc.accept(pid=client.pid, handshake=acked)
        if not acked:
            hello = conn.recv(timeout=5)
            assert hello is not None and hello.type == P.MsgType.HELLO
        client.send("go")
        rc, rest = client.finish(timeout=15)
        assert rc == 0, rest
        assert rest == [f"{what.removeprefix('fork-')}: ok, threads 1"]
        if not what.startswith("fork-"):
            bye = recv_skipping_advisory(conn, timeout=5)
            assert bye is not None and bye.type == P.MsgType.BYE
    finally:
        svc.close()


# ---- 5: bad input ------------------------------------------------------------

def _hdr(msg_type: int, length: int, seq: int = 1, version: int = P.PROTO_VERSION,
         magic: int = P.PROTO_MAGIC) -> bytes:
    return bytes(P.MsgHdr(magic=magic, version=version, type=msg_type, length=length, seq=seq))


def _assert_untouched(client, sites, originals):
    assert client.proc.poll() is None, client.err.lines
    for s in sites:
        assert read_mem(client.pid, s, 8) == originals[s]


def _expect_session_dropped(conn, timeout: float = 3.0) -> P.Message | None:
    """The agent answers a protocol error with ERROR (when it can) and closes."""
    from dbr_service.common.errors import AgentError, ProtocolError
    err = None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            rec = conn.recv(timeout=0.5)
        except (AgentError, ProtocolError):
            return err
        if rec is not None and rec.type is P.MsgType.ERROR:
            err = rec.msg
    raise AssertionError("agent kept the session open after bad input")


BAD_MESSAGES = {
    "truncated": lambda: _hdr(P.MsgType.PATCH, 16)[:10],
    "wrong-magic": lambda: _hdr(P.MsgType.ACK, 24, magic=0xDEADBEEF) + bytes(8),
    "wrong-version": lambda: _hdr(P.MsgType.ACK, 24, version=9) + bytes(8),
    "unknown-type": lambda: _hdr(77, 24) + bytes(8),
    "length-mismatch": lambda: _hdr(P.MsgType.PC_CENSUS_REQ, 40) + bytes(8),
    "oversized": lambda: _hdr(P.MsgType.PATCH, P.MSG_MAX + 64) + bytes(P.MSG_MAX + 48),
    "patch-n-too-big": lambda: _hdr(P.MsgType.PATCH, 24 + 32) + (1).to_bytes(4, "little")
    + (P.MAX_SITES + 1).to_bytes(4, "little") + bytes(32),
    "agent-only-type": lambda: _hdr(P.MsgType.HELLO, 16 + 400) + bytes(400),
    "second-hello-ack": lambda: bytes(P.pack(P.HelloAck(service_pid=1), P.MsgType.HELLO_ACK, 2)),
    "empty": lambda: b"",
}


@pytest.mark.parametrize("name", sorted(BAD_MESSAGES))
def test_malformed_message_closes_session_without_writing(svc, storm_exe, name):
    client, conn, sites = start_storm(svc, storm_exe, "2")
    originals = {s: read_mem(client.pid, s, 8) for s in sites}
    try:
        conn.send_raw(BAD_MESSAGES[name]())
    except Exception:
        if name != "oversized":
            raise
        pytest.skip("the kernel refused to send a datagram that large")
    _expect_session_dropped(conn)
    _assert_untouched(client, sites, originals)
    # The agent goes back to dormant retry and reconnects.
    conn2 = svc.accept(pid=client.pid, timeout=10)
    assert conn2.census(timeout_ms=200)
    rc, _ = client.finish()
    assert rc == 0


def test_bad_patch_requests_are_refused_with_codes(svc, storm_exe):
    client, conn, sites = start_storm(svc, storm_exe, "4")
    originals = {s: read_mem(client.pid, s, 8) for s in sites}
    buf = conn.code_buffer(near=sites[0], size=4096)
    target = exit_stub(buf, buf.base, sites[0])
    stack_addr = next(int(line.split("-")[0], 16) for line in open(f"/proc/{client.pid}/maps")
                      if "[stack]" in line)
    heap_like = next(int(line.split("-")[0], 16) for line in open(f"/proc/{client.pid}/maps")
                     if line.split()[1].startswith("rw"))
    cases = [
        (make_site(stack_addr + 64, target, read_mem(client.pid, stack_addr + 64, 5)),
         P.Result.E_NOT_EXEC),
        (make_site(heap_like, target, read_mem(client.pid, heap_like, 5)), P.Result.E_NOT_EXEC),
        (make_site(sites[1], target, b"\x90" * 5), P.Result.E_MISMATCH),
        (make_site(sites[2], sites[3], read_mem(client.pid, sites[2], 5)), P.Result.E_TARGET),
        (make_site(sites[3], 0x1000, read_mem(client.pid, sites[3], 5)), P.Result.E_TARGET),
        (make_site(sites[4], target, read_mem(client.pid, sites[4], 5), variant=9),
         P.Result.E_INVAL),
        (make_site(buf.base, target, buf.read(buf.base, 5)), P.Result.E_FORBIDDEN),
        (make_site(0, target, bytes(5)), P.Result.E_NOT_EXEC),
    ]
    bad_len = make_site(sites[5], target, read_mem(client.pid, sites[5], 5))
    bad_len.len = 7
    cases.append((bad_len, P.Result.E_INVAL))
    results = conn.patch([c for c, _ in cases])
    assert results == [int(want) for _, want in cases]
    # Unpatch of something never patched.
    assert conn.unpatch([make_site(sites[6], target, originals[sites[6]][:5])]) == \
        [P.Result.E_NOT_PATCHED]
    # Double patch of one site: the second is busy; an overlapping site too.
    good = make_site(sites[7], target, originals[sites[7]][:5])
    again = make_site(sites[7], target, originals[sites[7]][:5])
    assert conn.patch([good]) == [P.Result.OK]
    assert conn.patch([again]) == [P.Result.E_BUSY]
    assert conn.unpatch([good]) == [P.Result.OK]
    # Freeing a buffer with no sites works; an unknown id is refused.
    assert conn.free_buffer(12345) == P.Result.E_UNKNOWN
    _assert_untouched(client, sites, originals)
    rc, _ = client.finish()
    assert rc == 0


def test_free_buffer_in_use_is_refused(svc, storm_exe):
    client, conn, sites = start_storm(svc, storm_exe, "2")
    buf = conn.code_buffer(near=sites[0], size=4096)
    ps = patch_sites(conn, client.pid, {sites[0]: exit_stub(buf, buf.base, sites[0])})
    assert conn.patch(ps) == [P.Result.OK]
    assert conn.free_buffer(buf.buffer_id) == P.Result.E_IN_USE
    assert conn.unpatch(ps) == [P.Result.OK]
    # as the service does before it frees code: no thread may still be inside (a
    # worker preempted in the stub would resume in unmapped memory: CI saw SIGSEGV)
    deadline = time.monotonic() + 10
    while any(e.state == P.CENSUS_OK and buf.base <= e.pc < buf.base + buf.size
              for e in conn.census(timeout_ms=300)):
        assert time.monotonic() < deadline, "a thread stayed in the buffer after unpatch"
    assert conn.free_buffer(buf.buffer_id) == P.Result.OK
    rc, _ = client.finish()
    assert rc == 0


# Hypothesis: random service->agent messages.  Whatever arrives, the agent either
# answers with refusal codes or drops the session; it never writes client memory.
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

SERVICE_TYPES = [P.MsgType.CODE_BUFFER_REQ, P.MsgType.CODE_BUFFER_FREE, P.MsgType.REGION,
                 P.MsgType.REGION_FORGET, P.MsgType.PATCH, P.MsgType.UNPATCH,
                 P.MsgType.PC_CENSUS_REQ, P.MsgType.SAMPLER_STOP, P.MsgType.ACK,
                 P.MsgType.TRANSFER]


@st.composite
def random_messages(draw):
    mtype = draw(st.sampled_from(SERVICE_TYPES + [draw(st.integers(0, 0xFFFF))]))
    body = draw(st.binary(min_size=0, max_size=300))
    length = 16 + len(body)
    if draw(st.booleans()):
        length = draw(st.integers(0, 0xFFFFFFFF))
    version = P.PROTO_VERSION if draw(st.booleans()) else draw(st.integers(0, 0xFFFF))
    return _hdr(int(mtype), length, seq=draw(st.integers(0, 2**32 - 1)), version=version) + body


class _Session:
    conn = None


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(raw=random_messages())
def test_random_messages_never_write_memory(svc_storm, raw):
    svc, client, sites, originals = svc_storm
    from dbr_service.common.errors import AgentError, ProtocolError
    for _ in range(2):  # the agent may have dropped the session after the last example
        if _Session.conn is None or _Session.conn.closed:
            _Session.conn = svc.accept(pid=client.pid, timeout=10)
        conn = _Session.conn
        try:
            conn.send_raw(raw)
            break
        except AgentError:
            conn.close()
    try:
        conn.recv(timeout=0.3)  # a reply, an ERROR, or EOF
    except (AgentError, ProtocolError):
        conn.close()
    _assert_untouched(client, sites, originals)


@pytest.fixture(scope="module")
def svc_storm(storm_exe):
    s = FakeService()
    client = s.spawn([storm_exe, "2"])
    sites = parse_sites(client.out.expect("sites"))
    client.out.expect("ready")
    originals = {x: read_mem(client.pid, x, 8) for x in sites}
    _Session.conn = None
    yield s, client, sites, originals
    rc, _ = client.finish()
    assert rc == 0
    s.close()
