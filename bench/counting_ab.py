"""Optimised code built from exact counts against code built from samples, A/B.

``python -m bench.counting_ab [--pairs N] [--n ITER]``: examples/mislaid.c (a loop
whose good layout depends on which side of its branch is hot) runs under
`dbr run --embedded --aggressive` with ``profile=count`` (A) and ``profile=sample``
(B), alternated, each run's output checked against the native run.  Prints each
side's wall times, the ratio A/B (geometric mean over pairs, with its min and max)
and the service CPU of each side (from the run reports).  Nothing runs off loopback.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _build(tmp: Path) -> Path:
    exe = tmp / "mislaid"
    subprocess.run(["gcc", "-O2", "-s", "-o", str(exe), str(ROOT / "examples" / "mislaid.c")],
                   check=True)
    return exe


def _run(exe: Path, n: int, profile: str, tmp: Path, want: bytes) -> tuple[float, float]:
    report = tmp / f"report-{profile}.json"
    t0 = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "dbr_service.commands.cli", "run", "--embedded",
                          "--aggressive", "-o", f"profile={profile}", "--report", str(report),
                          "--", str(exe), str(n)], capture_output=True, timeout=600, cwd=ROOT)
    wall = time.monotonic() - t0
    if run.returncode != 0 or run.stdout != want:
        raise SystemExit(f"profile={profile}: exit {run.returncode}, output differs: "
                         f"{run.stderr.decode()[-500:]}")
    rep = json.loads(report.read_text())
    cpu = sum(c.get("service_cpu_s", 0.0) for c in rep["clients"])
    return wall, cpu


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--n", type=int, default=400_000_000)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        exe = _build(tmp)
        want = subprocess.run([str(exe), str(args.n)], capture_output=True, check=True,
                              timeout=600).stdout
        rows: dict[str, list[tuple[float, float]]] = {"count": [], "sample": []}
        for i in range(args.pairs):
            order = ("count", "sample") if i % 2 == 0 else ("sample", "count")
            for p in order:
                rows[p].append(_run(exe, args.n, p, tmp, want))
        ratios = [a[0] / b[0] for a, b in zip(rows["count"], rows["sample"])]
        gm = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
        for p, rs in rows.items():
            print(f"profile={p}: wall {[round(w, 3) for w, _ in rs]} s, service CPU "
                  f"{[round(c, 3) for _, c in rs]} s")
        print(f"count/sample wall ratio: {gm:.3f} (geometric mean of {len(ratios)} pairs; "
              f"min {min(ratios):.3f}, max {max(ratios):.3f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
