"""The comparison benchmark's runner on tiny workloads: JSON structure, ratio
arithmetic, a FAILURE row when a configuration's output differs, a skipped workload
when its tool is missing from PATH, a crashed workload reported as such while the
results so far are already on disk."""

from __future__ import annotations

import json
import os
import shutil
import statistics
from pathlib import Path

import pytest

from bench import compare, configs, runner, suite
from bench.common import Results
from bench.stats import ratio_ci, spread, verdict

SH = "/bin/sh"


class Wrapped(configs.Config):
    """A fake configuration: runs the program through ``sh -c``, optionally adding output."""

    def __init__(self, name: str, suffix: str = ""):
        super().__init__()
        self.name, self.what, self.suffix = name, f"fake {name}", suffix

    def command(self, argv, prep, work):
        extra = f"; echo {self.suffix}" if self.suffix else ""
        return [SH, "-c", f'"$@"{extra}', "sh", *argv]


class Missing(configs.Config):
    name, what = "missing", "a tool that is not installed"

    def check(self, ctx, env, tmp):
        return "unavailable: not installed (test)"


def _shell(name: str, script: str, outputs: list[str] | None = None) -> suite.Workload:
    return suite.Workload(name, "test", f"test: {script}",
                          lambda ctx: suite.Prepared([SH, "-c", script], outputs=outputs or []))


@pytest.fixture()
def ran(tmp_path, capsys):
    seen_on_disk: dict = {}
    results = Results(tmp_path / "results", "test-session", quick=True, command=["pytest"])

    def peek(ctx):  # runs after "crasher": the crash must already be on disk
        seen_on_disk.update(json.loads(results.json_path.read_text()))
        return suite.Prepared([SH, "-c", "echo ok"])

    zstd = next(w for w in suite.registry() if w.name == "zstd")
    empty_path = tmp_path / "emptybin"
    empty_path.mkdir()
    workloads = [
        _shell("tiny", "i=0; while [ $i -lt 2000 ]; do i=$((i+1)); done; echo hi; "
                       "echo data > out.txt", ["out.txt"]),
        _shell("crasher", "echo partial; kill -SEGV $$"),
        suite.Workload("peek", "test", "reads latest.json", peek),
        zstd,
    ]
    cfgs = [configs.Native(), Wrapped("same"), Wrapped("differs", suffix="EXTRA"),
            Missing()]
    ctx = suite.Ctx(quick=True, cache=tmp_path / "cache", path=str(empty_path),
                    log=lambda m: None)
    st = compare.Settings(quick=True, runs=3, warmup=1, min_timeout=20)
    rc = compare.run_suite(workloads, cfgs, ctx, st, results)
    results.finish()
    out = capsys.readouterr()
    data = json.loads(results.json_path.read_text())
    return rc, data, out, seen_on_disk, results


def test_json_structure_and_ratios(ran):
    rc, data, out, _, results = ran
    assert data["schema"] == "dbr.bench/1"
    m = data["machine"]
    for key in ("cpu", "cores", "kernel", "pmu", "loadavg_start", "loadavg_end",
                "cpu_governor"):
        assert key in m, key
    cmp_ = data["benchmarks"]["compare"]
    assert cmp_["status"] == "complete"
    assert cmp_["configs"]["missing"] == {"what": "a tool that is not installed",
                                          "available": False,
                                          "reason": "unavailable: not installed (test)",
                                          "check_s": cmp_["configs"]["missing"]["check_s"]}
    rows = {r["name"]: r for r in cmp_["workloads"]}
    assert list(rows) == ["tiny", "crasher", "peek", "zstd"]
    same = rows["tiny"]["configs"]["same"]
    native = rows["tiny"]["configs"]["native"]
    assert same["status"] == "ok" and same["runs"] == 3 and native["runs"] == 3
    assert same["ratio"] == pytest.approx(same["wall_s"]["median"] / native["wall_s"]["median"])
    assert same["wall_s"]["min"] <= same["wall_s"]["median"] <= same["wall_s"]["max"]
    assert same["paired_ratio"]["n"] == 3
    assert rows["tiny"]["configs"]["missing"]["status"] == "unavailable"
    assert rows["peek"]["status"] == "FAILURE"  # "differs" fails everywhere
    assert results.md_path.exists() and (results.dir / "ratios.png").exists()
    assert "ratios.png" in data["plots"]
    assert rc == 1


