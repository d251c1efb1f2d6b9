"""Finding the tools the long benchmark needs, and installing them (``--setup``).

Everything it needs comes from Debian's packages (apt) and from PyPI (the ``lupa``
source distribution, which carries Lua 5.4's sources).  A missing tool never stops the
whole benchmark: ``missing()`` gives the message under which a workload or a
configuration is skipped."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

#: Debian packages and what they bring.
APT_PACKAGES = {
    "bolt-19": "llvm-bolt-19 and /usr/lib/llvm-19/bin/perf2bolt (BOLT configuration)",
    "linux-perf": "perf record -e cpu-clock (BOLT's profile)",
    "redis-server": "the server workload",
    "redis-tools": "redis-benchmark and redis-cli (the server workload's load and check)",
    "sqlite3": "the sqlite3 workload",
    "gcc": "cc1 (the cc1 workload) and the Lua builds",
    "make": "the Lua builds",
    "python3.11": "the python workload's interpreter",
}

CACHE = Path(os.environ.get("DBR_BENCH_CACHE")
             or Path.home() / ".cache" / "dbr-bench-long")

LLVM_BIN = Path("/usr/lib/llvm-19/bin")


def which(name: str) -> str | None:
    return shutil.which(name)


def real_elf(path: str | None) -> str | None:
    """``path`` resolved to an ELF file (pyenv shims and other scripts refused)."""
    if not path:
        return None
    p = os.path.realpath(path)
    try:
        with open(p, "rb") as f:
            if f.read(4) == b"\x7fELF":
                return p
    except OSError:
        pass
    return None


def python311() -> str | None:
    """The system python3.11 binary (an ELF), not a pyenv shim."""
    for cand in ("/usr/bin/python3.11", "/usr/local/bin/python3.11",
                 shutil.which("python3.11")):
        elf = real_elf(cand)
        if elf:
            return elf
    return None


def cc1() -> str | None:
    for cand in ("/usr/lib/gcc/x86_64-linux-gnu/12/cc1",):
        if os.access(cand, os.X_OK):
            return cand
    try:
        out = subprocess.run(["gcc", "-print-prog-name=cc1"], capture_output=True,
                             text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return out if out and os.access(out, os.X_OK) else None


def llvm_bolt() -> str | None:
    for cand in ("llvm-bolt-19", str(LLVM_BIN / "llvm-bolt")):
        p = shutil.which(cand) or (cand if os.access(cand, os.X_OK) else None)
        if p:
            return p
    return None


def perf2bolt() -> str | None:
    """The unversioned perf2bolt: ``perf2bolt-19`` (a copy under another name) does not
    switch llvm-bolt into its profile-only mode, ``/usr/lib/llvm-19/bin/perf2bolt`` does."""
    p = LLVM_BIN / "perf2bolt"
    return str(p) if os.access(p, os.X_OK) else None


def perf() -> str | None:
    return shutil.which("perf")


def lua_sources() -> Path | None:
    """The directory of Lua 5.4's sources unpacked from the cached lupa sdist."""
    src = CACHE / "lua54"
    if (src / "lua.c").exists() or (src / "src" / "lua.c").exists():
        return src / "src" if (src / "src" / "lua.c").exists() else src
    return None


def _unpack_lua(sdist: Path) -> Path | None:
    """Copy the lua54 tree out of the sdist into CACHE/lua54."""
    dest = CACHE / "lua54"
    with tarfile.open(sdist) as tf:
        names = [m for m in tf.getmembers() if "/lua54/" in m.name and m.isfile()]
        if not names:
            return None
        for m in names:
            rel = m.name.split("/lua54/", 1)[1]
            if not rel or ".." in rel.split("/"):
                continue
            out = dest / rel
            out.parent.mkdir(parents=True, exist_ok=True)
            f = tf.extractfile(m)
            if f is not None:
                out.write_bytes(f.read())
    return lua_sources()


def setup(log=print) -> int:
    """Install what the benchmark needs: the apt packages above and the lupa sdist.
    Returns 0 when everything is there afterwards."""
    rc = 0
    apt = shutil.which("apt-get")
    missing_pkgs = []
    for pkg in APT_PACKAGES:
        st = subprocess.run(["dpkg-query", "-W", "-f=${Status}", pkg], capture_output=True,
                            text=True)
        if "install ok installed" not in st.stdout:
            missing_pkgs.append(pkg)
    if missing_pkgs:
        if not apt:
            log(f"setup: no apt-get; install by other means: {' '.join(missing_pkgs)}")
            rc = 1
        else:
            log(f"setup: apt-get install {' '.join(missing_pkgs)}")
            env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
            subprocess.run([apt, "update", "-qq"], env=env)
            p = subprocess.run([apt, "install", "-y", "-qq", *missing_pkgs], env=env)
            if p.returncode != 0:
                log(f"setup: apt-get install exited {p.returncode}")
                rc = 1
    else:
        log("setup: apt packages present: " + " ".join(APT_PACKAGES))
    # redis-server is started by the bench on its own port; the distro's unit is not needed
    if shutil.which("systemctl") and os.path.exists("/run/systemd/system"):
        subprocess.run(["systemctl", "disable", "--now", "redis-server"],
                       capture_output=True)
    if lua_sources() is None:
        CACHE.mkdir(parents=True, exist_ok=True)
        dl = CACHE / "sdist"
        dl.mkdir(exist_ok=True)
        log(f"setup: pip download --no-binary :all: --no-deps lupa -> {dl}")
        p = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-binary",
                            ":all:", "--no-deps", "-d", str(dl), "lupa"])
        sdists = sorted(dl.glob("lupa-*.tar.gz"))
        if p.returncode != 0 or not sdists:
            log("setup: could not download the lupa sdist")
            rc = 1
        elif _unpack_lua(sdists[-1]) is None:
            log(f"setup: {sdists[-1].name} carries no lua54 sources")
            rc = 1
    src = lua_sources()
    log(f"setup: Lua sources: {src or 'missing'}")
    for name, found in (("python3.11", python311()), ("cc1", cc1()),
                        ("sqlite3", which("sqlite3")), ("redis-server", which("redis-server")),
                        ("redis-benchmark", which("redis-benchmark")), ("perf", perf()),
                        ("llvm-bolt", llvm_bolt()), ("perf2bolt", perf2bolt())):
        log(f"setup: {name:16s} {found or 'MISSING'}")
        if not found:
            rc = 1
    return rc
