"""The ELF file view as the loader would map it: a PIE's pointer tables in
``.data.rel.ro`` hold base + addend (R_X86_64_RELATIVE) and are read-only
(PT_GNU_RELRO), while slots the loader fills from other modules stay untrusted.

Without this, ``dbr analyze`` saw a PIE's const function-pointer table as zeros in
writable memory: an indirect call through it had no known target, its callees were
not inlined, and the offline selection found less than the service finds live.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import capstone
import pytest

from dbr_service.region.discovery import hot_code_discovery
from dbr_service.region.memview import ElfMemoryView
from dbr_service.region.model import TermKind

lief = pytest.importorskip("lief")

PROGS = Path(__file__).resolve().parent.parent / "region_progs"
BASE = 0x555555554000

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None or shutil.which("strip") is None,
                                reason="needs gcc and strip")


@pytest.fixture(scope="module")
def relro_build(tmp_path_factory):
    d = tmp_path_factory.mktemp("relro")
    full, stripped = d / "relro", d / "relro.stripped"
    subprocess.run(["gcc", "-O2", "-fPIE", "-pie", "-Wl,-z,relro,-z,now", "-o", str(full),
                    str(PROGS / "relro.c")], check=True, capture_output=True, timeout=60)
    subprocess.run(["strip", "-o", str(stripped), str(full)], check=True, timeout=60)
    elf = lief.ELF.parse(str(full))
    syms = {s.name: s.value for s in elf.symbols if s.name}
    step = next(s for s in elf.symbols if s.name == "step")
    return stripped, syms, (step.value, step.value + step.size)


def test_pointer_table_is_relocated_and_read_only(relro_build):
    exe, syms, _ = relro_build
    mem = ElfMemoryView(str(exe), base=BASE)
    table = BASE + syms["table"]
    slots = [int.from_bytes(mem.read(table + 8 * i, 8), "little") for i in range(4)]
    assert slots == [BASE + syms[f"f{i}"] for i in range(4)]
    assert mem.is_readonly_range(table, 32) and mem.perms(table) == "r--"
    # the RW segment past RELRO stays writable
    data = next(r for r in mem.ranges() if r.perms == "rw-")
    assert data.start >= table + 32


def test_import_slots_stay_untrusted(relro_build):
    exe, _, _ = relro_build
    mem = ElfMemoryView(str(exe), base=BASE)
    slots = [a for a in mem._got if mem.import_name(a) in ("printf", "__libc_start_main")]
    assert slots
    for a in slots:
        assert mem.perms(a) == "r--"                    # inside RELRO (-z now)...
        assert not mem.is_readonly_range(a, 8)          # ...but its value is not in the file
        assert not mem.is_readonly_range(a - 4, 8)      # nor any read overlapping it


def test_transfer_through_the_table_has_its_four_targets(relro_build):
    exe, syms, (lo, hi) = relro_build
    mem = ElfMemoryView(str(exe), base=BASE)
    cs = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    insns = list(cs.disasm(mem.read(BASE + lo, hi - lo), BASE + lo))
    # gcc -O2: lea rdx, [rip+table]; ...; and eax, 3; jmp qword ptr [rdx + rax*8] (a
    # tail call; calls.c in bench/ has the same table behind a call)
    icall = next(i for i in insns
                 if i.mnemonic in ("call", "jmp") and i.op_str.startswith("qword ptr"))
    samples = {i.address: 5.0 for i in insns}
    sr = hot_code_discovery(samples, mem, jumps_from_hot_limit=2)
    bb = next(b for k, b in sr.blocks()
              if b.term in (TermKind.ICALL, TermKind.IJMP) and b.contains(icall.address))
    assert sorted(bb.targets) == sorted(BASE + syms[f"f{i}"] for i in range(4))
    assert not bb.unknown_target       # a bounded index into read-only memory: complete
