"""TRANSFER: the agent moves threads stopped at listed original PCs into replacement
code (shared/dbr_protocol.h), and refuses requests that could send a thread anywhere
else.  ``spin`` threads loop in three instructions; the replacement copy returns 2
instead of 1, so each thread's result says whether it was moved."""

from __future__ import annotations

import pytest

from dbr_service.wire import protocol as P
from dbr_service.wire.agentconn import AgentConnection
from harness import FakeService, assemble, compile_c

#: The copy of ``spin``'s loop: same instructions and offsets, returns 2.
COPY = "loop: mov rax, qword ptr [rdi]; test rax, rax; je loop; mov eax, 2; ret"
OFFSETS = (0, 3, 6)           # the loop's instructions (spin.c)


@pytest.fixture(scope="module")
def spin_exe():
    return compile_c(["spin.c"])


def start(svc: FakeService, exe, threads: int):
    client = svc.spawn([exe, str(threads)])
    spin = int(client.out.expect("spin").split()[1], 16)
    client.out.expect("ready")
    conn = svc.accept(pid=client.pid)
    buf = conn.code_buffer(near=spin, size=4096)
    code = assemble(COPY, buf.base)
    assert len(code) == 14
    buf.write(buf.base, code)
    return client, conn, spin, buf


def announce(conn: AgentConnection, region_id: int, lo: int, hi: int) -> None:
    assert conn.region(region_id, lo, hi, []) == P.Result.OK


def results(client) -> list[int]:
    rc, rest = client.finish()
    assert rc == 0, (rc, client.err.lines)
    line = next(x for x in rest if x.startswith("results"))
    return [int(v) for v in line.split()[1:]]


@pytest.mark.parametrize("threads", [1, 4])
def test_spinning_threads_are_moved(svc, spin_exe, threads):
    client, conn, spin, buf = start(svc, spin_exe, threads)
    announce(conn, 7, buf.base, buf.base + 64)
    points = {spin + o: buf.base + o for o in OFFSETS}
    moved = most = 0
    for _ in range(20):     # a thread may still be starting (not yet in the loop)
        res = conn.transfer(7, points, timeout_ms=500)
        assert res.result == P.Result.OK
        # running threads are signalled: the spinners, not main (asleep in read()); a
        # spinner still inside pthread's start-up may be asleep on its creator's lock
        assert res.threads <= threads and res.no_reply == 0
        most = max(most, res.threads)
        moved += res.moved
        if moved == threads:
            break
    # a moved thread is in the copy: never moved twice
    assert moved == threads and most == threads
    # a census sees them in the copy, main elsewhere
    pcs = [e.pc for e in conn.census(500) if e.state == P.CENSUS_OK]
    assert sum(buf.base <= pc < buf.base + 8 for pc in pcs) == threads
    assert results(client) == [2] * threads


def test_threads_elsewhere_are_left_alone(svc, spin_exe):
    """Points that no thread is stopped at move nobody (the loop's return path)."""
    client, conn, spin, buf = start(svc, spin_exe, 3)
    announce(conn, 3, buf.base, buf.base + 64)
    res = conn.transfer(3, {spin + 8: buf.base + 8}, timeout_ms=500)
    assert res.result == P.Result.OK and res.moved == 0 and res.threads == 3
    assert results(client) == [1, 1, 1]


def test_bad_transfers_are_refused_and_move_nobody(svc, spin_exe):
    client, conn, spin, buf = start(svc, spin_exe, 2)
    announce(conn, 5, buf.base, buf.base + 64)
    good = {spin + o: buf.base + o for o in OFFSETS}
    stack = next(int(line.split("-")[0], 16)
                 for line in open(f"/proc/{client.pid}/maps").read().splitlines()
                 if line.endswith("[stack]"))
    cases = {
        "unknown region": (9, good, P.Result.E_UNKNOWN),
        "repl outside the region's code": (5, {spin: buf.base + 64}, P.Result.E_TARGET),
        "repl outside every buffer": (5, {spin: spin + 3}, P.Result.E_TARGET),
        "orig inside a code buffer": (5, {buf.base + 32: buf.base}, P.Result.E_FORBIDDEN),
        "orig not executable": (5, {stack: buf.base}, P.Result.E_NOT_EXEC),
    }
    for what, (rid, points, want) in cases.items():
        res = conn.transfer(rid, points, timeout_ms=200)
        assert res.result == want, (what, res.result)
        assert res.moved == 0 and res.threads == 0, what
    # unsorted points: built by hand (conn.transfer sorts)
    items = [P.TransferPoint(orig=spin + 3, repl=buf.base + 3),
             P.TransferPoint(orig=spin, repl=buf.base)]
    rec = conn.request(P.MsgType.TRANSFER, P.Transfer(req_id=conn.next_id(), region_id=5,
                                                      timeout_ms=200), items=items)
    assert rec.msg.body.result == P.Result.E_INVAL and rec.msg.body.moved == 0
    # a forgotten region cannot be transferred into
    assert conn.region_forget(5) == P.Result.OK
    assert conn.transfer(5, good).result == P.Result.E_UNKNOWN
    assert results(client) == [1, 1]


