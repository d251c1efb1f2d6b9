"""Agent-timer sampling: the agent's per-thread CPU timers fill a shared ring we drain.

Used where ``perf_event_open`` is denied.  The agent creates a memfd holding
``struct dbr_ring_header`` followed by ``capacity`` entries of ``entry_size`` bytes
(shared/dbr_protocol.h), and passes the fd in DBR_MSG_SAMPLER_RING.  Producers (signal
handlers on any client thread) reserve slot ``head`` with a CAS while
``head - tail < capacity`` (else they add one to ``dropped``), fill pc/tid, then store
``seq = (uint32)(slot + 1)`` with release ordering.  This consumer reads slots from
``tail`` while ``entry.seq == (uint32)(tail + 1)``, then stores the new ``tail``.

Ordering on x86-64: the seq load is done before the pc/tid loads (loads are not
reordered with loads, so that is the acquire), and ``tail`` is stored after them
(stores are not reordered with older loads), so a producer never refills a slot that is
still being read.  Each access below is one aligned machine load or store.
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import time
from typing import Callable, Sequence

from dbr_service.wire import protocol
from dbr_service.common.clientfiles import size_sealed
from dbr_service.common.errors import SamplingError
from dbr_service.sampling.base import Sample, SamplingSource

HEADER_SIZE = ctypes.sizeof(protocol.RingHeader)  # 64
ENTRY_SIZE = ctypes.sizeof(protocol.RingEntry)    # 16
_TAIL_OFF = protocol.RingHeader.tail.offset
_HEAD_OFF = protocol.RingHeader.head.offset
_DROPPED_OFF = protocol.RingHeader.dropped.offset
_IN_KERNEL_OFF = protocol.RingHeader.in_kernel.offset
_SEQ_WORD = protocol.RingEntry.seq.offset // 4    # u32 index of seq inside an entry
_TID_WORD = protocol.RingEntry.tid.offset // 4
_PC_WORD = protocol.RingEntry.pc.offset // 4

#: Seconds a reserved-but-unpublished slot may block the ring before it is skipped
#: (its producer was killed or stopped between reserving and publishing).  A producer
#: merely preempted inside its handler publishes within a scheduler timeslice or two.
DEFAULT_SKIP_AFTER_S = 1.0


def ring_bytes(capacity: int, entry_size: int = ENTRY_SIZE) -> int:
    """Size of a ring mapping with ``capacity`` entries."""
    return HEADER_SIZE + capacity * entry_size


def create_ring_memfd(capacity: int, name: str = "dbr-sampler-ring") -> int:
    """Create and initialise a ring in a new memfd (what the agent does); returns the fd.

    The service never needs this; tests and synthetic producers do.
    """
    if capacity < 1 or capacity & (capacity - 1):
        raise SamplingError(f"ring capacity must be a power of two: {capacity}")
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    size = ring_bytes(capacity)
    os.ftruncate(fd, size)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    with mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as mm:
        hdr = protocol.RingHeader(magic=protocol.RING_MAGIC, version=protocol.PROTO_VERSION,
                                  capacity=capacity, entry_size=ENTRY_SIZE)
        mm[:HEADER_SIZE] = bytes(hdr)
    return fd


class AgentTimerRing:
    """Consumer side of one sampler ring.

    ``source`` is an fd (mapped, then left open for the caller to close) or an existing
    writable ``mmap``.  :meth:`read` returns ``(pc, tid)`` pairs in slot order.
    """

    def __init__(self, source: int | mmap.mmap,
                 skip_after_s: float = DEFAULT_SKIP_AFTER_S) -> None:
        self._ident: tuple[int, int] | None = None
        if isinstance(source, mmap.mmap):
            self.mm, self._own = source, False
        else:
            if not size_sealed(source):   # shrunk under the mapping, it would kill us
                raise SamplingError(f"sampler ring fd {source} is not sealed against "
                                    f"shrinking")
            try:
                size = os.fstat(source).st_size
                self.mm = mmap.mmap(source, size, mmap.MAP_SHARED,
                                    mmap.PROT_READ | mmap.PROT_WRITE)
            except (OSError, ValueError) as e:
                raise SamplingError(f"cannot map sampler ring fd {source}: {e}") from e
            self._own = True
            self._ident = _ident(source)
        try:
            self._validate()
        except SamplingError:
            self.close()
            raise
        self._view = memoryview(self.mm)
        self._words = self._view.cast("I")
        self._head = ctypes.c_uint64.from_buffer(self.mm, _HEAD_OFF)
        self._tail = ctypes.c_uint64.from_buffer(self.mm, _TAIL_OFF)
        self._dropped = ctypes.c_uint64.from_buffer(self.mm, _DROPPED_OFF)
        self._in_kernel = ctypes.c_uint64.from_buffer(self.mm, _IN_KERNEL_OFF)
        self.in_kernel_seen = 0
        self.tail = self._tail.value
        # drops since the ring was created count, even those before we mapped it
        self.dropped_seen = 0
        self.skip_after_s = skip_after_s
        self._stall: tuple[int, float] | None = None  # (blocked slot, since when)
        #: Entries read and unpublished slots skipped (cumulative).
        self.consumed = 0
        self.skipped = 0

    def _validate(self) -> None:
        if len(self.mm) < HEADER_SIZE:
            raise SamplingError(f"sampler ring too small: {len(self.mm)} bytes")
        hdr = protocol.RingHeader.from_buffer_copy(self.mm[:HEADER_SIZE])
        if hdr.magic != protocol.RING_MAGIC:
            raise SamplingError(f"sampler ring: bad magic {hdr.magic:#x}")
        if hdr.version != protocol.PROTO_VERSION:
            raise SamplingError(f"sampler ring: version {hdr.version}, expected "
                                f"{protocol.PROTO_VERSION}")
        cap = hdr.capacity
        if cap < 1 or cap & (cap - 1):
            raise SamplingError(f"sampler ring: capacity {cap} is not a power of two")
        if hdr.entry_size < ENTRY_SIZE or hdr.entry_size % 8:
            raise SamplingError(f"sampler ring: bad entry_size {hdr.entry_size}")
        if len(self.mm) < ring_bytes(cap, hdr.entry_size):
            raise SamplingError(f"sampler ring: {len(self.mm)} bytes cannot hold {cap} "
                                f"entries of {hdr.entry_size}")
        self.capacity = cap
        self.entry_words = hdr.entry_size // 4

    @property
    def dropped(self) -> int:
        """The producers' cumulative drop counter."""
        return self._dropped.value

    def read(self, limit: int | None = None) -> list[tuple[int, int]]:
        """Consume every published entry from tail on; returns ``[(pc, tid), ...]``."""
        words, mask, stride = self._words, self.capacity - 1, self.entry_words
        base = HEADER_SIZE // 4
        out: list[tuple[int, int]] = []
        tail = self.tail
        while limit is None or len(out) < limit:
            w = base + (tail & mask) * stride
            if words[w + _SEQ_WORD] != (tail + 1) & 0xFFFFFFFF:  # acquire: seq first
                break
            pc = words[w + _PC_WORD] | (words[w + _PC_WORD + 1] << 32)
            out.append((pc, words[w + _TID_WORD]))
            tail += 1
        if not out:
            tail = self._maybe_skip(tail)
        if tail != self.tail:
            self.tail = tail
            self._tail.value = tail  # release the slots after their loads (x86 TSO)
        self.consumed += len(out)
        return out

    def _maybe_skip(self, tail: int) -> int:
        """Skip the slot at ``tail`` once it has stayed reserved-but-unpublished for
        ``skip_after_s`` seconds (its producer died, or is stopped, between the CAS and
        the seq store).  A producer that publishes after the skip writes into a slot the
        ring may have handed out again; at worst that one sample is lost or garbled."""
        if self._head.value == tail:
            self._stall = None
            return tail
        now = time.monotonic()
        if self._stall is None or self._stall[0] != tail:
            self._stall = (tail, now)
            return tail
        if now - self._stall[1] < self.skip_after_s:
            return tail
        self._stall = None
        self.skipped += 1
        return tail + 1

    def new_drops(self) -> int:
        """Drops counted by producers since the last call."""
        now = self._dropped.value
        delta, self.dropped_seen = now - self.dropped_seen, now
        return delta

    def new_in_kernel(self) -> int:
        """Timer signals the producers did not take as samples since the last call:
        delivered on the way out of a system call (the tick came in the kernel)."""
        now = self._in_kernel.value
        delta, self.in_kernel_seen = now - self.in_kernel_seen, now
        return delta

    def same_file(self, fd: int) -> bool:
        """Whether ``fd`` refers to the memfd this ring maps (agent reused its ring)."""
        return self._ident is not None and _ident(fd) == self._ident

    def close(self) -> None:
        for attr in ("_words", "_view", "_head", "_tail", "_dropped", "_in_kernel"):
            obj = self.__dict__.pop(attr, None)
            if isinstance(obj, memoryview):
                obj.release()
            del obj  # the last ctypes view must not outlive the mapping
        if self._own and not self.mm.closed:
            self.mm.close()


