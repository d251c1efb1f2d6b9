"""The latency probe kind (docs/decisions/0040-probes.md, "Latency"): at a function's
entry the handler records the time (``rdtsc``) and replaces the return address on the
stack with the probe's exit stub; the function returns into the stub, which adds the
elapsed ticks to a log2 histogram and returns to the real caller.

Data buffer layout (little-endian u64 words, offsets from the buffer's base):

* ``COUNT`` calls measured, ``SUM`` their ticks, ``MISS_SLOT`` entries that found no
  thread slot, ``MISS_DEPTH`` entries deeper than ``DEPTH`` in their thread;
* ``HIST``: 64 buckets, bucket b counts elapsed ticks t with ``floor(log2 t) == b``
  (t = 0 goes to bucket 0);
* ``SLOTS``: ``NSLOTS`` thread slots of ``SLOT`` bytes: ``owner`` (the thread's TCB
  self pointer, ``%fs:0x10`` on glibc x86-64; 0 when free), ``depth``, then ``DEPTH``
  shadow-stack entries of ``ENTRY`` bytes: ``saved`` (the entry's rsp, where the
  return address is), ``ret`` (the real return address), ``tsc``.

A thread finds its slot from a multiplicative hash of its TCB pointer, probing
``PROBE`` slots; it claims a free one with ``lock cmpxchg`` and gives it back when its
depth returns to 0.  Only the owner writes a slot's depth and entries, and each step
is one instruction (``xadd`` reserves an entry before it is written), so a signal
handler that enters the function in between pushes above and pops its own entry.
The exit stub looks for the topmost entry whose ``saved`` is its own return slot
(rsp - 8) and drops it, every entry above it, and the run of entries right below it
whose ``saved`` is not above its own: on one stack those are frames a ``longjmp``, an
exception or a signal handler's ``siglongjmp`` abandoned (a live caller's return slot
is above the callee's).  Dropped entries get ``saved`` = FREE before the depth is
lowered, so an entry reserved and not yet written (a signal handler runs between the
``xadd`` and the stores) is neither matched nor trimmed by the handler's own exit.  An
entry that finds no slot or no room records nothing and leaves the return address
alone (counted as a miss).
"""

from __future__ import annotations

import struct
from typing import Any

from dbr_service.codegen.counting import Trampoline, relocate_site
from dbr_service.codegen.relocate import Relocator
from dbr_service.common.errors import CodegenError

COUNT, SUM, MISS_SLOT, MISS_DEPTH = 0, 8, 16, 24
HIST = 64
BUCKETS = 64
SLOTS = 1024
NSLOTS = 64
PROBE = 8
DEPTH = 24
ENTRY = 32
SLOT_HEAD = 64
SLOT = SLOT_HEAD + DEPTH * ENTRY
DATA_BYTES = SLOTS + NSLOTS * SLOT
#: A 32-bit odd multiplier for the slot hash (2**32 / golden ratio, as a positive imm32).
_HASH = 0x61C88647
_SHIFT = 64 - (NSLOTS.bit_length() - 1)
#: Bytes the entry handler keeps between rsp and the function's return slot.
_ENTRY_FRAME = 128 + 7 * 8
#: Bytes the exit stub keeps between rsp and the return slot it refills.
_EXIT_FRAME = 9 * 8
#: ``saved`` of an entry no frame holds: never matched, never trimmed.
FREE = (1 << 64) - 1

_ks = None


def _asm(text: str, at: int) -> bytes:
    global _ks
    import keystone
    if _ks is None:
        _ks = keystone.Ks(keystone.KS_ARCH_X86, keystone.KS_MODE_64)
    try:
        enc, _n = _ks.asm(text, at)
    except keystone.KsError as exc:        # pragma: no cover - fixed text
        raise CodegenError(f"latency probe code does not assemble: {exc}") from None
    return bytes(enc)


#: ``mov rcx, qword ptr fs:[0x10]`` (keystone encodes fs:[disp32] as rip-relative).
_TCB_RCX = ".byte 0x64, 0x48, 0x8b, 0x0c, 0x25, 0x10, 0x00, 0x00, 0x00"


def _hash(dst: str, key: str) -> str:
    return f"mov {dst}, {key}; imul {dst}, {dst}, {_HASH:#x}; shr {dst}, {_SHIFT};"


