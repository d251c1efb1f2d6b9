"""Synthetic branch traces with a known answer (tests of the branch-trace edge profile).

A program is a list of basic blocks laid out as real x86-64 code (NOP bodies, then
``jne rel32``, ``jmp rel32``, ``call rel32``, ``ret`` or nothing), so that the profile's
full-trace step decodes it like a client's code.  :func:`run` executes it as a Markov
chain (each conditional branch taken with its fixed probability), counts every branch
edge executed (taken and not taken: the true answer), keeps the last ``depth`` taken
branches as branch-stack hardware does, and takes a stack whenever the count of taken
branches since the previous one reaches the period, drawn afresh each time.  Stacks are
written as PERF_RECORD_SAMPLE records with the kernel's layout (:func:`sample_record`).
"""

from __future__ import annotations

import random
import struct
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

from dbr_service.sampling import perf_abi as A

BASE = 0x401000

#: (name, NOP bytes, terminator, target name, probability the jcc is taken)
#: main: an outer loop with a hot call, a rarely taken side path and a fall-through-only
#: block; f: a call with a skip branch and a self-loop.
PROGRAM = [
    ("a", 3, "jcc", "c", 0.3),
    ("b", 2, "fall", None, 0.0),
    ("c", 1, "call", "f0", 0.0),
    ("d", 2, "jcc", "a", 0.85),
    ("e", 1, "jcc", "g", 0.5),
    ("e2", 4, "jmp", "a", 0.0),
    ("g", 2, "jmp", "a", 0.0),
    ("f0", 1, "jcc", "f2", 0.4),
    ("f1", 3, "jcc", "f1", 0.75),
    ("f2", 0, "ret", None, 0.0),
]

#: A loop of four taken jumps per iteration, one with a never-taken jcc before it.
LOCKSTEP = [
    ("l0", 1, "jcc", "l0", 0.0),
    ("l0b", 1, "jmp", "l1", 0.0),
    ("l1", 2, "jmp", "l2", 0.0),
    ("l2", 3, "jmp", "l3", 0.0),
    ("l3", 1, "jmp", "l0", 0.0),
]

_LEN = {"jcc": 6, "jmp": 5, "call": 5, "ret": 1, "fall": 0}


@dataclass
class Block:
    name: str
    start: int
    nops: int
    term: str
    target: str | None
    p_taken: float

    @property
    def branch(self) -> int:
        """Address of the terminating instruction."""
        return self.start + self.nops

    @property
    def end(self) -> int:
        return self.branch + _LEN[self.term]


@dataclass
class Program:
    blocks: list[Block]
    code: bytes
    by_name: dict[str, Block] = field(default_factory=dict)

    def read(self, addr: int, n: int) -> bytes:
        off = addr - BASE
        if off < 0 or off + n > len(self.code):
            raise ValueError(f"{addr:#x}+{n} outside the program")
        return self.code[off:off + n]


def build(spec=PROGRAM) -> Program:
    blocks, a = [], BASE
    for name, nops, term, target, p in spec:
        b = Block(name, a, nops, term, target, p)
        blocks.append(b)
        a = b.end
    prog = Program(blocks, b"", {b.name: b for b in blocks})
    code = bytearray()
    for b in blocks:
        code += b"\x90" * b.nops
        tgt = prog.by_name[b.target].start if b.target else 0
        rel = tgt - b.end
        if b.term == "jcc":
            code += b"\x0f\x85" + struct.pack("<i", rel)
        elif b.term == "jmp":
            code += b"\xe9" + struct.pack("<i", rel)
        elif b.term == "call":
            code += b"\xe8" + struct.pack("<i", rel)
        elif b.term == "ret":
            code += b"\xc3"
    prog.code = bytes(code)
    return prog


@dataclass
class Run:
    #: (branch address, next address) -> times executed: taken and not-taken edges.
    truth: Counter
    #: Branch stacks, newest first, as (from, to) pairs.
    stacks: list[tuple[tuple[int, int], ...]]
    #: IP of each stack's sample (the newest branch's target).
    ips: list[int]
    taken: int


def run(prog: Program, steps: int, period: Callable[[], int], depth: int = 16,
        seed: int = 1) -> Run:
    """Execute ``steps`` blocks from the first; sample every ``period()`` taken branches."""
    rng = random.Random(seed)
    truth: Counter = Counter()
    lbr: list[tuple[int, int]] = []
    stacks, ips = [], []
    ret_stack: list[int] = []
    blocks = prog.blocks
    index = {b.start: i for i, b in enumerate(blocks)}
    i, since, taken_total = 0, 0, 0
    due = period()
    for _ in range(steps):
        b = blocks[i]
        if b.term == "fall":
            i += 1
            continue
        dst = None
        if b.term == "jcc":
            if rng.random() < b.p_taken:
                dst = prog.by_name[b.target].start
            else:
                truth[(b.branch, b.end)] += 1
                i += 1
                continue
        elif b.term in ("jmp", "call"):
            dst = prog.by_name[b.target].start
            if b.term == "call":
                ret_stack.append(b.end)
        else:                       # ret
            dst = ret_stack.pop()
        truth[(b.branch, dst)] += 1
        lbr.append((b.branch, dst))
        if len(lbr) > depth:
            del lbr[0]
        taken_total += 1
        since += 1
        if since >= due:
            stacks.append(tuple(reversed(lbr)))
            ips.append(dst)
            since, due = 0, period()
        i = index[dst]
    return Run(truth, stacks, ips, taken_total)


SAMPLE_TYPE = A.PERF_SAMPLE_IP | A.PERF_SAMPLE_TID | A.PERF_SAMPLE_TIME | \
    A.PERF_SAMPLE_BRANCH_STACK


def sample_record(pid: int, tid: int, ip: int, time_ns: int,
                  stack: tuple[tuple[int, int], ...], hw_idx: int | None = 0) -> bytes:
    """One PERF_RECORD_SAMPLE for SAMPLE_TYPE (``hw_idx`` None: no HW_INDEX word)."""
    body = struct.pack("<QIIQQ", ip, pid, tid, time_ns, len(stack))
    if hw_idx is not None:
        body += struct.pack("<Q", hw_idx)
    body += b"".join(struct.pack("<QQQ", f, t, 0) for f, t in stack)
    return struct.pack("<IHH", A.PERF_RECORD_SAMPLE, 2, 8 + len(body)) + body


def relative_errors(truth: Counter, est: dict[int, dict[int, int]],
                    min_share: float) -> dict[tuple[int, int], float]:
    """|estimated share - true share| / true share for edges above ``min_share``."""
    total_t = sum(truth.values())
    total_e = sum(n for dsts in est.values() for n in dsts.values())
    out = {}
    for (src, dst), n in truth.items():
        share = n / total_t
        if share >= min_share:
            got = est.get(src, {}).get(dst, 0) / total_e
            out[(src, dst)] = abs(got - share) / share
    return out