def test_output_mismatch_is_a_loud_failure(ran):
    rc, data, out, _, results = ran
    row = {r["name"]: r for r in data["benchmarks"]["compare"]["workloads"]}["tiny"]
    assert row["status"] == "FAILURE"
    bad = row["configs"]["differs"]
    assert bad["status"] == "FAILURE" and "output differs" in bad["message"]
    assert "ratio" not in bad and "wall_s" not in bad  # not a data point
    assert "!! FAILURE: tiny under differs" in out.err
    md = results.md_path.read_text()
    assert "FAILURE" in md


def test_missing_tool_skips_and_crash_is_reported_with_partial_results(ran):
    rc, data, out, seen, _ = ran
    rows = {r["name"]: r for r in data["benchmarks"]["compare"]["workloads"]}
    assert rows["zstd"]["status"] == "skipped"
    assert "zstd" in rows["zstd"]["message"]
    assert "skipped zstd" in out.err
    assert rows["crasher"]["status"] == "crashed"
    assert "SIGSEGV" in rows["crasher"]["message"]
    # written incrementally: the crash was on disk before the next workload started
    names = [r["name"] for r in seen["benchmarks"]["compare"]["workloads"]]
    assert names == ["tiny", "crasher"]
    assert seen["benchmarks"]["compare"]["status"] == "running"


def _run(wall: float) -> runner.Run:
    return runner.Run(wall=wall, exit_code=0, digest="d", cpu_s=wall, maxrss_kb=1)


def test_ratio_and_pgo_share_arithmetic():
    nat, b = compare.Cell(configs.Native()), compare.Cell(Wrapped("b"))
    nat.runs = [_run(x) for x in (1.0, 2.0, 3.0)]
    b.runs = [_run(x) for x in (1.5, 3.0, 4.5)]
    rounds = [[("native", 1.0), ("b", 1.5)], [("b", 3.0), ("native", 2.0)],
              [("native", 3.0), ("b", 4.5)]]
    cj = compare.cell_json(b, nat, rounds)
    assert cj["ratio"] == pytest.approx(1.5)
    assert cj["paired_ratio"]["median"] == pytest.approx(1.5)
    assert cj["cpu_ratio"] == pytest.approx(1.5)
    assert cj["extra_cpu_s"] == pytest.approx(1.0)
    st = compare.Settings()
    share = compare.pgo_share({"pgo": {"status": "ok", "ratio": 0.8},
                               "dbr": {"status": "ok", "ratio": 0.95}}, st)
    assert share["value"] == pytest.approx(0.25)
    assert compare.pgo_share({"pgo": {"status": "ok", "ratio": 0.99},
                              "dbr": {"status": "ok", "ratio": 0.9}}, st)["value"] is None
    assert compare.pgo_share({"pgo": {"status": "ok", "ratio": 0.8},
                              "dbr": {"status": "unavailable"}}, st)["value"] is None
    s = spread([4.0, 1.0, 3.0, 2.0])
    assert (s["min"], s["max"], s["median"], s["n"]) == (1.0, 4.0, 2.5, 4)
    assert s["q1"] <= s["median"] <= s["q3"]
    assert statistics.median([1.0, 2.0]) == 1.5


def _noisy_pairs(ratio: float, n: int, noise: float, seed: int) -> list[tuple[float, float]]:
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        load = 1 + rng.random() * 0.3          # what hits both runs of a round alike
        base = load * (1 + rng.uniform(-noise, noise))
        out.append((ratio * load * (1 + rng.uniform(-noise, noise)), base))
    return out


def test_ratio_interval_and_the_verdict_it_gives():
    # a clear 5 % slowdown over 41 rounds of 1 % noise: missed, the interval holds 1.05
    ci = ratio_ci(_noisy_pairs(1.05, 41, 0.01, 1))
    assert ci[0] < 1.05 < ci[1] and ci[0] > 1.01
    assert verdict(ci, 1.01) == "missed"
    # no difference, little noise: met
    ci = ratio_ci(_noisy_pairs(1.0, 41, 0.002, 2))
    assert ci[0] <= 1.0 <= ci[1] < 1.01 and verdict(ci, 1.01) == "met"
    # no difference but 10 % noise and few rounds: the interval spans the limit
    ci = ratio_ci(_noisy_pairs(1.0, 7, 0.10, 3))
    assert ci[0] < 1.01 < ci[1] and verdict(ci, 1.01) == "undecided"
    # deterministic, and silent below 5 rounds
    assert ratio_ci(_noisy_pairs(1.0, 9, 0.05, 4)) == ratio_ci(_noisy_pairs(1.0, 9, 0.05, 4))
    assert ratio_ci([(1.0, 1.0)] * 4) is None and verdict(None, 1.01) == "undecided"