def test_malformed_transfer_length_closes_the_session(svc, spin_exe):
    client, conn, spin, buf = start(svc, spin_exe, 1)
    body = P.Transfer(req_id=1, region_id=1, n=3, timeout_ms=10)
    body.hdr = P.make_hdr(P.MsgType.TRANSFER, 32 + 16, 99)  # says 3 points, carries 1
    conn.sock.send(bytes(body) + bytes(P.TransferPoint(orig=spin, repl=buf.base)))
    seen = []
    for _ in range(20):                 # thread notices may come first
        m = conn.recv(3.0)
        if m is None:
            break
        seen.append(m.type)
        if m.type is P.MsgType.ERROR:
            break
    assert P.MsgType.ERROR in seen
    assert results(client) == [1]       # nobody moved, the program unharmed


# ---- the service side: Installer, evaluation, the original-code check ---------------

from dbr_service.common.errors import CodegenError  # noqa: E402
from dbr_service.installation.install import CodeSpace, InstallState, Installer  # noqa: E402
from dbr_service.installation.optimize import EvalPolicy, Evaluator, check_original  # noqa: E402
from harness import FakeGen, read_mem  # noqa: E402


def transfer_only_region(svc, exe, threads: int, *, offsets=OFFSETS, transfer=True):
    client = svc.spawn([exe, str(threads)])
    spin = int(client.out.expect("spin").split()[1], 16)
    client.out.expect("ready")
    conn = svc.accept(pid=client.pid)
    inst = Installer(conn, lambda a, n: read_mem(client.pid, a, n),
                     space=CodeSpace(conn, buffer_size=65536), transfer=transfer)
    chunk = inst.reserve(64, reach=[spin])
    # a region without patch sites whose code is the copy of ``spin``'s loop
    gen = FakeGen(assemble(COPY, chunk.addr), chunk.addr, {},
                  addr_map=[(chunk.addr, chunk.addr + 14, spin)],
                  transfers={spin + o: chunk.addr + o for o in offsets})
    return client, inst, chunk, gen, spin


def test_installer_transfer_only_region_goes_live_by_moving_threads(svc, spin_exe):
    client, inst, chunk, gen, _ = transfer_only_region(svc, spin_exe, 2)
    reg = inst.install(chunk, gen, name="t")
    assert reg.state is InstallState.INSTALLED and inst.patches_installed == 0
    assert 1 <= reg.transferred <= 2 and inst.threads_transferred == reg.transferred
    for _ in range(20):                       # a thread still starting: moved later
        if reg.transferred == 2:
            break
        inst.transfer(reg)
    assert reg.transferred == 2 and inst.first_patch_at is not None
    assert results(client) == [2, 2]


def test_installer_transfer_only_region_fails_when_nobody_is_inside(svc, spin_exe):
    client, inst, chunk, gen, _ = transfer_only_region(svc, spin_exe, 2, offsets=(8,))
    reg = inst.install(chunk, gen)
    assert reg.state is InstallState.FAILED and "no thread" in reg.why_removed
    assert inst.space.quarantine                  # its space awaits reuse
    assert results(client) == [1, 1]


def test_installer_with_transfer_disabled_moves_nobody(svc, spin_exe):
    client, inst, chunk, gen, _ = transfer_only_region(svc, spin_exe, 2, transfer=False)
    reg = inst.install(chunk, gen)
    assert reg.state is InstallState.FAILED and inst.threads_transferred == 0
    assert results(client) == [1, 1]


