"""The latency probe's code (dbr_service/codegen/probes_latency.py) run in unicorn: a
recursive function whose start runs the entry handler, and a function that leaves by
a longjmp-like stack switch.  Checks counts per depth, that every register the
handler and the stub promise to keep is kept, that the real return addresses are
used, that abandoned entries are dropped, and the misses past DEPTH."""

from __future__ import annotations

import struct

import pytest
from codegen_util import asm

from dbr_service.codegen import probes_latency as L

unicorn = pytest.importorskip("unicorn", reason="unicorn is a test dependency")
from unicorn import x86_const as U  # noqa: E402

CODE, DATA, STACK, TCB = 0x100000, 0x300000, 0x500000, 0x700000
F = CODE + 0x1000            # the probed function
MAIN = CODE
EXIT = CODE + 0x3000


def _machine(body: str, main: str) -> tuple[unicorn.Uc, int]:
    """``F`` = the entry handler then ``body``; the exit stub at EXIT; ``main`` at MAIN
    ending in ``hlt``-free ``jmp`` to its own end (the run stops there)."""
    mu = unicorn.Uc(unicorn.UC_ARCH_X86, unicorn.UC_MODE_64)
    mu.mem_map(CODE, 0x10000)
    mu.mem_map(DATA, 0x20000)
    mu.mem_map(STACK, 0x10000)
    mu.mem_map(TCB, 0x1000)
    mu.mem_write(DATA, L.initial_data())
    head = L.entry_handler(F, DATA, EXIT)
    mu.mem_write(F, head + asm(body, F + len(head)))
    mu.mem_write(EXIT, L.exit_stub(EXIT, DATA))
    code = asm(main, MAIN)
    mu.mem_write(MAIN, code)
    mu.mem_write(TCB + 0x10, struct.pack("<Q", TCB))
    mu.reg_write(U.UC_X86_REG_FS_BASE, TCB)
    mu.reg_write(U.UC_X86_REG_RSP, STACK + 0x8000)
    return mu, MAIN + len(code)


def _data(mu) -> tuple[int, ...]:
    return struct.unpack("<4Q", bytes(mu.mem_read(DATA, 32)))


def _slot(mu) -> tuple[int, int]:
    """(owner, depth) of every slot that is not free, summed: the thread's."""
    out = []
    for i in range(L.NSLOTS):
        owner, depth = struct.unpack("<2Q", bytes(mu.mem_read(DATA + L.SLOTS + i * L.SLOT, 16)))
        if owner or depth:
            out.append((owner, depth))
    return out


RECURSE = f"""
    push rbx
    mov rbx, rdi
    add r12, 1
    dec rdi
    jz leaf
    call {F:#x}
    leaf:
    mov rax, rbx
    pop rbx
    ret
"""


def test_recursion_counts_every_depth_and_keeps_registers() -> None:
    main = f"""
        mov rdi, 10; xor r12, r12
        mov r13, 0x1111; mov r14, 0x2222; mov r15, 0x3333; mov rbp, 0x4444
        mov rcx, 0x5555; mov rsi, 0x6666; mov r8, 0x7777; mov r11, 0x8888; mov r10, 0x9999
        call {F:#x}
        mov r9, rsp
    """
    mu, end = _machine(RECURSE, main)
    sp = mu.reg_read(U.UC_X86_REG_RSP)
    mu.emu_start(MAIN, end, count=100000)
    count, total, miss_slot, miss_deep = _data(mu)
    assert (count, miss_slot, miss_deep) == (10, 0, 0)
    assert mu.reg_read(U.UC_X86_REG_R12) == 10              # every level ran
    assert mu.reg_read(U.UC_X86_REG_RAX) == 10              # the outermost's result
    assert mu.reg_read(U.UC_X86_REG_R9) == sp               # stack balanced
    for reg, want in ((U.UC_X86_REG_R13, 0x1111), (U.UC_X86_REG_R14, 0x2222),
                      (U.UC_X86_REG_R15, 0x3333), (U.UC_X86_REG_RBP, 0x4444),
                      (U.UC_X86_REG_R10, 0x9999), (U.UC_X86_REG_RCX, 0x5555),
                      (U.UC_X86_REG_RSI, 0x6666), (U.UC_X86_REG_R8, 0x7777),
                      (U.UC_X86_REG_R11, 0x8888)):
        assert mu.reg_read(reg) == want
    assert _slot(mu) == []                                  # slot given back at depth 0
    hist = struct.unpack(f"<{L.BUCKETS}Q", bytes(mu.mem_read(DATA + L.HIST, 8 * L.BUCKETS)))
    assert sum(hist) == 10
    # the entry handler keeps everything it touches for the body
    mu2, end2 = _machine("mov r9, rcx; mov r10, rsi; mov r13, r11; ret",
                         f"mov rcx, 0x5555; mov rsi, 0x6666; mov r11, 0x8888; call {F:#x}")
    mu2.emu_start(MAIN, end2, count=10000)
    assert [mu2.reg_read(r) for r in (U.UC_X86_REG_R9, U.UC_X86_REG_R10, U.UC_X86_REG_R13)] \
        == [0x5555, 0x6666, 0x8888]
    assert _data(mu2)[0] == 1


