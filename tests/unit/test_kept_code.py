"""Code kept with a selection made ahead (dbr_service/installation/keptcode.py): its
fields found by emission, its placement anywhere equal to an emission there, its
installation without emitting, and what refuses it."""

from __future__ import annotations

import dataclasses
import os
import shutil
from types import SimpleNamespace

import pytest
from harness import compile_c, symbols
from warm_util import flat_counts as _flat
from warm_util import mix_profile as _profile

from dbr_service.codegen.emit import GeneratedCode
from dbr_service.common.config import AGGRESSIVE, Config
from dbr_service.common.states import InstallState
from dbr_service.installation import keptcode, optimize
from dbr_service.profiles.profiledata import EntrySite, HotRegion, ModuleProfile, selection_params
from dbr_service.profiles.rebase import rebase
from dbr_service.profiles.warmprep import _FileTarget, file_view, prepare

LIBBZ2 = "/usr/lib/x86_64-linux-gnu/libbz2.so.1.0.4"
#: Where the tests move the module to (another process's place for it).
SHIFT = -0x3F000000000


@pytest.fixture(scope="module")
def prog() -> str:
    return str(compile_c(["warmwork.c"], flags=["-O1", "-fPIE", "-pie"], out_name="keptcode"))


def _prepared(prog: str):
    return prepare(_profile(prog, _flat(prog), selection_params(Config(**AGGRESSIVE))),
                   prog, Config().to_dict())


def _libbz2_prepared():
    """libbz2's BZ2_compressBlock selected ahead from a flat profile over it: a region
    with real calls, their unwind information and many exits."""
    import capstone
    import lief

    if not os.path.exists(LIBBZ2):
        pytest.skip(f"{LIBBZ2} is not installed")
    elf = lief.parse(LIBBZ2)
    lo, hi = next((s.value, s.value + s.size) for s in elf.dynamic_symbols
                  if s.name == "BZ2_compressBlock")
    with open(LIBBZ2, "rb") as f:
        data = f.read()
    md = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    counts = {i.address: 5.0 for i in md.disasm(data[lo:hi], lo)}
    from dbr_service.profiles.modkey import module_key

    prof = ModuleProfile(module_key(LIBBZ2).key, LIBBZ2, "", 1, 0.0, 0.0, counts, {},
                         [HotRegion([EntrySite(lo, b"\x90")], [(lo, hi)],
                                    selection_params(Config(**AGGRESSIVE)))])
    return prepare(prof, LIBBZ2, Config().to_dict())


def _switch_prepared():
    """tests/agent_progs/switchwork.c's mix(), a switch through a jump table, selected
    ahead from a flat profile over it: a region with a dispatch table in its code."""
    import capstone

    prog = str(compile_c(["switchwork.c"], flags=["-O2", "-fPIE", "-pie"],
                         out_name="switchwork"))
    lo, hi = symbols(prog)["mix"]
    with open(prog, "rb") as f:
        data = f.read()
    md = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    counts = {i.address: 6.0 for i in md.disasm(data[lo:hi], lo)}
    return prepare(_profile(prog, counts, selection_params(Config(**AGGRESSIVE))), prog,
                   Config().to_dict())


def _moved(maps, res):
    there = [m._replace(lo=m.lo + SHIFT, hi=m.hi + SHIFT) for m in maps]
    return there, rebase(res, maps, there)


def test_every_field_of_generated_code_has_its_rule():
    assert {f.name for f in dataclasses.fields(GeneratedCode)} == set(keptcode.GEN_FIELDS)


def test_fields_are_found_and_a_change_that_fits_none_refuses():
    a = bytearray(24)
    code, both = bytearray(a), bytearray(a)
    code[4:8] = (-keptcode.CODE_STEP & 0xFFFFFFFF).to_bytes(4, "little")     # rel32
    both[12:20] = (keptcode.BOTH_STEP & (1 << 64) - 1).to_bytes(8, "little")  # module abs
    got = keptcode.find_fixups(bytes(a), bytes(code), bytes(both), keptcode.CODE_STEP,
                               keptcode.BOTH_STEP)
    assert got == [(4, keptcode.REL32), (12, keptcode.MOD64)]
    code[21] ^= 1                                     # a byte no field explains
    assert keptcode.find_fixups(bytes(a), bytes(code), bytes(both), keptcode.CODE_STEP,
                                keptcode.BOTH_STEP) is None
    assert keptcode.find_fixups(bytes(a), bytes(code[:-1]), None, keptcode.CODE_STEP,
                                0) is None