def test_evaluator_restarts_are_bounded():
    class Reg:
        region_id, state, installed_at, kept = 1, InstallState.INSTALLED, 0.0, False
        orig_ranges = [(0x1000, 0x1100)]

        def contains_code(self, ip):
            return 0x9000 <= ip < 0x9100

    class Inst:
        regions = {1: Reg()}

    ev = Evaluator(Inst(), EvalPolicy(grace_s=0, min_samples=10, max_restarts=2))
    for k in range(4):
        ev.snapshot({0x1010: 40, 0x9010: 10})       # 80% in original code
        restarted = ev.restart(1)
        assert restarted == (k < 2)
        verdicts = ev.verdicts(now=10.0)
        assert bool(verdicts) == (k >= 2), k        # judged once restarts are used up


def test_check_original_refuses_changed_code(svc, spin_exe):
    from region_graphs import Builder, T

    client, inst, chunk, gen, spin = transfer_only_region(svc, spin_exe, 1)
    b = Builder()
    b.block(spin, (3, 3, 2), T.JCC, targets=[spin], ft=spin + 8)
    bb = b.sr.block(spin)
    bb.data = read_mem(client.pid, spin, 8)
    check_original(inst, b.sr)                               # unchanged: fine
    bb.data = bytes([bb.data[0] ^ 1]) + bb.data[1:]
    with pytest.raises(CodegenError, match="changed since"):
        check_original(inst, b.sr)

    class Patched:                  # a live region of ours with a patch over that byte
        state = InstallState.INSTALLED
        patched_sites = [P.PatchSite(site=spin - 2)]

    inst.live = ((0, 0, Patched()),)   # the installer's snapshot of its live regions
    check_original(inst, b.sr)      # our own patch bytes are not the program's change
    bb.data = bb.data[:6] + bytes([bb.data[6] ^ 1]) + bb.data[7:]
    with pytest.raises(CodegenError, match="changed since"):
        check_original(inst, b.sr)  # ... but a byte past the patch is
    inst.live = ()
    assert results(client) == [1]


def test_sleeping_threads_are_not_signalled(svc, spin_exe):
    """A transfer must not cut short a sleep that is never restarted: only running
    threads get the signal (main sits in read(); its read is not interrupted)."""
    client, conn, spin, buf = start(svc, spin_exe, 1)
    announce(conn, 4, buf.base, buf.base + 64)
    for _ in range(5):
        res = conn.transfer(4, {spin + 8: buf.base + 8}, timeout_ms=200)
        assert res.result == P.Result.OK and res.threads == 1     # the spinner only
    assert results(client) == [1]


@pytest.mark.parametrize("rounds", [200, pytest.param(5000, marks=pytest.mark.long)],
                         ids=["200", "soak-5000"])
def test_hurried_transfers_with_late_handlers(svc, spin_exe, rounds):
    """Stress of the late-handler path: 64 spinners on 2 cores and a 1 ms bound, so
    most threads answer after the agent closed each transfer and their handlers run
    while the next table is prepared (the agent waits for them, or says E_BUSY).
    Nobody may be moved by a table whose points it was not stopped at, the agent
    must neither deadlock nor drop the session, and a transfer afterwards must move
    every spinner into the copy it names."""
    client, conn, spin, buf = start(svc, spin_exe, 64)
    announce(conn, 8, buf.base, buf.base + 64)
    # a second copy of the loop returning 3, for the "wrong table" half of the storm
    other = buf.base + 32
    buf.write(other, assemble(COPY.replace("mov eax, 2", "mov eax, 3"), other))
    # points no thread sits at (the return path), alternating between the copies; then
    # the real one, into the copy returning 3
    _hurried(conn.transfer, rounds,
             lambda k: {spin + 8: (buf.base if k % 2 else other) + 8},
             {spin + o: other + o for o in OFFSETS}, 64)
    assert results(client) == [3] * 64