def entry_handler(at: int, data: int, exit_stub: int) -> bytes:
    """The entry handler at ``at`` (a function's start: ``[rsp]`` is the return
    address) for the data buffer at ``data`` and the exit stub at ``exit_stub``; every
    register and flag is as before when it ends."""
    slots = data + SLOTS
    text = f"""
        lea rsp, [rsp - 128]; pushfq
        push rax; push rcx; push rdx; push rsi; push rdi; push r11
        rdtsc; shl rdx, 32; or rax, rdx; mov rsi, rax
        {_TCB_RCX}
        movabs r11, {slots:#x}
        {_hash("rax", "rcx")}
        mov edi, {PROBE}
    find:
        imul rdx, rax, {SLOT}
        cmp qword ptr [r11 + rdx], rcx
        je have
        inc eax; and eax, {NSLOTS - 1}
        dec edi; jnz find
        {_hash("rax", "rcx")}
        mov edi, {PROBE}
    claim:
        imul rdx, rax, {SLOT}
        cmp qword ptr [r11 + rdx], 0
        jne next
        push rax; xor eax, eax
        lock cmpxchg qword ptr [r11 + rdx], rcx
        pop rax
        jne next
        mov qword ptr [r11 + rdx + 8], 0
        jmp have
    next:
        inc eax; and eax, {NSLOTS - 1}
        dec edi; jnz claim
        movabs rax, {data + MISS_SLOT:#x}
        lock inc qword ptr [rax]
        jmp done
    have:
        lea rdx, [r11 + rdx]
        mov eax, 1
        xadd qword ptr [rdx + 8], rax
        cmp rax, {DEPTH}
        jb room
        dec qword ptr [rdx + 8]
        movabs rax, {data + MISS_DEPTH:#x}
        lock inc qword ptr [rax]
        jmp done
    room:
        shl rax, {ENTRY.bit_length() - 1}
        lea rdx, [rdx + rax + {SLOT_HEAD}]
        lea rax, [rsp + {_ENTRY_FRAME}]
        mov qword ptr [rdx], rax
        mov rdi, qword ptr [rax]
        mov qword ptr [rdx + 8], rdi
        mov qword ptr [rdx + 16], rsi
        movabs rdi, {exit_stub:#x}
        mov qword ptr [rax], rdi
    done:
        pop r11; pop rdi; pop rsi; pop rdx; pop rcx; pop rax
        popfq; lea rsp, [rsp + 128]
    """
    return _asm(text, at)


def exit_stub(at: int, data: int) -> bytes:
    """The exit stub at ``at``, entered by the probed function's ``ret`` (rsp is the
    entry's rsp + 8; rax, rdx, the vector and x87 registers hold the results and are
    kept, as are the flags).  It ends with ``ret`` to the real caller.  ``ud2`` if no
    entry of this thread matches (the thread switched stacks inside the function:
    not supported, docs/decisions/0040-probes.md)."""
    slots = data + SLOTS
    text = f"""
        push rax; pushfq
        push rax; push rcx; push rdx; push rsi; push rdi; push r8; push r9; push r11
        rdtsc; shl rdx, 32; or rax, rdx; mov rsi, rax
        {_TCB_RCX}
        movabs r11, {slots:#x}
        lea r8, [rsp + {_EXIT_FRAME}]
        {_hash("rax", "rcx")}
        mov edi, {PROBE}
    look:
        imul rdx, rax, {SLOT}
        cmp qword ptr [r11 + rdx], rcx
        jne other
        push rax
        mov rax, qword ptr [r11 + rdx + 8]
        cmp rax, {DEPTH}
        jbe top
        mov eax, {DEPTH}
    top:
        mov r9, rax
    scan:
        test rax, rax
        jz none
        dec rax
        mov rcx, rax
        shl rcx, {ENTRY.bit_length() - 1}
        add rcx, rdx
        cmp qword ptr [r11 + rcx + {SLOT_HEAD}], r8
        jne scan
        lea rcx, [r11 + rcx + {SLOT_HEAD}]
        mov rdi, qword ptr [rcx + 8]
        mov qword ptr [r8], rdi
        sub rsi, qword ptr [rcx + 16]
    trim:
        test rax, rax
        jz trimmed
        lea rcx, [rax - 1]
        shl rcx, {ENTRY.bit_length() - 1}
        add rcx, rdx
        cmp qword ptr [r11 + rcx + {SLOT_HEAD}], r8
        ja trimmed
        dec rax
        jmp trim
    trimmed:
        mov rdi, rax
    clear:
        cmp rdi, r9
        jae cleared
        mov rcx, rdi
        shl rcx, {ENTRY.bit_length() - 1}
        add rcx, rdx
        mov qword ptr [r11 + rcx + {SLOT_HEAD}], -1
        inc rdi
        jmp clear
    cleared:
        mov qword ptr [r11 + rdx + 8], rax
        test rax, rax
        jnz kept
        mov qword ptr [r11 + rdx], 0
    kept:
        pop rax
        jmp record
    none:
        pop rax
        {_TCB_RCX}
    other:
        inc eax; and eax, {NSLOTS - 1}
        dec edi; jnz look
        ud2
    record:
        test rsi, rsi
        jns counted
        xor esi, esi
    counted:
        movabs r11, {data:#x}
        lock inc qword ptr [r11 + {COUNT}]
        lock add qword ptr [r11 + {SUM}], rsi
        bsr rax, rsi
        jnz bucket
        xor eax, eax
    bucket:
        lock inc qword ptr [r11 + rax * 8 + {HIST}]
        pop r11; pop r9; pop r8; pop rdi; pop rsi; pop rdx; pop rcx; pop rax
        popfq
        ret
    """
    return _asm(text, at)


