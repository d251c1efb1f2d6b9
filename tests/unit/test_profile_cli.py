"""`dbr profile`: list, show, forget, export and import on real store directories,
the pprof file read back by a reader of this test's own, and bad input refused with
a message and exit 1, never a traceback."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dbr_service.profiles import pprof
from dbr_service.profiles.modkey import ModuleKey, module_key
from dbr_service.profiles.profiledata import EntrySite, HotRegion
from dbr_service.profiles.profilestore import ProfileStore

ROOT = Path(__file__).resolve().parents[2]
DBR = [sys.executable, "-m", "dbr_service.commands.cli", "profile"]
SRC = """
__attribute__((noinline)) long hot_loop(long n) { long s = 0; for (long i = 0; i < n; i++)
    s += i * %d; return s; }
int main(int c, char **v) { (void)v; return (int)hot_loop(c) & 1; }
"""


def _dbr(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DBR_")}
    return subprocess.run([*DBR, *args], capture_output=True, timeout=120, cwd=ROOT,
                          input=stdin, env=env)


def _ok(*args: str, stdin: bytes | None = None) -> str:
    r = _dbr(*args, stdin=stdin)
    assert r.returncode == 0, r.stderr.decode()
    return r.stdout.decode()


def _refused(*args: str, match: str, stdin: bytes | None = None) -> None:
    r = _dbr(*args, stdin=stdin)
    err = r.stderr.decode()
    assert r.returncode == 1 and match in err and "Traceback" not in err, err


@pytest.fixture(scope="module")
def prog(tmp_path_factory) -> tuple[Path, ModuleKey, int]:
    """A program with symbols, its key, and hot_loop's module offset."""
    d = tmp_path_factory.mktemp("prog")
    (d / "p.c").write_text(SRC % 3)
    exe = d / "p"
    subprocess.run(["gcc", "-O1", "-Wl,--build-id", "-o", str(exe), str(d / "p.c")],
                   check=True, timeout=120)
    nm = subprocess.run(["nm", str(exe)], capture_output=True, text=True, check=True).stdout
    addr = next(int(f.split()[0], 16) for f in nm.splitlines() if f.endswith(" hot_loop"))
    return exe, module_key(str(exe)), addr      # PIE: link address == module offset


def _hot(off: int) -> list[HotRegion]:
    return [HotRegion([EntrySite(off, b"\xf3\x0f\x1e\xfa\x48")], [(off, off + 0x30)],
                      {"hot_threshold": 0.01, "inline": True})]


@pytest.fixture
def store(tmp_path, prog) -> Path:
    exe, mk, off = prog
    with ProfileStore(tmp_path / "a") as st:
        st.record_run(mk, {off: 90, off + 8: 10}, {(off + 8, off): 80}, _hot(off))
        st.record_run(ModuleKey("path-" + "1" * 32, "/gone/lib.so"), {0x40: 5})
    return tmp_path / "a"


def test_list_and_show(store, prog):
    exe, mk, off = prog
    out = _ok("list", "--state-dir", str(store))
    assert mk.key in out and str(exe) in out and "/gone/lib.so" in out
    rows = json.loads(_ok("list", "--json", "--state-dir", str(store)))
    assert {r["key"] for r in rows} == {mk.key, "path-" + "1" * 32}
    for name in (mk.key, mk.key[:8], str(exe)):               # key, prefix, path
        text = _ok("show", name, "--state-dir", str(store))
        assert f"key        {mk.key}" in text and "runs       1" in text
        assert "hot_loop" in text and f"{off:#x} [f30f1efa48]" in text
    js = json.loads(_ok("show", "--json", mk.key, "--state-dir", str(store)))
    assert js["top"][0] == {"offset": off, "count": 90.0, "name": "hot_loop"}
    assert js["hot_text"][0]["entries"] == [{"offset": off, "orig": "f30f1efa48"}]
    gone = _ok("show", "path-1", "--state-dir", str(store))
    assert "not this module" in gone and "/gone/lib.so" in gone


