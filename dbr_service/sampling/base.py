"""The one interface every sampling source implements, and the sample it produces.

A source is opened on one client process, told about its threads, switched on and off
around snapshot windows (docs/architecture.md, "One cycle" 2) and drained without blocking.
Sources keep their own counters so ``dbr ctl status`` can show what each one did.
"""

from __future__ import annotations

import abc
from dataclasses import asdict, dataclass, field
from typing import Sequence

from dbr_service.common.errors import SamplingError

__all__ = ["Sample", "SamplingSource", "SamplingError", "SourceStats", "BranchPair"]

#: One taken branch as a (from, to) pair of instruction addresses.
BranchPair = tuple[int, int]


@dataclass(slots=True)
class Sample:
    """One sample of one client thread.

    Only ``pid``, ``tid`` and ``ip`` are always present; the other fields are filled
    by the sources that have them (IBS: taken/target/load address, LBR: branch stack).
    """

    #: Client process (thread-group) id.
    pid: int
    #: Kernel thread id of the sampled thread.
    tid: int
    #: Sampled user instruction pointer.
    ip: int
    #: Timestamp in nanoseconds (perf: the perf clock, agent timer: none).
    time_ns: int | None = None
    #: Last taken branches, newest first (perf's PERF_SAMPLE_BRANCH_STACK order).
    branch_stack: tuple[BranchPair, ...] | None = None
    #: For a sampled branch instruction: whether it was taken (IBS op).
    taken: bool | None = None
    #: For a sampled branch instruction: its target (IBS op).
    target: int | None = None
    #: For a sampled load/store: the data address (IBS op, perf PERF_SAMPLE_ADDR).
    load_addr: int | None = None

    def to_json(self) -> dict:
        """JSON-able dict without the fields that are unset (see recorded.py)."""
        d = {k: v for k, v in asdict(self).items() if v is not None}
        if "branch_stack" in d:
            d["branch_stack"] = [list(p) for p in d["branch_stack"]]
        return d


@dataclass(slots=True)
class SourceStats:
    """Counters every source keeps (cumulative since open)."""

    #: Samples returned by read().
    samples: int = 0
    #: Samples the kernel or the producer reported lost (ring full).
    lost: int = 0
    #: Recoverable errors (a record that could not be parsed, a failed ioctl, ...).
    errors: int = 0
    #: Threads currently sampled.
    threads: int = 0
    #: Threads that went away while being sampled or before they could be opened.
    threads_gone: int = 0
    #: Source-specific extras (throttle events, reads, ...).
    extra: dict[str, int] = field(default_factory=dict)


class SamplingSource(abc.ABC):
    """A source of IP samples for the threads of one client process.

    Lifecycle: ``open(pid, tids)`` → (``enable()`` … ``read()``* … ``disable()``)* →
    ``close()``.  ``read()`` never blocks: it returns whatever is buffered (possibly
    nothing).  Samples taken before ``disable()`` stay readable after it.  Methods raise
    :class:`SamplingError` for failures of the source as a whole; a single thread
    vanishing is not an error (it is counted in ``stats.threads_gone``).
    """

    #: Short kebab-case name shown by ``dbr ctl status`` ("perf-cpu-clock", ...).
    name: str = "abstract"

    def __init__(self) -> None:
        self.stats = SourceStats()
        self.pid: int | None = None
        self.enabled = False

    @classmethod
    @abc.abstractmethod
    def available(cls) -> tuple[bool, str]:
        """Whether this host can run the source, and a one-line reason."""

    @abc.abstractmethod
    def open(self, pid: int, tids: Sequence[int] | None = None) -> None:
        """Prepare to sample ``pid``; ``tids=None`` means every current thread."""

    def add_thread(self, tid: int) -> bool:
        """Start sampling a new thread of the client; False if it is already gone."""
        return False

    def remove_thread(self, tid: int) -> None:
        """Stop sampling a thread (it exited); its buffered samples stay readable."""

    @abc.abstractmethod
    def enable(self) -> None:
        """Start taking samples (beginning of a snapshot window)."""

    @abc.abstractmethod
    def disable(self) -> None:
        """Stop taking samples (end of a snapshot window)."""

    @abc.abstractmethod
    def read(self) -> list[Sample]:
        """Drain and return the samples buffered so far, without blocking."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release every kernel object and mapping; idempotent."""

    def fileno(self) -> list[int]:
        """File descriptors that become readable when samples are waiting."""
        return []

    def __enter__(self) -> SamplingSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _require_open(self) -> int:
        if self.pid is None:
            raise SamplingError(f"{self.name}: source is not open")
        return self.pid
