"""`make demo`: a program that runs faster under dbr, timed both ways, and where its
code went.

Builds examples/mislaid.c (a hot loop whose compiled layout contradicts its data: the
branch hint calls the common case rare), then

1. `dbr run --embedded --aggressive --compare 6`: one native warm-up run, six pairs of
   native and dbr runs alternated, outputs compared, dbr's time over native's with its
   interval (dbr_service/commands/compare.py);
2. one more run under dbr with a report, from which it prints the region that went
   live: its entry (by function name), blocks, bytes and layout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent.parent / "examples"
DBR = [sys.executable, "-m", "dbr_service.commands.cli"]


def build_example(name: str, out_dir: str, extra_flags: tuple[str, ...] = ()) -> str:
    """Compile examples/NAME.c with the system C compiler; the binary's path."""
    src = EXAMPLES / f"{name}.c"
    out = os.path.join(out_dir, name)
    cc = os.environ.get("CC", "cc")
    subprocess.run([cc, "-O2", "-o", out, str(src), *extra_flags], check=True)
    return out


def describe_regions(report: dict, prog: str) -> list[str]:
    """A line per region of PROG's client: state, entry by name (the report names
    entries after the functions holding them), size, layout."""
    out = []
    for c in report.get("clients", []):
        if c.get("exe") != prog:
            continue
        for r in c.get("regions", []):
            names = r.get("entry_names") or [f"{e:#x}" for e in r["entries"]]
            out.append(f"demo: region {r['id']} {r['state']}: entry {', '.join(names)}; "
                       f"{r['blocks']} blocks copied into {r['code_bytes']} bytes, laid out "
                       f"by {r['info'].get('layout', '?')}")
        after = c.get("samples_after_first_patch") or 0
        if after:
            out.append(f"demo: {c['samples_in_replacement'] / after:.0%} of the samples after "
                       f"the first patch ({c['time_to_first_patch_s']:.2f} s) ran in the copy")
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    iters = argv[0] if argv else "2000000000"
    with tempfile.TemporaryDirectory(prefix="dbr-demo-") as tmp:
        prog = build_example("mislaid", tmp)
        print("demo: examples/mislaid.c, gcc -O2: a loop whose branch hint calls its common "
              "case rare, so the compiler put that path out of line", flush=True)
        print(f"demo: dbr run --embedded --aggressive --compare 6 -- mislaid {iters}",
              flush=True)
        rc = subprocess.run([*DBR, "run", "--embedded", "--aggressive", "--compare", "6",
                             "--", prog, iters], check=False).returncode
        if rc != 0:
            return rc
        report = os.path.join(tmp, "report.json")
        print("demo: once more under dbr, to show where the code went:", flush=True)
        rc = subprocess.run([*DBR, "run", "--embedded", "--aggressive", "--quiet", "--report",
                             report, "--", prog, iters], check=False).returncode
        if os.path.exists(report):
            with open(report) as fh:
                lines = describe_regions(json.load(fh), prog)
            print("\n".join(lines) or "demo: no region went live in this run", flush=True)
        return rc


if __name__ == "__main__":
    sys.exit(main())
