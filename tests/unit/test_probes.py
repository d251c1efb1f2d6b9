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


def test_latency_refusals_without_a_process(tmp_path) -> None:
    """A host without an invariant TSC, and a process that maps a C++ runtime or whose
    module defines __cxa_throw (a static C++ runtime), refuse latency probes."""
    import os

    from harness import compile_c

    from dbr_service.common.procmaps import MapEntry
    from dbr_service.common.tsc import invariant_problem
    from dbr_service.session.probes import cxx_problem, shadow_stack_problem

    cpu = tmp_path / "cpuinfo"
    cpu.write_text("processor\t: 0\nflags\t\t: fpu tsc msr constant_tsc\n")
    assert invariant_problem(str(cpu)) == "the TSC is not invariant on this host (no nonstop_tsc)"
    cpu.write_text("processor\t: 0\nflags\t\t: fpu tsc constant_tsc nonstop_tsc\n")
    assert invariant_problem(str(cpu)) is None
    assert "cannot read" in invariant_problem(str(tmp_path / "none"))

    prog = str(compile_c(["probed.c"], out_name="probed_plain"))
    st = os.stat(prog)
    dev = (os.major(st.st_dev), os.minor(st.st_dev))
    exe = MapEntry(0x400000, 0x401000, "r-xp", 0, prog, dev, st.st_ino)
    assert cxx_problem([exe], prog) is None
    cxx = MapEntry(0x7f0000000000, 0x7f0000001000, "r-xp", 0,
                   "/usr/lib/x86_64-linux-gnu/libstdc++.so.6.0.30")
    assert "maps libstdc++.so.6.0.30" in cxx_problem([exe, cxx], prog)
    thrower = tmp_path / "thrower.c"
    thrower.write_text("void __cxa_throw(void *a, void *b, void (*c)(void *)) {}\n"
                       "int main(void) { __cxa_throw(0, 0, 0); return 0; }\n")
    static = str(compile_c([thrower], out_name="thrower"))
    st = os.stat(static)
    mod = MapEntry(0x400000, 0x401000, "r-xp", 0, static,
                   (os.major(st.st_dev), os.minor(st.st_dev)), st.st_ino)
    assert "defines __cxa_throw" in cxx_problem([mod], static)

    assert shadow_stack_problem(b"Name:\tx\nx86_Thread_features:\tshstk wrss\n")
    assert shadow_stack_problem(b"Name:\tx\nx86_Thread_features:\t\n") is None
    assert shadow_stack_problem(b"Name:\tx\n") is None and shadow_stack_problem(None) is None
