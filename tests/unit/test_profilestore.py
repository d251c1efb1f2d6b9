"""The profile store (dbr_service/profiles/profilestore.py): module identity, merging with
decay, expiry, limits, a killed writer, a damaged file, two writers, a rebuilt
binary, 1,000 modules, and the conversion of a session's samples and regions."""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import logging
import os
import random
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from dbr_service.profiles import profilestore as ps
from dbr_service.wire.agentconn import make_site
from dbr_service.profiles.modkey import ModuleKey, ModuleKeyError, module_key
from dbr_service.common.procmaps import read_maps
from dbr_service.profiles.profiledata import (
    MAX_OFFSETS, EntrySite, HotRegion, ProfileDataError, module_counts, module_edges,
    module_hot_text, profiles_from_doc, profiles_to_doc, selection_params)
from dbr_service.profiles.profilestore import ProfileStore, SchemaError, StoreBusyError, StoreError
from dbr_service.sampling.aggregate import SampleAggregator
from dbr_service.sampling.base import Sample
from dbr_service.session.session_regions import RegionRecord
from dbr_service.common.states import RegionState
from dbr_service.common.symbols import symbols_of

ROOT = Path(__file__).resolve().parents[2]
DAY = 86400.0
PROG = "int work(int n) {{ int s = 0; for (int i = 0; i < n; i++) s += i * {k}; return s; }}\n" \
       "int main(int c, char **v) {{ (void)v; return work(c) & 1; }}\n"


def _mk(i: int = 0) -> ModuleKey:
    return ModuleKey(f"{i:040x}", f"/opt/m{i}.so", f"{i:040x}")


def _hot(entry: int, tag: int = 0) -> list[HotRegion]:
    return [HotRegion([EntrySite(entry, bytes([0x48, 0x89, 0xe5, 0x90, tag & 0xFF]))],
                      [(entry, entry + 0x40), (entry + 0x80, entry + 0x90)],
                      {"hot_threshold": 0.01, "run": tag})]


def _compile(src: str, out: Path, *flags: str) -> Path:
    c = out.with_suffix(".c")
    c.write_text(src)
    subprocess.run(["gcc", "-O1", *flags, "-o", str(out), str(c)], check=True, timeout=120)
    return out


# ------------------------------------------------------------------------------ identity
def test_build_id_is_the_notes(tmp_path):
    exe = _compile(PROG.format(k=3), tmp_path / "p", "-Wl,--build-id")
    notes = subprocess.run(["readelf", "-n", str(exe)], capture_output=True, text=True,
                           check=True).stdout
    bid = next(line.split(":", 1)[1].strip() for line in notes.splitlines()
               if "Build ID" in line)
    mk = module_key(str(exe))
    assert mk.key == mk.build_id == bid and mk.path == str(exe)


def test_without_a_build_id_the_key_follows_path_size_mtime_and_text(tmp_path):
    exe = _compile(PROG.format(k=3), tmp_path / "p", "-Wl,--build-id=none")
    k1 = module_key(str(exe))
    assert k1.key.startswith("path-") and not k1.build_id
    assert module_key(str(exe)) == k1                     # stable
    other = tmp_path / "q"
    other.write_bytes(exe.read_bytes())
    os.utime(other, ns=(exe.stat().st_mtime_ns,) * 2)
    assert module_key(str(other)).key != k1.key           # another path
    _compile(PROG.format(k=5), exe, "-Wl,--build-id=none")
    assert module_key(str(exe)).key != k1.key             # rebuilt in place


def test_what_is_no_module_is_a_clear_error(tmp_path):
    (tmp_path / "text").write_text("hello")
    os.mkfifo(tmp_path / "fifo")
    for name, why in (("missing", "No such file"), ("text", "not an ELF64"),
                      ("fifo", "not a regular file")):
        with pytest.raises(ModuleKeyError, match=why):
            module_key(str(tmp_path / name))              # the FIFO does not block
    bad = bytearray(Path(sys.executable).resolve().read_bytes()[:64])
    bad[0x38:0x3A] = (60000).to_bytes(2, "little")        # e_phnum beyond the file
    (tmp_path / "bad").write_bytes(bytes(bad))
    with pytest.raises(ModuleKeyError, match="program headers"):
        module_key(str(tmp_path / "bad"))


