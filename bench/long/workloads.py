"""The long benchmark's workloads: what each runs, on which binary, with which input,
and how its BOLT and PGO variants are made.

Every workload's ``prepare(ctx)`` returns a Prepared or raises Skip with the reason
(a missing tool, a failed build): the harness reports it and goes on."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from bench.long import gen_c, gen_sql, tools

PROGS = Path(__file__).resolve().parent / "progs"


class Skip(Exception):
    """A workload or configuration that cannot run here; the message says why."""


@dataclass
class Ctx:
    quick: bool
    work: Path                  # scratch space of this benchmark run
    cache: Path = tools.CACHE   # builds, generated inputs, BOLT binaries kept across runs
    log: Callable[[str], None] = print


@dataclass
class Prepared:
    name: str
    kind: str                          # "batch" or "server"
    binary: str                        # the native ELF every configuration runs
    argv: Callable[[str], list[str]]   # the command line, given the binary to run
    what: str                          # one line: program and input
    outputs: list[str] = field(default_factory=list)  # files written in cwd, compared
    env: dict[str, str] = field(default_factory=dict)
    # BOLT: the ELF it rewrites ("exe": the binary; "lib": a shared library the binary
    # loads, put first on LD_LIBRARY_PATH) and the training command (its input)
    bolt_target: str | None = None
    bolt_mode: str = "exe"
    bolt_na: str | None = None          # why BOLT does not apply, when it does not
    bolt_out_name: str | None = None    # the rewritten file's name (a library's soname)
    train_argv: Callable[[str], list[str]] | None = None
    train_what: str = ""
    pgo_binary: str | None = None       # the PGO build, where the bench builds the program
    pgo_na: str = "not applicable: a distribution binary, not built by the bench"
    notes: list[str] = field(default_factory=list)
    # servers
    duration_s: float = 0.0


def _key(*parts: object) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(repr(p).encode())
    return h.hexdigest()[:12]


def _file_key(path: str | Path) -> tuple:
    st = os.stat(path)
    return (str(path), st.st_size, int(st.st_mtime))


# ------------------------------------------------------------------ python

PY_SCALE = {True: 4.5, False: 20.0}


def python(ctx: Ctx) -> Prepared:
    exe = tools.python311()
    if not exe:
        raise Skip("skipped: no python3.11 ELF binary (/usr/bin/python3.11 or on PATH; "
                   "pyenv shims are scripts)")
    script = str(PROGS / "pybench.py")
    scale = PY_SCALE[ctx.quick]
    return Prepared(
        name="python", kind="batch", binary=exe,
        argv=lambda b: [b, "-E", "-s", script, str(scale)],
        what=f"{exe} pybench.py {scale} (richards, nbody, float, json, regex, deltablue, "
             "chaos, generators, unpack_sequence)",
        bolt_target=exe,
        train_argv=lambda b: [b, "-E", "-s", script, str(PY_SCALE[True])],
        train_what=f"pybench.py {PY_SCALE[True]}")


# ------------------------------------------------------------------ cc1

CC1_FUNCS = {True: 500, False: 1700}


def _c_input(ctx: Ctx, nfuncs: int) -> Path:
    d = ctx.cache / "inputs"
    d.mkdir(parents=True, exist_ok=True)
    src = d / f"gen-{nfuncs}-{_key(Path(gen_c.__file__).read_text())}.c"
    if not src.exists():
        tmp = src.with_suffix(".tmp")
        tmp.write_text(gen_c.generate(nfuncs))
        tmp.replace(src)
    return src


def cc1(ctx: Ctx) -> Prepared:
    exe = tools.cc1()
    if not exe:
        raise Skip("skipped: gcc 12's cc1 not found (/usr/lib/gcc/x86_64-linux-gnu/12/cc1)")
    n = CC1_FUNCS[ctx.quick]
    src = _c_input(ctx, n)
    train = _c_input(ctx, CC1_FUNCS[True])
    return Prepared(
        name="cc1", kind="batch", binary=exe,
        argv=lambda b: [b, "-quiet", "-O2", str(src), "-o", "out.s"],
        what=f"cc1 -O2 on a generated C file of {n} functions ({src.stat().st_size >> 10} KiB)",
        outputs=["out.s"], bolt_target=exe,
        train_argv=lambda b: [b, "-quiet", "-O2", str(train), "-o", "train.s"],
        train_what=f"the {CC1_FUNCS[True]}-function file")


# ------------------------------------------------------------------ sqlite3

SQL_ROUNDS = {True: 25, False: 100}


def _shared_lib(binary: str, soname: str) -> str | None:
    try:
        out = subprocess.run(["ldd", binary], capture_output=True, text=True,
                             timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        if line.strip().startswith(soname) and "=>" in line:
            path = line.split("=>", 1)[1].split("(")[0].strip()
            return os.path.realpath(path) if path else None
    return None


def sqlite(ctx: Ctx) -> Prepared:
    exe = tools.which("sqlite3")
    if not exe:
        raise Skip("skipped: no sqlite3 (python -m bench long --setup installs it)")
    exe = os.path.realpath(exe)
    d = ctx.cache / "inputs"
    d.mkdir(parents=True, exist_ok=True)
    k = _key(Path(gen_sql.__file__).read_text())
    db = d / f"sql-{k}.db"
    if not db.exists():
        ctx.log(f"   generating the sqlite3 database ({gen_sql.ROWS} orders)")
        gen_sql.make_db(db)
    rounds = SQL_ROUNDS[ctx.quick]

    def queries(n: int) -> Path:
        q = d / f"sql-{k}-{n}.sql"
        if not q.exists():
            q.write_text(gen_sql.make_queries(n))
        return q
    q, tq = queries(rounds), queries(SQL_ROUNDS[True])
    lib = _shared_lib(exe, "libsqlite3.so")
    p = Prepared(
        name="sqlite3", kind="batch", binary=exe,
        argv=lambda b: [b, "-readonly", str(db), f".read {q}"],
        what=f"sqlite3 -readonly on {db.stat().st_size >> 20} MiB, {rounds} rounds of "
             f"{len(gen_sql.QUERIES)} analytic queries",
        train_argv=lambda b: [b, "-readonly", str(db), f".read {tq}"],
        train_what=f"{SQL_ROUNDS[True]} rounds")
    if lib:
        p.bolt_target, p.bolt_mode, p.bolt_out_name = lib, "lib", "libsqlite3.so.0"
        p.notes.append(f"the SQL engine is in {lib}; BOLT rewrites that library")
    else:
        p.bolt_target = exe
    return p


# ------------------------------------------------------------------ lua

LUA_SCALE = {True: 4.0, False: 20.0}
LUA_CFLAGS = ["-O2", "-DLUA_COMPAT_5_3", "-DLUA_USE_LINUX", "-fno-pie"]
LUA_LDFLAGS = ["-no-pie", "-Wl,-q", "-Wl,-E"]


def _lua_objs(src: Path) -> list[Path]:
    return sorted(p for p in src.glob("l*.c")
                  if p.name not in ("ltests.c", "luac.c", "onelua.c"))


def _compile_lua(src: Path, out: Path, extra: list[str], log) -> None:
    """Compile Lua's sources into ``out``/lua (two compilers at a time)."""
    out.mkdir(parents=True, exist_ok=True)
    cc = shutil.which("gcc")
    if not cc:
        raise Skip("skipped: no gcc to build Lua")
    procs = []
    objs = []
    for c in _lua_objs(src):
        o = out / (c.stem + ".o")
        objs.append(o)
        procs.append(subprocess.Popen([cc, *LUA_CFLAGS, *extra, "-c", str(c), "-o", str(o)],
                                      stderr=subprocess.PIPE, text=True, cwd=out))
        if len(procs) >= 2:
            _wait_cc(procs.pop(0))
    for p in procs:
        _wait_cc(p)
    p = subprocess.run([cc, *LUA_LDFLAGS, *extra, "-o", str(out / "lua"),
                        *map(str, objs), "-lm", "-ldl"], capture_output=True, text=True)
    if p.returncode != 0:
        raise Skip(f"skipped: linking Lua failed: {p.stderr.strip()[-300:]}")


