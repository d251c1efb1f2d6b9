"""Entry sites in patch-point selection (region/patchpoints.py; docs/architecture.md,
"Invariants" 3): a function entry whose first instructions are short is patched at
its start when they span >= 5 bytes and nothing known branches into bytes 1..4.
Also the function-entry index (region/functions.py) and the installer's decoding of
a site's inner boundaries (entry_sites.decode_inner)."""

from __future__ import annotations

import subprocess
from collections import Counter

import pytest

from dbr_service.codegen.cfi import load_eh_frame
from dbr_service.codegen.frames import Module
from dbr_service.installation.entry_sites import decode_inner
from dbr_service.region.functions import FunctionEntries, call_targets
from dbr_service.common.symbols import symbols_of
from dbr_service.region.model import CloneKey
from dbr_service.region.patchpoints import (check_entry_invariant, entry_site_inner,
                                            select_patch_points)
from region_graphs import T, Builder, bb

F = 0x1000


def function(entry_sizes=(1, 3, 4), **kw) -> Builder:
    """f at F: an entry block (push rbp; mov rbp,rsp; sub rsp,16 by default), then a
    loop of short instructions (no 5-byte one: not patchable the old way), then ret."""
    b = Builder()
    loop = F + sum(entry_sizes)
    b.block(F, entry_sizes, T.FALLTHROUGH, count=1, **kw)
    b.block(loop, (3, 2), T.JCC, targets=[loop], count=100)
    b.block(loop + 5, (2,), T.JMP, targets=[0x9000], count=1)
    b.ft(F, loop, 1)
    b.flow(loop, loop, 99)
    b.ft(loop, loop + 5, 1)
    b.exit(loop + 5, 0x9000, 1)
    b.entry(F, 1)
    return b


def test_entry_site_chosen_at_a_function_entry():
    b = function()
    c = Counter()
    assert select_patch_points(b.sr, c, functions={F})
    b.sr.verify()
    check_entry_invariant(b.sr)
    assert b.sr.entry_points() == [F]
    assert b.sr.info["entry_sites"] == {F: [F + 1, F + 4]}
    assert c["entry-sites"] == 1 and c["blocks-split"] == 0


def test_without_function_knowledge_there_is_no_entry_site():
    """The same SR, F not known as a function entry: nothing patchable, dropped."""
    assert not select_patch_points(function().sr)
    assert not select_patch_points(function().sr, functions={F + 0x100})


def test_function_entries_from_region_info():
    b = function()
    b.sr.info["function_entries"] = {F}
    assert select_patch_points(b.sr)
    assert b.sr.info["entry_sites"] == {F: [F + 1, F + 4]}


def test_branch_into_byte_2_refuses_the_site():
    b = function()
    b.block(0x2000, (5,), T.JMP, targets=[F + 2])
    b.exit(0x2000, F + 2)
    b.entry(0x2000)
    assert entry_site_inner(b.sr, F, {F}) is None
    assert select_patch_points(b.sr, functions={F})
    assert b.sr.info["entry_sites"] == {} and F not in b.sr.entry_points()


@pytest.mark.parametrize("into", [F + 1, F + 4])
def test_exit_or_fallthrough_into_the_site_refuses_it(into):
    b = function()
    b.exit(F + 5 + 3, into)        # the loop block exits into the site's bytes
    assert entry_site_inner(b.sr, F, {F}) is None
    b2 = function()
    b2.block(0x2000, (5,), T.FALLTHROUGH, ft=into)
    b2.entry(0x2000)
    b2.exit(0x2000, into)
    assert entry_site_inner(b2.sr, F, {F}) is None


def test_branch_to_byte_0_or_past_byte_4_is_fine():
    b = function()
    b.block(0x2000, (5,), T.JCC, targets=[F], ft=F + 5)
    b.exit(0x2000, F + 5)
    b.flow(0x2000, F)
    b.entry(0x2000)
    assert entry_site_inner(b.sr, F, {F}) == [F + 1, F + 4]