def test_a_rebuilt_binary_at_the_same_path_does_not_get_the_old_profile(tmp_path):
    exe = tmp_path / "prog"
    _compile(PROG.format(k=3), exe, "-Wl,--build-id")
    old = module_key(str(exe))
    with ProfileStore(tmp_path / "state") as st:
        st.record_run(old, {0x1130: 40}, None, _hot(0x1130))
        _compile(PROG.format(k=7), exe, "-Wl,--build-id")
        new = module_key(str(exe))
        assert new.build_id and new.key != old.key
        assert st.lookup(new.key) is None
        assert st.lookup(old.key).counts == {0x1130: 40.0}


# ------------------------------------------------------------------------------ merging
def test_counts_merge_with_decay_and_the_newest_hot_text_wins(tmp_path):
    st = ProfileStore(tmp_path, half_life_s=DAY, expiry_s=0)
    t0 = 1_700_000_000.0
    st.record_run(_mk(), {0x10: 8, 0x20: 4}, {(0x10, 0x20): 6}, _hot(0x10, 1), now=t0)
    st.record_run(_mk(), {0x10: 2}, None, None, now=t0 + 2 * DAY)   # two half-lives
    p = st.lookup(_mk().key)
    assert p.runs == 2 and p.first_seen == t0 and p.last_seen == t0 + 2 * DAY
    assert p.counts == {0x10: pytest.approx(8 / 4 + 2), 0x20: pytest.approx(1.0)}
    assert p.edges == {(0x10, 0x20): pytest.approx(1.5)}
    assert p.hot_text == _hot(0x10, 1)                    # None kept the stored one
    st.record_run(_mk(), {0x30: 1}, None, _hot(0x30, 3), now=t0 + 2 * DAY)
    assert st.lookup(_mk().key).hot_text == _hot(0x30, 3)
    # counts decayed below MIN_COUNT are dropped
    st.record_run(_mk(), {0x40: 1}, None, None, now=t0 + 40 * DAY)
    assert set(st.lookup(_mk().key).counts) == {0x40}
    st.close()


def test_an_older_import_decays_to_the_stored_time(tmp_path):
    st = ProfileStore(tmp_path, half_life_s=DAY, expiry_s=0)
    t0 = 1_700_000_000.0
    st.record_run(_mk(), {0x10: 4}, None, _hot(0x10, 1), now=t0)
    older = profiles_from_doc(profiles_to_doc([st.lookup(_mk().key)], t0))[0]
    older.last_seen = older.first_seen = t0 - DAY
    older.hot_text = _hot(0x99, 9)
    st.merge_profile(older, now=t0)
    p = st.lookup(_mk().key)
    assert p.counts == {0x10: pytest.approx(4 + 2)} and p.runs == 2
    assert p.hot_text == _hot(0x10, 1) and p.last_seen == t0   # the newer side's
    st.close()


def test_modules_not_seen_expire_when_a_writer_opens(tmp_path):
    now = time.time()
    with ProfileStore(tmp_path, expiry_s=0) as st:
        st.record_run(_mk(1), {1: 1}, now=now - 40 * DAY)
        st.record_run(_mk(2), {1: 1}, now=now - 1 * DAY)
    with ProfileStore(tmp_path, readonly=True, expiry_s=30 * DAY) as rd:
        assert len(rd.keys()) == 2                        # readers change nothing
    with ProfileStore(tmp_path, expiry_s=30 * DAY) as st:
        assert st.keys() == [_mk(2).key]
        assert st.lookup(_mk(1).key) is None


def test_limits_refuse_or_trim(tmp_path, monkeypatch):
    st = ProfileStore(tmp_path, expiry_s=0)
    with pytest.raises(ProfileDataError, match="more than"):
        st.record_run(_mk(), {i: 1 for i in range(MAX_OFFSETS + 1)})
    for bad in ({-1: 1}, {1 << 50: 1}, {1: float("nan")}, {1: -2}, {True: 1}):
        with pytest.raises(ProfileDataError):
            st.record_run(_mk(), bad)
    with pytest.raises(ProfileDataError, match="original bytes"):
        st.record_run(_mk(), {}, None, [HotRegion([EntrySite(1, b"")], [], {})])
    with pytest.raises(ProfileDataError, match="empty"):
        st.record_run(_mk(), {}, None, [HotRegion([], [(5, 5)], {})])
    assert st.keys() == []                                # nothing was written
    monkeypatch.setattr(ps, "MAX_OFFSETS", 100)
    for run in range(3):
        st.record_run(_mk(), {run * 1000 + i: 1 + i + run for i in range(80)})
    counts = st.lookup(_mk().key).counts
    assert len(counts) == 100 and min(counts.values()) >= sorted(
        [1 + i + r for r in range(3) for i in range(80)])[-100]
    st.close()