def _wait_cc(p: subprocess.Popen) -> None:
    _, err = p.communicate()
    if p.returncode != 0:
        raise Skip(f"skipped: building Lua failed: {err.strip()[-300:]}")


def lua(ctx: Ctx) -> Prepared:
    src = tools.lua_sources()
    if src is None:
        raise Skip("skipped: no Lua sources (python -m bench long --setup downloads the lupa "
                   "sdist, which carries them)")
    script = PROGS / "bench.lua"
    scale = LUA_SCALE[ctx.quick]
    key = _key(sorted(_file_key(p) for p in _lua_objs(src)), LUA_CFLAGS, LUA_LDFLAGS)
    plain = ctx.cache / f"lua-{key}" / "plain"
    if not (plain / "lua").exists():
        ctx.log("   building Lua (-O2 -no-pie -Wl,-q)")
        _compile_lua(src, plain, [], ctx.log)
    pgo_key = _key(key, script.read_text(), LUA_SCALE[True])
    pgo = ctx.cache / f"lua-{key}" / f"pgo-{pgo_key}"
    pgo_binary = None
    pgo_na = ""
    if not (pgo / "use" / "lua").exists():
        ctx.log("   building Lua with gcc PGO (-fprofile-generate, training run, "
                "-fprofile-use)")
        try:
            prof = pgo / "profile"
            shutil.rmtree(pgo, ignore_errors=True)
            gen = pgo / "gen"
            _compile_lua(src, gen, [f"-fprofile-generate={prof}"], ctx.log)
            r = subprocess.run([str(gen / "lua"), str(script), str(LUA_SCALE[True])],
                               capture_output=True, timeout=600)
            if r.returncode != 0:
                raise Skip(f"the PGO training run exited {r.returncode}")
            _compile_lua(src, pgo / "use", [f"-fprofile-use={prof}", "-fprofile-correction",
                                            "-Wno-missing-profile"], ctx.log)
        except Skip as exc:
            pgo_na = f"failed: {exc}"
    if (pgo / "use" / "lua").exists():
        pgo_binary = str(pgo / "use" / "lua")
    p = Prepared(
        name="lua", kind="batch", binary=str(plain / "lua"),
        argv=lambda b: [b, str(script), str(scale)],
        what=f"Lua {_lua_version(src)} built -O2 -no-pie -Wl,-q; bench.lua {scale} (fib, "
             "binary_trees, nbody, spectral_norm, strings, tables, closures)",
        bolt_target=str(plain / "lua"),
        train_argv=lambda b: [b, str(script), str(LUA_SCALE[True])],
        train_what=f"bench.lua {LUA_SCALE[True]}",
        pgo_binary=pgo_binary)
    if pgo_binary is None:
        p.pgo_na = pgo_na or "failed: no PGO build"
    else:
        p.notes.append(f"PGO trained on bench.lua {LUA_SCALE[True]}")
    return p


