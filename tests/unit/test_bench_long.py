"""The long benchmark's harness logic (bench/long): statistics, partial results and
skip messages.  No tools are run: it takes milliseconds and needs nothing installed."""

from __future__ import annotations

import json

import pytest

from bench import stats
from bench.long import report, runner, tools
from bench.long import main as long_main
from bench.long.workloads import Ctx, Skip


def test_paired_ratios_skip_missing_sides():
    assert stats.paired_ratios([2.0, None, 3.0, 1.0], [1.0, 1.0, None, 2.0]) == [2.0, 0.5]


def test_median_interval_order_statistics():
    # n=5: too few for 95 %, so min-max with its real coverage (1 - 2/32)
    ci = stats.median_interval([5, 1, 4, 2, 3])
    assert (ci["lo"], ci["hi"]) == (1, 5)
    assert ci["coverage"] == pytest.approx(1 - 2 / 32)
    assert not ci["level_met"]
    # n=9: the 2nd and 8th order statistics cover the median with 96.1 %
    ci = stats.median_interval(list(range(1, 10)))
    assert (ci["lo"], ci["hi"]) == (2, 8)
    assert ci["coverage"] == pytest.approx(0.9609375)
    assert ci["level_met"]
    assert stats.median_interval([1.0]) is None


def test_summarize_and_geomean_and_share():
    s = stats.summarize([1.1, 0.9, 1.0])
    assert (s["n"], s["median"], s["min"], s["max"]) == (3, 1.0, 0.9, 1.1)
    assert stats.summarize([]) == {"n": 0}
    assert stats.geomean([0.5, 2.0, None]) == pytest.approx(1.0)
    assert stats.geomean([]) is None
    assert stats.share_of_gain(0.95, 0.90) == pytest.approx(0.5)
    assert stats.share_of_gain(1.05, 0.90) == pytest.approx(-0.5)
    assert stats.share_of_gain(0.95, 1.02) is None  # the reference gains nothing
    assert stats.share_of_gain(1.05, 0.995) is None  # ... or less than noise


def _slices(rps, start=0.0, step=2.0):
    out, t = [], start
    for r in rps:
        out.append({"start": t, "end": t + step, "requests": r * step})
        t += step
    return out


def test_server_ratio_counts_only_the_window_after_the_first_patch():
    native = _slices([100, 100, 100, 100])
    cfg = _slices([50, 50, 120, 120])  # slow before its patch at 4 s, faster after
    w = stats.server_pair_ratio(cfg, native, first_patch_s=4.0)
    assert w["ratio"] == pytest.approx(1.2)
    assert w["after_patch"] and w["window_start_s"] == 4.0
    whole = stats.server_pair_ratio(cfg, native, first_patch_s=None)
    assert whole["ratio"] == pytest.approx(0.85)
    assert not whole["after_patch"]
    assert stats.window_mean([], 0.0) is None
    late = stats.server_pair_ratio(cfg, native, first_patch_s=7.5)  # after the last slice
    assert late["ratio"] == pytest.approx(0.85) and not late["after_patch"]
    assert "after the last whole slice" in late["note"]


def test_classify_runs():
    ok = {"exit": 0, "digest": "a"}
    assert runner.classify(ok, "a") == "ok"
    assert runner.classify(ok, "b") == "wrong-output"
    assert runner.classify({"exit": -11, "digest": "a"}, "a") == "crashed"
    assert runner.classify({"exit": 0, "digest": "a", "timed_out": True}, "a") == "timeout"
    assert runner.classify({"exit": 0, "digest": "a", "error": "x"}, "a") == "error"


def _run(pair, config, wall, status="ok", **kw):
    return {"pair": pair, "config": config, "wall_s": wall, "cpu_s": wall, "status": status,
            **kw}


def _data():
    rep = {"time_to_first_patch_s": 1.5, "share_in_replacement": 0.4,
           "share_after_first_patch": 0.5, "regions_installed": 3, "code_bytes_installed": 900}
    runs = []
    for p, (n, d, b) in enumerate([(10.0, 9.5, 9.0), (10.0, 10.5, 9.0), (10.0, 9.0, 9.0)]):
        runs += [_run(p, "native", n), _run(p, "dbr-default", d, service_cpu_s=0.5, report=rep),
                 _run(p, "bolt", b)]
    runs.append(_run(0, "dbr-aggressive", 3.0, status="crashed", exit=-11, report={}))
    return {"quick": True, "pairs": 3, "workloads": {
        "prog": {"kind": "batch", "status": "done", "runs": runs, "configs": {
            "native": {"status": "available"}, "dbr-default": {"status": "available"},
            "dbr-aggressive": {"status": "available"}, "bolt": {"status": "available"},
            "pgo": {"status": "n/a", "reason": "not applicable: a distribution binary"}}},
        "gone": {"status": "skipped", "reason": "skipped: no redis-server (python -m bench "
                                                "long --setup installs it)"}}}


