"""The perf_event ABI as dbr uses it: constants, structs, the syscall, events, records.

``perf_event_attr`` and the mmap page as ctypes structures, ``perf_event_open``, the
sampling events dbr knows, the parser of sample records and the per-event ring
(:class:`PerfRing`).  The sampling source is in sampling/perf.py.

Memory ordering (perf_event.h, "struct perf_event_mmap_page"): read ``data_head``, then
``smp_rmb()``, then the data, then ``smp_mb()``, then store ``data_tail``.  On x86-64 (the
only target) loads are not reordered with loads and stores are not reordered with older
loads, so only a compiler barrier is needed; in Python each ctypes field access is one
aligned 8-byte machine load/store performed in program order, and the data is copied out
of the ring before ``data_tail`` is stored, so the kernel cannot overwrite it under us.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dbr_service.common.errors import SamplingError
from dbr_service.sampling.base import Sample

# ---------------------------------------------------------------------------------------
# Kernel ABI: include/uapi/linux/perf_event.h.  Keep in sync (tests/live/test_sampling.py
# compiles a probe against the installed header and compares sizes and offsets).
# ---------------------------------------------------------------------------------------

SYS_perf_event_open = 298  # x86-64

PERF_TYPE_HARDWARE = 0
PERF_TYPE_SOFTWARE = 1
PERF_TYPE_RAW = 4

PERF_COUNT_HW_CPU_CYCLES = 0
PERF_COUNT_SW_CPU_CLOCK = 0
PERF_COUNT_SW_TASK_CLOCK = 1

PERF_SAMPLE_IP = 1 << 0
PERF_SAMPLE_TID = 1 << 1
PERF_SAMPLE_TIME = 1 << 2
PERF_SAMPLE_ADDR = 1 << 3
PERF_SAMPLE_READ = 1 << 4
PERF_SAMPLE_CALLCHAIN = 1 << 5
PERF_SAMPLE_ID = 1 << 6
PERF_SAMPLE_CPU = 1 << 7
PERF_SAMPLE_PERIOD = 1 << 8
PERF_SAMPLE_STREAM_ID = 1 << 9
PERF_SAMPLE_RAW = 1 << 10
PERF_SAMPLE_BRANCH_STACK = 1 << 11
PERF_SAMPLE_IDENTIFIER = 1 << 16

PERF_SAMPLE_BRANCH_USER = 1 << 0
PERF_SAMPLE_BRANCH_ANY = 1 << 3
PERF_SAMPLE_BRANCH_NO_FLAGS = 1 << 14   # entries without mispredict/abort flags
PERF_SAMPLE_BRANCH_NO_CYCLES = 1 << 15  # entries without cycle counts (cheaper to save)
PERF_SAMPLE_BRANCH_HW_INDEX = 1 << 17

PERF_RECORD_LOST = 2
PERF_RECORD_THROTTLE = 5
PERF_RECORD_UNTHROTTLE = 6
PERF_RECORD_SAMPLE = 9

PERF_EVENT_IOC_ENABLE = 0x2400   # _IO('$', 0)
PERF_EVENT_IOC_DISABLE = 0x2401  # _IO('$', 1)
PERF_EVENT_IOC_PERIOD = 0x40082404  # _IOW('$', 4, __u64): a new sample period

PERF_FLAG_FD_CLOEXEC = 1 << 3

PAGE_SIZE = mmap.PAGESIZE

#: Sample layouts this parser understands (in the kernel's record order).
SUPPORTED_SAMPLE_TYPE = (PERF_SAMPLE_IDENTIFIER | PERF_SAMPLE_IP | PERF_SAMPLE_TID
                         | PERF_SAMPLE_TIME | PERF_SAMPLE_ADDR | PERF_SAMPLE_ID
                         | PERF_SAMPLE_STREAM_ID | PERF_SAMPLE_CPU | PERF_SAMPLE_PERIOD
                         | PERF_SAMPLE_BRANCH_STACK)

_u16, _u32, _s32, _u64 = ctypes.c_uint16, ctypes.c_uint32, ctypes.c_int32, ctypes.c_uint64


class PerfEventAttr(ctypes.Structure):
    """``struct perf_event_attr`` up to PERF_ATTR_SIZE_VER7 (128 bytes, adds sig_data).

    The flag bits are ctypes bit fields on one u64, which CPython lays out as GCC does.
    Unions are represented by their first member; aliases are properties below.
    """

    _fields_ = [
        ("type", _u32), ("size", _u32), ("config", _u64),
        ("sample_period", _u64),            # union with sample_freq
        ("sample_type", _u64), ("read_format", _u64),
        ("disabled", _u64, 1), ("inherit", _u64, 1), ("pinned", _u64, 1),
        ("exclusive", _u64, 1), ("exclude_user", _u64, 1), ("exclude_kernel", _u64, 1),
        ("exclude_hv", _u64, 1), ("exclude_idle", _u64, 1), ("mmap", _u64, 1),
        ("comm", _u64, 1), ("freq", _u64, 1), ("inherit_stat", _u64, 1),
        ("enable_on_exec", _u64, 1), ("task", _u64, 1), ("watermark", _u64, 1),
        ("precise_ip", _u64, 2), ("mmap_data", _u64, 1), ("sample_id_all", _u64, 1),
        ("exclude_host", _u64, 1), ("exclude_guest", _u64, 1),
        ("exclude_callchain_kernel", _u64, 1), ("exclude_callchain_user", _u64, 1),
        ("mmap2", _u64, 1), ("comm_exec", _u64, 1), ("use_clockid", _u64, 1),
        ("context_switch", _u64, 1), ("write_backward", _u64, 1), ("namespaces", _u64, 1),
        ("ksymbol", _u64, 1), ("bpf_event", _u64, 1), ("aux_output", _u64, 1),
        ("cgroup", _u64, 1), ("text_poke", _u64, 1), ("build_id", _u64, 1),
        ("inherit_thread", _u64, 1), ("remove_on_exec", _u64, 1), ("sigtrap", _u64, 1),
        ("__reserved_1", _u64, 26),
        ("wakeup_events", _u32),            # union with wakeup_watermark
        ("bp_type", _u32),
        ("config1", _u64),                  # union with bp_addr, kprobe_func, uprobe_path
        ("config2", _u64),                  # union with bp_len, kprobe_addr, probe_offset
        ("branch_sample_type", _u64), ("sample_regs_user", _u64),
        ("sample_stack_user", _u32), ("clockid", _s32), ("sample_regs_intr", _u64),
        ("aux_watermark", _u32), ("sample_max_stack", _u16), ("__reserved_2", _u16),
        ("aux_sample_size", _u32), ("__reserved_3", _u32), ("sig_data", _u64),
    ]

    @property
    def wakeup_watermark(self) -> int:
        return self.wakeup_events

    @wakeup_watermark.setter
    def wakeup_watermark(self, value: int) -> None:
        self.wakeup_events = value


PERF_ATTR_SIZE_VER7 = 128
assert ctypes.sizeof(PerfEventAttr) == PERF_ATTR_SIZE_VER7


class PerfEventMmapPage(ctypes.Structure):
    """``struct perf_event_mmap_page``: the first page of every perf mmap."""

    _fields_ = [
        ("version", _u32), ("compat_version", _u32), ("lock", _u32), ("index", _u32),
        ("offset", ctypes.c_int64), ("time_enabled", _u64), ("time_running", _u64),
        ("capabilities", _u64), ("pmc_width", _u16), ("time_shift", _u16),
        ("time_mult", _u32), ("time_offset", _u64), ("time_zero", _u64), ("size", _u32),
        ("__reserved_1", _u32), ("time_cycles", _u64), ("time_mask", _u64),
        ("__reserved", _u64 * 116),
        ("data_head", _u64), ("data_tail", _u64), ("data_offset", _u64), ("data_size", _u64),
        ("aux_head", _u64), ("aux_tail", _u64), ("aux_offset", _u64), ("aux_size", _u64),
    ]


_DATA_HEAD_OFF = PerfEventMmapPage.data_head.offset  # 1024
_DATA_TAIL_OFF = PerfEventMmapPage.data_tail.offset  # 1032

_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long


def perf_event_open(attr: PerfEventAttr, pid: int, cpu: int = -1, group_fd: int = -1,
                    flags: int = PERF_FLAG_FD_CLOEXEC) -> int:
    """The raw syscall; returns the fd or raises OSError with the kernel's errno."""
    fd = _syscall(ctypes.c_long(SYS_perf_event_open), ctypes.byref(attr), ctypes.c_int(pid),
                  ctypes.c_int(cpu), ctypes.c_int(group_fd), ctypes.c_ulong(flags))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return fd


