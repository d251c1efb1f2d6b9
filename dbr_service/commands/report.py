"""Run reports: the ``dbr.run/1`` JSON (docs/architecture.md, "Reports") and its short text form.

Each client's entry is built by its session (``ClientSession.report`` in session/clients.py);
this module only joins entries into the document, and imports no session code."""

from __future__ import annotations

import os
import shlex
import signal
from collections import Counter
from typing import Any

from dbr_service.installation.speedcheck import verdict_text

SCHEMA = "dbr.run/1"
#: ``RegionState.INSTALLED.value`` (spelled out: `dbr run` builds the report after PROG
#: exits and must not pay for importing the service's session code then).
INSTALLED = "installed"


def run_report(program: list[str], exit_code: int, wall_s: float,
               clients: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    """The whole ``dbr.run/1`` document."""
    totals = {
        "samples": sum(c["samples"] for c in clients),
        "samples_in_replacement": sum(c["samples_in_replacement"] for c in clients),
        "patches_installed": sum(c["patches_installed"] for c in clients),
        "regions_went_live": sum(c.get("regions_went_live", 0) for c in clients),
        "threads_transferred": sum(c.get("threads_transferred", 0) for c in clients),
        "threads_evicted": sum(c.get("threads_evicted", 0) for c in clients),
        "regions_installed": sum(1 for c in clients for r in c["regions"]
                                 if r["state"] == INSTALLED),
        # hot functions' entries patched in regions that went live (region/prune.py,
        # info["functions"]), and the distinct functions (by FDE start) whose code
        # those regions copy, inlined callees included (info["function_starts"])
        "function_entries_went_live": sum(
            r.get("info", {}).get("functions", 0) for c in clients for r in c["regions"]
            if "install_id" in r.get("info", {})),
        "functions_copied": sum(len({
            f for r in c["regions"] if "install_id" in r.get("info", {})
            for f in r["info"].get("function_starts", ())}) for c in clients),
        "service_cpu_s": round(sum(c.get("service_cpu_s") or 0.0 for c in clients), 3),
        "client_cpu_s": round(sum(c.get("client_cpu_s") or 0.0 for c in clients), 3),
        "deferred_by_budget": sum(c.get("deferred_by_budget") or 0 for c in clients),
    }
    return {"schema": SCHEMA, "program": list(program), "exit_code": exit_code,
            "wall_s": round(wall_s, 3), "clients": clients, "totals": totals, **extra}


def how_it_ended(exit_code: int) -> str:
    """``exited N``, or ``killed by SIGNAME`` for a status of 128 + a signal's number
    (what `dbr run` returns for a program a signal ended)."""
    if 128 < exit_code < 128 + 65:
        try:
            return f"killed by {signal.Signals(exit_code - 128).name}"
        except ValueError:
            return f"killed by signal {exit_code - 128}"
    return f"exited {exit_code}"


def regions_text(client: dict[str, Any]) -> str:
    """A client's regions by their current state ("1 installed, 2 removed"), from the
    region records themselves, so the line cannot contradict the patch counts."""
    states = Counter(r.get("state", "?") for r in client.get("regions", []))
    if not states:
        return "none selected"
    order = ["installed", "selected", "removed", "failed"]
    keys = [k for k in order if k in states] + sorted(k for k in states if k not in order)
    return ", ".join(f"{states[k]} {k}" for k in keys)


#: The command line as the summary shows it: at most this many characters.
PROGRAM_TEXT_MAX = 160


def program_text(program: list[str]) -> str:
    """The command line, shell-quoted on one line (a newline in an argument shows as
    ``\\n``), cut to :data:`PROGRAM_TEXT_MAX` characters."""
    text = shlex.join(program).replace("\n", "\\n")
    return text if len(text) <= PROGRAM_TEXT_MAX else text[:PROGRAM_TEXT_MAX - 3] + "..."


def quiet(client: dict[str, Any]) -> bool:
    """A client dbr did nothing to: no patch and no region (a shell, a short child)."""
    return not client.get("patches_installed") and not client.get("regions")


def folded_clients(clients: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str]:
    """The clients the summary shows a block for, and one line for the others.

    Every client dbr patched or selected regions for has its block, and so has the
    client with the most samples (the program itself, in a run of one); the quiet rest
    (the shell's children of a script, say) are folded into one line."""
    busiest = max(clients, key=lambda c: c.get("samples", 0), default=None)
    shown = [c for c in clients if not quiet(c) or c is busiest]
    rest = [c for c in clients if not any(c is x for x in shown)]
    if len(rest) < 2:
        return clients, ""
    names = Counter(os.path.basename(c.get("exe") or "?") for c in rest)
    what = ", ".join(f"{n} x{k}" if k > 1 else n for n, k in names.most_common())
    samples = sum(c.get("samples", 0) for c in rest)
    return shown, (f"{len(rest)} other clients, nothing hot, not patched: {what} "
                   f"({samples} samples in all)")


def format_report(rep: dict[str, Any]) -> str:
    """A few lines for stderr at the end of `dbr run`."""
    t = rep["totals"]
    lines = [(f"dbr: {program_text(rep['program'])} {how_it_ended(rep['exit_code'])} after "
              f"{rep['wall_s']:.2f} s; {len(rep['clients'])} client(s), {t['samples']} samples, "
              f"{t['patches_installed']} patches, {t['regions_installed']} regions installed")]
    if rep.get("service"):
        lines[0] += f" ({rep['service']} service)"
    if rep.get("note"):
        lines.append(f"dbr:   {rep['note']}")
    shown, folded = folded_clients(rep["clients"])
    for c in shown:
        lines.append(f"dbr:   pid {c['pid']} {c['exe']}: {c['samples']} samples "
                     f"via {c.get('sampling_source') or 'none'}, "
                     f"{c['patches_installed']} patches; regions: {regions_text(c)}")
        if c.get("client_cpu_s"):
            lines.append(f"dbr:     service CPU {c.get('service_cpu_s', 0):.2f} s for its "
                         f"{c['client_cpu_s']:.2f} s ({c['service_cpu_s'] / c['client_cpu_s']:.1%}"
                         f"); {c.get('jobs_done', 0)} jobs, "
                         f"{c.get('deferred_by_budget', 0)} deferred by the CPU budget")
        if c.get("time_to_first_patch_s") is not None:
            after = c.get("samples_after_first_patch") or 0
            share = c.get("samples_in_replacement", 0) / after if after else 0.0
            lines.append(f"dbr:     first patch after {c['time_to_first_patch_s']:.2f} s; "
                         f"{share:.0%} of the {after} samples since then in replacement code")
        for sc in c.get("speed_checks", []):
            lines.append(f"dbr:     speed check of {', '.join(sc['regions'])}: "
                         f"{verdict_text(sc['verdict'], sc.get('ratio'), sc.get('measure'))}")
        for h in c.get("hotspots", [])[:3]:
            off = f"+{h['offset']:#x}" if h.get("offset") is not None else ""
            name = f"  {h['symbol']}" if h.get("symbol") else ""
            lines.append(f"dbr:     {h['fraction'] * 100:5.1f}%  {h['ip']:#x}  "
                         f"{h['module'].rsplit('/', 1)[-1]}{off}{name}")
    if folded:
        lines.append(f"dbr:   {folded}")
    return "\n".join(lines)