def _ident(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


#: ``start(period_us, ring_entries) -> fd`` asks the agent to start its timers and
#: returns the ring memfd it sent (ownership passes to the source); ``stop()`` asks it
#: to stop.  Both raise on failure.
StartFn = Callable[[int, int], int]
StopFn = Callable[[], None]


class AgentTimerSource(SamplingSource):
    """Samples from the agent's timers, for hosts where perf_event_open is denied.

    The agent samples every thread of its process on its own, so add_thread and
    remove_thread have nothing to do.  enable()/disable() start and stop the timers.
    """

    name = "agent-timer"

    def __init__(self, start: StartFn, stop: StopFn, period_us: int = 1000,
                 ring_entries: int = 4096) -> None:
        super().__init__()
        if period_us <= 0:
            raise SamplingError(f"period_us must be positive: {period_us}")
        if ring_entries < 1 or ring_entries & (ring_entries - 1):
            raise SamplingError(f"ring_entries must be a power of two: {ring_entries}")
        self._start, self._stop = start, stop
        self.period_us, self.ring_entries = period_us, ring_entries
        self.ring: AgentTimerRing | None = None
        self._pending: list[Sample] = []
        #: skipped: unpublished slots given up; in_kernel: timer signals that came on
        #: the way out of a system call, not samples (perf's exclude_kernel)
        self.stats.extra.update(skipped=0, in_kernel=0)

    @classmethod
    def available(cls) -> tuple[bool, str]:
        return True, "agent timer: needs the dbr agent loaded in the client"

    def open(self, pid: int, tids: Sequence[int] | None = None) -> None:
        if self.pid is not None:
            raise SamplingError(f"{self.name}: already open on pid {self.pid}")
        self.pid = pid

    def add_thread(self, tid: int) -> bool:
        self._require_open()
        return True

    def enable(self) -> None:
        self._require_open()
        if self.enabled:
            return
        try:
            fd = self._start(self.period_us, self.ring_entries)
        except SamplingError:
            raise
        except Exception as e:
            raise SamplingError(f"{self.name}: agent refused to start sampling: {e}") from e
        try:
            self._adopt_ring(fd)
        finally:
            os.close(fd)
        self.enabled = True

    def _adopt_ring(self, fd: int) -> None:
        if self.ring is not None and self.ring.same_file(fd):
            return
        if self.ring is not None:
            self._drain(self._pending)
            self.ring.close()
            self.ring = None
        self.ring = AgentTimerRing(fd)

    def disable(self) -> None:
        self._require_open()
        if not self.enabled:
            return
        self.enabled = False
        try:
            self._stop()
        except Exception as e:
            self.stats.errors += 1
            raise SamplingError(f"{self.name}: agent failed to stop sampling: {e}") from e
        finally:
            self._drain(self._pending)

    def _drain(self, out: list[Sample]) -> None:
        ring = self.ring
        if ring is None:
            return
        pid = self.pid or 0
        skipped = ring.skipped
        out.extend(Sample(pid, tid, pc) for pc, tid in ring.read())
        self.stats.lost += ring.new_drops() + ring.skipped - skipped
        self.stats.extra["skipped"] += ring.skipped - skipped
        self.stats.extra["in_kernel"] += ring.new_in_kernel()

    def read(self) -> list[Sample]:
        out, self._pending = self._pending, []
        self._drain(out)
        self.stats.samples += len(out)
        return out

    def close(self) -> None:
        try:
            if self.enabled:
                self.enabled = False
                self._stop()
        except Exception:
            self.stats.errors += 1
        finally:
            if self.ring is not None:
                self.ring.close()
                self.ring = None
            self._pending.clear()
            self.pid = None
