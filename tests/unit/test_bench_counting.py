"""bench/counting_ab.py's own arithmetic: the steady steps of a run, the cost of a
counting phase against them, and the final code read back from a jitdump file."""

from __future__ import annotations

import struct

from bench.counting_ab import Run, _phase, jit_loads

from dbr_service.installation.jitdump import HEADER, JIT_CODE_LOAD, LOAD


def _record(name: str, addr: int, code: bytes) -> bytes:
    body = name.encode() + b"\0" + code
    return LOAD.pack(JIT_CODE_LOAD, LOAD.size + len(body), 0, 1, 1, addr, addr, len(code),
                     0) + body


def test_the_last_code_of_each_region_normalised() -> None:
    loop = bytes.fromhex("4883c001") + b"\xeb\xfa"                # add rax,1; jmp back
    counted = bytes.fromhex("f048ff0500100000") + loop
    data = struct.pack("<IIIIIIQQ", 0x4A695444, 1, HEADER.size, 62, 0, 1, 0, 0)
    data += _record("dbr:f+0x10 [r1]", 0x7000, counted) + _record("dbr:f+0x10 [r1]", 0x9000,
                                                                     loop)
    got = jit_loads(data)
    assert list(got) == ["dbr:f+0x10 [r1]"]
    assert got["dbr:f+0x10 [r1]"] == (("add", "rax, 1", 4), ("jmp", "@0", 2))
    # the same code elsewhere reads the same
    assert jit_loads(data[:HEADER.size] + _record("dbr:f+0x10 [r1]", 0x5000, loop)) == got


def test_phase_cost_against_the_steady_steps() -> None:
    # 10 steps of 1,000,000 iterations, 1 ms each in steady state
    r = Run(1.0, 0.1, [1_000_000] * 10, [2_000_000] * 5 + [1_000_000] * 5)
    assert r.steady("wall") == 1_000_000 and r.steady(how=min) == 1_000_000
    assert r.steady_from_s() == 0.01
    # 10 ms of counting made 100,000 entries: the final code does them in 0.1 ms
    r.counting = [{"region": "r1", "phase": "over", "why": "promoted", "polls": 2,
                   "seconds": 0.01, "block_counts": {"a": 100_000, "b": 5},
                   "over_at_s": 0.02, "replace_s": 0.005},
                  {"region": "r2", "phase": "ended with the client", "block_counts": {}}]
    (ph,) = _phase(r, 1_000_000)
    assert ph["region"] == "r1" and ph["entries"] == 100_000
    assert abs(ph["lost_s"] - 0.0099) < 1e-9 and ph["slowdown"] == 100.0
    assert ph["late"]                      # replaced 25 ms in, the steady steps from 10 ms
