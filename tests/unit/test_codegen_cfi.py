"""Tests of the CFI building block (dbr_service.codegen.cfi and cfi_lsda).

* Parsing and row evaluation against ``readelf --debug-dump=frames-interp``: FDE ranges
  and, at every row readelf prints, the CFA rule and each register's rule, on real
  binaries (python3.11, cc1, libc, libstdc++), programs compiled here (C and C++, -O0
  and -O2) and a linked assembly file that uses every CFA instruction.
* Pointer encodings, augmentations and record forms readelf cannot be made to show
  (64-bit lengths, version 3, ``eh``, every DW_EH_PE format) on hand-built sections.
* LSDAs against g++'s own assembly output (call-site count, actions, type count).
* Translation: the blob re-parsed by the same parser gives, at every copied byte, the
  original's row and call-site entry (landing pads at the original + bias), for shifted
  and for split-and-permuted copies with glue; what cannot be translated raises.
* Hostile input: random mutations of real sections only ever raise CfiError, quickly.
* libgcc's own unwinder through a copy registered with ``__register_frame``
  (backtrace, a caught exception whose landing pad stays in the original, an exception
  passing through), and the same copy unregistered as the control.
"""

from __future__ import annotations

import dataclasses
import random
import re
import shutil
import struct
import subprocess
import time
from pathlib import Path

import capstone
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dbr_service.codegen.cfi import (
    CfiError, Fde, Glue, Image, evaluate, function_ranges, load_eh_frame, parse_eh_frame,
    sleb, translate, uleb)
from dbr_service.codegen.cfi_lsda import parse_lsda
from dbr_service.common.errors import CodegenError
from harness import relocate_copy, symbols

PROGS = Path(__file__).parent.parent / "cfi_progs"
CS = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
CS.detail = True
NAMES = ["rax", "rdx", "rcx", "rbx", "rsi", "rdi", "rbp", "rsp"] + [f"r{i}" for i in range(8, 16)]
REG = {n: i for i, n in enumerate(NAMES)} | {f"xmm{i}": 17 + i for i in range(16)}
SYSTEM = {
    "python3.11": "/usr/bin/python3.11",
    "cc1": "/usr/lib/gcc/x86_64-linux-gnu/12/cc1",
    "libc": "/usr/lib/x86_64-linux-gnu/libc.so.6",
    "libstdc++": "/usr/lib/x86_64-linux-gnu/libstdc++.so.6",
}
pytestmark = pytest.mark.skipif(shutil.which("readelf") is None or shutil.which("g++") is None,
                                reason="needs readelf and g++")


# --------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def progs(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("cfi_progs")
    out = {}
    builds = {"eh-O0": ("g++", "-O0", "eh.cpp"), "eh-O2": ("g++", "-O2", "eh.cpp"),
              "plain-O0": ("gcc", "-O0", "plain.c"),
              "plain-O2": ("gcc", "-O2 -fexceptions", "plain.c"),
              "opcodes": ("gcc", "-nostdlib -static -no-pie", "opcodes.s")}
    for name, (cc, flags, src) in builds.items():
        out[name] = d / name
        subprocess.run([cc, *flags.split(), "-o", str(out[name]), str(PROGS / src)], check=True)
    subprocess.run(["g++", "-O2", "-S", "-o", str(d / "eh-O2.s"), str(PROGS / "eh.cpp")],
                   check=True)
    out["eh-O2.s"] = d / "eh-O2.s"
    return out


def module(progs, name: str) -> str:
    return SYSTEM[name] if name in SYSTEM else str(progs[name])


def section(path, name: str) -> tuple[int, int, int]:
    """(address, file offset, size) of a section, by readelf -S."""
    out = subprocess.run(["readelf", "-SW", str(path)], capture_output=True, text=True,
                         check=True).stdout
    for line in out.splitlines():
        f = line.replace("[ ", "[").split()
        if len(f) > 5 and f[1] == name:
            return int(f[3], 16), int(f[4], 16), int(f[5], 16)
    raise KeyError(name)


# --------------------------------------------------------------------------- readelf

FDE_RE = re.compile(r"^([0-9a-f]{8,16}) [0-9a-f]+ [0-9a-f]{8,16} FDE cie=[0-9a-f]+ "
                    r"pc=([0-9a-f]+)\.\.([0-9a-f]+)")
ROW_RE = re.compile(r"^([0-9a-f]{8,16}) (\S+)\s+(.*)$")
TOK_RE = re.compile(r"r\d+ \([^)]*\)|\S+")