def test_show_of_a_rebuilt_program_finds_no_profile(store, prog, tmp_path):
    exe, mk, _ = prog
    copy = tmp_path / "p2"
    (tmp_path / "p2.c").write_text(SRC % 7)
    subprocess.run(["gcc", "-O1", "-Wl,--build-id", "-o", str(copy), str(tmp_path / "p2.c")],
                   check=True, timeout=120)
    _refused("show", str(copy), "--state-dir", str(store), match="no profile of")


def test_forget(store, prog):
    _, mk, _ = prog
    _ok("forget", mk.key[:10], "--state-dir", str(store))
    assert mk.key not in _ok("list", "--state-dir", str(store))
    _refused("forget", mk.key, "--state-dir", str(store), match="no profile of")


def test_json_export_import_round_trip_on_another_state_dir(store, prog, tmp_path):
    _, mk, off = prog
    out = tmp_path / "x.json"
    _ok("export", "--state-dir", str(store), "--output", str(out))
    other = tmp_path / "elsewhere"
    _ok("import", str(out), "--state-dir", str(other))
    with ProfileStore(store, readonly=True) as a, ProfileStore(other, readonly=True) as b:
        assert a.keys() == b.keys()
        for k in a.keys():
            pa, pb = a.lookup(k), b.lookup(k)
            assert (pb.hot_text, pb.counts, pb.edges, pb.path) == \
                (pa.hot_text, pa.counts, pa.edges, pa.path)
        assert b.lookup(mk.key).hot_text == _hot(off)
    # a second import merges: runs add up, hot text stays
    _ok("import", "-", "--state-dir", str(other), stdin=out.read_bytes())
    with ProfileStore(other, readonly=True) as b:
        assert b.lookup(mk.key).runs == 2 and b.lookup(mk.key).hot_text == _hot(off)


# -- an independent reader of profile.proto (not dbr_service.profiles.pprof's)
def _msg(data: bytes) -> list[tuple[int, object]]:
    out, pos = [], 0

    def varint() -> int:
        nonlocal pos
        n = shift = 0
        while True:
            b = data[pos]
            pos += 1
            n |= (b & 0x7F) << shift
            shift += 7
            if b < 0x80:
                return n

    while pos < len(data):
        key = varint()
        if key & 7 == 0:
            out.append((key >> 3, varint()))
        else:
            assert key & 7 == 2, key
            n = varint()
            out.append((key >> 3, data[pos:pos + n]))
            pos += n
    return out


def _packed(v) -> list[int]:
    """A repeated integer field: one varint, or packed ones."""
    return [v] if isinstance(v, int) else _varints(v)


def _varints(b: bytes) -> list[int]:
    out, n, shift = [], 0, 0
    for x in b:
        n |= (x & 0x7F) << shift
        shift += 7
        if x < 0x80:
            out.append(n)
            n = shift = 0
    return out


def test_pprof_export_is_a_profile_proto(store, prog, tmp_path):
    exe, mk, off = prog
    out = tmp_path / "p.pb.gz"
    _ok("export", "--format", "pprof", "-o", str(out), mk.key, "--state-dir", str(store))
    top = _msg(gzip.decompress(out.read_bytes()))
    strings = [v.decode() for k, v in top if k == 6]
    assert strings[0] == ""
    (st,) = [dict(_msg(v)) for k, v in top if k == 1]
    assert (strings[st[1]], strings[st[2]]) == ("samples", "count")
    (mapping,) = [dict(_msg(v)) for k, v in top if k == 3]
    assert strings[mapping[5]] == str(exe) and strings[mapping[6]] == mk.build_id
    locs = {d[1]: d for d in (dict(_msg(v)) for k, v in top if k == 4)}
    funcs = {d[1]: strings[d[2]] for d in (dict(_msg(v)) for k, v in top if k == 5)}
    got = {}
    for k, v in top:
        if k == 2:
            s = dict(_msg(v))
            (lid,), (val,) = _packed(s[1]), _packed(s[2])
            loc = locs[lid]
            assert loc[2] == mapping[1]
            got[loc[3] - mapping[2]] = val
            if loc[3] - mapping[2] == off:
                assert funcs[dict(_msg(loc[4]))[1]] == "hot_loop"
    assert got == {off: 90, off + 8: 10}
    # and it imports: counts, no hot text
    other = tmp_path / "o"
    _ok("import", str(out), "--state-dir", str(other))
    with ProfileStore(other, readonly=True) as b:
        p = b.lookup(mk.key)
        assert p.counts == {off: 90.0, off + 8: 10.0} and p.hot_text == [] and not p.edges


