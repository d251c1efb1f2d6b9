"""Summaries, the Markdown table and the PNG plots of the long benchmark, all computed
from its results JSON (so a partial or killed run renders what it had)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from bench import stats

RATIO_CONFIGS = ["dbr-default", "dbr-aggressive", "dbr-nocalls", "dbr-aggressive-nocalls",
                 "dbr-nofunctions", "dbr-aggressive-hottext", "bolt", "pgo"]
DBR = ("dbr-default", "dbr-aggressive", "dbr-nocalls", "dbr-aggressive-nocalls",
       "dbr-nofunctions", "dbr-aggressive-hottext")
LABEL = {"dbr-default": "dbr default", "dbr-aggressive": "dbr --aggressive",
         "dbr-nocalls": "dbr default, no real calls",
         "dbr-aggressive-nocalls": "dbr --aggressive, no real calls",
         "dbr-nofunctions": "dbr default, no hot functions",
         "dbr-aggressive-hottext": "dbr --aggressive, hot text", "bolt": "BOLT",
         "pgo": "gcc PGO"}
#: Configurations older results files hold without naming them.
_LEGACY = ["dbr-default", "dbr-aggressive", "bolt", "pgo"]


def shown(data: dict) -> list[str]:
    """The configurations of RATIO_CONFIGS this run measured, in table order."""
    have = data.get("configs") or _LEGACY
    return [c for c in RATIO_CONFIGS if c in have]


def _med(xs) -> float | None:
    xs = [x for x in xs if isinstance(x, (int, float)) and not isinstance(x, bool)]
    return statistics.median(xs) if xs else None


def _requests(run: dict) -> float:
    return sum(s.get("requests") or 0 for s in run.get("slices") or [])


def summarize_workload(w: dict) -> dict:
    """Per configuration: paired ratios to native (time; for servers native's
    throughput over the configuration's in the window from its first patch), their
    median, min–max and interval, failures by kind, and dbr's numbers (medians)."""
    runs = w.get("runs") or []
    by = {}
    for r in runs:
        by.setdefault(r["config"], {})[r["pair"]] = r
    native = by.get("native", {})
    out: dict[str, Any] = {"configs": {}}
    nat_ok = [r for r in native.values() if r.get("status") == "ok"]
    out["native_s"] = _med(r["wall_s"] for r in nat_ok)
    out["native_cpu_s"] = _med(r.get("cpu_s") for r in nat_ok)
    if w.get("kind") == "server":
        out["native_rps"] = _med(r.get("rps") for r in nat_ok)
    for cfg, info in (w.get("configs") or {}).items():
        cs: dict[str, Any] = {"status": info.get("status"), "reason": info.get("reason"),
                              "bolt_notes": (info.get("bolt") or {}).get("notes") or []}
        rr = by.get(cfg, {})
        fails: dict[str, int] = {}
        for r in rr.values():
            if r.get("status") != "ok":
                fails[r["status"]] = fails.get(r["status"], 0) + 1
        cs["failures"] = fails
        cs["runs"] = len(rr)
        if cfg != "native":
            ratios, cpu_ratios, windows = [], [], []
            for pair, r in sorted(rr.items()):
                n = native.get(pair)
                if not n or r.get("status") != "ok" or n.get("status") != "ok":
                    continue
                if w.get("kind") == "server":
                    fp = r.get("first_patch_s")
                    win = stats.server_pair_ratio(r.get("slices") or [], n.get("slices") or [],
                                                  fp)
                    windows.append(win)
                    if win["ratio"]:
                        ratios.append(1.0 / win["ratio"])
                else:
                    ratios.extend(stats.paired_ratios([r["wall_s"]], [n["wall_s"]]))
                if r.get("cpu_s") and n.get("cpu_s"):
                    if w.get("kind") == "server":  # CPU per request served
                        rq, nq = _requests(r), _requests(n)
                        if rq and nq:
                            cpu_ratios.append((r["cpu_s"] / rq) / (n["cpu_s"] / nq))
                    else:
                        cpu_ratios.append(r["cpu_s"] / n["cpu_s"])
            cs["ratio"] = stats.summarize(ratios)
            cs["cpu_ratio"] = stats.summarize(cpu_ratios)
            if windows:
                cs["windows"] = windows
                cs["throughput_ratio"] = stats.summarize([x["ratio"] for x in windows
                                                          if x["ratio"]])
        ok = [r for r in rr.values() if r.get("status") == "ok"]
        if cfg != "native" and any("report" in r for r in rr.values()):
            reps = [r.get("report") or {} for r in ok]
            cs["dbr"] = {
                "service_cpu_s": _med(r.get("service_cpu_s") for r in ok),
                "service_over_program_cpu": _med(
                    r["service_cpu_s"] / r["cpu_s"] for r in ok
                    if r.get("service_cpu_s") is not None and r.get("cpu_s")),
                "time_to_first_patch_s": _med(
                    (r.get("first_patch_s") if w.get("kind") == "server" else None)
                    or (r.get("report") or {}).get("time_to_first_patch_s") for r in ok),
                "runs_patched": sum(1 for p in reps if p.get("time_to_first_patch_s")
                                    is not None),
                "share_in_replacement": _med(p.get("share_in_replacement") for p in reps),
                "share_after_first_patch": _med(p.get("share_after_first_patch") for p in reps),
                "regions_installed": _med(p.get("regions_installed") for p in reps),
                "regions_went_live": _med(p.get("regions_went_live") for p in reps),
                "code_bytes_installed": _med(p.get("code_bytes_installed") for p in reps),
                "report_errors": sorted({p["report_error"] for p in reps
                                         if p.get("report_error")}),
            }
        out["configs"][cfg] = cs
    bolt = (out["configs"].get("bolt") or {}).get("ratio", {}).get("median")
    bolt_cpu = (out["configs"].get("bolt") or {}).get("cpu_ratio", {}).get("median")
    for cfg in DBR:
        c = out["configs"].get(cfg)
        if c and "ratio" in c:
            c["share_of_bolt_gain"] = stats.share_of_gain(c["ratio"].get("median"), bolt)
            c["share_of_bolt_gain_cpu"] = stats.share_of_gain(
                (c.get("cpu_ratio") or {}).get("median"), bolt_cpu)
    return out


def summarize(data: dict) -> dict:
    sums = {name: summarize_workload(w) for name, w in (data.get("workloads") or {}).items()
            if w.get("runs")}
    geo = {}
    for cfg in shown(data):
        meds = [s["configs"].get(cfg, {}).get("ratio", {}).get("median") for s in sums.values()]
        meds = [m for m in meds if m]
        if meds:
            geo[cfg] = {"geomean": stats.geomean(meds), "workloads": len(meds)}
    return {"workloads": sums, "geomean": geo}


# ------------------------------------------------------------------ markdown

def _note(notes: list[str], text: str) -> int:
    """The number of ``text`` among the table's notes (added once)."""
    if text not in notes:
        notes.append(text)
    return notes.index(text) + 1


BLOCKS_ONLY = ("BOLT without relocations (a distribution binary): functions not reordered, "
               "blocks laid out in place; stripped: --allow-stripped")


def _ratio_cell(c: dict | None, notes: list[str]) -> str:
    if not c:
        return "–"
    r = c.get("ratio") or {}
    fails = c.get("failures") or {}
    fail = ", ".join(f"**{n} {k}**" for k, n in sorted(fails.items()))
    if r.get("n"):
        cell = f"x{r['median']:.3f} [{r['min']:.2f}–{r['max']:.2f}]"
        if r["n"] < 2:
            cell = f"x{r['median']:.3f} (1 pair)"
        if any("no relocations" in n for n in c.get("bolt_notes") or []):
            cell += f" ({_note(notes, BLOCKS_ONLY)})"
        return cell + (f"; {fail}" if fail else "")
    if fail:
        return fail
    if c.get("status") == "n/a" or c.get("reason"):
        return f"n/a ({_note(notes, c.get('reason') or 'not available')})"
    return "–"


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{x * 100:.0f} %"


def _num(x: float | None, fmt: str = "{:.2f}") -> str:
    return "–" if x is None else fmt.format(x)


def table(data: dict, summary: dict | None = None) -> str:
    """The results table (what docs/performance.md shows), with numbered notes for
    every configuration that does not apply and why."""
    summary = summary or summarize(data)
    notes: list[str] = []
    cfgs = shown(data)
    dbrs = [c for c in cfgs if c in DBR]
    which = "; ".join(LABEL[c].replace("dbr ", "") for c in dbrs)
    head = ("| workload | native | " + " | ".join(LABEL[c] for c in cfgs) +
            f" | service CPU / program CPU ({which}) | first patch s ({which}) | "
            f"samples in replacement code ({which}) |")
    blank = " |" * (len(cfgs) + 4)
    lines = [head, "|" + "---|" * (len(cfgs) + 5)]
    for name, w in (data.get("workloads") or {}).items():
        if name not in summary["workloads"]:
            why = w.get("reason") or w.get("status", "not run")
            lines.append(f"| {name} | {why if len(why) < 40 else f'skipped ({_note(notes, why)})'}"
                         + blank)
            continue
        s = summary["workloads"][name]
        cf = s["configs"]
        if w.get("kind") == "server":
            nat = (f"{_num(s.get('native_rps'), '{:.0f}')} req/s" if s.get("native_rps")
                   else "–")
        else:
            nat = f"{_num(s.get('native_s'), '{:.1f}')} s"
        nf = (cf.get("native") or {}).get("failures") or {}
        if nf:
            nat += "; " + ", ".join(f"**{n} {k}**" for k, n in nf.items())
        cells = [_ratio_cell(cf.get(c), notes) for c in cfgs]
        d = [(cf.get(c) or {}).get("dbr") or {} for c in dbrs]
        svc = "; ".join(_num(x.get("service_over_program_cpu")) for x in d)
        ttfp = "; ".join(_num(x.get("time_to_first_patch_s")) for x in d)
        share = "; ".join(_pct(x.get("share_in_replacement")) for x in d)
        lines.append(f"| {name} | {nat} | " + " | ".join(cells) +
                     f" | {svc} | {ttfp} | {share} |")
    g = summary.get("geomean") or {}
    lines.append("| **geomean** | | " + " | ".join(
        (f"x{g[c]['geomean']:.3f} ({g[c]['workloads']})" if c in g else "–")
        for c in cfgs) + " | | | |")
    out = "\n".join(lines) + "\n"
    if notes:
        out += "\n" + "\n".join(f"({i}) {n}" for i, n in enumerate(notes, 1)) + "\n"
    return out


def cpu_table(data: dict, summary: dict | None = None) -> str:
    """The program's own CPU time (user + sys, wait4) over native's, per pair (for a
    server: CPU time per request served): what the program itself did, without the
    waits that other load (and on 2 cores the service's CPU) add to its wall time."""
    summary = summary or summarize(data)
    cfgs = shown(data)
    lines = ["| workload | " + " | ".join(LABEL[c] for c in cfgs) + " |",
             "|" + "---|" * (len(cfgs) + 1)]
    for name, s in summary["workloads"].items():
        cells = []
        for c in cfgs:
            r = (s["configs"].get(c) or {}).get("cpu_ratio") or {}
            cells.append(f"x{r['median']:.3f} [{r['min']:.2f}–{r['max']:.2f}]" if r.get("n")
                         else "–")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def details(data: dict, summary: dict | None = None) -> str:
    summary = summary or summarize(data)
    out = ["| workload | config | pairs | median | min–max | interval of the median | "
           "failed runs | CPU ratio | regions installed | code bytes | in replacement "
           "after 1st patch | patched runs | share of BOLT's gain (wall; CPU) |", "|" + "---|" * 13]
    for name, s in summary["workloads"].items():
        for cfg, c in s["configs"].items():
            if cfg == "native":
                continue
            r = c.get("ratio") or {}
            if not r.get("n") and not c.get("failures"):
                continue
            ci = r.get("ci")
            ci_s = (f"{ci['lo']:.3f}–{ci['hi']:.3f} ({ci['coverage'] * 100:.1f} %)" if ci
                    else "–")
            d = c.get("dbr") or {}
            fails = ", ".join(f"{n} {k}" for k, n in (c.get("failures") or {}).items()) or "0"
            cpu = (c.get("cpu_ratio") or {}).get("median")
            sh = [c.get("share_of_bolt_gain"), c.get("share_of_bolt_gain_cpu")]
            out.append(
                f"| {name} | {cfg} | {r.get('n', 0)} | {_num(r.get('median'), '{:.3f}')} | "
                f"{_num(r.get('min'), '{:.3f}')}–{_num(r.get('max'), '{:.3f}')} | {ci_s} | "
                f"{fails} | {_num(cpu, '{:.3f}')} | {_num(d.get('regions_installed'), '{:.0f}')}"
                f" | {_num(d.get('code_bytes_installed'), '{:.0f}')} | "
                f"{_pct(d.get('share_after_first_patch'))} | "
                f"{d.get('runs_patched', '–') if d else '–'} | "
                f"{'; '.join('–' if x is None else f'{x * 100:.0f} %' for x in sh)} |")
    return "\n".join(out) + "\n"


def markdown(data: dict) -> str:
    summary = summarize(data)
    m = data.get("machine") or {}
    lines = [f"# dbr long-running benchmark ({'quick' if data.get('quick') else 'full'} run)",
             "",
             f"* command: `{data.get('command', '?')}`; started {data.get('started', '?')}, "
             f"finished {data.get('finished', 'not yet (partial results)')}"
             + (f", {data['elapsed_s'] / 60:.1f} min" if data.get("elapsed_s") else ""),
             f"* machine: {m.get('cpu', '?')}, {m.get('cores', '?')} cores, kernel "
             f"{m.get('kernel', '?')}, {m.get('pmu_note', '')}; load average at start "
             f"{m.get('loadavg_start', '?')}, at end {m.get('loadavg_end', '?')}",
             f"* dbr: commit {(data.get('code') or {}).get('commit', '?')}; pairs per workload: "
             f"{data.get('pairs')} (servers: {data.get('server_pairs')})",
             "",
             "Ratios are time over native's, per pair (lower is faster): the median over "
             "pairs and [min–max].  For the server: native's throughput over the "
             "configuration's, in the window from the configuration's first patch to the "
             "end of the run (the whole run when nothing was installed).",
             "", table(data, summary), "",
             "Program CPU time over native's (median [min–max] over pairs):", "",
             cpu_table(data, summary), "", "## Per configuration", "",
             details(data, summary), "", "## Workloads", ""]
    for name, w in (data.get("workloads") or {}).items():
        lines.append(f"* **{name}** ({w.get('status')}): {w.get('what') or w.get('reason', '')}")
        for n in w.get("notes") or []:
            lines.append(f"  * {n}")
        b = ((w.get("configs") or {}).get("bolt") or {}).get("bolt")
        if b:
            lines.append(f"  * BOLT: {b.get('path') or b.get('reason')}; "
                         f"{'; '.join(b.get('notes') or [])}; {b.get('profiled_functions', '')}")
        for r in w.get("runs") or []:
            if r.get("status") != "ok":
                lines.append(f"  * pair {r['pair'] + 1} {r['config']}: **{r['status']}** (exit "
                             f"{r.get('exit')}): {(r.get('stderr_tail') or '').strip()[-200:]}")
    lines += ["", "## Configurations", ""]
    for c, what in (data.get("config_what") or {}).items():
        lines.append(f"* `{c}`: {what}")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------ plots

def plots(data: dict, outdir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = summarize(data)
    made = []
    names = list(summary["workloads"])
    if names:
        fig, ax = plt.subplots(figsize=(9, 4.5))
        cfgs = shown(data)
        width = 0.8 / len(cfgs)
        for k, cfg in enumerate(cfgs):
            xs, ys, lo, hi = [], [], [], []
            for i, n in enumerate(names):
                r = (summary["workloads"][n]["configs"].get(cfg) or {}).get("ratio") or {}
                if r.get("n"):
                    xs.append(i + (k - (len(cfgs) - 1) / 2) * width)
                    ys.append(r["median"])
                    lo.append(r["median"] - r["min"])
                    hi.append(r["max"] - r["median"])
            if xs:
                ax.errorbar(xs, ys, yerr=[lo, hi], fmt="o", capsize=3, ms=6, label=LABEL[cfg])
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xticks(range(len(names)), [
            n + (" (throughput)" if (data["workloads"][n].get("kind") == "server") else "")
            for n in names])
        ax.set_ylabel("time / native (median, min–max over pairs)")
        ax.set_title("long-running programs: dbr, BOLT and PGO against native (lower is faster)")
        ax.grid(axis="y", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        fig.tight_layout()
        p = outdir / "long-ratios.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        made.append(p)
    for name, w in (data.get("workloads") or {}).items():
        if w.get("kind") != "server" or not w.get("runs"):
            continue
        fig, ax = plt.subplots(figsize=(9, 4.5))
        colors = {"native": "black", "dbr-default": "tab:blue", "dbr-aggressive": "tab:orange",
                  "dbr-nocalls": "tab:cyan", "dbr-aggressive-nocalls": "tab:brown",
                  "dbr-nofunctions": "tab:purple", "dbr-aggressive-hottext": "tab:olive",
                  "bolt": "tab:green", "pgo": "tab:red"}
        seen = set()
        for r in w["runs"]:
            sl = [s for s in r.get("slices") or [] if s.get("rps")]
            if not sl:
                continue
            c = r["config"]
            ax.plot([(s["start"] + s["end"]) / 2 for s in sl], [s["rps"] / 1000 for s in sl],
                    color=colors.get(c, "grey"), lw=1, alpha=0.8,
                    label=None if c in seen else c)
            seen.add(c)
            for e in r.get("events") or []:
                if e.get("event") == "patch-installed":
                    ax.axvline(e["t"], color=colors.get(c, "grey"), lw=0.6, ls=":", alpha=0.7)
        ax.set_xlabel("seconds since the server started (dotted: a dbr patch installed)")
        ax.set_ylabel("thousand requests / s (per slice)")
        ax.set_title(f"{name} under redis-benchmark: throughput over time, every run")
        ax.legend(fontsize=8)
        fig.tight_layout()
        p = outdir / f"long-{name}.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        made.append(p)
    return made
