"""Samples at the instruction after a ``syscall`` are the kernel's time, not the
block's executions (discovery.place_samples).  A loop that writes with a raw
``syscall`` every 1024 iterations spent 12 % of its time in the kernel, all of it
sampled at the instruction after the ``syscall``: the block looked 1/13 as hot as
the loop body instead of 1/1024, count inference sent that surplus out by the
write's error branch (both successors unsampled, the shorter path takes the
flow), the loop's trip count fell below the threshold and no region was selected
(stayloop.c before 9a2738f: 2 runs in 4).  Here the same loop, assembled, with the
samples of such a run, through the service's region selection (``dbr analyze``)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import capstone
import pytest

from dbr_service.region.memview import ElfMemoryView

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")

ASM = r"""
.text
.globl _start
_start:
    xor %r9d, %r9d
    xor %r10d, %r10d
    mov $1000000, %ebx
    mov $1, %ebp
    mov $0x1000, %edx
    lea buf(%rip), %rsi
    jmp body
loop:
    add $1, %r9
    add $7, %r10
    cmp %r9, %rbx
    je done
.globl body
body:
    mov %r9, %rax
    imul $0x9e3779b1, %r8d, %r8d
    and $0xfff, %eax
    movzbl (%rsi,%rax), %eax
    add %eax, %r8d
    mov %r10, %rax
    and $0xfff, %eax
    mov %r8d, %ecx
    shr $9, %ecx
    xor %cl, (%rsi,%rax)
    mov %r9, %rax
    and $0x3ff, %eax
    cmp $0x3ff, %rax
    jne loop
    mov %rbp, %rax
    syscall
.globl after
after:
    cmp $0x1000, %rax
    jne fail
    add $1, %r9
    add $7, %r10
    cmp %r9, %rbx
    jne body
done:
    xor %eax, %eax
    ret
fail:
    mov $1, %eax
    ret
.bss
buf: .zero 4096
"""


@pytest.fixture(scope="module")
def prog(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("syscall_samples")
    (d / "loop.s").write_text(ASM)
    exe = d / "loop"
    subprocess.run(["gcc", "-nostdlib", "-static", "-no-pie", "-o", str(exe), str(d / "loop.s")],
                   check=True, capture_output=True)
    return exe


def _symbols(exe: Path) -> dict[str, int]:
    out = subprocess.run(["nm", str(exe)], check=True, capture_output=True, text=True).stdout
    return {f[2]: int(f[0], 16) for f in (line.split() for line in out.splitlines()) if len(f) == 3}


def _analyze(exe: Path, samples: dict[int, int], tmp_path: Path) -> str:
    f = tmp_path / "samples.txt"
    f.write_text("".join(f"{a:#x} {n}\n" for a, n in samples.items()))
    r = subprocess.run([sys.executable, "-m", "dbr_service.commands.cli", "analyze", str(exe),
                        "--samples", str(f)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


def _samples(exe: Path, after: int) -> dict[int, int]:
    """As a run of stayloop.c gave them: the loop body's instructions (``body`` up
    to its ``jne loop``) 200 samples each, the loop's other block (``loop``) 18 at
    one instruction (a write every 1024 iterations: its other instructions draw
    none), and ``after`` samples at the instruction after the syscall."""
    sym = _symbols(exe)
    mem = ElfMemoryView(str(exe))
    md = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    out: dict[int, int] = {}
    for i in md.disasm(mem.read(sym["body"], sym["after"] - sym["body"]), sym["body"]):
        out[i.address] = 200
        if i.mnemonic == "jne":
            break
    out[sym["loop"] + 8] = 18                 # its cmp
    out[sym["after"]] = after
    return out


@pytest.mark.parametrize("after", [60, 240])
def test_kernel_time_after_a_syscall_does_not_hide_the_loop(prog, tmp_path, after):
    """60: the share of the stayloop run (67 of 3286 samples); 240: more time in
    the kernel."""
    out = _analyze(prog, _samples(prog, after=after), tmp_path)
    assert "1 super-region(s)" in out, out


def test_the_loop_is_selected_without_kernel_time_too(prog, tmp_path):
    """The control: the same samples with none after the syscall."""
    out = _analyze(prog, _samples(prog, after=0), tmp_path)
    assert "1 super-region(s)" in out, out