def readelf_fdes(path, max_lines: int | None = None) -> dict[int, tuple]:
    """FDE section offset -> (start, end, column names, [(loc, cfa, [rule tokens])]), from
    the first ``max_lines`` lines of readelf's output (all by default; the last FDE read
    is dropped when cut short)."""
    p = subprocess.Popen(["readelf", "--debug-dump=frames-interp", str(path)],
                         stdout=subprocess.PIPE, text=True)    # exits 1 on libc: ignored
    fdes, cur, last = {}, None, None
    try:
        for n, line in enumerate(p.stdout):
            if max_lines is not None and n >= max_lines:
                fdes.pop(last, None)
                break
            if m := FDE_RE.match(line):
                last = int(m[1], 16)
                cur = fdes[last] = (int(m[2], 16), int(m[3], 16), [], [])
            elif " CIE " in line:
                cur = None
            elif cur is not None and line.startswith("   LOC"):
                cur[2].extend(line.split()[2:])
            elif cur is not None and (m := ROW_RE.match(line)):
                cur[3].append((int(m[1], 16), m[2], TOK_RE.findall(m[3])))
    finally:
        p.kill()
        p.wait()
    return fdes


def fmt_cfa(cfa) -> str:
    return "exp" if cfa.reg is None else f"{NAMES[cfa.reg]}{cfa.offset:+d}"


def fmt_rule(rule) -> str:
    if rule is None or rule.kind == "undefined":
        return "u"
    return {"same": "s", "offset": f"c{rule.arg:+d}" if rule.kind == "offset" else "",
            "val_offset": f"v{rule.arg:+d}" if rule.kind == "val_offset" else "",
            "register": f"r{rule.arg}", "expression": "exp",
            "val_expression": "vexp"}[rule.kind]


def compare_with_readelf(path, max_lines: int | None = None) -> tuple[int, int]:
    """Check the FDE ranges and rows of the FDEs readelf prints in its first ``max_lines``
    lines (the set of FDEs too when all are read); returns (FDEs, rows) compared."""
    eh = load_eh_frame(str(path))
    ref = readelf_fdes(path, max_lines)
    mine = {f.addr - eh.addr: f for f in eh.fdes}
    assert set(mine) == set(ref) if max_lines is None else set(ref) <= set(mine)
    nf = nrows = 0
    for off, (start, end, cols, rows) in sorted(ref.items()):
        f = mine[off]
        if f.start:
            assert (f.start, f.end) == (start, end), hex(off)
        nf += 1
        table = evaluate(f)
        regs = [f.cie.ra_reg if c == "ra" else REG.get(c) for c in cols]
        for loc, cfa, toks in rows:
            if not start <= loc < end:
                continue
            row = table.row_at(loc)
            assert fmt_cfa(row.cfa) == cfa, (hex(off), hex(loc))
            for reg, tok in zip(regs, toks):
                if reg is not None:
                    assert fmt_rule(row.rule(reg)) == tok.split(" ")[0], (hex(off), hex(loc), reg)
            named = {r for r in regs if r is not None}
            assert all(r in named for r, _ in row.regs if r < 33), (hex(off), hex(loc))
            nrows += 1
    return nf, nrows


@pytest.mark.parametrize("name", ["python3.11", "cc1", "libc", "libstdc++", "eh-O0", "eh-O2",
                                  "plain-O0", "plain-O2", "opcodes"])
def test_rows_match_readelf(progs, name):
    path = module(progs, name)
    if not Path(path).exists():
        pytest.skip(f"{path} not installed")
    nf, nrows = compare_with_readelf(path, 40000 if name in ("cc1", "python3.11") else None)
    assert nf >= (4 if name == "opcodes" or name.startswith(("eh", "plain")) else 2000)
    assert nrows >= nf


def test_every_cfa_instruction_in_the_assembly_file(progs):
    """The linked opcodes.s uses every CFA instruction (gas picks advance_loc1/2/4);
    beyond readelf's columns, check what it does not show: args_size and expressions."""
    eh = load_eh_frame(str(progs["opcodes"]))
    syms = symbols(progs["opcodes"])
    f = eh.find(syms["everything"][0])
    ops = {b for b in f.instructions}
    table = evaluate(f)
    assert {0x02, 0x03, 0x04} <= ops                       # advance_loc1/2/4 were emitted
    sizes = {r.args_size for r in table.rows}
    assert {0, 16} <= sizes
    exprs = {r.cfa.expr for r in table.rows if r.cfa.reg is None}
    assert bytes([0x77, 0x08, 0x06]) in exprs
    sig = eh.find(syms["sigframe"][0])
    assert sig.cie.signal and sig.cie.augmentation.endswith("S")
    pers = eh.find(syms["with_personality"][0])
    assert pers.cie.personality == syms["my_personality"][0]
    assert function_ranges(eh) == sorted(function_ranges(eh))


def test_function_ranges_are_the_functions(progs):
    for name in ("eh-O2", "plain-O0", "plain-O2"):
        ranges = function_ranges(str(progs[name]))
        assert all(a < b <= c < d for (a, b), (c, d) in zip(ranges, ranges[1:]))
        syms = symbols(progs[name])
        for fn in ("main", "copyme", "thrower", "leaf", "vla", "many", "big", "cleaned"):
            if fn in syms:
                assert syms[fn] in ranges, (name, fn)
    # Without section headers: found through PT_GNU_EH_FRAME's .eh_frame_hdr.
    stripped = progs["plain-O2"].with_name("no-sections")
    data = bytearray(progs["plain-O2"].read_bytes())
    struct.pack_into("<Q", data, 0x28, 0)                  # e_shoff
    struct.pack_into("<HHH", data, 0x3A, 0, 0, 0)          # e_shentsize, e_shnum, e_shstrndx
    stripped.write_bytes(bytes(data))
    assert function_ranges(str(stripped)) == function_ranges(str(progs["plain-O2"]))
    ranges = function_ranges("/usr/lib/x86_64-linux-gnu/libc.so.6")
    assert len(ranges) > 3000 and all(b <= c for (_, b), (c, _) in zip(ranges, ranges[1:]))


