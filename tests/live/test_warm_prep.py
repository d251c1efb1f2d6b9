"""Warm selections (dbr_service/profiles/warmprep.py): a warm job selects under the
thresholds its hot text was selected under; stored modules are selected ahead from
their files, so a fresh service's first warm client is patched with no job; a
selection moved to a client is checked against the client's code."""

from __future__ import annotations

import math
import subprocess

import pytest
from harness import compile_c, symbols
from service_helpers import ServiceProc, agent_path, run_client
from warm_util import flat_counts as _flat
from warm_util import loop_insns
from warm_util import mix_profile as _profile

from dbr_service.common.config import AGGRESSIVE, Config
from dbr_service.common.errors import DbrError
from dbr_service.profiles.modkey import module_key
from dbr_service.profiles.profiledata import EntrySite, HotRegion, ModuleProfile, selection_params
from dbr_service.profiles.profilestore import ProfileStore
from dbr_service.profiles.warmprep import WARM_KEYS, prepare, warm_settings



@pytest.fixture(scope="module")
def prog() -> str:
    """tests/agent_progs/warmwork.c: hot in one loop, mix()."""
    return str(compile_c(["warmwork.c"], flags=["-O1", "-fPIE", "-pie"], out_name="warmprep"))


def test_warm_settings_take_the_hot_texts_thresholds_and_ignore_bad_values():
    svc = Config().to_dict()
    aggr = selection_params(Config(**AGGRESSIVE))
    got = warm_settings(svc, [HotRegion([], [], aggr)])
    assert {k: got[k] for k in WARM_KEYS} == {k: aggr[k] for k in WARM_KEYS}
    assert got["real_calls"] == svc["real_calls"] and got["entry_sites"] == svc["entry_sites"]
    bad = {"hot_threshold": math.nan, "min_loop_trip_count": -1, "jumps_from_hot_limit": 1e9,
           "min_region_size": True, "hot_function_threshold": "0.1"}
    assert warm_settings(svc, [HotRegion([], [], bad)]) == svc
    assert warm_settings(svc, []) == svc
    # the first region that records a valid value gives it
    two = [HotRegion([], [], {"hot_threshold": 7.0}), HotRegion([], [], {"hot_threshold": 0.003})]
    assert warm_settings(svc, two)["hot_threshold"] == 0.003


def test_a_profile_from_aggressive_training_selects_under_the_default_settings(prog):
    """The service's defaults find no hot block in a flat whole-run profile; the
    thresholds its hot text was made with do, as they did in the training run."""
    counts = _flat(prog)
    svc = Config().to_dict()
    got = prepare(_profile(prog, counts, selection_params(Config(**AGGRESSIVE))), prog, svc)
    assert got is not None and got[1].regions, got and got[1].region_status
    lo, hi = symbols(prog)["mix"]
    maps, res = got
    base = maps[0].lo - maps[0].offset
    assert all(lo <= e - base < hi for d in res.regions for e in d["entries"])
    # the same counts under the service's own thresholds: nothing (what a warm job
    # selected before it took the hot text's)
    none = prepare(_profile(prog, counts, selection_params(Config())), prog, svc)
    assert none is not None and none[1].regions == [], none[1].region_status


def test_hot_text_thresholds_that_select_nothing_give_way_to_the_services(prog):
    """A hot text whose thresholds find nothing patchable in the stored counts (here
    no block holds 90 % of them): the warm selection is the one the service's own
    settings make."""
    counts = {o: 50.0 for o in loop_insns(prog)}
    strict = dict(selection_params(Config()), hot_threshold=0.9)
    got = prepare(_profile(prog, counts, strict), prog, Config().to_dict())
    assert got is not None and got[1].regions, got and got[1].region_status
    assert not all(d["transfer_only"] for d in got[1].regions)
    assert "second configuration" in got[1].region_status


