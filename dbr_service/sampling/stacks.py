"""Call-stack samples through perf_event_open: what ``dbr ctl flamegraph`` collects.

Each sample of a thread carries, besides its IP:

* the kernel's user call chain (``PERF_SAMPLE_CALLCHAIN`` with
  ``exclude_callchain_kernel``), walked by frame pointers: right only through code
  that keeps ``rbp`` as its frame pointer;
* the user registers rip, rsp and rbp (``PERF_SAMPLE_REGS_USER``) and a bounded copy
  of the stack from rsp up (``PERF_SAMPLE_STACK_USER``), which the service unwinds
  with the modules' ``.eh_frame`` (stacks/unwind.py).

Like the snapshot sampler (sampling/perf.py) it opens one event and ring per thread
(``pid=tid``); its events are separate from the snapshot sampler's and live only for
one collection.  A sample record is at most 64 KiB (its size is a u16), so the stack
copy is bounded by :data:`MAX_STACK_BYTES`.
"""

from __future__ import annotations

import errno
import os
import struct
from dataclasses import dataclass
from typing import Sequence

from dbr_service.common.errors import SamplingError
from dbr_service.sampling.perf_abi import (
    EVENTS, PAGE_SIZE, PERF_SAMPLE_CALLCHAIN, PERF_SAMPLE_IP, PERF_SAMPLE_TID,
    PERF_SAMPLE_TIME, PerfRing, make_attr, perf_event_open, walk_records)

PERF_SAMPLE_REGS_USER = 1 << 12
PERF_SAMPLE_STACK_USER = 1 << 13

#: perf's x86 register numbers (arch/x86/include/uapi/asm/perf_regs.h).
PERF_REG_X86_BP, PERF_REG_X86_SP, PERF_REG_X86_IP = 6, 7, 8
REGS_MASK = (1 << PERF_REG_X86_BP) | (1 << PERF_REG_X86_SP) | (1 << PERF_REG_X86_IP)
#: Markers the kernel puts in a call chain (PERF_CONTEXT_*): values >= this.
PERF_CONTEXT_MAX = (1 << 64) - 4095

SAMPLE_TYPE = (PERF_SAMPLE_IP | PERF_SAMPLE_TID | PERF_SAMPLE_TIME | PERF_SAMPLE_CALLCHAIN
               | PERF_SAMPLE_REGS_USER | PERF_SAMPLE_STACK_USER)

DEFAULT_STACK_BYTES = 16 << 10
#: Largest stack copy asked for: the record (header, chain, registers, copy) must fit
#: in the 16-bit record size.
MAX_STACK_BYTES = 48 << 10
#: Longest call chain the kernel is asked for (its default perf_event_max_stack).
MAX_CHAIN = 127


@dataclass(frozen=True, slots=True)
class StackSample:
    """One sample: the thread, its registers, the kernel's frame-pointer chain (IP
    first, markers removed) and the copy of its stack starting at ``sp``."""

    pid: int
    tid: int
    time_ns: int
    ip: int
    sp: int | None
    bp: int | None
    chain: tuple[int, ...]
    stack: bytes


@dataclass(slots=True)
class StackParse:
    samples: list[StackSample]
    lost: int = 0
    throttles: int = 0
    bad_records: int = 0


_Q = struct.Struct("<Q").unpack_from
_II = struct.Struct("<II").unpack_from


def _parse_sample(buf: bytes, pos: int, end: int) -> StackSample:
    """One PERF_RECORD_SAMPLE body of :data:`SAMPLE_TYPE` (fields in the kernel's
    order: ip, pid/tid, time, callchain, regs_user, stack_user)."""
    (ip,) = _Q(buf, pos)
    pid, tid = _II(buf, pos + 8)
    (time_ns,) = _Q(buf, pos + 16)
    (nr,) = _Q(buf, pos + 24)
    pos += 32
    if nr > MAX_CHAIN + 8 or pos + 8 * nr > end:
        raise ValueError("call chain overruns its record")
    raw = struct.unpack_from(f"<{nr}Q", buf, pos)
    pos += 8 * nr
    chain = tuple(a for a in raw if a < PERF_CONTEXT_MAX)
    (abi,) = _Q(buf, pos)
    pos += 8
    sp = bp = None
    if abi:                 # PERF_SAMPLE_REGS_ABI_NONE: no user registers (none here)
        bp, sp, rip = struct.unpack_from("<QQQ", buf, pos)
        pos += 24
        ip = rip or ip
    (size,) = _Q(buf, pos)
    pos += 8
    stack = b""
    if size:
        if pos + size + 8 > end:
            raise ValueError("stack copy overruns its record")
        (dyn,) = _Q(buf, pos + size)
        stack = bytes(buf[pos:pos + min(size, dyn)])
        pos += size + 8
    if pos > end:
        raise ValueError("sample overruns its record")
    return StackSample(pid, tid, time_ns, ip, sp, bp, chain, stack)