def _hurried(move, rounds: int, idle, real: dict[int, int], threads: int) -> None:
    """``rounds`` TRANSFERs or EVICTs (``move``) with a 1 ms bound by ``idle(k)``, points
    no thread sits at: none may move a thread, and some handler must come late.  Then
    ``real`` until all ``threads`` have moved."""
    late = 0
    for k in range(rounds):
        res = move(8, idle(k), timeout_ms=1)
        assert res.result in (P.Result.OK, P.Result.E_BUSY), res.result
        assert res.moved == 0
        late += res.no_reply
    assert late > 0, "no late handler was provoked"
    moved = 0
    for _ in range(50):
        res = move(8, real, timeout_ms=500)
        assert res.result in (P.Result.OK, P.Result.E_BUSY)
        moved += res.moved
        if moved == threads:
            break
    assert moved == threads


# ---- EVICT: the other way, threads in replacement code back to original code -------

from dbr_service.wire.agentconn import make_site  # noqa: E402


def _all_in(conn, region_id: int, points: dict[int, int], threads: int) -> None:
    """TRANSFER until every spinner runs the copy."""
    moved = 0
    for _ in range(40):     # a thread may still be starting (not yet in the loop)
        res = conn.transfer(region_id, points, timeout_ms=500)
        assert res.result == P.Result.OK and res.left == 0
        moved += res.moved
        if moved == threads:
            return
    raise AssertionError(f"only {moved} of {threads} spinners moved in")


@pytest.mark.parametrize("threads", [1, 4])
def test_spinning_threads_are_evicted(svc, spin_exe, threads):
    """Spinners moved into the copy (which would return 2) and moved back by EVICT
    run the original loop (return 1): each point is the copy's instruction and the
    original it stands for."""
    client, conn, spin, buf = start(svc, spin_exe, threads)
    assert client is not None and conn.hello.flags & P.HELLO_EVICT
    announce(conn, 7, buf.base, buf.base + 64)
    _all_in(conn, 7, {spin + o: buf.base + o for o in OFFSETS}, threads)
    res = conn.evict(7, {buf.base + o: spin + o for o in OFFSETS}, timeout_ms=500)
    assert res.result == P.Result.OK
    assert (res.threads, res.moved, res.left, res.no_reply) == (threads, threads, 0, 0)
    pcs = [e.pc for e in conn.census(500) if e.state == P.CENSUS_OK]
    assert not any(buf.base <= pc < buf.base + 64 for pc in pcs)
    assert sum(spin <= pc < spin + 8 for pc in pcs) == threads
    assert results(client) == [1] * threads


def test_threads_at_no_eviction_point_are_counted_as_left(svc, spin_exe):
    """Spinners in the copy but at none of the points stay there and are counted in
    ``left``; a spinner in original code is neither moved nor left."""
    client, conn, spin, buf = start(svc, spin_exe, 3)
    announce(conn, 6, buf.base, buf.base + 64)
    _all_in(conn, 6, {spin + o: buf.base + o for o in OFFSETS}, 3)
    res = conn.evict(6, {buf.base + 8: spin + 8}, timeout_ms=500)   # the return path
    assert res.result == P.Result.OK and (res.moved, res.left) == (0, 3)
    # the same, for spinners in original code: not inside the region at all
    client2, conn2, spin2, buf2 = start(svc, spin_exe, 2)
    announce(conn2, 2, buf2.base, buf2.base + 64)
    res = conn2.evict(2, {buf2.base + o: spin2 + o for o in OFFSETS}, timeout_ms=500)
    assert res.result == P.Result.OK and (res.moved, res.left, res.threads) == (0, 0, 2)
    assert results(client) == [2, 2, 2] and results(client2) == [1, 1]


