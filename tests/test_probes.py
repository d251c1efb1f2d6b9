"""Location checks of dynamic probes (dbr_service/session/probes.py) that need no process:
the location's syntax, the instruction-boundary check, and the sweep for branches
into an entry site's bytes 1..4."""

from __future__ import annotations

import pytest
from codegen_util import asm

from dbr_service.session.probes import ProbeRefused, boundary_problem, branches_into, parse_location

F = 0x401000


@pytest.mark.parametrize("text,want", [
    ("work", ("work", 0)), ("work+0x10", ("work", 16)), ("libc.so.6+4096", ("libc.so.6", 4096)),
    ("/usr/lib/x+y.so+0x8", ("/usr/lib/x+y.so", 8)),
])
def test_parse_location(text: str, want: tuple) -> None:
    assert parse_location(text) == want


@pytest.mark.parametrize("text", ["", "+0x10", "work+", "work+zz", "work+-1",
                                  "work+0x800000000000"])
def test_parse_location_refuses(text: str) -> None:
    with pytest.raises(ProbeRefused, match="SYMBOL"):
        parse_location(text)


def test_boundary() -> None:
    code = asm("push rbp; mov rbp, rsp; mov rax, qword ptr [rdi + 0x10]; ret", F)
    assert boundary_problem(code, F, F) is None
    assert boundary_problem(code, F, F + 1) is None          # mov rbp, rsp
    assert boundary_problem(code, F, F + 4) is None          # the load
    assert "inside the instruction at 0x401001" in boundary_problem(code, F, F + 2)
    assert "does not decode up to" in boundary_problem(code, F, F + 0x40)


def test_branches_into() -> None:
    code = asm(f"xor eax, eax; jz {F + 0x23}; call {F + 0x30}; jmp {F + 0x22}", F)
    assert branches_into(code, F, F + 0x21, F + 0x25) == F + 2
    assert branches_into(code, F, F + 0x30, F + 0x31) == F + 4
    assert branches_into(code, F, F + 0x24, F + 0x30) is None