def _report_of_one(nat: compare.Cell, cj: dict, rounds: list) -> str:
    """bench.report's markdown of one workload "w": native and a dbr-preload cell."""
    from bench import report

    return report.markdown({"benchmarks": {"compare": {
        "settings": {}, "target": compare.TARGET, "configs": {},
        "workloads": [{"name": "w", "status": "ok",
                       "configs": {"native": compare.cell_json(nat, None, rounds),
                                   "dbr-preload": cj}}]}}})


def test_cell_json_carries_the_interval_and_the_report_judges_by_it():
    nat, b = compare.Cell(configs.Native()), compare.Cell(Wrapped("dbr-preload"))
    pairs = _noisy_pairs(1.05, 21, 0.01, 5)
    nat.runs = [_run(n) for _, n in pairs]
    b.runs = [_run(x) for x, _ in pairs]
    rounds = [[("native", n), ("dbr-preload", x)] for x, n in pairs]
    cj = compare.cell_json(b, nat, rounds)
    lo, hi = cj["ratio_ci95"]
    assert lo <= cj["ratio"] <= hi and lo > 1.01
    md = _report_of_one(nat, cj, rounds)
    assert "## Target: no workload slower than native by more than 1 %" in md
    assert f"| w | dbr-preload | {cj['ratio']:.3f} | {lo:.3f}–{hi:.3f} | **missed** |" in md
    assert "Verdicts: missed 1." in md


def test_rounds_split_by_whether_the_dbr_run_was_patched():
    # patched runs cost 5 %, unpatched ones nothing: the split shows it, the mix hides it
    nat, b = compare.Cell(configs.Native()), compare.Cell(Wrapped("dbr-preload"))
    pairs = _noisy_pairs(1.0, 40, 0.005, 6)
    rounds = []
    for i, (x, n) in enumerate(pairs):
        patched = i % 4 == 0
        nat.runs.append(_run(n))
        r = _run(x * (1.05 if patched else 1.0))
        r.round = i
        if i % 8 == 2:
            r.extra = {"report_error": "no session", "patched": False}
        elif i % 8 == 6:
            r.extra = {"report_error": "no readable report: x"}   # unknown: in neither side
        else:
            r.extra = {"report": {"time_to_first_patch_s": 0.3 if patched else None}}
        b.runs.append(r)
        rounds.append([("native", n), ("dbr-preload", r.wall)])
    cj = compare.cell_json(b, nat, rounds)
    assert cj["paired_patched"].count(True) == 10 and cj["paired_patched"].count(None) == 5
    bp = cj["by_patch"]
    assert bp["patched"]["rounds"] == 10 and bp["unpatched"]["rounds"] == 25
    assert bp["patched"]["ratio"] == pytest.approx(1.05, abs=0.01)
    assert bp["patched"]["ratio_ci95"][0] > 1.03
    assert bp["unpatched"]["ratio_ci95"][0] <= 1.0 <= bp["unpatched"]["ratio_ci95"][1]
    md = _report_of_one(nat, cj, rounds)
    assert "Rounds split by whether the dbr run had code installed" in md
    assert f"| w | dbr-preload | 10 | {bp['patched']['ratio']:.3f} |" in md
    # a native cell, or a run with no report at all, has no split
    assert "by_patch" not in compare.cell_json(nat, None, rounds)
    plain = compare.Cell(Wrapped("b"))
    plain.runs = [_run(x) for x, _ in pairs]
    assert "by_patch" not in compare.cell_json(
        plain, nat, [[("native", n), ("b", x)] for x, n in pairs])