def _lua_version(src: Path) -> str:
    try:
        text = (src / "lua.h").read_text()
        parts = {}
        for k in ("MAJOR", "MINOR", "RELEASE"):
            for line in text.splitlines():
                if line.startswith(f"#define LUA_VERSION_{k}\t") or \
                        line.startswith(f"#define LUA_VERSION_{k} "):
                    parts[k] = line.split('"')[1]
                    break
        return f"{parts['MAJOR']}.{parts['MINOR']}.{parts['RELEASE']}"
    except (OSError, KeyError, IndexError):
        return "5.4"


# ------------------------------------------------------------------ redis

REDIS_DURATION = {True: 15.0, False: 60.0}


def redis(ctx: Ctx) -> Prepared:
    srv = tools.which("redis-server")
    if not srv or not tools.which("redis-benchmark") or not tools.which("redis-cli"):
        raise Skip("skipped: no redis-server / redis-benchmark / redis-cli (python -m bench "
                   "long --setup installs redis-server and redis-tools)")
    exe = os.path.realpath(srv)  # Debian: a link to redis-check-rdb, which looks at argv[0]
    return Prepared(
        name="redis", kind="server", binary=exe,
        argv=lambda b: [b],  # the server runner adds argv[0] and its options
        what=f"redis-server on 127.0.0.1 under redis-benchmark for {REDIS_DURATION[ctx.quick]:.0f}"
             " s (50 clients, random keys; throughput per slice)",
        bolt_target=exe, bolt_out_name="redis-server", train_what="10 s of the same load",
        duration_s=REDIS_DURATION[ctx.quick])


# ------------------------------------------------------------------ mislaid

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
MISLAID_ITERS = {True: 4_000_000_000, False: 20_000_000_000}


def _build_mislaid(out: Path, extra: list[str]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    cc = shutil.which("gcc")
    if not cc:
        raise Skip("skipped: no gcc to build examples/mislaid.c")
    p = subprocess.run([cc, "-O2", "-no-pie", "-Wl,-q", *extra, "-o", str(out),
                        str(EXAMPLES / "mislaid.c")], capture_output=True, text=True)
    if p.returncode != 0:
        raise Skip(f"skipped: building examples/mislaid.c failed: {p.stderr.strip()[-300:]}")


def mislaid(ctx: Ctx) -> Prepared:
    """examples/mislaid.c: a loop whose compiled layout contradicts its profile (a branch
    hint calls the common case rare).  Where layout alone pays: not one of the programs
    users run, so not in the default set (``--only mislaid``)."""
    src = EXAMPLES / "mislaid.c"
    n = MISLAID_ITERS[ctx.quick]
    d = ctx.cache / f"mislaid-{_key(src.read_text())}"
    plain = d / "mislaid"
    if not plain.exists():
        _build_mislaid(plain, [])
    pgo = d / "pgo" / "mislaid"
    if not pgo.exists():
        prof = d / "profile"
        _build_mislaid(d / "gen" / "mislaid", [f"-fprofile-generate={prof}"])
        subprocess.run([str(d / "gen" / "mislaid"), "100000000"], capture_output=True,
                       timeout=120, check=True)
        _build_mislaid(pgo, [f"-fprofile-use={prof}", "-Wno-missing-profile"])
    return Prepared(
        name="mislaid", kind="batch", binary=str(plain),
        argv=lambda b: [b, str(n)],
        what=f"examples/mislaid.c -O2 -no-pie -Wl,-q, {n} iterations (a loop laid out "
             "against its profile)",
        bolt_target=str(plain), train_argv=lambda b: [b, "400000000"],
        train_what="400000000 iterations", pgo_binary=str(pgo),
        notes=["PGO trained on 100000000 iterations"])


WORKLOADS: dict[str, Callable[[Ctx], Prepared]] = {
    "python": python,
    "cc1": cc1,
    "sqlite3": sqlite,
    "lua": lua,
    "redis": redis,
    "mislaid": mislaid,
}
#: Workloads that run only when ``--only`` names them.
ON_REQUEST = {"mislaid"}