def read_paranoid() -> int | None:
    """``/proc/sys/kernel/perf_event_paranoid``, or None where it does not exist."""
    try:
        with open("/proc/sys/kernel/perf_event_paranoid") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


# ---------------------------------------------------------------------------------------
# Events
# ---------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class PerfEventSpec:
    """Which counter drives the sampling."""

    name: str
    type: int
    config: int
    #: True when sample_period counts nanoseconds (the software clocks).
    period_is_ns: bool
    precise_ip: int = 0


EVENTS: dict[str, PerfEventSpec] = {
    "cpu-clock": PerfEventSpec("cpu-clock", PERF_TYPE_SOFTWARE, PERF_COUNT_SW_CPU_CLOCK, True),
    "task-clock": PerfEventSpec("task-clock", PERF_TYPE_SOFTWARE, PERF_COUNT_SW_TASK_CLOCK,
                                True),
    # Cycles: sample_period is in cycles; we assume ~1 GHz to map sample_period_us.
    "cycles": PerfEventSpec("cycles", PERF_TYPE_HARDWARE, PERF_COUNT_HW_CPU_CYCLES, False, 0),
}
_CYCLES_PER_US = 1000


def make_attr(spec: PerfEventSpec, sample_period_us: int, data_size: int,
              sample_type: int = PERF_SAMPLE_IP | PERF_SAMPLE_TID | PERF_SAMPLE_TIME,
              branch_sample_type: int = 0, precise_ip: int | None = None) -> PerfEventAttr:
    """A sampling attr: user-only, created disabled, woken at half a ring."""
    attr = PerfEventAttr()
    attr.type = spec.type
    attr.size = ctypes.sizeof(PerfEventAttr)
    attr.config = spec.config
    per_us = 1000 if spec.period_is_ns else _CYCLES_PER_US
    attr.sample_period = max(1, sample_period_us) * per_us
    attr.sample_type = sample_type
    attr.disabled = 1
    attr.exclude_kernel = 1
    attr.exclude_hv = 1
    attr.precise_ip = spec.precise_ip if precise_ip is None else precise_ip
    attr.watermark = 1
    attr.wakeup_watermark = max(1, data_size // 2)
    attr.branch_sample_type = branch_sample_type
    return attr


# ---------------------------------------------------------------------------------------
# Record parsing (pure: bytes in, samples out; tested on synthetic rings)
# ---------------------------------------------------------------------------------------

@dataclass(slots=True)
class ParseResult:
    samples: list[Sample]
    lost: int = 0
    throttles: int = 0
    bad_records: int = 0


def _sample_parser(sample_type: int, branch_hw_index: bool):
    """Return ``parse(buf, pos, end) -> Sample`` for one PERF_RECORD_SAMPLE body."""
    if sample_type & ~SUPPORTED_SAMPLE_TYPE:
        raise SamplingError(f"unsupported perf sample_type bits {sample_type:#x}")
    unpack_q = struct.Struct("<Q").unpack_from
    unpack_ii = struct.Struct("<II").unpack_from

    def parse(buf: bytes, pos: int, end: int) -> Sample:
        pid = tid = ip = 0
        time_ns = addr = None
        stack = None
        if sample_type & PERF_SAMPLE_IDENTIFIER:
            pos += 8
        if sample_type & PERF_SAMPLE_IP:
            (ip,) = unpack_q(buf, pos)
            pos += 8
        if sample_type & PERF_SAMPLE_TID:
            pid, tid = unpack_ii(buf, pos)
            pos += 8
        if sample_type & PERF_SAMPLE_TIME:
            (time_ns,) = unpack_q(buf, pos)
            pos += 8
        if sample_type & PERF_SAMPLE_ADDR:
            (addr,) = unpack_q(buf, pos)
            pos += 8
        pos += 8 * bool(sample_type & PERF_SAMPLE_ID)
        pos += 8 * bool(sample_type & PERF_SAMPLE_STREAM_ID)
        pos += 8 * bool(sample_type & PERF_SAMPLE_CPU)
        pos += 8 * bool(sample_type & PERF_SAMPLE_PERIOD)
        if sample_type & PERF_SAMPLE_BRANCH_STACK:
            (nr,) = unpack_q(buf, pos)
            pos += 8 + 8 * branch_hw_index
            if pos + 24 * nr > end:
                raise ValueError("branch stack overruns its record")
            stack = tuple(struct.unpack_from("<QQ", buf, pos + 24 * i) for i in range(nr))
            pos += 24 * nr
        if pos > end:
            raise ValueError("sample overruns its record")
        return Sample(pid, tid, ip, time_ns, stack, None, None, addr)

    return parse


def parse_records(buf: bytes, sample_type: int, branch_hw_index: bool = False) -> ParseResult:
    """Parse a run of perf records (already unwrapped from the ring)."""
    return walk_records(buf, _sample_parser(sample_type, branch_hw_index), ParseResult([]))


def walk_records(buf: bytes, parse_sample: Callable[[bytes, int, int], Any], out: Any) -> Any:
    """Walk a run of perf records into ``out`` (its ``samples``, ``lost``,
    ``throttles`` and ``bad_records``): samples through ``parse_sample(buf, body,
    end)``; a record that overruns the run ends the walk, one that does not parse is
    counted bad."""
    hdr = struct.Struct("<IHH").unpack_from
    pos, n = 0, len(buf)
    while pos + 8 <= n:
        rtype, _misc, size = hdr(buf, pos)
        if size < 8 or pos + size > n:
            out.bad_records += 1
            break
        body, end = pos + 8, pos + size
        try:
            if rtype == PERF_RECORD_SAMPLE:
                out.samples.append(parse_sample(buf, body, end))
            elif rtype == PERF_RECORD_LOST:
                out.lost += struct.unpack_from("<QQ", buf, body)[1]
            elif rtype == PERF_RECORD_THROTTLE:
                out.throttles += 1
        except (struct.error, ValueError):
            out.bad_records += 1
        pos = end
    return out


class PerfRing:
    """The mmap of one perf event: header page + 2^n data pages, consumed in place."""

    def __init__(self, fd: int, data_pages: int) -> None:
        if data_pages < 1 or data_pages & (data_pages - 1):
            raise SamplingError(f"perf ring data pages must be a power of two: {data_pages}")
        self.mm = mmap.mmap(fd, (1 + data_pages) * PAGE_SIZE, mmap.MAP_SHARED,
                            mmap.PROT_READ | mmap.PROT_WRITE)
        self._head = _u64.from_buffer(self.mm, _DATA_HEAD_OFF)
        self._tail = _u64.from_buffer(self.mm, _DATA_TAIL_OFF)
        page = PerfEventMmapPage.from_buffer(self.mm)
        # data_offset/data_size exist since Linux 4.1; fall back to the classic layout.
        self.data_offset = page.data_offset or PAGE_SIZE
        self.data_size = page.data_size or data_pages * PAGE_SIZE
        del page
        self.tail = self._tail.value

    def drain(self) -> tuple[bytes, bool]:
        """Copy out every published byte and release it; (bytes, overrun detected)."""
        head = self._head.value  # one aligned 8-byte load; x86 needs no rmb after it
        avail = head - self.tail
        if avail == 0:
            return b"", False
        overrun = avail > self.data_size or avail < 0
        if overrun:  # cannot happen with a writable mapping; resynchronise defensively
            self.tail = head
            self._tail.value = head
            return b"", True
        start = self.tail % self.data_size
        base = self.data_offset
        first = min(avail, self.data_size - start)
        data = self.mm[base + start: base + start + first]
        if first < avail:  # the run wraps around the end of the data area
            data += self.mm[base: base + avail - first]
        self.tail = head
        self._tail.value = head  # store after the copy: TSO keeps it after the loads
        return data, False

    def close(self) -> None:
        del self._head, self._tail
        self.mm.close()