def test_summarize_dbr_report():
    rep = {"schema": "dbr.run/1", "exit_code": 0, "wall_s": 1.0,
           "clients": [{"pid": 1, "samples": 100, "samples_after_first_patch": 60,
                        "samples_in_replacement": 30, "time_to_first_patch_s": 0.4,
                        "patches_installed": 2, "patches_removed": 1,
                        "regions": [{"code_bytes": 100, "state": "installed"},
                                    {"code_bytes": 50, "state": "removed"}]}],
           "totals": {"samples": 100, "samples_in_replacement": 30, "patches_installed": 2,
                      "regions_installed": 1}}
    s = configs.summarize_report(rep)
    assert s["share_in_replacement"] == pytest.approx(0.3)
    assert s["share_after_first_patch"] == pytest.approx(0.5)
    assert s["time_to_first_patch_s"] == 0.4 and s["code_bytes"] == 150
    assert s["prog_wall_s"] == 1.0


def test_bench_cli_rejects_unknown_names():
    from bench.__main__ import main

    with pytest.raises(SystemExit):
        main(["no-such-benchmark"])


def test_workload_sources_exist():
    for p in suite.C_PROGS:
        for src in p.sources + ([p.lib] if p.lib else []):
            assert (suite.SRC / src).exists()
    assert (Path(suite.SRC) / "spin.c").exists()


def test_a_workload_environment_drops_what_it_must_not_see(tmp_path):
    """The python3 workload runs with a fixed hash seed and none of the caller's other
    PYTHON* variables (-E would have ignored the seed as well)."""
    ctx = suite.Ctx(quick=True, cache=tmp_path)
    prep = {w.name: w for w in suite.registry()}["python3"].prepare(ctx)
    assert "-E" not in prep.argv
    env = prep.environ({"PATH": "/bin", "PYTHONPATH": "/x", "PYTHONHOME": "/y",
                        "PYTHONHASHSEED": "random", "MYPYTHON": "kept"})
    assert env == {"PATH": "/bin", "PYTHONHASHSEED": "0", "MYPYTHON": "kept"}
    plain = suite.Prepared(["true"], env={"A": "1"})
    assert plain.environ({"PYTHONPATH": "/x"}) == {"PYTHONPATH": "/x", "A": "1"}


def test_preload_and_thread_only_configs(tmp_path):
    """dbr-preload runs PROG itself with the agent under a host service and gets what dbr
    did from the service by pid; thread-only's library really starts one extra thread
    (and nothing of dbr's): both are timed by the same run_once as native."""
    import os

    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    ctx = suite.Ctx(quick=True, cache=tmp_path / "cache", log=lambda m: None)
    # lives 0.3 s: the agent's HELLO (from its own thread) must reach the service
    # before the program ends, or the service never knew it
    prog = [SH, "-c", "grep -h '^Threads:' /proc/$$/status; sleep 0.3"]
    prep = suite.Prepared(prog)
    control = configs.ThreadOnly()
    assert control.check(ctx, env, tmp_path) is None
    # the control library in a program that never makes a thread of its own: 2 threads
    r = runner.run_once([SH, "-c", "sleep 0.2 & pid=$!; sleep 0.05; "
                          "grep -h '^Threads:' /proc/$pid/status; wait"],
                         control.environ(env), tmp_path / "run", [], timeout=30)
    assert r.exit_code == 0
    assert (tmp_path / "run" / "stdout").read_text().split() == ["Threads:", "2"]
    preload = configs.DbrPreload()
    try:
        assert preload.check(ctx, env, tmp_path) is None, "the host service must start"
        penv = preload.environ(env)
        assert penv["LD_PRELOAD"].endswith("libdbr_agent.so")
        assert penv["DBR_RUNTIME_DIR"] == preload.host.rt
        r = runner.run_once(preload.command(prog, prep, tmp_path), penv, tmp_path / "run",
                             [], timeout=30)
        assert r.exit_code == 0 and r.pid > 0
        extra = preload.collect(tmp_path, r)
        assert "report" in extra, extra
        rep = extra["report"]
        assert rep["clients"] >= 1 and rep["exit_code"] == 0
        assert rep["prog_wall_s"] == pytest.approx(r.wall, abs=1e-3)  # the report keeps ms
        assert isinstance(rep.get("service_cpu_s"), float) and rep["service_cpu_s"] >= 0
        assert rep["service_cpu_source"].startswith("host service CPU")
        # a pid the service never saw: an error entry, not a crash
        r.pid = 1
        assert "report_error" in preload.collect(tmp_path, r)
    finally:
        preload.host.stop()
    assert preload.host.proc.poll() is not None


