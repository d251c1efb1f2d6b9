"""`make demo`: build the bundled example and run it under `dbr run --embedded --aggressive`.

Compiles examples/hotloop.c (a CPU-bound program with one hot loop) into a temporary
directory, runs it under dbr with an embedded service, and prints the dbr.run/1 report.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def build_example(name: str, out_dir: str, extra_flags: tuple[str, ...] = ()) -> str:
    """Compile examples/NAME.c with the system C compiler; the binary's path."""
    src = EXAMPLES / f"{name}.c"
    out = os.path.join(out_dir, name)
    cc = os.environ.get("CC", "cc")
    subprocess.run([cc, "-O2", "-o", out, str(src), *extra_flags], check=True)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ms = argv[0] if argv else "1500"
    with tempfile.TemporaryDirectory(prefix="dbr-demo-") as tmp:
        prog = build_example("hotloop", tmp)
        report = os.path.join(tmp, "report.json")
        print(f"demo: dbr run --embedded --aggressive -- {prog} {ms}", flush=True)
        rc = subprocess.run([sys.executable, "-m", "dbr_service.cli", "run", "--embedded",
                             "--aggressive", "--report", report, "--", prog, ms],
                            check=False).returncode
        if os.path.exists(report):
            with open(report) as fh:
                print(json.dumps(json.load(fh), indent=2))
        return rc


if __name__ == "__main__":
    sys.exit(main())
