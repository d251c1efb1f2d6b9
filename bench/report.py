"""Render ``latest.json`` as Markdown tables and PNG plots (matplotlib, Agg backend)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.stats import verdict

CONFIG_ORDER = ["dbr", "dbr-host", "dbr-preload", "thread-only", "dbr-aggressive", "dbr-sampling",
                "perf", "valgrind", "pgo"]


def _f(x: Any, fmt: str = "{:.3f}", none: str = "–") -> str:
    if isinstance(x, bool) or x is None:
        return none
    if isinstance(x, (int, float)):
        return fmt.format(x)
    return str(x)


def _cell(c: dict | None) -> str:
    if not c:
        return "–"
    st = c.get("status", "?")
    if st == "ok" and "ratio" in c:
        pr = c.get("paired_ratio") or {}
        rng = f" [{pr['min']:.2f}–{pr['max']:.2f}]" if "min" in pr else ""
        small = " (small input)" if c.get("input") == "small" else ""
        return f"**{c['ratio']:.3f}**{rng} n={c.get('runs', '?')}{small}"
    if st == "unavailable":
        return "unavailable"
    if st == "n/a":
        return "n/a"
    return f"**{st.upper()}**" if st in ("FAILURE", "crashed", "timeout") else st


def _configs_in(rows: list[dict]) -> list[str]:
    seen: list[str] = []
    for r in rows:
        for n in r.get("configs", {}):
            if n != "native" and n not in seen:
                seen.append(n)
    return sorted(seen, key=lambda n: CONFIG_ORDER.index(n) if n in CONFIG_ORDER else 99)


def markdown(data: dict) -> str:
    m = data.get("machine", {})
    out = [f"# dbr benchmarks ({'quick' if data.get('quick') else 'full'} run)", ""]
    la0 = m.get("loadavg_start") or m.get("loadavg")
    la1 = m.get("loadavg_end") or m.get("loadavg_now")
    out += [
        f"* started {data.get('started', '?')}, finished {data.get('finished', 'not yet')}"
        f" — command `{' '.join(data.get('command', []))}`",
        f"* machine: {m.get('cpu', '?')}, {m.get('cores', '?')} cores, kernel "
        f"{m.get('kernel', '?')}, {m.get('pmu_note', '')}; CPU governor: "
        f"{m.get('cpu_governor', '?')}; "
        f"memory {_f((m.get('memtotal_kb') or 0) / 1048576, '{:.1f}')} GiB",
        f"* dbr measured: commit {data.get('code', {}).get('commit', '?')}, "
        f"{data.get('code', {}).get('uncommitted_files', '?')} uncommitted file(s) under "
        "dbr_service/, dbr_agent/, shared/",
        f"* load average (1/5/15 min) at start {_fmt_load(la0)}, at end {_fmt_load(la1)}"
        + (" — **the machine was loaded: treat differences of a few % as noise**"
           if la0 and max(la0[0], (la1 or [0])[0]) > 0.5 * (m.get('cores') or 1) else ""),
        "",
    ]
    cmp_ = data.get("benchmarks", {}).get("compare")
    if cmp_:
        out += _compare_md(cmp_)
    sc = data.get("benchmarks", {}).get("scaling")
    if sc:
        out += _scaling_md(sc)
    if data.get("plots"):
        out += ["## Plots", ""] + [f"![{p}]({p})" for p in data["plots"]] + [""]
    return "\n".join(out) + "\n"


def _fmt_load(la: Any) -> str:
    return "/".join(f"{x:.2f}" for x in la) if la else "?"


def _target_md(c: dict, rows: list[dict]) -> list[str]:
    """The slowdown target, judged by each ratio's bootstrap interval, not its median."""
    t = c.get("target") or {}
    limit, cfgs = t.get("limit"), [n for n in t.get("configs", [])
                                   if any(n in r.get("configs", {}) for r in rows)]
    if not limit or not cfgs:
        return []
    out = ["", f"## Target: no workload slower than native by more than "
           f"{100 * (limit - 1):.0f} %", "",
           f"Ratio of medians with its {100 * t.get('level', 0.95):.0f} % bootstrap interval "
           "(rounds resampled whole, so each round's native and dbr runs stay paired). "
           f"*met*: the whole interval ≤ {limit}; *missed*: the whole interval above it; "
           "*undecided*: the interval spans it (the noise of this run is larger than the "
           "difference: more rounds or a quieter machine are needed to tell).", "",
           f"| workload | config | ratio | {100 * t.get('level', 0.95):.0f} % interval | verdict |",
           "|---|---|---|---|---|"]
    tally: dict[str, int] = {}
    for r in rows:
        for n in cfgs:
            cj = r.get("configs", {}).get(n)
            if not cj:
                continue
            if cj.get("status") != "ok" or "ratio" not in cj:
                v = cj.get("status", "?")
                out.append(f"| {r['name']} | {n} | – | – | {v} |")
            else:
                ci = cj.get("ratio_ci95")
                v = verdict(tuple(ci) if ci else None, limit)
                ci_s = f"{ci[0]:.3f}–{ci[1]:.3f}" if ci else "– (under 5 rounds)"
                out.append(f"| {r['name']} | {n} | {cj['ratio']:.3f} | {ci_s} | **{v}** |")
            tally[v] = tally.get(v, 0) + 1
    out += ["", "Verdicts: " + ", ".join(f"{k} {v}" for k, v in sorted(tally.items())) + "."]
    out += _by_patch_md(rows, cfgs)
    return out