# ------------------------------------------------------------------------------ safety
def test_the_directory_is_private_and_checked(tmp_path):
    with ProfileStore(tmp_path / "a" / "state"):
        pass
    assert (tmp_path / "a" / "state").stat().st_mode & 0o777 == 0o700
    (tmp_path / "open").mkdir(mode=0o777)
    os.chmod(tmp_path / "open", 0o777)
    with pytest.raises(StoreError, match="writable by group or others"):
        ProfileStore(tmp_path / "open")
    os.symlink(tmp_path / "a" / "state", tmp_path / "link")
    with pytest.raises(StoreError, match="symbolic link"):
        ProfileStore(tmp_path / "link")


@pytest.mark.parametrize("damage", ["garbage", "truncated", "other-schema", "symlink"])
def test_a_damaged_file_is_moved_aside_and_rebuilt(tmp_path, caplog, damage):
    db = tmp_path / ps.DB_NAME
    if damage in ("garbage", "truncated"):
        with ProfileStore(tmp_path, expiry_s=0) as st:
            for i in range(200):
                st.record_run(_mk(i), {j: j for j in range(1, 50)}, None, _hot(i))
        (tmp_path / (ps.DB_NAME + "-wal")).unlink(missing_ok=True)
        data = db.read_bytes()
        db.write_bytes(os.urandom(len(data)) if damage == "garbage"
                       else data[:len(data) // 3])
    elif damage == "other-schema":
        with sqlite3.connect(db) as c:
            c.execute("CREATE TABLE t (x)")
    else:
        os.symlink("/etc/passwd", db)
    with pytest.raises(StoreError, match="damaged"):      # a reader says so, moves nothing
        ProfileStore(tmp_path, readonly=True).summaries()
    with caplog.at_level(logging.WARNING, "dbr.profiles"):
        st = ProfileStore(tmp_path)
    assert any("moved to" in r.message and r.levelno == logging.WARNING
               for r in caplog.records), caplog.text
    aside = [p.name for p in tmp_path.iterdir() if ".corrupt-" in p.name]
    assert any(n.startswith(ps.DB_NAME + ".corrupt-") for n in aside), aside
    assert st.keys() == [] and st.integrity() == "ok"
    st.record_run(_mk(), {1: 1})
    assert st.lookup(_mk().key).counts == {1: 1.0}
    st.close()
    assert Path("/etc/passwd").exists()


def test_a_newer_schema_is_refused_and_left_alone(tmp_path):
    ProfileStore(tmp_path).close()
    with sqlite3.connect(tmp_path / ps.DB_NAME) as c:
        c.execute("UPDATE meta SET value='99' WHERE name='schema_version'")
    before = (tmp_path / ps.DB_NAME).read_bytes()
    with pytest.raises(SchemaError, match="schema version 99, newer"):
        ProfileStore(tmp_path)
    assert (tmp_path / ps.DB_NAME).read_bytes() == before
    assert not [p for p in tmp_path.iterdir() if ".corrupt-" in p.name]


_HOLDER = """
import sys, time
from dbr_service.profiles.profilestore import ProfileStore
st = ProfileStore(sys.argv[1])
print("ready", flush=True)
sys.stdin.read()
st.close()
"""


def test_a_second_writer_is_refused_with_the_holders_pid(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(tmp_path)], cwd=ROOT,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        with pytest.raises(StoreBusyError, match=f"in use by pid {holder.pid}"):
            ProfileStore(tmp_path)
        with ProfileStore(tmp_path, readonly=True) as rd:  # readers go on
            assert rd.keys() == []
        holder.stdin.close()
        assert holder.wait(timeout=30) == 0
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(timeout=30)
    with ProfileStore(tmp_path) as st:                    # free again
        st.record_run(_mk(), {1: 1})


_WRITER = """
import sys
from dbr_service.profiles.modkey import ModuleKey
from dbr_service.profiles.profiledata import EntrySite, HotRegion
from dbr_service.profiles.profilestore import ProfileStore
st = ProfileStore(sys.argv[1], half_life_s=1e12, expiry_s=0)
n = st.lookup("ab" * 20).runs if st.lookup("ab" * 20) else 0
while True:
    n += 1
    hot = [HotRegion([EntrySite(0x10, bytes(5))], [(0x10, 0x20)], {"run": n})]
    st.record_run(ModuleKey("ab" * 20, "/bin/x", "ab" * 20),
                  {0: 1, **{1000 + n * 7 + i: 1 for i in range(200)}}, None, hot, now=1e9)
    print(n, flush=True)
"""


def test_a_writer_killed_mid_write_leaves_the_last_committed_run(tmp_path):
    rng = random.Random(7)
    last = 0
    for _ in range(6):                                     # bounded rounds
        w = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path)], cwd=ROOT,
                             stdout=subprocess.PIPE, text=True)
        try:
            assert int(w.stdout.readline()) == last + 1   # it writes
            time.sleep(rng.uniform(0.0, 0.4))
            w.kill()
            seen = w.stdout.read().split()
            last = int(seen[-1]) if seen else last + 1
        finally:
            w.kill()
            w.wait(timeout=30)
        with ProfileStore(tmp_path, readonly=True) as rd:
            assert rd.integrity() == "ok"
            p = rd.lookup("ab" * 20)
        # the run printed last is committed; the next may have committed unprinted
        assert p.runs in (last, last + 1), (p.runs, last)
        assert p.counts[0] == p.runs and p.hot_text[0].params["run"] == p.runs
        last = p.runs
    with ProfileStore(tmp_path) as st:
        assert st.integrity() == "ok"


