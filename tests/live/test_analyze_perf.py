"""`dbr analyze` on perf.data files (dbr_service/region/perfdata.py, region/analyze.py):
a real `perf record -e cpu-clock` of a PIE program is analysed without --base and
its hot function found; a program whose time goes to libc gets a warning naming
libc (stderr, and ``warnings`` in --json); a missing perf, a garbled perf.data or a
file that is neither form is a clear error with exit 2.  Skipped only where perf is
not installed (`make bench-setup` installs linux-perf)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dbr_service.region.perfdata import find_perf

DBR = [sys.executable, "-m", "dbr_service.commands.cli"]
PERF = find_perf()
needs_perf = pytest.mark.skipif(PERF is None, reason="perf is not installed "
                                "(make bench-setup installs linux-perf)")

HOT = r"""
#include <stdlib.h>
__attribute__((noinline)) long hot_loop(long n) {
    long s = 0;
    for (long i = 0; i < n; i++) s += (i * 7) ^ (s >> 3);
    return s;
}
int main(int c, char **v) { volatile long r = hot_loop(atol(v[1])); (void)r; return 0; }
"""

# most of the time in libc's memcpy and strlen, some in its own loop
LIBC = r"""
#include <stdlib.h>
#include <string.h>
__attribute__((noinline)) long mine(const char *b, size_t n) {
    long s = 0;
    for (size_t i = 0; i < n; i += 64) s = s * 31 + b[i];
    return s;
}
int main(int c, char **v) {
    long n = atol(v[1]);
    size_t sz = 1 << 20;
    char *a = malloc(sz), *b = malloc(sz);
    memset(a, 'x', sz - 1); a[sz - 1] = 0;
    long s = 0;
    for (long i = 0; i < n; i++) {
        memcpy(b, a, sz); s += strlen(b); s += mine(b, sz); b[i % 100] ^= 1;
    }
    volatile long r = s; (void)r;
    return 0;
}
"""


def _build(tmp_path, name: str, src: str) -> str:
    (tmp_path / f"{name}.c").write_text(src)
    exe = tmp_path / name
    subprocess.run(["gcc", "-O1", "-fPIE", "-pie", "-o", str(exe), str(tmp_path / f"{name}.c")],
                   check=True)
    return str(exe)


def _record(tmp_path, argv: list[str]) -> str:
    data = tmp_path / f"{os.path.basename(argv[0])}.data"
    r = subprocess.run([PERF, "record", "-q", "-e", "cpu-clock", "-o", str(data), "--", *argv],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return str(data)


def _analyze(*args: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([*DBR, "analyze", *args], capture_output=True, text=True,
                          timeout=300, env=env)


@pytest.fixture(scope="module")
def hot(tmp_path_factory):
    d = tmp_path_factory.mktemp("hot")
    exe = _build(d, "hot", HOT)
    return exe, _record(d, [exe, "300000000"]), d


@needs_perf
def test_a_pie_is_analysed_from_perf_data_without_base(hot):
    exe, data, d = hot
    r = _analyze(exe, "--samples", data, "--dot-dir", str(d / "dots"))
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr and "warning" not in r.stderr, r.stderr
    assert "0 samples not placed" in r.stdout, r.stdout
    # the region's loop block is named after the function the samples are in
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("    0x")]
    assert any("(hot_loop+0x" in ln and "samples=0" not in ln for ln in lines), r.stdout

    j = _analyze(exe, "--json", "--samples", data)
    assert j.returncode == 0, j.stderr
    doc = json.loads(j.stdout)
    assert doc["schema"] == "dbr.analyze/1" and doc["base"] is None
    s = doc["samples"]
    assert s["source"] == "perf.data" and s["recorded_as"] == os.path.realpath(exe)
    assert s["in_binary"] >= 0.9 * s["total"] > 0 and doc["warnings"] == []
    hot_nodes = [n for r in doc["regions"] for n in r["nodes"] if n["samples"] > 0]
    assert hot_nodes and all(n["name"].startswith("hot_loop+") for n in hot_nodes), hot_nodes
    assert sum(n["samples"] for n in hot_nodes) >= 0.9 * s["in_binary"]
    assert all(isinstance(n["start"], int) for n in hot_nodes)


@needs_perf
def test_most_samples_in_libc_is_warned_about(tmp_path):
    exe = _build(tmp_path, "libc", LIBC)
    data = _record(tmp_path, [exe, "2500"])
    r = _analyze(exe, "--samples", data)
    assert r.returncode == 0, r.stderr
    warn = [ln for ln in r.stderr.splitlines() if ln.startswith("warning:")]
    assert warn and "libc.so.6" in warn[0] and f"not in {exe}" in warn[0], r.stderr
    j = _analyze(exe, "--samples", data, "--json")
    doc = json.loads(j.stdout)
    assert any("libc.so.6" in w for w in doc["warnings"]), doc["warnings"]
    s = doc["samples"]
    assert s["in_binary"] < s["total"] / 2
    top = s["other_dsos"][0]
    assert top["dso"].endswith("libc.so.6") and top["samples"] > s["total"] / 2
    assert "warning:" in j.stderr                   # stderr too, with --json


@needs_perf
def test_samples_of_another_program_are_an_error_naming_where_they_are(hot, tmp_path):
    _exe, data, _d = hot
    other = _build(tmp_path, "other", "int main(void) { return 0; }\n")
    r = _analyze(other, "--samples", data)
    assert r.returncode == 2 and "none of its" in r.stderr and "/hot" in r.stderr, r.stderr
    assert "--dso" in r.stderr and "Traceback" not in r.stderr
    # --dso names the path perf recorded: the same samples, placed in a copy
    copy = tmp_path / "hot-copy"
    copy.write_bytes(open(_exe, "rb").read())
    ok = _analyze(str(copy), "--samples", data, "--dso", os.path.realpath(_exe), "--json")
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["samples"]["in_binary"] > 0


@needs_perf
def test_a_garbled_perf_data_is_a_clear_error(hot, tmp_path):
    exe, data, _d = hot
    raw = open(data, "rb").read()
    for name, blob in (("junk", b"PERFILE2" + bytes(range(256)) * 8), ("cut", raw[:200])):
        bad = tmp_path / f"{name}.data"
        bad.write_bytes(blob)
        r = _analyze(exe, "--samples", str(bad))
        assert r.returncode == 2, (name, r.stdout, r.stderr)
        assert r.stderr.startswith(f"dbr analyze: {bad}: ") and "Traceback" not in r.stderr


def test_a_missing_perf_is_a_clear_error(tmp_path, monkeypatch, capsys):
    from dbr_service.commands.cli import main
    from dbr_service.region import perfdata

    exe = _build(tmp_path, "hot", HOT)
    data = tmp_path / "perf.data"
    data.write_bytes(b"PERFILE2" + bytes(100))
    monkeypatch.setattr(perfdata, "find_perf", lambda: None)
    assert main(["analyze", exe, "--samples", str(data)]) == 2
    err = capsys.readouterr().err
    assert "needs `perf`" in err and "linux-perf" in err, err


def test_a_file_neither_text_nor_perf_data_is_a_clear_error(tmp_path):
    exe = _build(tmp_path, "hot", HOT)
    blob = tmp_path / "blob"
    blob.write_bytes(b"\xff\xfe\x00garbage" * 10)
    r = _analyze(exe, "--samples", str(blob))
    assert r.returncode == 2 and "neither a perf.data file nor a text samples file" in r.stderr
    r = _analyze(exe, "--samples", str(blob), "--dso", "/x")
    assert r.returncode == 2 and "--dso applies to a perf.data file" in r.stderr


def test_json_of_text_samples_parses(tmp_path):
    """--json with the text form: one JSON document on stdout, addresses as integers."""
    exe = _build(tmp_path, "hot", HOT)
    syms = subprocess.run(["nm", exe], capture_output=True, text=True, check=True).stdout
    lo = next(int(ln.split()[0], 16) for ln in syms.splitlines() if ln.endswith(" hot_loop"))
    samples = tmp_path / "s.txt"
    samples.write_text(f"{lo:#x} 30\n")
    r = _analyze(exe, "--samples", str(samples), "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["samples"] == {"source": "text", "file": str(samples), "total": 30.0}
    assert doc["discovery"]["blocks"] > 0 and doc["discovery"]["samples_unplaced"] == 0
    assert isinstance(doc["regions"], list) and doc["warnings"] == [] and doc["base"] is None


def test_text_samples_from_a_pipe_keep_their_first_line(tmp_path):
    """`--samples <(...)`: a pipe is not sniffed for the perf.data header (the bytes
    read would be lost to the text reader)."""
    exe = _build(tmp_path, "hot", HOT)
    syms = subprocess.run(["nm", exe], capture_output=True, text=True, check=True).stdout
    lo = next(int(ln.split()[0], 16) for ln in syms.splitlines() if ln.endswith(" hot_loop"))
    r = subprocess.run(["bash", "-c", f'"$@" --samples <(echo "{lo:#x} 7")', "-",
                        *DBR, "analyze", exe, "--json"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["samples"]["total"] == 7.0
