"""The time-stamp counter as the service reads it: whether this host's TSC is
invariant (one rate on every CPU, running in every power state, so that ticks read in
a client convert to nanoseconds with one factor), and that factor, calibrated against
CLOCK_MONOTONIC.  Latency probes (dbr_service/codegen/probes_latency.py) count ticks.

``rdtsc`` runs from a few bytes of code mapped executable in this process (standard
library: mmap and ctypes)."""

from __future__ import annotations

import ctypes
import mmap
import statistics
import time

#: rdtsc; shl rdx, 32; or rax, rdx; ret
_RDTSC = b"\x0f\x31\x48\xc1\xe2\x20\x48\x09\xd0\xc3"
_fn = None
_keep: list = []


def invariant_problem(cpuinfo: str = "/proc/cpuinfo") -> str | None:
    """Why this host's TSC cannot time latency probes, or None."""
    try:
        with open(cpuinfo) as fh:
            flags = next((ln.split(":", 1)[1].split() for ln in fh
                          if ln.startswith("flags")), [])
    except OSError as exc:
        return f"cannot read {cpuinfo}: {exc}"
    missing = [f for f in ("tsc", "constant_tsc", "nonstop_tsc") if f not in flags]
    return f"the TSC is not invariant on this host (no {', '.join(missing)})" if missing \
        else None


def rdtsc() -> int:
    """The TSC now."""
    global _fn
    if _fn is None:
        buf = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        buf.write(_RDTSC)
        addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        if libc.mprotect(addr, mmap.PAGESIZE, mmap.PROT_READ | mmap.PROT_EXEC) != 0:
            raise OSError(ctypes.get_errno(), "mprotect of the rdtsc page")
        _keep.append(buf)
        _fn = ctypes.CFUNCTYPE(ctypes.c_uint64)(addr)
    return _fn()


def ticks_per_ns(rounds: int = 3, span_s: float = 0.02) -> float:
    """TSC ticks per nanosecond: the median of ``rounds`` spans of ``span_s`` seconds,
    each the ticks between two CLOCK_MONOTONIC reads."""
    rates = []
    for _ in range(rounds):
        t0, c0 = time.monotonic_ns(), rdtsc()
        time.sleep(span_s)
        c1, t1 = rdtsc(), time.monotonic_ns()
        rates.append((c1 - c0) / max(1, t1 - t0))
    return statistics.median(rates)