# ------------------------------------------------------------------------------ scale
def test_a_thousand_modules(tmp_path, capsys):
    t0 = time.monotonic()
    with ProfileStore(tmp_path / "a") as st:
        for i in range(1000):
            st.record_run(_mk(i), {0x1000 + 16 * j: 100 - j for j in range(50)},
                          {(0x1000, 0x1010): 5}, _hot(0x1000, i))
        t_rec = time.monotonic() - t0
        rows = st.summaries()
        profiles = [st.lookup(k) for k in st.keys()]
    t_list = time.monotonic() - t0 - t_rec
    assert len(rows) == 1000 and all(r.offsets == 50 and r.regions == 1 for r in rows)
    doc = json.dumps(profiles_to_doc(profiles, time.time()))
    t_exp = time.monotonic() - t0 - t_rec - t_list
    with ProfileStore(tmp_path / "b") as st:
        for p in profiles_from_doc(json.loads(doc)):
            st.merge_profile(p)
        assert len(st.keys()) == 1000
        assert st.lookup(_mk(999).key).hot_text == _hot(0x1000, 999)
    total = time.monotonic() - t0
    with capsys.disabled():
        print(f"\n1000 modules: record {t_rec:.2f} s, list+lookup {t_list:.2f} s, "
              f"export {t_exp:.2f} s ({len(doc)} bytes), total with import {total:.2f} s")
    assert total < 120


# ------------------------------------------------------------------------------ conversion
def test_samples_and_regions_of_a_session_become_module_offsets():
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    addr = ctypes.cast(libc.getpid, ctypes.c_void_p).value
    maps = read_maps(os.getpid())
    m = next(m for m in maps if m.lo <= addr < m.hi)
    agg = SampleAggregator()
    pid = os.getpid()
    agg.add([Sample(pid, pid, addr), Sample(pid, pid, addr), Sample(pid, pid, addr + 1),
             Sample(pid, pid, 16)])                        # 16: nothing mapped there
    agg.add([Sample(pid, pid, addr + 4, taken=True, target=addr)])
    counts = module_counts(agg.ips[pid], maps)
    assert list(counts) == [m.path]
    off = min(counts[m.path])
    name, within = symbols_of(m.path).at_offset(off)      # the ELF file agrees
    assert "getpid" in name and within == 0
    assert counts[m.path] == {off: 2, off + 1: 1, off + 4: 1}
    assert module_edges(agg.branch_counts(pid), maps) == {m.path: {(off + 4, off): 1}}

    site = make_site(addr, 0x7000_0000, b"\xb8\x27\x00\x00\x00\x0f")
    rec = RegionRecord("r1", m.path, [addr], 3, 40, RegionState.INSTALLED, sites=[site],
                       orig_ranges=[(addr, addr + 40)])
    cold = RegionRecord("r2", m.path, [addr + 64], 1, 8)   # selected, never patched
    from dbr_service.common.config import Config
    params = selection_params(Config())
    hot = module_hot_text([rec, cold], maps, params)
    assert hot == {m.path: [HotRegion([EntrySite(off, b"\xb8\x27\x00\x00\x00")],
                                      [(off, off + 40)], params)]}
    # a region that copies code of another module too is left out, not stored with
    # an offset beyond the module (the whole run's record would be refused)
    other = next(x for x in maps if x.path != m.path and x.path.startswith("/")
                 and x.lo > m.hi)                  # above it: a positive offset
    both = RegionRecord("r3", m.path, [addr], 3, 40, RegionState.INSTALLED, sites=[site],
                        orig_ranges=[(addr, addr + 40), (other.lo, other.lo + 16)])
    assert module_hot_text([rec, both], maps, params) == hot