def test_deeper_than_depth_is_a_miss_and_returns_normally() -> None:
    n = L.DEPTH + 6
    mu, end = _machine(RECURSE, f"mov rdi, {n}; xor r12, r12; call {F:#x}")
    mu.emu_start(MAIN, end, count=200000)
    count, _total, miss_slot, miss_deep = _data(mu)
    assert (count, miss_slot, miss_deep) == (L.DEPTH, 0, 6)
    assert mu.reg_read(U.UC_X86_REG_RAX) == n
    assert _slot(mu) == []


def test_longjmp_out_of_a_recursion_is_cleaned_by_the_next_return() -> None:
    """F recurses 3 deep and the innermost jumps back to main with main's rsp (a
    longjmp): three entries are abandoned and nothing is counted.  main's next call
    of F returns normally: its exit drops the abandoned entries below its own (their
    return slots are not above its own), so the slot is free again."""
    body = f"""
        test rsi, rsi
        jz normal
        dec rdi
        jz jump
        call {F:#x}
        ret
    jump:
        mov rsp, r15
        jmp r14
    normal:
        mov rax, 77
        ret
    """
    main = f"""
        sub rsp, 64
        mov r15, rsp
        lea r14, [rip + back]
        mov rdi, 3
        mov esi, 1
        call {F:#x}
    back:
        xor esi, esi
        call {F:#x}
        add rsp, 64
        mov rbx, rsp
    """
    mu, end = _machine(body, main)
    sp = mu.reg_read(U.UC_X86_REG_RSP)
    mu.emu_start(MAIN, end, count=100000)
    assert _data(mu)[0] == 1                   # only the call that returned
    assert mu.reg_read(U.UC_X86_REG_RAX) == 77
    assert mu.reg_read(U.UC_X86_REG_RBX) == sp
    assert _slot(mu) == []


def test_exit_drops_entries_abandoned_above_its_own() -> None:
    """An entry abandoned by a longjmp from a deeper call (below the current frame)
    is dropped when the frame that called it returns: depth back to 0."""
    body = f"""
        test rdi, rdi
        jz inner_jump
        mov r15, rsp
        lea r14, [rip + resume]
        xor edi, edi
        call {F:#x}
    resume:
        ret
    inner_jump:
        mov rsp, r15
        jmp r14
    """
    mu, end = _machine(body, f"mov rdi, 1; call {F:#x}; mov rbx, rsp")
    sp = mu.reg_read(U.UC_X86_REG_RSP)
    mu.emu_start(MAIN, end, count=100000)
    count, *_ = _data(mu)
    assert count == 1                         # the outer call returned through the stub
    assert mu.reg_read(U.UC_X86_REG_RBX) == sp
    assert _slot(mu) == []                    # the inner, abandoned entry went with it


def test_read_latency_quantiles() -> None:
    data = bytearray(L.SLOTS)
    struct.pack_into("<4Q", data, 0, 100, 100 * 3000, 2, 1)
    struct.pack_into("<Q", data, L.HIST + 8 * 11, 90)      # [2048, 4096) ticks
    struct.pack_into("<Q", data, L.HIST + 8 * 13, 10)      # [8192, 16384)
    r = L.read_latency(bytes(data), 2.0)
    assert (r["count"], r["mean_ns"], r["misses_no_slot"], r["misses_too_deep"]) == \
        (100, 1500, 2, 1)
    assert r["p50_ns"] == 2048 and r["p90_ns"] == 2048 and r["p99_ns"] == 8192
    assert r["buckets"] == [[1024, 2048, 90], [4096, 8192, 10]]


def test_signal_handler_between_reserve_and_write() -> None:
    """A signal handler that calls F while F's entry handler has reserved its entry
    (the xadd) and not written it yet: the handler's call pushes above it, returns
    through the stub and leaves the reserved entry alone; both calls are measured and
    return to their callers."""
    handler_at = CODE + 0x5000
    # the first call runs deeper: its entry, once dropped, lies below the handler's
    mu, end = _machine("mov rax, 41; ret", f"sub rsp, 2048; call {F:#x}; add rsp, 2048; "
                                           f"call {F:#x}; mov rbx, rax")
    code = bytes(mu.mem_read(F, 0x200))
    import capstone
    md = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    after_xadd = next(i.address + i.size for i in md.disasm(code, F) if i.mnemonic == "xadd")
    hcode = asm(f"call {F:#x}; mov r12, rax; nop", handler_at)
    mu.mem_write(handler_at, hcode)
    hits = []

    def stop_second(uc, *_):
        hits.append(1)
        if len(hits) == 2:
            uc.emu_stop()
    hook = mu.hook_add(unicorn.UC_HOOK_CODE, stop_second, begin=after_xadd, end=after_xadd)
    mu.emu_start(MAIN, end, count=20000)                 # up to the second call's xadd
    assert _data(mu)[0] == 1
    mu.hook_del(hook)
    assert mu.reg_read(U.UC_X86_REG_RIP) == after_xadd
    assert _slot(mu)[0][1] == 1                          # reserved
    ctx = mu.context_save()
    mu.reg_write(U.UC_X86_REG_RSP, mu.reg_read(U.UC_X86_REG_RSP) - 1024)
    mu.emu_start(handler_at, handler_at + len(hcode) - 1, count=10000)
    assert mu.reg_read(U.UC_X86_REG_R12) == 41 and _data(mu)[0] == 2
    assert _slot(mu)[0][1] == 1                          # the reserved entry is kept
    mu.context_restore(ctx)
    mu.emu_start(after_xadd, end, count=10000)
    assert _data(mu)[0] == 3 and mu.reg_read(U.UC_X86_REG_RBX) == 41
    assert _slot(mu) == []
