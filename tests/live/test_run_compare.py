"""`dbr run --compare N` (dbr_service/commands/compare.py): the interval of the median, the
verdict, and whole comparisons of small programs under an embedded service: the
exit status is PROG's, a run whose output or status differs makes it 1, bad N is
refused before anything runs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from harness import compile_c

from dbr_service.commands.compare import Run, format_compare, median_interval, summarize, verdict

DBR = [sys.executable, "-m", "dbr_service.commands.cli"]


def test_median_interval_is_the_order_statistic_one():
    # 6 values: [min, max] holds the median with 1 - 2**-5
    assert median_interval([3, 1, 2, 6, 5, 4]) == (1, 6, pytest.approx(0.96875))
    # 10 values: the 2nd and 9th (1 - 2 * 11 / 1024 = 0.979); the 3rd and 8th give 0.891
    xs = list(range(10))
    assert median_interval(xs) == (1, 8, pytest.approx(1 - 22 / 1024))
    assert median_interval(xs, level=0.85) == (2, 7, pytest.approx(1 - 112 / 1024))
    # too few values for 95 %: [min, max] and what it has
    assert median_interval([2.0, 1.0, 3.0]) == (1.0, 3.0, pytest.approx(0.75))
    assert median_interval([1.0])[2] == 0.0
    with pytest.raises(ValueError):
        median_interval([])


def test_verdict_needs_the_whole_interval_on_one_side():
    assert verdict(0.90, 0.99) == "faster under dbr"
    assert verdict(1.01, 1.20) == "slower under dbr"
    assert verdict(0.98, 1.02) == "no difference resolved"


def test_summary_reports_mismatches_and_what_dbr_did():
    warm = Run("native", 1.0, 0, "h", 1)
    client = {"patches_installed": 2, "regions_went_live": 1, "samples_after_first_patch": 80,
              "samples_in_replacement": 20, "time_to_first_patch_s": 0.4,
              "service_cpu_s": 0.05, "client_cpu_s": 0.3}
    # the program's CPU is the runs' own (wait4), not the service's last look at it
    runs = [(Run("native", 1.0, 0, "h", 2), Run("dbr", 0.9, 0, "h", 3, [client], cpu_s=1.0)),
            (Run("native", 1.0, 0, "h", 4),
             Run("dbr", 0.95, 0, "other", 5, [client], cpu_s=1.0))]
    res = summarize(warm, runs)
    assert res["ratios"] == [0.9, 0.95] and res["mismatches"] == [
        {"pair": 2, "config": "dbr", "exit_code": 0, "output_differs": True}]
    text = format_compare(res)
    assert "x0.925 [0.900-0.950] (50% interval of the median)" in text, text
    assert "2 pair(s) give no 95 % interval" in text
    assert "2 of 2 patched, 2 region(s) went live, first patch after 0.40 s (median), 25% " \
           "of the samples since then in replacement code; service 5.0% of its CPU" in text
    assert "1 run(s) differ from the first native run (exit 0); the first: pair 2, dbr: " \
           "its output differs" in text


@pytest.fixture(scope="module")
def progs(tmp_path_factory):
    src = """
    #include <stdio.h>
    #include <stdlib.h>
    #include <string.h>
    #include <time.h>
    #include <unistd.h>
    int main(int argc, char **argv) {
        const char *mode = argc > 1 ? argv[1] : "same";
        volatile unsigned long s = 0;
        for (unsigned long i = 0; i < 20000000UL; i++)
            s += i * i;
        if (strcmp(mode, "pid") == 0)
            printf("%d\\n", (int)getpid());      /* differs every run */
        else
            printf("%lu\\n", s);
        return strcmp(mode, "three") == 0 ? 3 : 0;
    }
    """
    path = tmp_path_factory.mktemp("compare") / "compare_prog.c"
    path.write_text(src)
    return compile_c([path], flags=["-O1"])


def _compare(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(DBR + ["run", "--embedded", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_a_comparison_times_both_and_keeps_the_exit_status(progs, tmp_path):
    rep = tmp_path / "c.json"
    r = _compare("--compare", "2", "--report", str(rep), "--", str(progs), "three")
    assert r.returncode == 3, r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""
    assert "dbr: pair 2/2: native" in r.stderr and "dbr/native x" in r.stderr, r.stderr
    doc = json.loads(rep.read_text())
    assert doc["schema"] == "dbr.compare/1" and doc["pairs"] == 2 and doc["exit_code"] == 3
    assert len(doc["native_s"]) == len(doc["dbr_s"]) == len(doc["ratios"]) == 2
    assert doc["mismatches"] == [] and doc["verdict"] in (
        "faster under dbr", "slower under dbr", "no difference resolved")


def test_a_run_whose_output_differs_makes_the_comparison_fail(progs):
    r = _compare("--compare", "1", "--", str(progs), "pid")
    assert r.returncode == 1, r.stderr
    assert "run(s) differ from the first native run" in r.stderr
    assert "its output differs" in r.stderr


@pytest.mark.parametrize("n", ["0", "1001", "-3"])
def test_bad_pair_counts_are_refused_before_anything_runs(progs, n):
    r = _compare(f"--compare={n}", "--", str(progs))
    assert r.returncode == 2 and "--compare takes 1 to 1000 pairs" in r.stderr, r.stderr
    assert "pair" not in r.stderr.replace("1000 pairs", "")


def test_a_missing_program_is_said_once(tmp_path):
    r = _compare("--compare", "2", "--", str(tmp_path / "nope"))
    assert r.returncode == 127 and "cannot run" in r.stderr and "Traceback" not in r.stderr


def test_the_demo_names_the_region_it_shows(tmp_path):
    """`make demo`'s last lines: the region's entry by the name the run report gives
    it (dbr_service/common/hotnames.py names it after the function holding it), its size
    and layout, and the share of samples in the copy."""
    from dbr_service.commands.demo import describe_regions

    prog = str(tmp_path / "mislaid")
    report = {"clients": [{
        "exe": prog, "samples_after_first_patch": 200, "samples_in_replacement": 150,
        "time_to_first_patch_s": 0.25,
        "regions": [{"id": "r1", "state": "installed", "entries": [0x555555555213],
                     "entry_names": ["work+0x13"], "blocks": 5, "code_bytes": 61,
                     "info": {"layout": "ext-tsp"}}]},
        {"exe": "/bin/sh", "regions": [{"id": "r1"}]}]}
    assert describe_regions(report, prog) == [
        "demo: region r1 installed: entry work+0x13; 5 blocks copied into 61 bytes, laid "
        "out by ext-tsp",
        "demo: 75% of the samples after the first patch (0.25 s) ran in the copy"]


def test_run_json_puts_the_report_on_stderr(progs):
    """`dbr run --json`: the dbr.run/1 document on stderr instead of the lines (PROG's
    output keeps stdout); with --compare, dbr.compare/1."""
    r = subprocess.run(DBR + ["run", "--embedded", "--json", "--", str(progs)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip().isdigit(), (r.stdout, r.stderr)
    assert json.loads(r.stderr)["schema"] == "dbr.run/1"
    r = _compare("--json", "--compare", "1", "--", str(progs))
    doc = json.loads(r.stderr)
    assert r.returncode == 0 and doc["schema"] == "dbr.compare/1" and doc["pairs"] == 1