def parse_stack_records(buf: bytes) -> StackParse:
    """Parse a run of perf records of :data:`SAMPLE_TYPE` (unwrapped from the ring)."""
    return walk_records(buf, _parse_sample, StackParse([]))


class StackSampler:
    """Call-stack sampling of the given threads of one process: one event and ring each.

    ``max_threads`` bounds the events (and so the memory: ``data_pages`` pages a
    thread).  Threads that have ended are skipped; :meth:`add` may be called again
    with threads born since."""

    def __init__(self, pid: int, *, sample_period_us: int = 2000,
                 stack_bytes: int = DEFAULT_STACK_BYTES, data_pages: int = 128,
                 max_threads: int = 64, event: str = "cpu-clock") -> None:
        if not 0 < stack_bytes <= MAX_STACK_BYTES or stack_bytes % 8:
            raise SamplingError(f"stack copy must be a multiple of 8 up to "
                                f"{MAX_STACK_BYTES} bytes: {stack_bytes}")
        if data_pages < 1 or data_pages & (data_pages - 1):
            raise SamplingError(f"data_pages must be a power of two: {data_pages}")
        if event not in EVENTS:
            raise SamplingError(f"unknown perf event {event!r}")
        self.pid = pid
        self.spec = EVENTS[event]
        self.sample_period_us = max(1, sample_period_us)
        self.stack_bytes = stack_bytes
        self.data_pages = data_pages
        self.max_threads = max_threads
        self._events: dict[int, tuple[int, PerfRing]] = {}
        self.lost = self.throttles = self.bad_records = self.threads_over = 0

    def add(self, tids: Sequence[int]) -> None:
        """Open an enabled event for each thread not yet sampled (ended ones skipped)."""
        for tid in tids:
            if tid in self._events:
                continue
            if len(self._events) >= self.max_threads:
                self.threads_over += 1
                continue
            attr = make_attr(self.spec, self.sample_period_us, self.data_pages * PAGE_SIZE,
                             SAMPLE_TYPE)
            attr.exclude_callchain_kernel = 1
            attr.sample_regs_user = REGS_MASK
            attr.sample_stack_user = self.stack_bytes
            attr.sample_max_stack = MAX_CHAIN
            attr.disabled = 0
            try:
                fd = perf_event_open(attr, tid)
            except OSError as e:
                if e.errno == errno.ESRCH:
                    continue
                self.close()
                raise SamplingError(f"perf_event_open(tid={tid}) for call stacks: "
                                    f"{os.strerror(e.errno or 0)}") from e
            try:
                ring = PerfRing(fd, self.data_pages)
            except (OSError, ValueError, SamplingError) as e:
                os.close(fd)
                self.close()
                raise SamplingError(f"mmap of the stack ring of tid {tid}: {e}") from e
            self._events[tid] = (fd, ring)

    @property
    def tids(self) -> list[int]:
        return sorted(self._events)

    def read(self) -> list[StackSample]:
        """Every sample published since the last read."""
        out: list[StackSample] = []
        for _fd, ring in self._events.values():
            data, overrun = ring.drain()
            self.bad_records += overrun
            if data:
                res = parse_stack_records(data)
                out.extend(res.samples)
                self.lost += res.lost
                self.throttles += res.throttles
                self.bad_records += res.bad_records
        return out

    def close(self) -> None:
        for fd, ring in self._events.values():
            ring.close()
            os.close(fd)
        self._events.clear()