# --------------------------------------------------------------------------- hand-built

class Sec:
    """Builds an .eh_frame section at ``addr`` record by record."""

    def __init__(self, addr: int = 0x10000):
        self.addr, self.data = addr, bytearray()

    def record(self, body: bytes, wide: bool = False) -> int:
        at = len(self.data)
        self.data += (struct.pack("<IQ", 0xFFFFFFFF, len(body)) if wide
                      else struct.pack("<I", len(body))) + body
        return at

    def cie(self, aug=b"zR", augdata=b"\x1b", init=b"\x0c\x07\x08\x90\x01", version=1,
            ra=16, data_align=-8, eh=b"", wide=False) -> int:
        body = (b"\0\0\0\0" + bytes([version]) + aug + b"\0" + eh + uleb(1) + sleb(data_align)
                + (bytes([ra]) if version == 1 else uleb(ra))
                + (uleb(len(augdata)) + augdata if aug.startswith(b"z") else b"") + init)
        return self.record(body, wide)

    def fde(self, cie: int, pc: bytes, size: bytes, augdata: bytes | None, insns: bytes,
            wide=False) -> int:
        at = len(self.data)
        id_pos = at + (12 if wide else 4)
        body = struct.pack("<I", id_pos - cie) + pc + size
        body += (uleb(len(augdata)) + augdata if augdata is not None else b"") + insns
        return self.record(body, wide)

    def here(self, wide=False) -> int:
        """Address of an FDE's pc_begin field if the FDE starts now."""
        return self.addr + len(self.data) + (16 if wide else 8)

    def parse(self, **kw):
        return parse_eh_frame(bytes(self.data), self.addr, **kw)


@pytest.mark.parametrize("enc", [0x00, 0x02, 0x03, 0x04, 0x0A, 0x0B, 0x0C, 0x01, 0x09,
                                 0x10, 0x12, 0x13, 0x14, 0x1A, 0x1B, 0x1C, 0x11, 0x19])
def test_pointer_encodings(enc):
    fmt = {0: "<Q", 2: "<H", 3: "<I", 4: "<Q", 0xA: "<h", 0xB: "<i", 0xC: "<q"}
    s = Sec()
    c = s.cie(augdata=bytes([enc]))
    signed = enc & 0x0F in (0x09, 0x0A, 0x0B, 0x0C)
    if enc & 0x10:                                 # pcrel: forwards, or backwards if signed
        target = s.here() + (-0x1234 if signed else 0x1234)
    else:
        target = 0x1234 if enc & 0x0F in (2, 0xA) else 0x401000
    raw = target - s.here() if enc & 0x10 else target
    pack = (lambda v: uleb(v)) if enc & 0x0F == 1 else (lambda v: sleb(v)) \
        if enc & 0x0F == 9 else (lambda v: struct.pack(fmt[enc & 0x0F], v))
    s.fde(c, pack(raw), pack(0x40), b"", b"\x41\x0e\x10")
    s.data += b"\0\0\0\0"
    (f,) = s.parse().fdes
    assert (f.start, f.end) == (target, target + 0x40)
    rows = evaluate(f).rows
    assert [(r.start, fmt_cfa(r.cfa)) for r in rows] == [(target, "rsp+8"), (target + 1, "rsp+16")]


def test_cie_forms_personality_lsda_and_terminators():
    s = Sec()
    # zPLR: indirect pcrel personality (a slot address), pcrel LSDA, udata4 pc_begin.
    pers_field = s.addr + len(s.data) + 4 + 4 + 1 + 5 + 1 + 1 + 1 + 1 + 1
    slot = 0x20000
    c1 = s.cie(aug=b"zPLR", augdata=b"\x9b" + struct.pack("<i", slot - pers_field) + b"\x1b\x03")
    lsda_field = s.here() + 8 + 1
    s.fde(c1, struct.pack("<I", 0x5000), struct.pack("<I", 0x10),
          struct.pack("<i", 0x30000 - lsda_field), b"")
    # Version 3 with a uleb return-address register; 64-bit length records.
    c3 = s.cie(version=3, ra=16, wide=True)
    s.fde(c3, struct.pack("<i", 0x6000 - s.here(wide=True)), struct.pack("<i", 8), b"",
          b"\x0e\x10", wide=True)
    s.data += b"\0\0\0\0"
    # Old "eh" augmentation (an 8-byte eh_ptr, no augmentation data; absptr pc_begin).
    ceh = s.cie(aug=b"eh", eh=b"\0" * 8)
    s.fde(ceh, struct.pack("<Q", 0x7000), struct.pack("<Q", 4), None, b"")
    s.data += b"\0\0\0\0"
    eh = s.parse()
    f1, f3, feh = eh.fdes
    assert f1.cie.personality == slot and f1.cie.personality_enc == 0x9B
    assert f1.lsda == 0x30000 and (f1.start, f1.end) == (0x5000, 0x5010)
    assert f3.cie.version == 3 and (f3.start, f3.end) == (0x6000, 0x6008)
    assert fmt_cfa(evaluate(f3).rows[0].cfa) == "rsp+16"
    assert feh.cie.augmentation == "" and (feh.start, feh.end) == (0x7000, 0x7004)
    assert len(s.parse(stop_at_terminator=True).fdes) == 2
    assert function_ranges(eh) == [(0x5000, 0x5010), (0x6000, 0x6008), (0x7000, 0x7004)]