def test_summary_reports_ratios_failures_and_shares():
    s = report.summarize_workload(_data()["workloads"]["prog"])
    d = s["configs"]["dbr-default"]
    assert d["ratio"]["median"] == pytest.approx(0.95)
    assert (d["ratio"]["min"], d["ratio"]["max"]) == (0.9, 1.05)
    assert d["dbr"]["service_over_program_cpu"] == pytest.approx(0.5 / 9.5)
    assert d["dbr"]["runs_patched"] == 3
    assert d["share_of_bolt_gain"] == pytest.approx(0.5)
    # a crash is counted as such, never averaged in
    a = s["configs"]["dbr-aggressive"]
    assert a["failures"] == {"crashed": 1} and a["ratio"] == {"n": 0}
    assert s["configs"]["pgo"]["status"] == "n/a"


def test_table_says_why_instead_of_leaving_out():
    data = _data()
    md = report.table(data)
    assert "**1 crashed**" in md
    assert "not applicable: a distribution binary" in md
    assert "no redis-server" in md
    assert "x0.950 [0.90–1.05]" in md
    full = report.markdown(data)  # renders a partial run (no "finished")
    assert "not yet (partial results)" in full


def test_partial_results_are_written_and_renderable(tmp_path):
    out = long_main.Out(tmp_path, {"workloads": {}})
    out.data["workloads"]["prog"] = {"kind": "batch", "status": "running", "configs": {},
                                     "runs": [_run(0, "native", 10.0)]}
    out.save()
    back = json.loads((tmp_path / "results.json").read_text())
    assert back["workloads"]["prog"]["runs"][0]["wall_s"] == 10.0
    assert "prog" in (tmp_path / "results.md").read_text()


def test_missing_tools_skip_with_a_message(tmp_path, monkeypatch):
    from bench.long import workloads

    monkeypatch.setattr(tools, "which", lambda name: None)
    monkeypatch.setattr(tools, "python311", lambda: None)
    monkeypatch.setattr(tools, "lua_sources", lambda: None)
    ctx = Ctx(quick=True, work=tmp_path, cache=tmp_path)
    for fn, words in ((workloads.redis, "--setup"), (workloads.sqlite, "--setup"),
                      (workloads.python, "python3.11"), (workloads.lua, "lupa")):
        with pytest.raises(Skip) as e:
            fn(ctx)
        assert "skipped" in str(e.value) and words in str(e.value)


def test_real_elf_refuses_scripts(tmp_path):
    shim = tmp_path / "python3.11"
    shim.write_text("#!/bin/sh\nexec python3 \"$@\"\n")
    assert tools.real_elf(str(shim)) is None
    assert tools.real_elf(None) is None


def test_bolt_without_tools_is_unavailable(tmp_path, monkeypatch):
    from bench.long import bolt

    monkeypatch.setattr(tools, "llvm_bolt", lambda: None)
    target = tmp_path / "prog"
    target.write_bytes(b"\x7fELF")
    r = bolt.optimise(str(target), tmp_path / "out", lambda p: None)
    assert r.path is None and "bolt-19" in r.reason


def test_python_m_bench_long_passes_its_options_through(monkeypatch):
    import bench.__main__ as bm

    seen = []
    monkeypatch.setattr(long_main, "main", lambda argv: seen.append(argv) or 0)
    assert bm.main(["long", "--quick", "--only", "lua", "--pairs", "2"]) == 0
    assert bm.main(["--quick", "long", "--setup"]) == 0
    assert seen == [["--quick", "--only", "lua", "--pairs", "2"], ["--quick", "--setup"]]
    assert "long" in bm.NAMED_ONLY  # not part of a plain `make bench`


def test_unknown_workload_is_a_usage_error():
    with pytest.raises(SystemExit) as e:
        long_main.main(["--only", "nosuch"])
    assert e.value.code == 2