def test_sigterm_takes_down_the_run_and_the_host_service_and_keeps_the_results(tmp_path):
    """A benchmark stopped with SIGTERM (timeout(1), CI, kill) must not leave its host
    `dbr service` behind, and what it measured so far is still written."""
    import contextlib
    import os
    import signal
    import subprocess
    import sys
    import time

    import psutil

    env = dict(os.environ, DBR_BENCH_RESULTS=str(tmp_path / "results"),
               DBR_BENCH_SESSION="sigterm-test")
    env.pop("LD_PRELOAD", None)
    p = subprocess.Popen([sys.executable, "-m", "bench.compare", "--quick", "--runs", "50",
                          "--configs", "dbr-preload", "interp"],
                         cwd=Path(compare.REPO), env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        svc = None
        deadline = time.monotonic() + 120
        while svc is None and time.monotonic() < deadline and p.poll() is None:
            with contextlib.suppress(psutil.Error):
                for c in psutil.Process(p.pid).children(recursive=True):
                    with contextlib.suppress(psutil.Error):
                        if "service" in c.cmdline():
                            svc = c
            time.sleep(0.2)
        assert svc is not None, "the benchmark never started its host service"
        # into the alternated runs: a run of the workload has ended (a second began)
        runs: set[int] = set()
        while len(runs) < 2 and time.monotonic() < deadline and p.poll() is None:
            with contextlib.suppress(psutil.Error):
                for c in psutil.Process(p.pid).children(recursive=True):
                    with contextlib.suppress(psutil.Error):
                        if any("interp" in a for a in c.cmdline()[:1]):
                            runs.add(c.pid)
            time.sleep(0.05)
        assert len(runs) >= 2, "the benchmark never finished a run"
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)
        assert p.returncode == 128 + signal.SIGTERM, err[-2000:]
        svc_gone = False
        for _ in range(100):
            if not svc.is_running() or svc.status() == psutil.STATUS_ZOMBIE:
                svc_gone = True
                break
            time.sleep(0.1)
        assert svc_gone, "the host dbr service outlived the benchmark"
        data = json.loads((tmp_path / "results" / "latest.json").read_text())
        assert data["finished"] and "compare" in data["benchmarks"]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(10)


def test_a_host_service_runs_with_its_overrides(tmp_path):
    """bench.runner.HostService passes its ``-o KEY=VALUE`` settings to the service it
    starts (here the sampling-only key dbr-sampling uses), and stop() ends it."""
    import os

    from dbr_service.commands.ctlclient import ControlClient

    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    override = configs.sampling_only_override()[0]
    host = runner.HostService([override])
    try:
        assert host.start(env) is None, "the host service must start"
        key, value = override.split("=")
        got = ControlClient(host.rt).result("config_get", {"key": key})
        assert str(got[key]).lower() == value, got
    finally:
        host.stop()
    assert host.proc.poll() is not None


def test_a_timed_out_run_records_what_its_threads_were_doing(tmp_path):
    """Before a run over its time is killed, every thread of its session is recorded
    (state, wait channel, syscall): the evidence for chasing a hang later."""
    r = runner.run_once([SH, "-c", "sleep 30 & wait"], {"PATH": "/usr/bin:/bin"},
                         tmp_path / "run", [], timeout=0.5)
    assert r.timed_out and r.wall < 20
    comms = {t["comm"] for t in r.hung}
    assert {"sh", "sleep"} <= comms, r.hung
    sleeper = next(t for t in r.hung if t["comm"] == "sleep")
    assert sleeper["state"] == "S" and sleeper["pid"] != r.pid
    assert "syscall" in sleeper and sleeper["syscall"] != "running"
    cell = compare.Cell(configs.Native())
    compare._check_run(cell, r, 0, "", "test")
    assert cell.status == "timeout" and cell.hung == r.hung
    assert compare.cell_json(cell, None, [])["hung_threads"] == r.hung