@pytest.mark.parametrize("which", ["warmwork", "switch", "libbz2"])
def test_kept_code_placed_elsewhere_is_what_emitting_it_there_gives(prog, which):
    """The module moved (another process) and a chunk anywhere in reach: the kept
    bytes with their fields moved, the unwind information and every record of the code
    are those of an emission at that chunk."""
    maps, res = {"warmwork": lambda: _prepared(prog), "switch": _switch_prepared,
                 "libbz2": _libbz2_prepared}[which]()
    kept_srs = [sr for sr in res.srs if isinstance(sr.info.get("kept_code"), keptcode.KeptCode)]
    assert kept_srs, [sr.id for sr in res.srs]
    there, moved = _moved(maps, res)
    kinds = {k for sr in kept_srs for _, k in sr.info["kept_code"].fixups}
    if which == "libbz2":
        assert any(sr.info["kept_code"].gen.calls and sr.info["kept_code"].blobs
                   for sr in moved.srs if "kept_code" in sr.info)
    if which == "switch":        # its table: addresses of its own code, its base's offset
        assert {keptcode.CODE64, keptcode.BACK32} <= kinds, kinds
    for sr in moved.srs:
        kept = sr.info.get("kept_code")
        if kept is None:
            continue
        for addr in ((max(m.hi for m in there) + 0x2345670) & ~15,
                     (min(m.lo for m in there) - 0x1234560) & ~15):
            gen, blobs = keptcode.placed(kept, sr, addr)
            want, want_blobs, _ = optimize.emit_with_frames(_FileTarget(there), sr, addr)
            for f in keptcode.GEN_FIELDS:
                assert getattr(gen, f) == getattr(want, f), f
            assert blobs == want_blobs
            assert keptcode.placed(kept, sr, addr + 8) is None     # misaligned


class _Space:
    def __init__(self, at: int) -> None:
        self.at = at

    def span_fits(self, size, reach):
        return True

    def release(self, chunk):
        pass


class _Client(_FileTarget):
    """An installer for install_region: the module's file as its code, a chunk at a
    fixed address, and the code it was given kept for the test."""

    transfer_enabled = False

    def __init__(self, maps, at: int) -> None:
        super().__init__(maps)
        self.space, self.kept_placed, self.written = _Space(at), 0, None
        self.mem = file_view(maps[0].path)[0]          # the module where prepare had it

    def patched_ranges(self):
        return []

    def read_original(self, addr, n):
        return self.mem.read(addr - SHIFT, n)

    def copy_entries(self):
        return {}

    def reserve(self, size, reach):
        return SimpleNamespace(addr=self.space.at, size=size)

    def install(self, chunk, gen, **kw):
        self.written = (gen, kw["frames"])
        return SimpleNamespace(state=InstallState.INSTALLED, installed_at=0.0)


def test_a_region_with_kept_code_is_installed_without_emitting_it(prog, monkeypatch):
    maps, res = _prepared(prog)
    there, moved = _moved(maps, res)
    sr = next(sr for sr in moved.srs if "kept_code" in sr.info)
    sr.info["verify_original"] = True         # as warm start marks it: its bytes compared
    at = (max(m.hi for m in there) + 0x100000) & ~15
    want, _, _ = optimize.emit_with_frames(_FileTarget(there), sr, at)

    def no_emission(*a, **k):
        raise AssertionError("emitted")

    monkeypatch.setattr(optimize, "emit_with_frames", no_emission)
    monkeypatch.setattr(optimize, "emit_region", no_emission)
    client = _Client(there, at)
    optimize.install_region(client, sr)
    assert client.kept_placed == 1 and sr.info["code_from"] == "kept"
    assert client.written[0].code == want.code and client.written[0].base == at


def test_a_region_placed_where_its_kept_code_cannot_go_is_emitted(prog):
    """A chunk that does not keep the kept code's alignment: emitted as always."""
    maps, res = _prepared(prog)
    there, moved = _moved(maps, res)
    sr = next(sr for sr in moved.srs if "kept_code" in sr.info)
    at = ((max(m.hi for m in there) + 0x100000) & ~15) + 8
    client = _Client(there, at)
    optimize.install_region(client, sr)
    want, _, _ = optimize.emit_with_frames(_FileTarget(there), sr, at)
    assert client.kept_placed == 0 and sr.info["code_from"] == "emitted"
    assert client.written[0].code == want.code