def test_opcodes_rows_by_hand():
    """DWARF 4 6.4.2 semantics the readelf comparison cannot reach: set_loc, restore to
    the CIE's rule, remember/restore of the CFA, MIPS_advance_loc8, GNU_args_size kept
    out of remembered state (as libgcc), unknown opcodes."""
    s = Sec()
    c = s.cie(augdata=b"\x00")                     # absptr pc_begin, so set_loc is absolute
    prog = (b"\x0e\x10\x83\x02"                    # 0x100: cfa rsp+16, rbx at c-16
            + b"\x01" + struct.pack("<Q", 0x110)     # set_loc 0x110
            + b"\x0a\x0e\x20\x2e\x08\x09\x03\x0c"    # remember; cfa 32; args 8; rbx in r12
            + b"\x1d" + struct.pack("<Q", 4)         # MIPS_advance_loc8 -> 0x114
            + b"\x0b\x10\x06\x02\x76\x00"            # restore_state; rbp expression
            + b"\x42\xc3\x90\x05"                    # 0x116: restore rbx (CIE: none); ra c-40
            + b"\x42\x06\x10")                       # 0x118: restore_extended ra -> CIE c-8
    s.fde(c, struct.pack("<Q", 0x100), struct.pack("<Q", 0x20), b"", prog)
    (f,) = s.parse().fdes
    rows = [(r.start, r.end, fmt_cfa(r.cfa), fmt_rule(r.rule(3)), fmt_rule(r.rule(6)),
             fmt_rule(r.rule(16)), r.args_size) for r in evaluate(f).rows]
    assert rows == [
        (0x100, 0x110, "rsp+16", "c-16", "u", "c-8", 0),
        (0x110, 0x114, "rsp+32", "r12", "u", "c-8", 8),
        (0x114, 0x116, "rsp+16", "c-16", "exp", "c-8", 8),
        (0x116, 0x118, "rsp+16", "u", "exp", "c-40", 8),
        (0x118, 0x120, "rsp+16", "u", "exp", "c-8", 8),
    ]
    for bad in (b"\x1c", b"\x2d", b"\x0b", b"\x42\x01" + struct.pack("<Q", 0x100),
                b"\x0f\x05\x00", b"\x83"):
        s = Sec()
        c = s.cie(augdata=b"\x00")
        s.fde(c, struct.pack("<Q", 0x100), struct.pack("<Q", 0x20), b"", bad)
        with pytest.raises(CfiError):
            evaluate(s.parse().fdes[0])


@pytest.mark.parametrize("mangle", ["huge-length", "wide-huge", "cie-ptr-back", "not-a-cie",
                                    "bad-version", "no-nul", "datarel", "bad-format", "leb",
                                    "aug-len", "truncated"])
def test_hostile_sections_raise_cfierror(mangle):
    s = Sec()
    c = s.cie(augdata=b"\x1b")
    s.fde(c, struct.pack("<i", 0x100), struct.pack("<i", 0x10), b"", b"\x0e\x10")
    d = bytearray(s.data)
    fde = 24
    if mangle == "huge-length":
        d[fde:fde + 4] = struct.pack("<I", 0xFFFFFFF0)
    elif mangle == "wide-huge":
        d[fde:fde + 4] = b"\xff\xff\xff\xff"
        d[fde + 4:fde + 4] = struct.pack("<Q", 1 << 62)
    elif mangle == "cie-ptr-back":
        d[fde + 4:fde + 8] = struct.pack("<I", 0x7FFFFFFF)
    elif mangle == "not-a-cie":
        d[fde + 4:fde + 8] = struct.pack("<I", 4)
    elif mangle == "bad-version":
        d[8] = 2
    elif mangle == "no-nul":
        d[9:24] = b"z" * 15
    elif mangle in ("datarel", "bad-format"):
        d[17] = 0x3B if mangle == "datarel" else 0x07
    elif mangle == "leb":
        d[11:24] = b"\xff" * 13
    elif mangle == "aug-len":
        d[16] = 0x7F
    elif mangle == "truncated":
        d = d[:-3]
    with pytest.raises(CfiError):
        eh = parse_eh_frame(bytes(d), 0x10000)
        for f in eh.fdes:
            evaluate(f)
    assert issubclass(CfiError, CodegenError)


