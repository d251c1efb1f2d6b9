"""The workloads of the comparison benchmark and how to prepare them.

Two kinds:

* ``c``: the project's own C programs under ``bench/workloads/`` (call-heavy loops, a
  jump-table interpreter, multi-threaded loops, cross-library calls, branchy code with
  a poor static layout), built with ``gcc -O2`` into the cache directory, and also
  rebuilt with ``-fprofile-generate`` / training run / ``-fprofile-use`` (PGO);
* ``real``: programs not written here (gzip, xz, zstd, bzip2, sqlite3, perl, python3)
  over inputs the suite generates deterministically (seeded) and caches.

Every preparation is cached under ``bench/results/cache/`` (git-ignored) keyed by a
hash of what it depends on (source text, compiler version, generator version, size),
so a second run only runs.  A workload whose tool is missing raises :class:`Skip`.
"""

from __future__ import annotations

import hashlib
import io
import os
import random
import shutil
import sqlite3
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

HERE = Path(__file__).resolve().parent
SRC = HERE / "workloads"
DEFAULT_CACHE = HERE / "results" / "cache"
GEN_VERSION = "1"  # bump when a generator below changes its output


class Skip(Exception):
    """The workload cannot run here (missing tool, failed build): skipped, with reason."""


@dataclass
class Prepared:
    """How to run one workload: the same ``argv`` is wrapped by every configuration."""

    argv: list[str]
    outputs: list[str] = field(default_factory=list)  # files written in the run dir, hashed
    pgo_argv: list[str] | None = None      # the PGO build, same arguments (C workloads)
    small_argv: list[str] | None = None    # smaller input (valgrind in quick mode)
    env: dict[str, str] = field(default_factory=dict)  # extra environment
    #: Variables of the caller's environment this workload must not see: names, or
    #: prefixes ending in "*" ("PYTHON*"); ``env`` is applied after the removal.
    unset: list[str] = field(default_factory=list)
    note: str = ""

    def environ(self, base: Mapping[str, str]) -> dict[str, str]:
        """``base`` without the ``unset`` variables, plus ``env``."""
        def dropped(k: str) -> bool:
            return any(k.startswith(u[:-1]) if u.endswith("*") else k == u for u in self.unset)
        out = {k: v for k, v in base.items() if not dropped(k)}
        out.update(self.env)
        return out


@dataclass
class Ctx:
    quick: bool
    cache: Path = DEFAULT_CACHE
    path: str | None = None  # PATH used to find tools (None: os.environ's)
    log: Callable[[str], None] = print

    def which(self, tool: str) -> str:
        found = shutil.which(tool, path=self.path if self.path is not None
                             else os.environ.get("PATH", os.defpath))
        if not found:
            raise Skip(f"missing tool: {tool} not found on PATH")
        return found


@dataclass
class Workload:
    name: str
    kind: str  # "c" | "real" | "test"
    what: str
    prepare: Callable[[Ctx], Prepared]