def _by_patch_md(rows: list, cfgs: list[str]) -> list[str]:
    """The rounds of each dbr config split by whether its run had code installed (only
    where some runs were and some were not): what the mixed ratio above is made of."""
    lines = []
    for r in rows:
        for n in cfgs:
            bp = (r.get("configs", {}).get(n) or {}).get("by_patch") or {}
            if "patched" not in bp or "unpatched" not in bp:
                continue
            cells = []
            for key in ("patched", "unpatched"):
                side = bp[key]
                ci = side.get("ratio_ci95")
                cells.append(f"{side['rounds']} | {_f(side.get('ratio'))} | "
                             + (f"{ci[0]:.3f}–{ci[1]:.3f}" if ci else "–"))
            lines.append(f"| {r['name']} | {n} | " + " | ".join(cells) + " |")
    if not lines:
        return []
    return ["", "Rounds split by whether the dbr run had code installed (ratio of medians "
            "over those rounds, with its interval). Not the installed code's effect: code "
            "comes only to a run that lasts until the service's first job ends, so a run the "
            "machine slowed is more often patched (`bench.service_ab` with `patching=false` "
            "on one side measures the code itself):", "",
            "| workload | config | rounds patched | ratio | interval | rounds unpatched | "
            "ratio | interval |", "|---|---|---|---|---|---|---|---|"] + lines