def test_a_module_file_changed_since_gets_no_kept_selection(prog, tmp_path):
    """The selection made ahead (and its code) is tied to the file's store key: a
    client that maps a rebuilt file at the same path gets none of it."""
    from dbr_service.profiles.profilestore import ProfileStore
    from dbr_service.profiles.warmstart import WarmStart

    path = tmp_path / "lib" / "warmwork"
    path.parent.mkdir()
    os.chmod(path.parent, 0o755)
    shutil.copy(prog, path)
    got = prepare(_profile(str(path), _flat(str(path)),
                           selection_params(Config(**AGGRESSIVE))), str(path),
                  Config().to_dict())
    assert got is not None
    store = ProfileStore(tmp_path / "state")
    try:
        ws = WarmStart(store, Config())
        from dbr_service.profiles.modkey import module_key

        ws._prepared[module_key(str(path)).key] = got
        client = SimpleNamespace(build_id="", session_id=1, pid=1, exe=str(path),
                                 maps=file_view(str(path))[2])
        assert ws.prepared_result(client) is not None
        other = compile_c(["warmwork.c"], flags=["-O2", "-fPIE", "-pie"],
                          out_name="keptcode-rebuilt")
        os.unlink(path)
        shutil.copy(other, path)
        client.maps = file_view(str(path))[2]
        assert ws.prepared_result(client) is None
    finally:
        store.close()


def test_a_warm_jobs_kept_selection_gets_its_code_kept_for_the_next_processes(prog, tmp_path):
    """A warm job's result, kept for the program's next processes, has its regions'
    code kept in a worker after the job; a next process, its module elsewhere, gets
    code that placing gives as emitting would."""
    import concurrent.futures
    import time

    from dbr_service.profiles.profilestore import ProfileStore
    from dbr_service.profiles.warmstart import WarmStart

    maps, res = _prepared(prog)
    for sr in res.srs:              # as a job on a process gives it: no code kept
        sr.info.pop("kept_code", None)

    def runner(fn, *args):
        fut: concurrent.futures.Future = concurrent.futures.Future()
        fut.set_result(fn(*args))
        return fut

    store = ProfileStore(tmp_path / "state")
    ws = WarmStart(store, Config(), runner)
    try:
        first = SimpleNamespace(build_id="cd" * 20, session_id=1, pid=11, exe=prog, maps=maps)
        ws.job_queued(first, maps, {})
        assert ws.job_done(1, res) is False
        deadline = time.monotonic() + 60
        while ws.codes_kept == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ws.codes_kept >= 1
        there = [m._replace(lo=m.lo + SHIFT, hi=m.hi + SHIFT) for m in maps]
        nxt = SimpleNamespace(build_id="cd" * 20, session_id=2, pid=12, exe=prog, maps=there)
        moved, how = ws.kept_selection(nxt)
        assert how == "warm_selection_reused"
        sr = next(sr for sr in moved.srs if "kept_code" in sr.info)
        at = (max(m.hi for m in there) + 0x100000) & ~15
        gen, _ = keptcode.placed(sr.info["kept_code"], sr, at)
        want, _, _ = optimize.emit_with_frames(_FileTarget(there), sr, at)
        assert gen.code == want.code and gen.addr_map == want.addr_map
    finally:
        ws.close()


def test_kept_code_is_refused_where_its_module_could_move_apart_or_did(prog):
    """Code reaching outside its module's span is not kept (another module moves by
    another displacement); code of a module that does not move is not placed where
    it did."""
    maps, res = _prepared(prog)
    sr = next(sr for sr in res.srs if "kept_code" in sr.info)
    kept = sr.info["kept_code"]

    def emit(s, at, shift):
        assert shift == 0
        return optimize.emit_with_frames(_FileTarget(maps), s, at)

    assert keptcode.keep(sr, kept.base, (0, 0x1000), True, emit) is None
    fixed = dataclasses.replace(kept, movable=False)
    at = kept.base + 0x10000
    assert keptcode.placed(fixed, sr, at) is not None
    _, moved = _moved(maps, res)
    msr = next(s for s in moved.srs if "kept_code" in s.info)
    assert keptcode.placed(fixed, msr, at + SHIFT) is None
    assert keptcode.placed(kept, msr, at + SHIFT) is not None
    assert keptcode.placed(kept, msr, at) is None          # out of rel32 reach
