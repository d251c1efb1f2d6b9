"""dbr_service/common/symbols.py: function names for addresses from .symtab/.dynsym, checked
against nm; stripped programs fall back to .dynsym or nothing; any file, however
malformed, gives a table or OSError, never another exception."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dbr_service.common import symbols as S

SRC = r"""
#include <stdio.h>
static int __attribute__((noinline)) helper(int x) { return x * 3 + 1; }
int __attribute__((noinline)) exported(int x) { return helper(x) ^ 5; }
int alias_name(int x) __attribute__((alias("exported")));
int main(int c, char **v) { printf("%d\n", exported(c) + alias_name(c)); return 0; }
"""


def _nm(path) -> dict[str, tuple[int, int]]:
    out = subprocess.run(["nm", "-S", "--defined-only", str(path)], capture_output=True,
                         text=True, check=True).stdout
    got = {}
    for ln in out.splitlines():
        f = ln.split()
        if len(f) == 4 and f[2] in "tTiW":
            got[f[3]] = (int(f[0], 16), int(f[1], 16))
    return got


@pytest.fixture(scope="module")
def progs(tmp_path_factory):
    d = tmp_path_factory.mktemp("syms")
    (d / "p.c").write_text(SRC)
    out = {}
    for name, flags in {"pie": ["-O2"], "nopie": ["-O2", "-no-pie"],
                        "stripped": ["-O2", "-s"], "rdynamic": ["-O2", "-s", "-rdynamic"]}.items():
        subprocess.run(["gcc", *flags, "-o", str(d / name), str(d / "p.c")], check=True)
        out[name] = d / name
    return out


@pytest.mark.parametrize("kind", ["pie", "nopie"])
def test_names_match_nm(progs, kind):
    t = S.read_symbols(str(progs[kind]))
    assert t.source == ".symtab"
    want = _nm(progs[kind])
    for name in ("main", "helper"):
        lo, size = want[name]
        assert t.lookup(lo) == (name, 0)
        assert t.lookup(lo + size - 1) == (name, size - 1)
    lo, size = want["exported"]
    assert t.lookup(lo + 1) == ("exported", 1)          # the global name, not the alias
    assert t.first_load == (0x400000 if kind == "nopie" else 0)
    off = lo + 1 - t.first_load
    assert S.describe(t, str(progs[kind]), off) == "exported+0x1"


def test_stripped_program_has_no_names_and_rdynamic_keeps_the_exported(progs):
    t = S.read_symbols(str(progs["stripped"]))
    assert len(t) == 0 and t.source == ""
    assert S.describe(t, "/x/prog", 0x1234) == "prog+0x1234"
    r = S.read_symbols(str(progs["rdynamic"]))
    assert r.source == ".dynsym"
    names = {s.name for s in r._syms}
    assert {"main", "exported"} <= names and "helper" not in names


def test_libc_dynsym():
    path = "/lib/x86_64-linux-gnu/libc.so.6"
    t = S.symbols_of(path)
    assert len(t) > 1000 and t.source in (".symtab", ".dynsym")
    assert S.symbols_of(path) is t                      # cached per file identity


def test_not_elf_and_missing(tmp_path):
    f = tmp_path / "x"
    f.write_bytes(b"#!/bin/sh\necho hi\n")
    assert len(S.read_symbols(str(f))) == 0
    assert len(S.symbols_of(str(tmp_path / "missing"))) == 0
    assert len(S.symbols_of(str(tmp_path))) == 0          # a directory


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_malformed_files_never_raise(progs, data):
    raw = bytearray((progs["nopie"]).read_bytes())
    rnd = random.Random(data.draw(st.integers(0, 2**32)))
    for _ in range(data.draw(st.integers(1, 40))):
        # header fields, section headers and symbol entries are where lengths live
        zone = rnd.choice([(0, 64), (len(raw) - 4096, len(raw)), (0, len(raw))])
        i = rnd.randrange(max(zone[0], 0), zone[1])
        raw[i] = rnd.randrange(256)
    cut = data.draw(st.integers(0, len(raw)))
    for blob in (bytes(raw), bytes(raw[:cut])):
        t = S.parse_symbols(blob)
        t.lookup(0x401000)


def test_analyze_names_addresses_of_a_pie_at_its_base(progs):
    """Region graphs and `dbr analyze` name addresses through FunctionEntries.name:
    the symbol holding it, else the .eh_frame FDE holding it (``fn_START``)."""
    from dbr_service.region.analyze import function_entries
    from dbr_service.region.memview import ElfMemoryView

    lo, _ = _nm(progs["pie"])["helper"]
    name = function_entries(ElfMemoryView(str(progs["pie"]), 0x555555554000)).name
    assert name(0x555555554000 + lo + 2) == "helper+0x2"
    assert name(0x555555554000 + lo) == "helper"
    assert name(0x10) is None
    stripped = function_entries(ElfMemoryView(str(progs["stripped"]))).name
    assert stripped(lo + 2) == f"fn_{lo:x}+0x2"         # no symbols: its FDE's start


def test_hot_spots_are_named_only_from_the_file_the_maps_show(progs, tmp_path):
    """dbr_service/common/hotnames.py: a hot spot gets ``symbol`` from its module file when
    that path is a regular file with the maps' device and inode; a file replaced since
    (another inode), a path that is no regular file or a stripped program: none."""
    import os
    import shutil

    from dbr_service.common.hotnames import name_hotspots
    from dbr_service.common.procmaps import MapEntry, parse_maps

    exe = tmp_path / "pie"
    shutil.copy(progs["pie"], exe)
    st = os.stat(exe)
    dev = (os.major(st.st_dev), os.minor(st.st_dev))
    lo, size = _nm(exe)["helper"]
    line = f"555555554000-555555556000 r-xp 00000000 {dev[0]:02x}:{dev[1]:02x} {st.st_ino}"
    [m] = parse_maps(f"{line}    {exe}\n")
    assert (m.dev, m.ino, m.path) == (dev, st.st_ino, str(exe))

    def named(maps, module=str(exe), offset=lo + 2):
        h = [{"module": module, "offset": offset, "ip": 0x555555554000}]
        name_hotspots(h, maps)
        return h[0].get("symbol")

    assert named([m]) == "helper+0x2"
    assert named([m], offset=lo) == "helper"
    assert named([m._replace(ino=st.st_ino + 1)]) is None        # not the mapped file
    assert named([m._replace(path="/dev/zero")], module="/dev/zero") is None
    assert named([MapEntry(m.lo, m.hi, m.perms, 0, str(exe))]) is None   # no identity
    assert named(None) is None and named([m], offset=None) is None
    s = os.stat(progs["stripped"])
    stripped = m._replace(path=str(progs["stripped"]), ino=s.st_ino,
                          dev=(os.major(s.st_dev), os.minor(s.st_dev)))
    assert named([stripped], module=str(progs["stripped"])) is None


def test_a_passing_read_failure_is_not_kept(monkeypatch, tmp_path):
    """An OSError (EMFILE, say) gives an empty table this once, not for good."""
    exe = os.path.realpath(sys.executable)
    real = S.read_symbols
    S._cache.clear()
    monkeypatch.setattr(S, "read_symbols",
                        lambda p: (_ for _ in ()).throw(OSError(24, "Too many open files")))
    assert len(S.symbols_of(exe)) == 0
    monkeypatch.setattr(S, "read_symbols", real)
    assert len(S.symbols_of(exe)) > 0
