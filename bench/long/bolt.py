"""The BOLT configuration: profile a training run with ``perf record -e cpu-clock``
(no LBR on this kind of machine), turn it into BOLT's profile with the unversioned
``/usr/lib/llvm-19/bin/perf2bolt -nl`` (``perf2bolt-19`` does not switch to its
profile-only mode), and rewrite the ELF with ``llvm-bolt-19``.

What BOLT refuses is retried with what it allows, and said: a stripped binary with
``--allow-stripped``, a binary without relocations without ``-reorder-functions``
(BOLT then only lays out blocks inside functions in place).  Results are cached by
the target's identity and the training command."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from bench.long import tools

FLAGS = ["-reorder-blocks=ext-tsp", "-reorder-functions=cdsort", "-split-functions",
         "-split-all-cold", "-dyno-stats"]


@dataclass
class BoltResult:
    path: str | None                 # the rewritten ELF, or None
    reason: str = ""                 # why there is none
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0             # training + perf2bolt + llvm-bolt
    profiled_functions: str = ""     # "46 out of 10221 functions ... have profile"

    def to_json(self) -> dict:
        return {"path": self.path, "reason": self.reason, "notes": self.notes,
                "seconds": round(self.seconds, 1),
                "profiled_functions": self.profiled_functions}


def _tail(text: str, n: int = 3) -> str:
    lines = [ln for ln in text.strip().splitlines() if "ERROR" in ln or "error" in ln]
    lines = lines or text.strip().splitlines()
    return " / ".join(lines[-n:])[-400:]


def cache_key(target: str, train: list[str], extra: str = "") -> str:
    st = os.stat(target)
    h = hashlib.sha256(json.dumps([target, st.st_size, int(st.st_mtime), train, FLAGS,
                                   extra]).encode())
    return h.hexdigest()[:12]


def optimise(target: str, out_dir: Path, record: Callable[[Path], str | None],
             out_name: str | None = None, log=print) -> BoltResult:
    """Rewrite ``target`` with BOLT.  ``record(perf_data)`` runs the training workload
    under ``perf record -e cpu-clock -o perf_data`` and returns None, or why it failed.
    The result is ``out_dir/<out_name or basename>``; a previous success in
    ``out_dir`` (its result.json) is reused."""
    t0 = time.monotonic()
    done = out_dir / "result.json"
    if done.exists():
        try:
            r = BoltResult(**json.loads(done.read_text()))
            if r.path is None or os.path.exists(r.path):
                r.notes = list(r.notes) + ["reused from an earlier run's cache"]
                return r
        except (OSError, ValueError, TypeError):
            pass
    bolt, p2b = tools.llvm_bolt(), tools.perf2bolt()
    if not bolt or not p2b or not tools.perf():
        return BoltResult(None, "unavailable: needs llvm-bolt-19, /usr/lib/llvm-19/bin/perf2bolt "
                                "and perf (python -m bench long --setup installs bolt-19 and "
                                "linux-perf)")
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    notes: list[str] = []
    perf_data = out_dir / "perf.data"
    why = record(perf_data)
    if why:
        return _save(done, BoltResult(None, f"failed: training run under perf: {why}",
                                      seconds=time.monotonic() - t0))
    fdata = out_dir / "profile.fdata"
    p2b_flags: list[str] = []
    for _ in range(2):
        p = subprocess.run([p2b, "-nl", *p2b_flags, "-p", str(perf_data), "-o", str(fdata),
                            target], capture_output=True, text=True, timeout=1800)
        (out_dir / "perf2bolt.log").write_text(p.stdout + p.stderr)
        if p.returncode == 0:
            break
        if "stripped binaries are not supported" in p.stdout + p.stderr and not p2b_flags:
            p2b_flags = ["--allow-stripped"]
            notes.append("stripped binary: --allow-stripped (functions from .eh_frame)")
            continue
        why = f"BOLT refused (perf2bolt): {_tail(p.stdout + p.stderr)}"
        return _save(done, BoltResult(None, why, notes, time.monotonic() - t0))
    else:
        return _save(done, BoltResult(None, "BOLT refused (perf2bolt)", notes,
                                      time.monotonic() - t0))
    perf_data.unlink(missing_ok=True)
    out = out_dir / (out_name or os.path.basename(target))
    flags = list(FLAGS) + p2b_flags
    profiled = ""
    for _ in range(3):
        p = subprocess.run([bolt, target, "-o", str(out), f"-data={fdata}", *flags],
                           capture_output=True, text=True, timeout=3600)
        text = p.stdout + p.stderr
        (out_dir / "llvm-bolt.log").write_text(text)
        for ln in text.splitlines():
            if "have non-empty execution profile" in ln:
                profiled = ln.replace("BOLT-INFO: ", "").strip()
        if p.returncode == 0 and out.exists():
            break
        if "stripped binaries are not supported" in text and "--allow-stripped" not in flags:
            flags.append("--allow-stripped")
            notes.append("stripped binary: --allow-stripped")
            continue
        if "function reordering only works when relocations are enabled" in text and \
                "-reorder-functions=cdsort" in flags:
            flags.remove("-reorder-functions=cdsort")
            notes.append("no relocations (not linked with -q): functions not reordered, "
                         "blocks laid out in place")
            continue
        return _save(done, BoltResult(None, f"BOLT refused: {_tail(text)}", notes,
                                      time.monotonic() - t0, profiled))
    else:
        return _save(done, BoltResult(None, "BOLT refused", notes, time.monotonic() - t0,
                                      profiled))
    notes.append("llvm-bolt " + " ".join(flags))
    return _save(done, BoltResult(str(out), "", notes, time.monotonic() - t0, profiled))


def _save(path: Path, r: BoltResult) -> BoltResult:
    try:
        path.write_text(json.dumps(r.to_json()))
    except OSError:
        pass
    return r


def perf_record_argv(perf_data: Path, argv: list[str]) -> list[str]:
    return [tools.perf() or "perf", "record", "-q", "-e", "cpu-clock", "-o", str(perf_data),
            "--", *argv]