def initial_data(size: int = DATA_BYTES) -> bytes:
    """The data buffer's first contents (``size`` bytes): zero counters, free slots,
    every entry's ``saved`` FREE."""
    data = bytearray(size)
    for i in range(NSLOTS):
        for k in range(DEPTH):
            struct.pack_into("<Q", data, SLOTS + i * SLOT + SLOT_HEAD + k * ENTRY, FREE)
    return bytes(data)


def _quantile(hist: list[int], q: float, ticks_per_ns: float) -> float | None:
    """The upper bound (ns) of the bucket holding the ``q`` quantile."""
    total = sum(hist)
    if not total:
        return None
    want, run = q * total, 0
    for b, n in enumerate(hist):
        run += n
        if run >= want:
            return (1 << (b + 1)) / ticks_per_ns
    return None     # pragma: no cover


def read_latency(data: bytes, ticks_per_ns: float) -> dict[str, Any]:
    """The probe's results from the first ``SLOTS`` bytes of its data buffer: count,
    sum and mean (ns), p50/p90/p99 (the upper bound of the bucket holding each, ns),
    misses, and the non-empty buckets as [low ns, high ns, count]."""
    count, total, miss_slot, miss_depth = struct.unpack_from("<4Q", data, 0)
    hist = list(struct.unpack_from(f"<{BUCKETS}Q", data, HIST))
    out: dict[str, Any] = {
        "count": count, "sum_ns": round(total / ticks_per_ns),
        "mean_ns": round(total / ticks_per_ns / count) if count else None,
        "misses_no_slot": miss_slot, "misses_too_deep": miss_depth,
        "ticks_per_ns": ticks_per_ns,
        "buckets": [[0 if b == 0 else round((1 << b) / ticks_per_ns),
                     round((1 << (b + 1)) / ticks_per_ns), n]
                    for b, n in enumerate(hist) if n]}
    for name, q in (("p50_ns", 0.5), ("p90_ns", 0.9), ("p99_ns", 0.99)):
        v = _quantile(hist, q, ticks_per_ns)
        out[name] = round(v) if v is not None else None
    return out


def latency_trampoline(code: bytes, site: int, at: int, data: int,
                       relocator: Relocator | None = None) -> Trampoline:
    """The latency probe's trampoline at ``at`` for the function start ``site``
    (original bytes ``code``): the entry handler, the patched instructions relocated
    and a jmp back (counting.relocate_site), then the exit stub."""
    head = entry_handler(at, data, 0)
    tail, n, exits = relocate_site(code, site, at + len(head), relocator)
    stub_at = at + len(head) + len(tail)
    head = entry_handler(at, data, stub_at)
    if stub_at != at + len(head) + len(tail):      # pragma: no cover - movabs is 10 bytes
        raise CodegenError("the latency entry handler's size depends on its exit stub")
    return Trampoline(site, at, head + tail + exit_stub(stub_at, data), n, exits)