def test_a_file_that_is_not_the_one_profiled_is_not_selected(prog, tmp_path):
    prof = _profile(prog, _flat(prog), selection_params(Config(**AGGRESSIVE)))
    other = compile_c(["warmwork.c"], flags=["-O2", "-fPIE", "-pie"], out_name="warmprep2")
    assert module_key(str(other)).key != prof.key
    assert prepare(prof, str(other), Config().to_dict()) is None
    with pytest.raises((DbrError, OSError)):
        prepare(prof, str(tmp_path / "missing"), Config().to_dict())


def test_only_files_nobody_else_can_write_are_read(prog, tmp_path):
    """The file (and its directory) must be writable by its owner alone, root or the
    service's user, and no symlink."""
    import os
    import shutil

    prof = _profile(prog, _flat(prog), selection_params(Config(**AGGRESSIVE)))
    here = tmp_path / "lib"
    here.mkdir(mode=0o755)
    copy = here / "prog"
    shutil.copy(prog, copy)
    os.chmod(copy, 0o755)
    got = prepare(prof, str(copy), Config().to_dict())
    assert got is not None and got[1].regions, got
    os.chmod(copy, 0o775)
    assert prepare(prof, str(copy), Config().to_dict()) is None
    os.chmod(copy, 0o755)
    os.chmod(here, 0o777)
    assert prepare(prof, str(copy), Config().to_dict()) is None
    os.chmod(here, 0o755)
    link = here / "link"
    link.symlink_to(copy)
    with pytest.raises(OSError):
        prepare(prof, str(link), Config().to_dict())


def test_a_moved_selection_whose_code_differs_is_not_installed(prog):
    """Installation compares every byte a moved selection copies with the client's
    code (here: every byte reads as int3) before it emits anything."""
    from dbr_service.common.errors import CodegenError
    from dbr_service.installation.optimize import install_region
    from dbr_service.profiles.warmstart import _moved_here

    _, res = prepare(_profile(prog, _flat(prog), selection_params(Config(**AGGRESSIVE))),
                     prog, Config().to_dict())
    _moved_here(res)

    class Client:
        transfer_enabled = False

        def patched_ranges(self):
            return []

        def read_original(self, addr, n):
            return b"\xcc" * n

    with pytest.raises(CodegenError, match="changed since"):
        install_region(Client(), res.srs[0])


def test_a_region_emitted_ahead_is_placed_as_at_the_clients_place(prog, monkeypatch):
    """What a selection made ahead keeps of its regions' emission near their patch
    sites, moved to another place of the module, is what emitting them there gives;
    placement takes it without emitting."""
    from dbr_service.installation import optimize
    from dbr_service.profiles.rebase import rebase
    from dbr_service.profiles.warmprep import _FileTarget

    maps, res = prepare(_profile(prog, _flat(prog), selection_params(Config(**AGGRESSIVE))),
                        prog, Config().to_dict())
    assert res.srs and all(isinstance(sr.info.get("provisional"), optimize.Provisional)
                           for sr in res.srs)
    there = [m._replace(lo=m.lo - 0x3F000000000, hi=m.hi - 0x3F000000000) for m in maps]
    moved = rebase(res, maps, there)
    for sr in moved.srs:
        fresh, why = optimize.provisional(_FileTarget(there), sr)
        assert why is None and sr.info["provisional"] == fresh

    class Space:
        def span_fits(self, size, reach):
            return True

    class Client(_FileTarget):
        space = Space()

    def no_emission(*a, **k):
        raise AssertionError("emitted again")

    monkeypatch.setattr(optimize, "emit_with_frames", no_emission)
    sr = moved.srs[0]
    size, reach = optimize.placement(Client(there), sr)
    pre = sr.info["provisional"]
    assert size == pre.size + pre.frames and set(pre.data_refs) <= set(reach)


needs_agent = pytest.mark.skipif(agent_path() is None, reason="libdbr_agent.so cannot be built")