def test_steady_state_runs_all_four_ways_and_reports_what_the_service_did(tmp_path,
                                                                         monkeypatch):
    """bench.steady_state on one short workload: native, host, host-fixed and
    host-sampling all ran with native's output, ratios are medians over medians, and
    the service's view of each run (windows sampled, interval) came back by pid;
    host-sampling never patches.  Each run lasts past min_client_age_s (1 s): a
    younger client's agent has made no thread, so the service never hears of it."""
    from bench import steady_state

    monkeypatch.setenv("DBR_BENCH_RESULTS", str(tmp_path))
    assert steady_state.main(["--runs", "2", "--seconds", "1.5", "threads"]) == 0
    res = json.loads((tmp_path / "steady_state.json").read_text())
    row = res["workloads"]["threads"]["configs"]
    assert set(row) == {"native", "host", "host-fixed", "host-sampling"}
    for name, c in row.items():
        assert len(c["wall_all"]) == len(c["cpu_all"]) == 2
        assert c["wall_ratio"] == pytest.approx(
            statistics.median(c["wall_all"]) / statistics.median(row["native"]["wall_all"]))
        if name != "native":
            assert len(c["service"]) == 2 and all("missing" not in s for s in c["service"])
            assert all(s["sampling_interval_s"] in (0.0, 1.0) for s in c["service"])
    assert all(not s.get("patches_installed") for s in row["host-sampling"]["service"])
    assert "| threads | host-fixed |" in res["markdown"]
    assert json.loads((tmp_path / "latest.json").read_text())["benchmarks"]["steady_state"]


def test_steady_state_rejects_unknown_workloads():
    from bench import steady_state

    with pytest.raises(SystemExit):
        steady_state.main(["no-such-workload"])
    with pytest.raises(SystemExit):
        steady_state.main(["--configs", "host,no-such-config", "threads"])
    assert set(steady_state.DEFAULT_CONFIGS) < set(steady_state.SERVICE_CONFIGS)
    assert steady_state.SERVICE_CONFIGS["host-nocheck"] == ("speed_check=false",)


def test_service_ab_runs_a_program_under_two_services(tmp_path, monkeypatch, capsys):
    """bench/service_ab.py: five rounds of /bin/true natively and under two host
    services (one with a setting changed), the figures printed and written; a missing
    program or too few rounds is a usage error."""
    from bench import service_ab

    monkeypatch.setenv("DBR_BENCH_RESULTS", str(tmp_path))
    assert service_ab.main(["--runs", "5", "-a", "short_thread_memory_s=0", "--",
                            "/bin/true"]) == 0
    out = capsys.readouterr().out
    assert "B over A" in out and "A: short_thread_memory_s=0; B: defaults" in out, out
    data = json.loads((tmp_path / "service_ab.json").read_text())
    assert set(data["configs"]) == {"native", "A", "B"}
    assert all(len(w) == 5 for w in data["walls"].values())
    # /bin/true ends before any service hears of it: no session, so no code, known
    assert data["patched"] == {"A": [False] * 5, "B": [False] * 5}
    assert "B       code installed in 0 of 5 runs\n" in out, out
    lo, hi = data["b_over_a_ci95"]
    assert lo <= data["b_over_a"] <= hi
    # a setting the service refuses: it does not start, and nothing is run
    assert service_ab.main(["--runs", "5", "-b", "no_such_key=1", "--", "/bin/true"]) == 1
    assert "service B unavailable" in capsys.readouterr().err
    for bad in (["--runs", "5"], ["--runs", "4", "--", "/bin/true"],
                ["--", "/no/such/program"]):
        with pytest.raises(SystemExit) as exc:
            service_ab.main(bad)
        assert exc.value.code == 2


def test_preload_floor_compares_the_agent_born_late_with_any_preloaded_library(
        tmp_path, monkeypatch, capsys):
    """bench/preload_floor.py: five rounds of a program natively, with an empty library
    preloaded, with the agent disabled and with the agent born late (a program file as
    a service writes it): figures printed and written (every run exited 0); a missing
    program or too few rounds is a usage error."""
    from bench import preload_floor

    monkeypatch.setenv("DBR_BENCH_RESULTS", str(tmp_path))
    assert preload_floor.main(["--runs", "5", "--", "true"]) == 0
    out = capsys.readouterr().out
    assert all(f"{name} " in out for name in ("native", "empty", "disabled", "late")), out
    data = json.loads((tmp_path / "preload_floor.json").read_text())
    assert set(data["configs"]) == {"native", "empty", "disabled", "late"}
    assert all(len(w) == 5 for w in data["walls"].values())
    assert data["prog"][0] == os.path.realpath(shutil.which("true"))
    for bad in (["--runs", "5"], ["--runs", "4", "--", "true"],
                ["--", "/no/such/program"]):
        with pytest.raises(SystemExit) as exc:
            preload_floor.main(bad)
        assert exc.value.code == 2