# --------------------------------------------------------------------------- LSDA

def gxx_lsda(asm: str, fn: str) -> dict:
    """The call-site table, actions and type count of ``fn``'s (hot) LSDA in g++ -S."""
    body = asm[asm.index(f"\n{fn}:"):]
    label = re.search(r"\.cfi_lsda 0x1b,(\.LLSDA\d+)", body)[1]
    lines = [ln.strip() for ln in asm[asm.index(f"\n{label}:") + 1:].splitlines()[1:]]
    i = next(k for k, ln in enumerate(lines) if ln.startswith(".LLSDACSB"))
    j = next(k for k, ln in enumerate(lines) if ln.startswith(".LLSDACSE"))
    sites = [lines[k:k + 4] for k in range(i + 1, j, 4)]
    rest = []
    for ln in lines[j + 1:]:
        if ln.startswith((".LLSDATT", ".text", ".section")) or ln.endswith(":"):
            break
        rest.append(ln)
    return {"lpstart": lines[0], "ttype": lines[1],
            "actions": [int(s[3].split()[-1], 0) for s in sites],
            "landing": [s[2].split()[-1] != "0" for s in sites],
            "types": sum(ln.startswith(".long") for ln in rest)}


def test_lsda_matches_gxx_assembly(progs):
    asm = progs["eh-O2.s"].read_text()
    eh = load_eh_frame(str(progs["eh-O2"]))
    syms = symbols(progs["eh-O2"])
    for fn in ("copyme", "main"):
        want = gxx_lsda(asm, fn)
        f = eh.find(syms[fn][0])
        lsda = parse_lsda(eh.image, f.lsda, f.start, f.cie.fde_enc)
        assert [c.action for c in lsda.call_sites] == want["actions"]
        assert [bool(c.landing_pad) for c in lsda.call_sites] == want["landing"]
        assert len(lsda.types) == want["types"] and want["lpstart"] == ".byte\t0xff"
        assert lsda.ttype_enc == int(want["ttype"].split()[-1], 0)
        cold = syms.get(f"{fn}.cold", (0, 0))
        for c in lsda.call_sites:
            assert f.start <= c.start < c.end <= f.end
            assert c.landing_pad == 0 or f.start <= c.landing_pad < f.end \
                or cold[0] <= c.landing_pad < cold[1]
        if fn == "copyme":                   # its calls (through cb) can all throw
            code = eh.image.cursor(f.start).bytes(f.end - f.start)
            calls = [i for i in CS.disasm(code, f.start) if i.mnemonic == "call"]
            assert len(calls) == 2 and all(lsda.site_at(i.address) for i in calls)


def test_lsdas_of_libstdcxx_parse():
    eh = load_eh_frame(SYSTEM["libstdc++"])
    n = 0
    for f in eh.fdes:
        if f.lsda is None:
            continue
        lsda = parse_lsda(eh.image, f.lsda, f.start, f.cie.fde_enc)
        starts = [c.start for c in lsda.call_sites]
        assert starts == sorted(starts)
        for c in lsda.call_sites:
            assert f.start <= c.start < c.end <= f.end
            assert c.landing_pad == 0 or eh.find(c.landing_pad) is not None
        n += 1
    assert n > 1000


def test_lsdas_with_specs_and_catch_all_translate():
    """Every libstdc++ function whose LSDA has exception specifications or a catch-all
    (null type entry): the copy's tables reach the same specs and types."""
    eh = load_eh_frame(SYSTEM["libstdc++"])
    bias, n = 0x7F55_0000_0000, {"specs": 0, "catch-all": 0}
    for f in eh.fdes:
        if f.lsda is None:
            continue
        lsda = parse_lsda(eh.image, f.lsda, f.start, f.cie.fde_enc)
        if not lsda.specs and all(v for v, _ in lsda.types):
            continue
        n["specs"] += bool(lsda.specs)
        n["catch-all"] += any(v == 0 for v, _ in lsda.types)
        layout = [(0x7E00_0000_0000 + f.start, 0x7E00_0000_0000 + f.end, f.start)]
        blob = translate(f, layout, (0x7E00_0100_0000 + f.start) & ~7, bias=bias)
        check_copy(f, layout, blob, bias, every_byte=False)
        new = parse_eh_frame(blob.data, blob.at, stop_at_terminator=True).fdes[0]
        got = parse_lsda(Image.from_bytes(blob.at, blob.data), new.lsda, new.start,
                         new.cie.fde_enc)
        assert got.specs == lsda.specs and len(got.types) == len(lsda.types)
    assert n["specs"] >= 10 and n["catch-all"] >= 100


# --------------------------------------------------------------------------- translation