def test_never_in_a_clone():
    b = function()
    clone = bb(F, (1, 3, 4))
    clone.clone_of = F
    key = CloneKey((0x3000,), F)
    b.sr.add_block(clone, key)
    assert entry_site_inner(b.sr, key, {F}) is None
    # the original block is still fine: a clone is a copy elsewhere
    assert entry_site_inner(b.sr, F, {F}) == [F + 1, F + 4]


def test_overlapping_decoded_entry_refuses_the_site():
    b = function()
    b.block(F + 3, (5,), T.JMP, targets=[0x9000], known_exec=False)
    b.exit(F + 3, 0x9000)
    b.entry(F + 3)
    assert entry_site_inner(b.sr, F, {F}) is None


@pytest.mark.parametrize("kw", [{"unpatchable": True}, {"known_exec": False}])
def test_unpatchable_or_not_known_to_execute_refuses_the_site(kw):
    assert entry_site_inner(function(**kw).sr, F, {F}) is None


def test_block_shorter_than_five_bytes_refuses_the_site():
    assert entry_site_inner(function((1, 3)).sr, F, {F}) is None


def test_first_instruction_of_five_bytes_is_an_ordinary_site():
    b = function((5, 1))
    assert entry_site_inner(b.sr, F, {F}) is None
    assert select_patch_points(b.sr, functions={F})
    assert b.sr.entry_points() == [F] and b.sr.info["entry_sites"] == {}
    check_entry_invariant(b.sr)


def test_entry_site_preferred_to_a_split():
    """push rbp; mov rbp,rsp; then a 7-byte instruction: without function knowledge
    the block is split before it; with it, the function entry itself is the site."""
    b = function((1, 3, 7))
    assert select_patch_points(b.sr)
    assert b.sr.entry_points() == [F + 4]
    b = function((1, 3, 7))
    assert select_patch_points(b.sr, functions={F})
    assert b.sr.entry_points() == [F] and b.sr.info["entry_sites"] == {F: [F + 1, F + 4]}


def test_entry_invariant_checks_recorded_boundaries():
    b = function()
    assert select_patch_points(b.sr, functions={F})
    b.sr.info["entry_sites"] = {F: [F + 1]}
    with pytest.raises(AssertionError):
        check_entry_invariant(b.sr)
    b.sr.info["entry_sites"] = {}
    with pytest.raises(AssertionError):
        check_entry_invariant(b.sr)


def test_call_targets():
    b = function()
    b.block(0x2000, (5,), T.CALL, targets=[F], ft=0x2005)
    assert call_targets(b.sr) == {F}


def test_function_entries_from_eh_frame_and_symbols(tmp_path):
    src = tmp_path / "f.c"
    src.write_text("int g(int x) { return x * 3; }\n"
                   "static int h(int x) { return x + g(x); }\n"
                   "int (*volatile p)(int) = h;\n"
                   "int main(void) { return p(1) == 4 ? 0 : 1; }\n")
    exe = tmp_path / "f"
    subprocess.run(["gcc", "-O1", "-fno-pie", "-no-pie", "-o", str(exe), str(src)], check=True)
    syms = {}
    for line in subprocess.run(["nm", str(exe)], capture_output=True, text=True,
                               check=True).stdout.splitlines():
        parts = line.split()
        if len(parts) == 3:
            syms[parts[2]] = int(parts[0], 16)
    assert {syms["g"], syms["h"], syms["main"]} <= symbols_of(str(exe)).starts()
    mod = Module(str(exe), 0, load_eh_frame(str(exe)))
    fe = FunctionEntries(module_at=lambda a: mod)
    for name in ("g", "h", "main"):
        assert syms[name] in fe and syms[name] + 1 not in fe
    # only the given addresses without a module look-up; failures say no
    assert syms["g"] not in FunctionEntries() and 5 in FunctionEntries([5])

    def boom(a):
        raise OSError("gone")
    assert syms["g"] not in FunctionEntries(module_at=boom)