def test_bad_evictions_are_refused_and_move_nobody(svc, spin_exe):
    client, conn, spin, buf = start(svc, spin_exe, 2)
    announce(conn, 5, buf.base, buf.base + 64)
    _all_in(conn, 5, {spin + o: buf.base + o for o in OFFSETS}, 2)
    good = {buf.base + o: spin + o for o in OFFSETS}
    stack = next(int(line.split("-")[0], 16)
                 for line in open(f"/proc/{client.pid}/maps").read().splitlines()
                 if line.endswith("[stack]"))
    # a live patch over `mov eax, 1` (spin+8, 5 bytes) into the copy's return path
    site = make_site(spin + 8, buf.base + 8, read_mem(client.pid, spin + 8, 5), region_id=5)
    assert conn.patch([site]) == [P.Result.OK]
    cases = {
        "unknown region": (9, good, P.Result.E_UNKNOWN),
        "repl outside the region's code": (5, {buf.base + 64: spin}, P.Result.E_TARGET),
        "repl outside every buffer": (5, {spin + 3: spin}, P.Result.E_TARGET),
        "orig inside a code buffer": (5, {buf.base: buf.base + 32}, P.Result.E_FORBIDDEN),
        "orig not executable": (5, {buf.base: stack}, P.Result.E_NOT_EXEC),
        "orig inside a patched site": (5, {buf.base + 8: spin + 9}, P.Result.E_FORBIDDEN),
    }
    for what, (rid, points, want) in cases.items():
        res = conn.evict(rid, points, timeout_ms=200)
        assert res.result == want, (what, res.result)
        assert res.moved == 0 and res.threads == 0, what
    # the site's own start is a fine place to go: its jmp leads back into the copy
    assert conn.evict(5, {buf.base + 8: spin + 8}, timeout_ms=200).result == P.Result.OK
    # points not sorted by their replacement address: built by hand (conn.evict sorts)
    items = [P.TransferPoint(orig=spin + 3, repl=buf.base + 3),
             P.TransferPoint(orig=spin, repl=buf.base)]
    rec = conn.request(P.MsgType.EVICT, P.Transfer(req_id=conn.next_id(), region_id=5,
                                                   timeout_ms=200), items=items)
    assert rec.msg.body.result == P.Result.E_INVAL and rec.msg.body.moved == 0
    assert conn.unpatch([site]) == [P.Result.OK]
    # a forgotten region: nobody is moved out of it
    assert conn.region_forget(5) == P.Result.OK
    assert conn.evict(5, good).result == P.Result.E_UNKNOWN
    assert results(client) == [2, 2]


def test_installer_suspend_evicts_and_resume_transfers(svc, spin_exe):
    """A transfer-only region through the speed check's steps: suspend moves the
    spinners out (they would finish in original code), resume moves them in again,
    uninstall with evict moves them out for good."""
    client, inst, chunk, gen, spin = transfer_only_region(svc, spin_exe, 2)
    gen.evictions = {b: a for a, b in gen.transfers.items()}
    inst.evict_enabled = True
    reg = inst.install(chunk, gen, name="t")
    assert reg.state is InstallState.INSTALLED
    while reg.transferred < 2:
        assert inst.transfer(reg) >= 0
    for k in range(3):
        inst.suspend(reg.region_id)
        assert reg.state is InstallState.SUSPENDED and reg.evicted == 2 * (k + 1)
        inst.resume(reg.region_id)
        assert reg.state is InstallState.INSTALLED and reg.transferred == 2 * (k + 2)
    inst.uninstall(reg.region_id, "test", evict=True)
    assert reg.state is InstallState.REMOVED and inst.threads_evicted == 8
    assert results(client) == [1, 1]


def test_installer_without_evict_leaves_threads_inside(svc, spin_exe):
    """An agent that does not offer EVICT is never sent one: suspend leaves threads in
    the copy, as before."""
    client, inst, chunk, gen, spin = transfer_only_region(svc, spin_exe, 1)
    gen.evictions = {b: a for a, b in gen.transfers.items()}
    assert inst.evict_enabled is False
    reg = inst.install(chunk, gen, name="t")
    while reg.transferred < 1:
        inst.transfer(reg)
    inst.suspend(reg.region_id)
    assert reg.evicted == 0
    inst.uninstall(reg.region_id, "test", evict=True)
    assert inst.threads_evicted == 0
    assert results(client) == [2]


def test_hurried_evictions_with_late_handlers(svc, spin_exe):
    """The late-handler stress of TRANSFER, for EVICT: 64 spinners in the copy, 200
    evictions with a 1 ms bound naming only the copy's return path (nobody sits
    there), so most handlers run after their eviction closed.  Nobody may be moved by
    them, the agent must neither deadlock nor drop the session, and an eviction by the
    loop's points afterwards moves every spinner back to the original loop."""
    client, conn, spin, buf = start(svc, spin_exe, 64)
    announce(conn, 8, buf.base, buf.base + 64)
    _all_in(conn, 8, {spin + o: buf.base + o for o in OFFSETS}, 64)
    _hurried(conn.evict, 200, lambda _k: {buf.base + 8: spin + 8},
             {buf.base + o: spin + o for o in OFFSETS}, 64)
    assert results(client) == [1] * 64