def check_copy(fde: Fde, layout, blob, bias: int = 0, every_byte: bool = True) -> int:
    """At each copied byte (or each row boundary), the blob's row and call-site entry
    equal the original's at the mapped address.  Returns the addresses checked."""
    eh = parse_eh_frame(blob.data, blob.at, stop_at_terminator=True)
    assert blob.register_at == blob.at and blob.data[len(blob.data) - 4:] != b"" \
        and len(eh.fdes) == len(blob.ranges)
    orig = evaluate(fde)
    image = Image.from_bytes(blob.at, blob.data)
    lsda0 = parse_lsda(fde.image, fde.lsda, fde.start, fde.cie.fde_enc) if fde.lsda else None
    tables = [(f, evaluate(f), parse_lsda(image, f.lsda, f.start, f.cie.fde_enc)
               if f.lsda else None) for f in eh.fdes]
    if fde.cie.personality is not None:
        assert eh.fdes[0].cie.personality == fde.cie.personality + bias
        assert eh.fdes[0].cie.personality_enc & 0x80 == fde.cie.personality_enc & 0x80
    n = 0
    for item in layout:
        lo, hi, o = item
        glue = isinstance(item, Glue)
        if every_byte or glue:
            addrs = range(lo, hi)
        else:
            marks = {r.start for r in orig.rows} | {r.end - 1 for r in orig.rows}
            if lsda0:
                marks |= {c.start for c in lsda0.call_sites} | {c.end for c in lsda0.call_sites}
            addrs = sorted({lo, hi - 1} | {lo + m - o for m in marks if o <= m < o + hi - lo})
        for a in addrs:
            src = o if glue else o + a - lo
            f, t, lsda = next(x for x in tables if x[0].start <= a < x[0].end)
            assert t.row_at(a).state() == orig.row_at(src).state(), (hex(a), hex(src))
            if lsda0:
                want, got = lsda0.site_at(src), lsda.site_at(a)
                assert (got is None) == (want is None), hex(a)
                if want:
                    assert got.action == want.action
                    assert got.landing_pad == (want.landing_pad + bias if want.landing_pad else 0)
            n += 1
    for *_, lsda in tables if lsda0 else ():
        # What the copy's call sites reach of the tables is the original's, types relocated.
        assert lsda0.actions.startswith(lsda.actions) and lsda0.specs.startswith(lsda.specs)
        want = [v + bias if v else 0 for v, _ in lsda0.types]
        assert [v for v, _ in lsda.types] == want[:len(lsda.types)]
        assert lsda.ttype_enc & 0x80 == lsda0.ttype_enc & 0x80 or not lsda.types
    return n


def sample_fdes(eh, k: int, seed: int, lsda: bool | None = None) -> list[Fde]:
    pool = [f for f in eh.fdes if f.start and f.end > f.start
            and (lsda is None or (f.lsda is not None) == lsda)]
    return random.Random(seed).sample(pool, min(k, len(pool)))


@pytest.mark.parametrize("name,bias", [("libstdc++", 0x7F12_3400_0000), ("cc1", 0),
                                       ("eh-O2", 0x5555_5555_4000), ("plain-O2", 0x1000)])
def test_shifted_copy_has_the_same_rows(progs, name, bias):
    eh = load_eh_frame(module(progs, name))
    at = 0x7F00_0000_0000
    done = lsdas = refused = 0
    fdes = sample_fdes(eh, 60, 1, True) + sample_fdes(eh, 150, 2, False)
    for i, f in enumerate(fdes):
        new = (f.start + bias + 0x4000_0000) & ~0xF | (f.start & 0xF)
        layout = [(new, new + f.end - f.start, f.start)]
        try:                                       # odd: pc_begin pc-relative, even: absolute
            blob = translate(f, layout, (new + 0x10_0000) & ~7 if i % 2 else at, bias=bias)
        except CfiError as e:
            assert "program counter" in str(e), e             # PLT stubs
            refused += 1
            continue
        check_copy(f, layout, blob, bias, every_byte=f.end - f.start < 512)
        done += 1
        lsdas += blob.has_lsda
    assert refused <= 3 and done == len(fdes) - refused
    assert lsdas >= min(10, sum(f.lsda is not None for f in fdes))


def instruction_starts(f: Fde) -> list[int]:
    code = f.image.cursor(f.start).bytes(f.end - f.start)
    return [i.address for i in CS.disasm(code, f.start)]