@needs_agent
def test_a_fresh_services_first_warm_client_is_patched_with_no_job(prog, tmp_path):
    """A store with the program's profile and hot text, a service started on it: the
    program selected ahead at the start; its first process, too short and young for
    sampling, is patched from its start, with no region job, and computes the same."""
    native = subprocess.run([prog, "40"], capture_output=True, text=True, timeout=60).stdout
    lo, hi = symbols(prog)["mix"]
    mk = module_key(prog)
    store = ProfileStore(tmp_path / "state")
    store.record_run(mk, {o: 50.0 for o in loop_insns(prog)}, None,
                     [HotRegion([EntrySite(lo, b"\x90")], [(lo, hi)],
                                selection_params(Config()))])
    store.mark_program(mk.key, prog)
    store.close()
    svc = ServiceProc(env={"DBR_STATE_DIR": str(tmp_path / "state")}).wait_ready()
    try:
        # in a pool worker at niceness 19: on a busy host it waits for idle CPU
        svc.wait_for(lambda: svc.call("status")["warm_start"]["prepared_selections"] >= 1,
                     timeout=180, what="the selection made ahead")
        out, pid = run_client(svc.dir, [prog, "40"])
        assert out == native
        rep = svc.call("report", {"pids": [pid]})[0]
        assert "warm_selection_prepared" in rep["timeline"], rep["timeline"]
        assert "warm_job_queued" not in rep["timeline"], rep["timeline"]
        assert rep["time_to_first_patch_s"] is not None, rep
        st = svc.call("status")["warm_start"]
        assert st["prepared_used"] == 1 and st["warm_jobs"] == 0, st
        assert st["prepare_pending"] == 0, st
        # its code was kept with the selection: placed, not emitted
        live = [r for r in svc.call("regions", {"pid": pid})["regions"]
                if r["state"] == "installed"]
        assert live and all(r["info"]["code_from"] == "kept" for r in live), live
    finally:
        svc.stop()


def test_a_kept_selection_of_nothing_gives_way_to_one_made_ahead(tmp_path, monkeypatch):
    """A warm job that ran before the selections ahead were ready selected nothing and
    was kept; the program's next process gets the selection made ahead instead, and the
    empty one is not offered again."""
    from types import SimpleNamespace

    from dbr_service.profiles.warmstart import WarmStart

    store = ProfileStore(tmp_path / "state")
    try:
        ws = WarmStart(store, Config())
        client = SimpleNamespace(build_id="ab" * 20, session_id=7, pid=4242, exe="/bin/x",
                                 maps=[])
        ws._pending[client.session_id] = (ws._exe_key(client), [], {}, False)
        ws.job_done(client.session_id, SimpleNamespace(regions=[]))
        ahead = SimpleNamespace(regions=[{"transfer_only": False}])
        monkeypatch.setattr(ws, "prepared_result", lambda s: ahead)
        assert ws.kept_selection(client) == (ahead, "warm_selection_prepared")
        monkeypatch.setattr(ws, "prepared_result", lambda s: None)
        assert ws.kept_selection(client) == (None, "")
    finally:
        store.close()


def test_a_kept_selection_gives_way_to_one_made_ahead_once_it_is_ready(tmp_path, monkeypatch):
    """A warm job's selection with a region to patch, kept while the selections ahead
    were not ready, serves the next process until they are; then they do (their code
    is kept: no emission) and it is dropped."""
    from types import SimpleNamespace

    from dbr_service.profiles.warmstart import WarmStart

    store = ProfileStore(tmp_path / "state")
    try:
        ws = WarmStart(store, Config())
        client = SimpleNamespace(build_id="ab" * 20, session_id=7, pid=4242, exe="/bin/x",
                                 maps=[])
        ws._pending[client.session_id] = (ws._exe_key(client), [], {}, False)
        ws.job_done(client.session_id, SimpleNamespace(regions=[{"transfer_only": False}]))
        live = SimpleNamespace(regions=[{"transfer_only": False}])
        monkeypatch.setattr(ws, "reused_result", lambda s, key: live if key in ws._results
                            else None)
        monkeypatch.setattr(ws, "prepared_result", lambda s: None)
        assert ws.kept_selection(client) == (live, "warm_selection_reused")
        ahead = SimpleNamespace(regions=[{"transfer_only": False}])
        monkeypatch.setattr(ws, "prepared_result", lambda s: ahead)
        assert ws.kept_selection(client) == (ahead, "warm_selection_prepared")
        monkeypatch.setattr(ws, "prepared_result", lambda s: None)
        assert ws.kept_selection(client) == (None, "")
    finally:
        store.close()


