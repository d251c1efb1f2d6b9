"""Replayable recorded or synthetic sample streams (JSON lines, schema ``dbr.samples/1``).

Code for sources this machine lacks (AMD IBS op, Intel LBR) is exercised by replaying
streams recorded elsewhere or written by hand.  One JSON object per line::

    {"schema": "dbr.samples/1", "source": "lbr"}                      optional header
    {"pid": 7, "tid": 7, "ip": "0x401000", "time_ns": 12}               IP sample
    {"pid": 7, "tid": 7, "ip": "0x401010", "taken": true,
     "target": "0x401000", "load_addr": "0x7ffd0000"}                   IBS op sample
    {"pid": 7, "tid": 8, "ip": "0x401020",
     "branch_stack": [["0x401020", "0x401000"], ["0x400ff0", "0x400fe0"]]}  LBR, newest first
    {"pid": 7, "tid": 8, "ip": "0x401020",
     "brstack": "0x401020/0x401000/P/-/-/0 0x400ff0/0x400fe0/P/-/-/0"}  perf-script brstack

Addresses are integers or "0x" strings.  Blank lines and lines starting with ``#`` are
ignored.
"""

from __future__ import annotations

import json
import os
from typing import IO, Iterable, Sequence

from dbr_service.common.errors import SamplingError
from dbr_service.sampling.base import BranchPair, Sample, SamplingSource
from dbr_service.sampling.lbr import LbrProfile, edges_from_lbr, fallthroughs_from_lbr, lbr_profile

__all__ = ["RecordedSource", "parse_line", "parse_brstack", "read_samples", "write_samples",
           "edges_from_lbr", "fallthroughs_from_lbr", "lbr_profile", "LbrProfile", "SCHEMA"]

SCHEMA = "dbr.samples/1"


def _addr(v: int | str) -> int:
    if isinstance(v, bool):
        raise ValueError(f"bad address {v!r}")
    if isinstance(v, int):
        return v
    return int(v, 0)


def parse_brstack(text: str) -> tuple[BranchPair, ...]:
    """Parse perf-script ``brstack`` text: ``FROM/TO[/flags...]`` tokens, newest first.

    Tokens that do not start with an address pair (the comm, pid, ip columns of a full
    ``perf script -F ...,brstack`` line) are skipped, so whole lines can be fed in.
    """
    pairs = []
    for tok in text.split():
        parts = tok.split("/")
        if len(parts) < 2:
            continue
        try:
            pairs.append((int(parts[0], 16), int(parts[1], 16)))
        except ValueError:
            continue
    return tuple(pairs)


def parse_line(obj: dict) -> Sample:
    """One decoded JSON object -> Sample (raises ValueError/KeyError if malformed)."""
    stack = None
    if "branch_stack" in obj:
        stack = tuple((_addr(a), _addr(b)) for a, b in obj["branch_stack"])
    elif "brstack" in obj:
        stack = parse_brstack(obj["brstack"])
    opt = {k: _addr(obj[k]) for k in ("target", "load_addr") if obj.get(k) is not None}
    taken = obj.get("taken")
    if taken is not None and not isinstance(taken, bool):
        raise ValueError(f"taken must be a boolean: {taken!r}")
    return Sample(int(obj["pid"]), int(obj.get("tid", obj["pid"])), _addr(obj["ip"]),
                  obj.get("time_ns"), stack, taken, opt.get("target"), opt.get("load_addr"))


def read_samples(lines: Iterable[str], strict: bool = False
                 ) -> tuple[dict, list[Sample], int]:
    """Decode a stream; returns (header, samples, malformed line count)."""
    header: dict = {}
    samples: list[Sample] = []
    bad = 0
    for lineno, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            obj = json.loads(line)
            if "schema" in obj:
                if obj["schema"] != SCHEMA:
                    raise SamplingError(f"line {lineno}: unknown schema {obj['schema']!r}")
                header = obj
                continue
            samples.append(parse_line(obj))
        except (ValueError, KeyError, TypeError) as e:
            if strict:
                raise SamplingError(f"line {lineno}: malformed sample: {e}") from e
            bad += 1
    return header, samples, bad


def write_samples(out: IO[str], samples: Iterable[Sample], source: str = "unknown") -> int:
    """Record samples (e.g. from a live source) as a replayable stream; returns count."""
    out.write(json.dumps({"schema": SCHEMA, "source": source}) + "\n")
    n = 0
    for s in samples:
        out.write(json.dumps(s.to_json()) + "\n")
        n += 1
    return n


class RecordedSource(SamplingSource):
    """Replays a recorded stream through the sampling interface.

    Samples come out only while enabled, ``batch`` per read() (all by default), with
    their pid rewritten to the opened pid unless ``rewrite_pid`` is False (then samples
    of other pids are filtered out).  Threads are not filtered: a replay has no live
    threads to follow.
    """

    name = "recorded"

    def __init__(self, stream: str | os.PathLike | Iterable[str] | Sequence[Sample],
                 batch: int | None = None, rewrite_pid: bool = True,
                 strict: bool = False) -> None:
        super().__init__()
        if isinstance(stream, (str, os.PathLike)):
            try:
                with open(stream) as f:
                    header, samples, bad = read_samples(f, strict)
            except OSError as e:
                raise SamplingError(f"cannot read recorded samples {stream}: {e}") from e
        else:
            items = list(stream)
            if items and isinstance(items[0], Sample):
                header, samples, bad = {}, items, 0
            else:
                header, samples, bad = read_samples(items, strict)
        self.header = header
        self.name = f"recorded:{header.get('source', 'unknown')}"
        self._samples = samples
        self._pos = 0
        self.batch = batch
        self.rewrite_pid = rewrite_pid
        self.stats.errors += bad

    @classmethod
    def available(cls) -> tuple[bool, str]:
        return True, "replays a recorded sample stream"

    def open(self, pid: int, tids: Sequence[int] | None = None) -> None:
        if self.pid is not None:
            raise SamplingError(f"{self.name}: already open on pid {self.pid}")
        self.pid = pid
        self._pos = 0

    def enable(self) -> None:
        self._require_open()
        self.enabled = True

    def disable(self) -> None:
        self._require_open()
        self.enabled = False

    @property
    def remaining(self) -> int:
        return len(self._samples) - self._pos

    def read(self) -> list[Sample]:
        pid = self._require_open()
        if not self.enabled:
            return []
        end = len(self._samples) if self.batch is None else self._pos + self.batch
        chunk = self._samples[self._pos:end]
        self._pos += len(chunk)
        if self.rewrite_pid:
            out = [s if s.pid == pid else _with_pid(s, pid) for s in chunk]
        else:
            out = [s for s in chunk if s.pid == pid]
        self.stats.samples += len(out)
        return out

    def close(self) -> None:
        self.enabled = False
        self.pid = None


def _with_pid(s: Sample, pid: int) -> Sample:
    return Sample(pid, s.tid, s.ip, s.time_ns, s.branch_stack, s.taken, s.target, s.load_addr)