def split_layout(f: Fde, cuts, order, base: int, glue: bool):
    bounds = [f.start, *cuts, f.end]
    pieces = [(bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]
    layout, at = [], base
    for k in order:
        o_lo, o_hi = pieces[k]
        layout.append((at, at + o_hi - o_lo, o_lo))
        at += o_hi - o_lo
        if glue and o_hi < f.end:
            layout.append(Glue(at, at + 5, o_hi))
            at += 5
        elif not glue:
            at += 16                               # a gap: the next piece starts a new FDE
    return layout


@pytest.mark.parametrize("name,bias", [("cc1", 0), ("libstdc++", 0x7F12_3400_0000)])
def test_split_and_permuted_copy_has_the_same_rows(progs, name, bias):
    eh = load_eh_frame(module(progs, name))
    rng = random.Random(5)
    done = 0
    for f in sample_fdes(eh, 400, 3):
        if len(evaluate(f).rows) < 4 or not 64 <= f.end - f.start <= 4096:
            continue
        starts = instruction_starts(f)[1:]
        if len(starts) < 6:
            continue
        cuts = sorted(rng.sample(starts, 2))
        for order, glue in (((2, 0, 1), True), ((1, 2, 0), False)):
            layout = split_layout(f, cuts, order, 0x7E00_0000_0000 + rng.randrange(1 << 20),
                                  glue)
            try:
                blob = translate(f, layout, 0x7E00_1000_0000, bias=bias)
            except CfiError as e:
                assert "program counter" in str(e), e
                break
            assert len(blob.ranges) == (1 if glue else 3)
            check_copy(f, layout, blob, bias)
        done += 1
        if done >= 40:
            break
    assert done >= 40


def test_lsda_translation_maps_every_call_site(progs):
    eh = load_eh_frame(str(progs["eh-O2"]))
    syms = symbols(progs["eh-O2"])
    bias = 0x5600_0000_0000
    for fn in ("copyme", "main"):
        f = eh.find(syms[fn][0])
        lsda = parse_lsda(eh.image, f.lsda, f.start, f.cie.fde_enc)
        starts = instruction_starts(f)
        calls = [a for a in starts if eh.image.cursor(a).bytes(1) in (b"\xe8", b"\xff", b"\x41")]
        cuts = [starts[len(starts) // 3], starts[2 * len(starts) // 3]]
        layout = split_layout(f, cuts, (2, 1, 0), 0x7E00_0000_0000, True)
        blob = translate(f, layout, 0x7E00_0001_0000, bias=bias)
        assert blob.has_lsda and calls
        check_copy(f, layout, blob, bias)
        new = parse_eh_frame(blob.data, blob.at, stop_at_terminator=True).fdes[0]
        nl = parse_lsda(Image.from_bytes(blob.at, blob.data), new.lsda, new.start,
                        new.cie.fde_enc)
        pads = {c.landing_pad - bias for c in nl.call_sites if c.landing_pad}
        assert pads == {c.landing_pad for c in lsda.call_sites if c.landing_pad}


def test_untranslatable_raises(progs):
    # The PLT's CFA expression reads rip.
    eh = load_eh_frame(SYSTEM["python3.11"])
    plt = section(SYSTEM["python3.11"], ".plt")[0]
    f = eh.find(plt + 8)
    with pytest.raises(CfiError, match="program counter"):
        translate(f, [(0x100000, 0x100000 + f.end - f.start, f.start)], 0x200000)
    # The signal trampoline's expressions do not: it translates, S kept.
    libc = load_eh_frame(SYSTEM["libc"])
    sig = next(f for f in libc.fdes if f.cie.signal)
    blob = translate(sig, [(0x100000, 0x100000 + sig.end - sig.start, sig.start)], 0x200000,
                     bias=0x7F00_0000_0000)
    assert parse_eh_frame(blob.data, blob.at, stop_at_terminator=True).fdes[0].cie.signal
    check_copy(sig, [(0x100000, 0x100000 + sig.end - sig.start, sig.start)], blob,
               0x7F00_0000_0000)
    # Outside the FDE, overlapping items.
    g = sample_fdes(libc, 1, 9)[0]
    for layout in ([(0x1000, 0x1000 + g.end - g.start + 1, g.start)],
                   [(0x1000, 0x1010, g.start), (0x100F, 0x1011, g.start)],
                   [Glue(0x1000, 0x1005, g.end)], []):
        with pytest.raises(CfiError):
            translate(g, layout, 0x200000)
    # Absolute personality in a relocated module; unknown augmentation letters.
    s = Sec()
    c = s.cie(aug=b"zPR", augdata=b"\x03" + struct.pack("<I", 0x4000) + b"\x1b")
    s.fde(c, struct.pack("<i", 0x100), struct.pack("<i", 0x10), b"", b"\x0e\x10")
    f = s.parse().fdes[0]
    translate(f, [(0x9000, 0x9010, f.start)], 0x20000)
    with pytest.raises(CfiError, match="absolute personality"):
        translate(f, [(0x9000, 0x9010, f.start)], 0x20000, bias=0x1000)
    s = Sec()
    c = s.cie(aug=b"zRB", augdata=b"\x1b")
    s.fde(c, struct.pack("<i", 0x100), struct.pack("<i", 0x10), b"", b"\x0e\x10")
    f = s.parse().fdes[0]
    with pytest.raises(CfiError, match="augmentation"):
        translate(f, [(0x9000, 0x9010, f.start)], 0x20000)


# --------------------------------------------------------------------------- hostile

@pytest.fixture(scope="module")
def real_sections(progs):
    path = progs["eh-O2"]
    out = {}
    for name in (".eh_frame", ".gcc_except_table"):
        addr, off, size = section(path, name)
        out[name] = (addr, path.read_bytes()[off:off + size])
    return out


def mutate(data: bytes, ops) -> bytes:
    d = bytearray(data)
    for kind, pos, val in ops:
        if not d:
            break
        p = pos % len(d)
        if kind == 0:
            d[p] = val
        elif kind == 1:
            d[p] ^= 1 << (val % 8)
        elif kind == 2:
            d[p:p] = bytes([val]) * (1 + val % 5)
        elif kind == 3:
            del d[p:p + 1 + val % 8]
        else:
            d = d[:p]
    return bytes(d)


OPS = st.lists(st.tuples(st.integers(0, 4), st.integers(0, 1 << 20), st.integers(0, 255)),
               min_size=1, max_size=6)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(ops=OPS, target=st.sampled_from([".eh_frame", ".gcc_except_table"]))
def test_mutated_sections_only_raise_cfierror(real_sections, ops, target):
    (ea, eh_bytes), (ga, gx) = real_sections[".eh_frame"], real_sections[".gcc_except_table"]
    if target == ".eh_frame":
        eh_bytes = mutate(eh_bytes, ops)
    else:
        gx = mutate(gx, ops)
    t0 = time.monotonic()
    try:
        eh = parse_eh_frame(eh_bytes, ea, image=Image.from_bytes(ga, gx, pic=True))
        function_ranges(eh)
        for f in eh.fdes:
            try:
                evaluate(f)
                if f.start:
                    translate(f, [(0x7000_0000, 0x7000_0000 + f.end - f.start, f.start)],
                              0x7100_0000, bias=0x1000)
            except CfiError:
                pass
    except CfiError:
        pass
    assert time.monotonic() - t0 < 2.0


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 1 << 30), ops=OPS, junk=st.binary(max_size=48))
def test_mutated_programs_only_raise_cfierror(real_sections, progs, seed, ops, junk):
    """An FDE of a real module with a mutated (or random) CFA program: evaluation and
    translation raise CfiError or produce a blob that reproduces the rows."""
    eh = load_eh_frame(str(progs["eh-O2"]))
    f = random.Random(seed).choice([f for f in eh.fdes if f.start])
    f = dataclasses.replace(f, instructions=mutate(f.instructions, ops) if seed % 3 else junk)
    t0 = time.monotonic()
    try:
        evaluate(f)
        layout = [(0x7000_0000, 0x7000_0000 + f.end - f.start, f.start)]
        check_copy(f, layout, translate(f, layout, 0x7100_0000, bias=0x1000), 0x1000,
                   every_byte=False)
    except CfiError:
        pass
    assert time.monotonic() - t0 < 2.0


# --------------------------------------------------------------------------- libgcc

def run_copy(progs, tmp_path, kind: str, register: bool):
    path = progs["eh-O2"]
    syms = symbols(path)
    eh = load_eh_frame(str(path))
    f = eh.find(syms["copyme"][0])
    p = subprocess.Popen([str(path), "copy"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        head = p.stdout.readline().split()
        copyme_rt, main_rt, area = (int(head[i], 16) for i in (1, 3, 5))
        bias = copyme_rt - syms["copyme"][0]
        code_at, blob_at = area + 0x1230, area + 0x80000
        if kind == "shifted":
            layout = [(code_at, code_at + f.end - f.start, f.start)]
        else:
            insns = list(CS.disasm(f.image.cursor(f.start).bytes(f.end - f.start), f.start))
            call = next(i for i in insns if i.mnemonic == "call")
            ret = next(i for i in insns if i.mnemonic == "ret")
            layout = split_layout(f, [call.address + call.size, ret.address + 1], (2, 1, 0),
                                  code_at, True)
        code = relocate_copy(f, layout, bias)
        entry = next(it[0] for it in layout if not isinstance(it, Glue) and it[2] == f.start)
        blob = translate(f, layout, blob_at, bias=bias)
        (tmp_path / "code").write_bytes(code)
        (tmp_path / "blob").write_bytes(blob.data)
        base = min(it[0] for it in layout)
        assert entry == base or kind == "permuted"
        out, err = p.communicate(f"{tmp_path / 'code'} {base:x} {entry:x} {tmp_path / 'blob'} "
                                 f"{blob_at:x} {int(register)}\n", timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    frames = [int(ln.split()[1], 16) for ln in out.splitlines() if ln.startswith("frame ")]
    main_lo, main_hi = (a + bias for a in syms["main"])
    return p.returncode, out, frames, (base, base + len(code)), (main_lo, main_hi), entry


@pytest.mark.parametrize("kind", ["shifted", "permuted"])
def test_libgcc_unwinds_through_registered_copy(progs, tmp_path, kind):
    rc, out, frames, (lo, hi), (mlo, mhi), entry = run_copy(progs, tmp_path, kind, True)
    assert rc == 0, out
    assert "result -5" in out and "caught escaped" in out, out
    assert any(lo <= a <= hi for a in frames), out
    assert any(mlo <= a < mhi for a in frames), out


def test_unregistered_copy_is_the_control(progs, tmp_path):
    rc, out, frames, (lo, hi), (mlo, mhi), _ = run_copy(progs, tmp_path, "shifted", False)
    assert rc != 0 and "result" not in out
    assert any(lo <= a <= hi for a in frames) and not any(mlo <= a < mhi for a in frames)