def test_pprof_of_a_module_without_build_id_keeps_its_key(store, tmp_path):
    out = tmp_path / "p.pb.gz"
    _ok("export", "--format", "pprof", "-o", str(out), "--state-dir", str(store))
    profs, skipped = pprof.to_profiles(pprof.decode(out.read_bytes()), 2e9)
    assert skipped == 0 and {p.key for p in profs} >= {"path-" + "1" * 32}


@pytest.mark.parametrize("data,match", [
    (b"{not json", "not JSON"),
    (b'{"format": "other"}', "not a dbr profile export"),
    (json.dumps({"format": "dbr.profiles/1", "modules": [{"key": "../etc"}]}).encode(),
     "neither a build id"),
    (json.dumps({"format": "dbr.profiles/1", "modules": [
        {"key": "ab" * 20, "last_seen": 1, "counts": [[-5, 1]]}]}).encode(), "[0, "),
    (json.dumps({"format": "dbr.profiles/1", "modules": [
        {"key": "ab" * 20, "last_seen": 1, "counts": [[5, "1"]]}]}).encode(), "not a count"),
    (json.dumps({"format": "dbr.profiles/1", "modules": [
        {"key": "ab" * 20, "last_seen": 1, "counts": [[i, 1] for i in range(70000)]}]}
     ).encode(), "at most 65536"),
    (json.dumps({"format": "dbr.profiles/1", "modules": [
        {"key": "ab" * 20, "last_seen": 1, "hot_text": [{"entries": [
            {"offset": 1, "orig": "zz"}], "blocks": []}]}]}).encode(), "not hex"),
    (b'{"a":' + b"[" * 100000, "not JSON"),
    (b"[1]", "neither a JSON export nor a pprof profile"),
    (gzip.compress(b"\x0a\xff\xff\xff\xff\x0f"), "beyond the message"),
    (b"\x1f\x8b\x08garbage", "not a gzip stream"),
])
def test_bad_imports_are_refused_and_change_nothing(store, data, match):
    before = _ok("list", "--json", "--state-dir", str(store))
    _refused("import", "-", "--state-dir", str(store), stdin=data, match=match)
    assert _ok("list", "--json", "--state-dir", str(store)) == before


def test_a_gzip_bomb_is_cut_off(store, tmp_path, monkeypatch):
    monkeypatch.setattr(pprof, "MAX_PROFILE_BYTES", 1 << 20)
    with pytest.raises(pprof.PprofError, match="inflates to more than"):
        pprof.decode(gzip.compress(bytes(4 << 20)))


def test_a_busy_store_and_a_missing_file_are_clear_errors(store, tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from dbr_service.profiles.profilestore import "
         "ProfileStore; s = ProfileStore(sys.argv[1]); print('ready', flush=True); "
         "sys.stdin.read()", str(store)], cwd=ROOT, stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        _refused("forget", "path-1", "--state-dir", str(store),
                 match=f"in use by pid {holder.pid}")
        assert "path-" in _ok("list", "--state-dir", str(store))   # readers go on
    finally:
        holder.kill()
        holder.wait(timeout=30)
    _refused("import", str(tmp_path / "nope.json"), "--state-dir", str(store),
             match="No such file")
    _refused("show", "ffff", "--state-dir", str(store), match="no profile of")
    assert "no profiles in" in _ok("list", "--state-dir", str(tmp_path / "empty"))
    assert not (tmp_path / "empty").exists()               # readers create nothing