def test_selections_ahead_not_done_are_counted_until_done(tmp_path):
    """status' prepare_pending: modules queued for a selection ahead and not done,
    whatever their outcome (here: the worker fails)."""
    import concurrent.futures
    import threading
    import time

    from dbr_service.profiles.warmstart import WarmStart

    prog_key = "k" * 40
    store = ProfileStore(tmp_path / "state")
    gate = threading.Event()

    def runner(fn, *args):
        fut: concurrent.futures.Future = concurrent.futures.Future()

        def finish():
            gate.wait(10)
            fut.set_exception(DbrError("no such module"))
        threading.Thread(target=finish, daemon=True).start()
        return fut

    try:
        ws = WarmStart(store, Config(), runner)
        ws._lookup = lambda key: ModuleProfile(key, "/x", "", 1, 0.0, 0.0, {1: 1.0}, {},
                                               [HotRegion([EntrySite(1, b"\x90")], [(1, 2)], {})])
        ws.prepare_ahead(prog_key, "/x")
        assert ws.status()["prepare_pending"] == 1
        gate.set()
        deadline = time.monotonic() + 10
        while ws.status()["prepare_pending"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ws.status()["prepare_pending"] == 0 and ws.status()["prepared_selections"] == 0
    finally:
        ws.close()


def test_a_quick_selection_with_nothing_to_patch_gives_way_to_a_full_one(prog, monkeypatch):
    """A selection ahead whose quick job finds only regions without a patch site (a
    loop entered only by moving threads in, which a process at its start has none in)
    selects again without the quick bounds, and keeps that when it has a patch site."""
    from dbr_service.profiles import warmprep
    from dbr_service.region.worker import JobResult

    quick_flags = []

    def fake(job):
        quick_flags.append(job.quick)
        return JobResult(0, 0, [], [{"transfer_only": job.quick}], "", srs=[])

    monkeypatch.setattr(warmprep, "optimize_client", fake)
    _, res = prepare(_profile(prog, _flat(prog), selection_params(Config(**AGGRESSIVE))),
                     prog, Config().to_dict())
    assert quick_flags == [True, False] and res.regions == [{"transfer_only": False}]


def test_a_quick_warm_job_with_nothing_to_patch_asks_for_a_full_one(tmp_path):
    """Its result is not kept (the next processes would get nothing to patch again);
    the full job's result is, whatever it found."""
    from types import SimpleNamespace

    from dbr_service.profiles.warmstart import WarmStart

    store = ProfileStore(tmp_path / "state")
    try:
        ws = WarmStart(store, Config())
        client = SimpleNamespace(build_id="ab" * 20, session_id=7, pid=4242, exe="/bin/x",
                                 maps=[])
        key = ws._exe_key(client)
        ws.job_queued(client, [], {})
        assert ws.job_done(7, SimpleNamespace(regions=[{"transfer_only": True}])) is True
        assert key not in ws._results
        ws.job_queued(client, [], {}, quick=False)
        assert ws.job_done(7, SimpleNamespace(regions=[{"transfer_only": True}])) is False
        assert key in ws._results
        ws.job_queued(client, [], {})
        assert ws.job_done(7, SimpleNamespace(regions=[{"transfer_only": False}])) is False
        assert ws._results[key][1].regions == [{"transfer_only": False}]
    finally:
        store.close()