def _compare_md(c: dict) -> list[str]:
    st = c.get("settings", {})
    out = ["## Configurations", "", "| config | what | status |", "|---|---|---|"]
    for name, info in c.get("configs", {}).items():
        out.append(f"| {name} | {info.get('what', '')} | "
                   f"{'available' if info.get('available') else info.get('reason', '')} |")
    rows = c.get("workloads", [])
    names = _configs_in(rows)
    out += ["", "## Wall time relative to native", "",
            f"Median of {st.get('runs', '?')} alternated runs per config after "
            f"{st.get('warmup', '?')} warm-up round(s) (besides the native reference run and "
            "each tool's availability smoke run, which warm the caches), divided by native's "
            "median; "
            "[min–max] of the per-round paired ratios; valgrind: its own native/valgrind "
            f"pair, up to {st.get('valgrind_runs', '?')} run(s) (no new round after "
            f"{st.get('valgrind_budget_s', '?')} s). Lower is better; 1 = native. "
            "*share of PGO gain* = (native − dbr)/(native − pgo), shown when PGO gains "
            f"at least {100 * (1 - st.get('pgo_helps', 0.98)):.0f} % and in at least 3 of 4 "
            "paired rounds (paired-ratio q3 < 1).", "",
            "| workload | native s median (IQR) | " + " | ".join(names)
            + " | dbr share of PGO gain | status |",
            "|---|---|" + "---|" * len(names) + "---|---|"]
    for r in rows:
        nat = r.get("configs", {}).get("native", {})
        w = nat.get("wall_s") or {}
        nat_s = (f"{w['median']:.3f} ({w['q1']:.3f}–{w['q3']:.3f})" if "median" in w else "–")
        share = r.get("pgo_share") or {}
        v = share.get("value")
        share_s = ((f"{v:.2f}" if v >= 0 else f"{v:.2f} (dbr slower than native: no gain)")
                   if isinstance(v, (int, float)) else (share.get("why") or "–"))
        status = r.get("status", "?")
        if status in ("skipped", "crashed", "FAILURE"):
            status = f"**{status.upper()}**: {r.get('message', '')}"
        out.append(f"| {r['name']} | {nat_s} | "
                   + " | ".join(_cell(r.get("configs", {}).get(n)) for n in names)
                   + f" | {share_s} | {status} |")
    out += _target_md(c, rows)
    # dbr metrics
    dbr_names = [n for n in names if n.startswith("dbr")]
    out += ["", "## What dbr did", "",
            "Medians over the recorded runs, from each run's `dbr run --report` JSON. "
            "Service CPU: from the report when it carries it, else rusage of the `dbr run` "
            "process tree (embedded service thread + agent + program) minus native's CPU; "
            "peak RSS likewise (else ru_maxrss of the largest process of that tree).", "",
            "*prog ratio*: PROG's own wall time as `dbr run` timed it (start-up of dbr run and "
            "its embedded service, report collection and shutdown excluded) / native.", "",
            "| workload | config | prog ratio | CPU ratio | first patch s (runs patched) "
            "| samples | "
            "in replacement (after 1st patch) | patches (removed) | code bytes installed "
            "(generated) | service CPU s | peak RSS MB | region status (last run) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    any_dbr = False
    for r in rows:
        for n in dbr_names:
            cj = r.get("configs", {}).get(n)
            if not cj:
                continue
            any_dbr = True
            d = cj.get("dbr") or {}
            if cj.get("status") in ("unavailable", "n/a"):
                continue  # said once, in the configurations table
            if cj.get("status") != "ok":
                out.append(f"| {r['name']} | {n} | **{cj.get('status')}**: "
                           f"{cj.get('message', '')} ||||||||||")
                continue
            rss = d.get("service_peak_rss_kb")
            out.append(
                f"| {r['name']} | {n} | {_f(d.get('prog_ratio'))} | {_f(cj.get('cpu_ratio'))} | "
                f"{_f(d.get('time_to_first_patch_s'))} ({d.get('runs_patched', '–')}/"
                f"{d.get('reports', '–')}) | {_f(d.get('samples'), '{:.0f}')} | "
                f"{_f(d.get('share_in_replacement'), '{:.1%}')} "
                f"({_f(d.get('share_after_first_patch'), '{:.1%}')}) | "
                f"{_f(d.get('patches_installed'), '{:.0f}')} "
                f"({_f(d.get('patches_removed'), '{:.0f}')}) | "
                f"{_f(d.get('code_bytes_installed'), '{:.0f}')} "
                f"({_f(d.get('code_bytes'), '{:.0f}')}) | "
                f"{_f(d.get('service_cpu_s'), '{:.2f}')} | "
                f"{_f(rss / 1024 if rss else None, '{:.0f}')} | {d.get('region_status') or '–'} |")
    if not any_dbr:
        out.append("| (no dbr configuration ran) |||||||||||")
    out.append("")
    probs = [r for r in rows if r.get("status") != "ok"]
    if probs:
        out += ["## Skipped, crashed and failed", ""]
        out += [f"* **{r['name']}**: {r.get('status')}: {r.get('message', '')}" for r in probs]
        out.append("")
    out.append(f"Compare section status: {c.get('status', '?')}.")
    out.append("")
    return out


def _scaling_md(s: dict) -> list[str]:
    out = ["## Scaling: concurrent clients under one service", "",
           s.get("method", ""), ""]
    if s.get("status", "").startswith("unavailable"):
        return out + [f"**{s['status']}**", ""]
    out += ["| clients | status | service CPU s (share of one core) | service peak RSS MB | "
            "clients patched | first patch s median (max) | ctl status ms median (p90, n) | "
            "`dbr ctl --json status` command ms median | client wall s median |",
            "|---|---|---|---|---|---|---|---|---|"]
    for lv in s.get("levels", []):
        cpu = lv.get("service_cpu_s")
        lat = lv.get("ctl_latency_ms") or {}
        ttfp = lv.get("time_to_first_patch_s") or {}
        rss_kb = lv.get("service_peak_rss_kb")
        out.append(
            f"| {lv.get('clients')} | {lv.get('status')} | {_f(cpu, '{:.2f}')} "
            f"({_f(lv.get('service_cpu_share'), '{:.0%}')}) | "
            f"{_f(rss_kb / 1024 if rss_kb else None, '{:.0f}')} | "
            f"{lv.get('clients_patched', '–')}/{lv.get('clients_seen', '–')} | "
            f"{_f(ttfp.get('median'))} ({_f(ttfp.get('max'))}) | "
            f"{_f(lat.get('median'), '{:.1f}')} "
            f"({_f(lat.get('p90'), '{:.1f}')}, {lat.get('n', 0)}) | "
            f"{_f((lv.get('dbr_ctl_command_ms') or {}).get('median'), '{:.0f}')} | "
            f"{_f((lv.get('client_wall_s') or {}).get('median'))} |")
    out.append("")
    return out


# ------------------------------------------------------------------ plots

def plots(data: dict, outdir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made: list[Path] = []
    cmp_ = data.get("benchmarks", {}).get("compare")
    loaded = (data.get("machine", {}).get("loadavg_start") or [0])[0]
    tag = (f"{'quick' if data.get('quick') else 'full'} run {data.get('started', '')}, "
           f"load {loaded:.1f} on {data.get('machine', {}).get('cores', '?')} cores")
    if cmp_ and cmp_.get("workloads"):
        rows = [r for r in cmp_["workloads"] if r.get("configs")]
        names = _configs_in(rows)
        fig, ax = plt.subplots(figsize=(max(8, 1.1 * len(rows) + 3), 5))
        width = 0.8 / max(1, len(names))
        plotted = []
        for j, n in enumerate(names):
            xs, ys, lo, hi = [], [], [], []
            for i, r in enumerate(rows):
                c = r["configs"].get(n) or {}
                if c.get("status") == "ok" and "ratio" in c:
                    pr = c.get("paired_ratio") or {}
                    xs.append(i + (j - (len(names) - 1) / 2) * width)
                    ys.append(c["ratio"])
                    lo.append(max(0.0, c["ratio"] - pr.get("min", c["ratio"])))
                    hi.append(max(0.0, pr.get("max", c["ratio"]) - c["ratio"]))
            if xs:
                ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=n)
                plotted.append(n)
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels([r["name"] + ("" if r.get("status") == "ok" else f"\n({r['status']})")
                            for r in rows], rotation=30, ha="right")
        ax.set_yscale("log")
        ax.set_ylabel("wall time / native (median; bars: paired min–max)")
        missing = [f"{n}: {i.get('reason', '')[:60]}" for n, i in cmp_.get("configs", {}).items()
                   if not i.get("available")]
        ax.set_title("dbr vs alternatives — " + tag, fontsize=9)
        if missing:
            ax.text(0.01, 0.98, "\n".join(missing), transform=ax.transAxes, fontsize=7,
                    va="top", color="dimgray")
        if plotted:
            ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        fig.tight_layout()
        p = outdir / "ratios.png"
        fig.savefig(p, dpi=90)
        plt.close(fig)
        made.append(p)
    sc = data.get("benchmarks", {}).get("scaling")
    if sc and sc.get("levels"):
        lv = sc["levels"]
        ns = [x["clients"] for x in lv]
        fig, axs = plt.subplots(2, 2, figsize=(9, 6))
        series = [
            (axs[0][0], "service CPU s", [x.get("service_cpu_s") for x in lv]),
            (axs[0][1], "service peak RSS MB",
             [(x.get("service_peak_rss_kb") or 0) / 1024 or None for x in lv]),
            (axs[1][0], "first patch s (median)",
             [(x.get("time_to_first_patch_s") or {}).get("median") for x in lv]),
            (axs[1][1], "ctl status round trip ms (median)",
             [(x.get("ctl_latency_ms") or {}).get("median") for x in lv]),
        ]
        for ax, title, ys in series:
            pts = [(n, y) for n, y in zip(ns, ys) if isinstance(y, (int, float))]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-")
                ax.set_ylim(bottom=0)  # no magnified differences
            else:
                ax.text(0.5, 0.5, "no data (no client patched?)" if "patch" in title
                        else "no data", ha="center", transform=ax.transAxes)
            ax.set_xscale("log", base=2)
            ax.set_xticks(ns)
            ax.set_xticklabels([str(n) for n in ns])
            ax.set_title(title, fontsize=9)
            ax.set_xlabel("concurrent clients", fontsize=8)
        fig.suptitle("one service, N clients — " + tag, fontsize=9)
        fig.tight_layout()
        p = outdir / "scaling.png"
        fig.savefig(p, dpi=90)
        plt.close(fig)
        made.append(p)
    return made