def test_a_recorded_session_round_trips_through_the_store(tmp_path):
    exe = Path(sys.executable).resolve()
    mk = module_key(str(exe))
    hot = [HotRegion([EntrySite(0x2000, b"\x55\x48\x89\xe5\x41")], [(0x2000, 0x2100)],
                     {"hot_threshold": 0.01})]
    with ProfileStore(tmp_path / "a") as st:
        st.record_run(mk, {0x2000: 9, 0x2004: 1}, {(0x2004, 0x2000): 7}, hot)
        src = st.lookup(mk.key)
    doc = json.loads(json.dumps(profiles_to_doc([src], time.time())))
    with ProfileStore(tmp_path / "b") as st:
        for p in profiles_from_doc(doc):
            st.merge_profile(p)
        got = st.lookup(mk.key)
    assert got.hot_text == hot and got.counts == src.counts and got.edges == src.edges
    assert (got.path, got.build_id, got.runs) == (str(exe), mk.build_id, 1)


def test_a_hostile_store_row_is_ignored_not_fatal(tmp_path, caplog):
    with ProfileStore(tmp_path) as st:
        st.record_run(_mk(), {1: 1}, None, _hot(1))
    with sqlite3.connect(tmp_path / ps.DB_NAME) as c:
        c.execute("UPDATE modules SET hot_text=?", (textwrap.dedent("[{\"entries\": 5}]"),))
    with caplog.at_level(logging.WARNING, "dbr.profiles"), \
            ProfileStore(tmp_path, readonly=True) as rd:
        p = rd.lookup(_mk().key)
    assert p.hot_text == [] and p.counts == {1: 1.0} and "ignored" in caplog.text


def test_an_empty_file_is_an_empty_store_and_bad_knobs_are_refused(tmp_path):
    os.chmod(tmp_path, 0o700)
    (tmp_path / ps.DB_NAME).write_bytes(b"")
    with ProfileStore(tmp_path, readonly=True) as rd:
        assert rd.summaries() == [] and rd.lookup(_mk().key) is None
    with ProfileStore(tmp_path) as st:                    # a writer makes the schema
        st.record_run(_mk(), {1: 1})
    for knobs in ({"half_life_s": 0}, {"expiry_s": -1}):
        with pytest.raises(StoreError, match="half-life"):
            ProfileStore(tmp_path, **knobs)
    with ProfileStore(tmp_path, readonly=True) as rd, pytest.raises(StoreError, match="read-only"):
        rd.record_run(_mk(), {1: 1})


def test_programs_are_marked_kept_and_forgotten_with_their_key(tmp_path):
    st = ProfileStore(tmp_path, expiry_s=30 * DAY)
    t0 = time.time()
    st.mark_program(_mk(1).key, "/usr/bin/python3.11", now=t0)
    st.mark_program(_mk(2).key, "/usr/bin/old", now=t0 - 40 * DAY)
    assert st.programs() == {_mk(1).key: "/usr/bin/python3.11", _mk(2).key: "/usr/bin/old"}
    assert st.expire(now=t0) == 0 and st.programs() == {_mk(1).key: "/usr/bin/python3.11"}
    st.record_run(_mk(1), {0x10: 3}, None, None, now=t0)
    assert st.forget(_mk(1).key) and st.programs() == {}
    st.close()


def test_a_version_1_store_is_upgraded_in_place_with_its_data(tmp_path):
    st = ProfileStore(tmp_path)
    st.record_run(_mk(), {0x10: 5}, None, _hot(0x10), now=time.time())
    st.close()
    db = sqlite3.connect(tmp_path / ps.DB_NAME)
    db.execute("DROP TABLE programs")
    db.execute("UPDATE meta SET value='1' WHERE name='schema_version'")
    db.commit()
    db.close()
    reader = ProfileStore(tmp_path, readonly=True)      # a reader sees it as it is
    assert reader.programs() == {} and reader.lookup(_mk().key).counts == {0x10: 5}
    reader.close()
    st = ProfileStore(tmp_path)                         # a writer upgrades it
    assert st.lookup(_mk().key).hot_text == _hot(0x10)
    st.mark_program(_mk(3).key, "/bin/p")
    assert st.programs() == {_mk(3).key: "/bin/p"}
    st.close()
    db = sqlite3.connect(tmp_path / ps.DB_NAME)
    assert db.execute("SELECT value FROM meta WHERE name='schema_version'").fetchone() == \
        (str(ps.SCHEMA_VERSION),)
    db.close()