def test_decode_inner():
    site = 0x401000
    # push rbp; mov rbp,rsp; sub rsp,16
    assert decode_inner(bytes.fromhex("554889e54883ec10"), site) == [site + 1, site + 4]
    assert decode_inner(bytes.fromhex("b801000000c3"), site) == []      # mov eax, 1
    assert decode_inner(bytes.fromhex("554889"), site) is None           # cut short
    assert decode_inner(bytes.fromhex("90909090ff"), site) is None       # undecodable tail


HOT_CALLEE = r"""
#include <stdio.h>
volatile long sink;
__attribute__((noinline)) long work(long n) {
    long s = 0;
    for (long i = 0; i < n; i++) s += (i ^ sink) * 3;
    return s;
}
int main(int argc, char **argv) {
    long t = 0;
    for (long k = 0; k < 1000; k++) t += work(argc * 1000);
    printf("%ld\n", t);
    return 0;
}
"""


def test_select_regions_learns_call_targets_as_function_entries(tmp_path):
    """Selection with the client's function entries (a look-up that cannot be
    pickled, as the worker's file look-ups cannot): the direct call target discovery
    saw becomes a known entry, and the regions handed back to the service carry no
    look-up."""
    import pickle

    import capstone

    from dbr_service.region.memview import ElfMemoryView
    from dbr_service.region.pipeline import RegionConfig, select_regions
    from harness import compile_c

    src = tmp_path / "hot.c"
    src.write_text(HOT_CALLEE)
    flags = ["-O1", "-no-pie", "-fno-inline"]
    exe = compile_c([src], flags=[*flags, "-s"], out_name="hotcallee")
    twin = compile_c([src], flags=flags, out_name="hotcallee-syms")   # same code, named
    syms = {s.name: s for s in symbols_of(str(twin))._syms}
    mem = ElfMemoryView(str(exe))
    md = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    samples = {}
    for name, n in (("work", 50), ("main", 5)):
        fn = syms[name]
        samples.update({i.address: n for i in md.disasm(mem.read(fn.start, fn.size), fn.start)})
    def no_module(addr: int):
        raise OSError(f"{addr:#x}: no module file")

    entries = FunctionEntries(module_at=no_module)
    cfg = RegionConfig(hot_threshold=2.0, jumps_from_hot_limit=4, real_calls=True)
    res = select_regions(samples, mem, cfg, functions=entries)
    assert syms["work"].start in entries
    assert res.regions, res.counters
    assert all("function_entries" not in sr.info for sr in res.regions)
    pickle.dumps(res.regions)
    with pytest.raises(Exception):
        pickle.dumps(entries)


def test_the_service_takes_no_entry_site_unless_configured():
    """Entry sites are off by default (config `entry_sites`): "nothing branches into
    bytes 1..4" is only known for decoded code, and glibc's __mempcpy_* jumps to
    __memcpy_*+3.  The pass honours RegionConfig.entry_sites; the service's default
    turns it off, `-o entry_sites=true` on."""
    from dbr_service.common.config import Config
    from dbr_service.region.pipeline import PassContext, PatchPointSelectionPass, RegionConfig
    from dbr_service.region.worker import region_config

    assert region_config(Config(), 1000).entry_sites is False
    assert region_config(Config().replace_value("entry_sites", "true"), 1000).entry_sites
    for on, want in ((False, []), (True, [F])):
        b = function()
        b.sr.info["function_entries"] = {F}
        ctx = PassContext(RegionConfig(entry_sites=on), None, lambda sr, exc: None)
        out = PatchPointSelectionPass().run([b.sr], ctx)
        assert [sr.entry_points() for sr in out] == ([want] if want else []), (on, out)