def _key(*parts: object) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(repr(p).encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


def _atomic_dir(final: Path, build: Callable[[Path], None]) -> Path:
    """Build into a temporary sibling then rename, so a half-built cache never counts."""
    if final.exists():
        return final
    tmp = final.with_name(final.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        build(tmp)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


# ------------------------------------------------------------------ C workloads

def _gcc_version(ctx: Ctx) -> str:
    gcc = ctx.which("gcc")
    return subprocess.run([gcc, "--version"], capture_output=True, text=True).stdout.split("\n")[0]


def _gcc(ctx: Ctx, args: list[str]) -> None:
    p = subprocess.run([ctx.which("gcc"), *args], capture_output=True, text=True)
    if p.returncode != 0:
        raise Skip(f"build failed: gcc {' '.join(args)}: {p.stderr.strip()[-400:]}")


@dataclass
class CProg:
    name: str
    sources: list[str]
    full: list[str]
    quick: list[str]
    train: list[str]
    lib: str | None = None  # source of a shared library the program links against
    libs: list[str] = field(default_factory=list)
    what: str = ""

    def build(self, ctx: Ctx) -> Prepared:
        texts = [(SRC / s).read_text() for s in self.sources + ([self.lib] if self.lib else [])]
        key = _key(self.name, texts, self.libs, _gcc_version(ctx), "O2")
        d = _atomic_dir(ctx.cache / "c" / f"{self.name}-{key}", lambda t: self._build(ctx, t))
        args = self.quick if ctx.quick else self.full
        small = [str(max(1, int(a) // 4)) if i == 0 else a for i, a in enumerate(self.quick)]
        return Prepared([str(d / "native" / self.name), *args],
                        pgo_argv=[str(d / "pgo" / self.name), *args],
                        small_argv=[str(d / "native" / self.name), *small])

    def _compile(self, ctx: Ctx, out: Path, flags: list[str]) -> None:
        out.mkdir(parents=True, exist_ok=True)
        link: list[str] = []
        if self.lib:
            lib_so = out / "libxlibwork.so"
            _gcc(ctx, ["-O2", "-fPIC", "-shared", *flags, "-o", str(lib_so), str(SRC / self.lib)])
            link = ["-L", str(out), "-lxlibwork", "-Wl,-rpath,$ORIGIN"]
        _gcc(ctx, ["-O2", *flags, "-o", str(out / self.name),
                   *[str(SRC / s) for s in self.sources], *link, *self.libs])

    def _build(self, ctx: Ctx, d: Path) -> None:
        ctx.log(f"   building {self.name} "
                "(-O2, and PGO: instrumented, training run, -fprofile-use)")
        self._compile(ctx, d / "native", [])
        # PGO: instrumented build, a training run on a smaller input, then the
        # optimised build with the same output path (gcc names .gcda files after it).
        prof = d / "profile"
        gen = ["-fprofile-generate", "-fprofile-update=atomic", f"-fprofile-dir={prof}"]
        self._compile(ctx, d / "pgo", gen)
        p = subprocess.run([str(d / "pgo" / self.name), *self.train], capture_output=True)
        if p.returncode != 0:
            raise Skip(f"PGO training run of {self.name} exited {p.returncode}")
        use = ["-fprofile-use", "-fprofile-correction", f"-fprofile-dir={prof}",
               "-Wmissing-profile", "-Werror=missing-profile"]
        self._compile(ctx, d / "pgo", use)


# Arguments: full ~1-2 s natively on an idle core of the reference machine, quick
# ~0.2-0.5 s, training (PGO) a fifth of quick.
C_PROGS = [
    CProg("calls", ["calls.c"], ["100"], ["20"], ["5"],
          what="call-heavy loop: small noinline functions and a function-pointer table"),
    CProg("interp", ["interp.c"], ["160"], ["30"], ["8"],
          what="bytecode interpreter, dense-switch (jump-table) dispatch"),
    CProg("threads", ["threads.c"], ["12000", "4"], ["2400", "4"], ["600", "4"],
          libs=["-lpthread"], what="4 threads, each a hashing loop over a private buffer"),
    CProg("churn", ["churn.c"], ["60000"], ["12000"], ["2400"], libs=["-lpthread"],
          what="starts and joins 60000 short threads one at a time beside a busy one"),
    CProg("xlib", ["xlib.c"], ["110"], ["22"], ["5"], lib="xlib_lib.c",
          what="hot loop calling a shared library (built by the suite) through the PLT"),
    CProg("branchy", ["branchy.c"], ["200"], ["40"], ["10"],
          what="branchy classifier whose common cases are marked unlikely (poor layout)"),
    CProg("stdio", ["stdio.c"], ["40"], ["10"], ["2"],
          what="character-at-a-time stdio: putc and getc through a temporary file"),
]


# ------------------------------------------------------------------ generated inputs

def gen_text(size: int, seed: int = 1234) -> bytes:
    """~``size`` bytes of mixed text-like data: Zipf-distributed prose, CSV records,
    log lines and a few percent of hex noise.  Deterministic for (size, seed)."""
    rng = random.Random(seed)
    syll = ["ka", "lo", "mi", "ne", "tor", "sha", "qu", "ven", "dre", "pli", "ax", "zu",
            "em", "or", "ith", "ba", "co", "ry"]
    vocab = ["".join(rng.choices(syll, k=rng.randint(1, 4))) for _ in range(6000)]
    cum = []
    acc = 0.0
    for i in range(len(vocab)):
        acc += 1.0 / (i + 1)
        cum.append(acc)
    out = io.StringIO()
    n = line_no = 0
    while n < size:
        kind = rng.random()
        if kind < 0.6:
            words = rng.choices(vocab, cum_weights=cum, k=400)
            chunk = "\n".join(" ".join(words[i:i + rng.randint(6, 14)]).capitalize() + "."
                              for i in range(0, 400, 10)) + "\n"
        elif kind < 0.8:
            chunk = "".join(f"{line_no + i},{rng.choice(vocab)},{rng.randint(0, 10**6)},"
                            f"{rng.random():.6f}\n" for i in range(80))
        elif kind < 0.95:
            chunk = "".join(f"2026-01-{1 + i % 28:02d}T{i % 24:02d}:{i % 60:02d}:"
                            f"{(i * 7) % 60:02d}Z INFO [{rng.choice(vocab)}] "
                            f"req={rng.getrandbits(32):08x} took {rng.randint(1, 999)}ms\n"
                            for i in range(60))
        else:
            chunk = rng.randbytes(3000).hex() + "\n"
        line_no += 80
        out.write(chunk)
        n += len(chunk)
    return out.getvalue()[:size].encode()


def text_input(ctx: Ctx, size: int) -> Path:
    path = ctx.cache / "inputs" / f"text-{size}-{_key(GEN_VERSION, size)}.txt"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        ctx.log(f"   generating {size / 1e6:.0f} MB text input (seeded, cached)")
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(gen_text(size))
        os.replace(tmp, path)
    return path


def sqlite_db(ctx: Ctx, orders: int) -> Path:
    path = ctx.cache / "inputs" / f"shop-{orders}-{_key(GEN_VERSION, orders)}.sqlite"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    ctx.log(f"   generating sqlite database, {orders} orders (seeded, cached)")
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.unlink(missing_ok=True)
    rng = random.Random(42)
    con = sqlite3.connect(tmp)
    con.executescript("""
        CREATE TABLE customers(id INTEGER PRIMARY KEY, name TEXT, region TEXT);
        CREATE TABLE products(id INTEGER PRIMARY KEY, name TEXT, category TEXT, price REAL);
        CREATE TABLE orders(id INTEGER PRIMARY KEY, customer INTEGER, product INTEGER,
                            qty INTEGER, day INTEGER, note TEXT);""")
    regions = ["north", "south", "east", "west", "central"]
    con.executemany("INSERT INTO customers VALUES(?,?,?)",
                    [(i, f"cust{i:05d}", rng.choice(regions)) for i in range(5000)])
    con.executemany("INSERT INTO products VALUES(?,?,?,?)",
                    [(i, f"prod{i:04d}", f"cat{rng.randint(0, 19)}",
                      round(rng.uniform(1, 500), 2)) for i in range(2000)])
    con.executemany("INSERT INTO orders VALUES(?,?,?,?,?,?)",
                    [(i, rng.randint(0, 4999), rng.randint(0, 1999), rng.randint(1, 20),
                      rng.randint(0, 729), "".join(rng.choices("abcdefghij ", k=20)))
                     for i in range(orders)])
    con.commit()
    con.close()
    os.replace(tmp, path)
    return path


# Input sizes: (full, quick, small) bytes of text per real workload.
TEXT_FULL, TEXT_QUICK, TEXT_SMALL = 24_000_000, 4_000_000, 1_000_000


def _compressor(tool: str, args: list[str], to_file: bool = False) -> Callable[[Ctx], Prepared]:
    def prepare(ctx: Ctx) -> Prepared:
        exe = ctx.which(tool)
        inp = text_input(ctx, TEXT_QUICK if ctx.quick else TEXT_FULL)
        small = text_input(ctx, TEXT_SMALL)
        if to_file:  # compressed output written to a file in the run dir (hashed)
            return Prepared([exe, *args, "-o", "out.zst", str(inp)], outputs=["out.zst"],
                            small_argv=[exe, *args, "-o", "out.zst", str(small)])
        return Prepared([exe, *args, "-c", str(inp)], small_argv=[exe, *args, "-c", str(small)])
    return prepare


def _sqlite(ctx: Ctx) -> Prepared:
    exe = ctx.which("sqlite3")
    db = sqlite_db(ctx, 50_000 if ctx.quick else 250_000)
    small = sqlite_db(ctx, 12_000)
    q = f".read {SRC / 'queries.sql'}"
    return Prepared([exe, "-readonly", "-batch", str(db), q],
                    small_argv=[exe, "-readonly", "-batch", str(small), q])


def _perl(ctx: Ctx) -> Prepared:
    exe = ctx.which("perl")
    script = str(SRC / "wordstat.pl")
    inp = text_input(ctx, 1_000_000 if ctx.quick else 6_000_000)
    return Prepared([exe, script, str(inp), "1"],
                    small_argv=[exe, script, str(text_input(ctx, 300_000)), "1"])


def _real_python(exe: str) -> str:
    """Resolve version-manager shims (pyenv) to the interpreter they would exec."""
    try:
        out = subprocess.run([exe, "-c", "import sys; print(sys.executable)"],
                             capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return exe
    return out if out and os.path.exists(out) else exe


def _python(ctx: Ctx) -> Prepared:
    exe = _real_python(ctx.which("python3"))
    script = str(SRC / "pywork.py")
    inp = text_input(ctx, 1_000_000 if ctx.quick else 8_000_000)
    # Not -E: it would ignore PYTHONHASHSEED too.  The caller's other PYTHON*
    # variables are removed instead, so the run is the same wherever it starts.
    return Prepared([exe, "-S", script, str(inp), "1" if ctx.quick else "2"],
                    small_argv=[exe, "-S", script, str(text_input(ctx, 300_000)), "1"],
                    env={"PYTHONHASHSEED": "0"}, unset=["PYTHON*"])


def registry() -> list[Workload]:
    """Every workload of the suite, in run order."""
    ws = [Workload(p.name, "c", p.what, p.build) for p in C_PROGS]
    ws += [
        Workload("gzip", "real", "gzip -6 of the generated text", _compressor("gzip", ["-6"])),
        Workload("xz", "real", "xz -1 (single thread)", _compressor("xz", ["-T1", "-1"])),
        Workload("zstd", "real", "zstd -9 (single thread), to an output file",
                 _compressor("zstd", ["-q", "-f", "-T1", "-9"], to_file=True)),
        Workload("bzip2", "real", "bzip2 -9", _compressor("bzip2", ["-9"])),
        Workload("sqlite3", "real", "joins, group-by, LIKE, window query on a generated DB",
                 _sqlite),
        Workload("perl", "real", "regex tokenising and hash counting (wordstat.pl)", _perl),
        Workload("python3", "real", "dict/string work and an n-body loop (pywork.py)", _python),
    ]
    return ws
