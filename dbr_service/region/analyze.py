"""dbr analyze: offline region selection on an ELF file from its samples.

Runs hot-code discovery (docs/architecture.md, "Region selection") on BINARY loaded at
its link address, then the rest of the region-selection pipeline, prints the
super-regions it selects (named after the functions of the binary's symbol table or
.eh_frame) and writes one DOT file per pass (and SVG with graphviz's `dot`).  Settings
are the service's defaults (`dbr_service/common/config.py`, as its scheduler turns them into
pipeline settings for that many samples), so the regions are those the service would
select from the same samples; `-o KEY=VALUE` changes one.  `--json` prints the result
as one JSON document (schema dbr.analyze/1, docs/control-api.md).

--samples takes a perf.data file (recognised by its header) or a text samples file.
A perf.data file is read with `perf script` (perf must be installed): samples in
BINARY are placed through the mappings perf recorded, so a PIE needs no --base; samples
in other DSOs are counted, with a warning when most of them are not in BINARY.

Text samples: one sample per line, `ADDR [COUNT]` (hex with 0x, or decimal; COUNT
defaults to 1, repeated addresses add up); a branch sample is `BRANCH -> TARGET
[COUNT]` (for a conditional branch the fall-through address stands for "not taken").
`#` starts a comment.  Addresses are run-time addresses: a PIE needs --base, its load
address.

examples:
  perf record -e cpu-clock -o perf.data ./prog args
  dbr analyze ./prog --samples perf.data --dot-dir out --svg
  dbr analyze ./prog --samples perf.data --json > analysis.json
  dbr analyze ./prog --samples samples.txt
  dbr analyze ./pie --base 0x555555554000 --samples s.txt
  dbr analyze ./prog --samples s.txt --lib /lib/x86_64-linux-gnu/libc.so.6@0x7ffff7c00000
  dbr analyze ./prog --samples s.txt -o jumps_from_hot_limit=3
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import subprocess
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TextIO

import networkx as nx

from dbr_service.codegen.frames import CfiSource
from dbr_service.common.errors import ConfigError, DbrError, MemoryViewError
from dbr_service.region.discovery import hot_code_discovery
from dbr_service.region.functions import FunctionEntries, call_targets
from dbr_service.region.memview import ElfMemoryView
from dbr_service.region.model import CloneKey, SuperRegion, fmt_node
from dbr_service.region.perfdata import is_perf_data, read_perf_data

PIPELINE_MODULE = "dbr_service.region.pipeline"
SCHEMA = "dbr.analyze/1"
#: DSOs the warning about samples outside the binary names; DSOs JSON output lists.
TOP_DSOS = 3
MAX_DSOS = 20


class SamplesError(DbrError):
    """A samples file could not be read or has a malformed line."""


@dataclass
class Samples:
    """IP samples and branch samples read from a samples file."""

    ips: dict[int, float] = field(default_factory=dict)
    branches: dict[int, dict[int, float]] = field(default_factory=dict)


def _num(tok: str) -> int:
    return int(tok, 16) if tok.lower().startswith("0x") else int(tok, 10)


def parse_samples(f: TextIO, name: str = "<samples>") -> Samples:
    """Read the samples format described in the module docstring."""
    out = Samples()
    branches: dict[int, dict[int, float]] = defaultdict(dict)
    for lineno, raw in enumerate(f, 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        toks = line.split()
        try:
            if len(toks) >= 3 and toks[1] == "->":
                if len(toks) > 4:
                    raise ValueError("too many fields")
                src, dst = _num(toks[0]), _num(toks[2])
                n = float(toks[3]) if len(toks) == 4 else 1.0
                if n < 0:
                    raise ValueError("negative count")
                branches[src][dst] = branches[src].get(dst, 0.0) + n
                continue
            if len(toks) > 2:
                raise ValueError("too many fields")
            addr = _num(toks[0])
            n = float(toks[1]) if len(toks) == 2 else 1.0
            if n < 0 or addr < 0:
                raise ValueError("negative value")
        except ValueError as exc:
            raise SamplesError(f"{name}:{lineno}: malformed sample line {raw.strip()!r} "
                               f"({exc}); expected 'ADDR [COUNT]' or 'BRANCH -> TARGET [COUNT]'"
                               ) from None
        out.ips[addr] = out.ips.get(addr, 0.0) + n
    out.branches = dict(branches)
    return out


def _lib_arg(text: str) -> tuple[str, int]:
    path, sep, base = text.rpartition("@")
    if not sep or not path:
        raise argparse.ArgumentTypeError(f"--lib {text!r}: expected PATH@BASE")
    try:
        return path, _num(base)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--lib {text!r}: bad base address {base!r}") from None


def _addr_arg(text: str) -> int:
    try:
        return _num(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad address {text!r}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("binary", metavar="BINARY", help="ELF x86-64 executable")
    parser.add_argument("--samples", required=True, metavar="FILE",
                        help="perf.data file, or text samples file ('-' for stdin)")
    parser.add_argument("--dso", metavar="PATH",
                        help="with a perf.data file: the path perf recorded for BINARY "
                             "(default: BINARY's own file, or the one file of its name)")
    parser.add_argument("--base", type=_addr_arg, default=None, metavar="ADDR",
                        help="load address of a PIE binary the text samples were taken "
                             "from (default 0: link addresses; not needed with perf.data)")
    parser.add_argument("--lib", type=_lib_arg, action="append", default=[],
                        metavar="PATH@BASE", help="also map a shared library at BASE")
    parser.add_argument("--dot-dir", metavar="DIR", help="write one DOT file per pass here")
    parser.add_argument("--svg", action="store_true", help="also render SVG (needs graphviz)")
    parser.add_argument("-o", dest="options", action="append", default=[], metavar="KEY=VALUE",
                        help="set a configuration key (e.g. jumps_from_hot_limit=3)")
    parser.add_argument("--json", action="store_true",
                        help="print the result as JSON (schema dbr.analyze/1)")


@dataclass
class _DiscoveryOnlyConfig:
    """Settings used when the pipeline module is not available."""

    jumps_from_hot_limit: int = field(default_factory=lambda: _service_defaults()
                                      .jumps_from_hot_limit)


def _service_defaults():
    from dbr_service.common.config import Config
    return Config()


def _coerce(key: str, current: object, raw: str) -> object:
    try:
        if isinstance(current, bool):
            if raw.lower() not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                raise ValueError(raw)
            return raw.lower() in ("1", "true", "yes", "on")
        if isinstance(current, int):
            return int(raw, 0)
        if isinstance(current, float):
            return float(raw)
    except ValueError:
        raise ConfigError(f"-o {key}={raw}: expected a {type(current).__name__}") from None
    return raw if raw else None


def _load_config(options: list[str], pipe, total_samples: float = 0.0) -> object:
    """The RegionConfig the service would use on ``total_samples`` samples (its default
    configuration: discovery reach, trip count, region size, inlining budget, hot
    threshold as that fraction of the samples), or discovery-only settings, with -o
    applied."""
    if pipe is not None:
        from dbr_service.region.worker import region_config
        cfg = region_config(_service_defaults(), int(total_samples))
    else:
        cfg = _DiscoveryOnlyConfig()
    if hasattr(cfg, "keep_stages"):
        cfg.keep_stages = True
    for text in options:
        key, sep, raw = text.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"-o {text!r}: expected KEY=VALUE")
        if not hasattr(cfg, key):
            known = ", ".join(sorted(vars(cfg)))
            raise ConfigError(f"unknown configuration key {key!r} (known: {known})")
        setattr(cfg, key, _coerce(key, getattr(cfg, key), raw.strip()))
    return cfg


def _read_text_samples(path: str) -> Samples:
    if path == "-":
        return parse_samples(sys.stdin, "<stdin>")
    try:
        with open(path, encoding="utf-8") as f:
            return parse_samples(f, path)
    except OSError as exc:
        raise SamplesError(f"{path}: cannot read samples: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise SamplesError(f"{path}: neither a perf.data file nor a text samples file "
                           f"(not UTF-8 text)") from None


def _pipeline():
    try:
        return importlib.import_module(PIPELINE_MODULE)
    except ModuleNotFoundError as exc:
        if exc.name != PIPELINE_MODULE:
            raise
        return None


def _paren(name: str | None) -> str:
    return f" ({name})" if name else ""


def _loops(sr: SuperRegion) -> int:
    body = sr.g.subgraph(sr.body_nodes())
    return sum(1 for scc in nx.strongly_connected_components(body)
               if len(scc) > 1 or any(body.has_edge(n, n) for n in scc))


def _summary(sr: SuperRegion, name=lambda a: None) -> str:
    entries = ", ".join(f"{a:#x}{_paren(name(a))}" for a in sr.entry_points()) or "-"
    size = sum(bb.size for _, bb in sr.blocks())
    return (f"{sr.id}: entries [{entries}]  blocks {len(sr)}  bytes {size}  "
            f"loops {_loops(sr)}  exits {len(sr.exit_edges())}")


def _sorted_blocks(sr: SuperRegion):
    return sorted(sr.blocks(), key=lambda kb: str(kb[0]))


def region_json(sr: SuperRegion, name=lambda a: None) -> dict:
    """One selected region in ``dbr.analyze/1`` (addresses are integers, as in every
    JSON dbr prints; docs/control-api.md)."""
    entries = sr.entry_points()
    nodes = []
    for k, bb in _sorted_blocks(sr):
        rec = {"start": bb.start, "name": name(bb.start), "size": bb.size,
               "term": bb.term.value, "samples": bb.samples, "unpatchable": bb.unpatchable}
        if isinstance(k, CloneKey):
            rec["clone_path"] = list(k.path)
        nodes.append(rec)
    return {"id": sr.id, "entries": entries, "entry_names": [name(a) for a in entries],
            "blocks": len(sr), "code_bytes": sum(bb.size for _, bb in sr.blocks()),
            "loops": _loops(sr), "exits": len(sr.exit_edges()), "nodes": nodes}


def _write_stage(dot_dir: str, idx: int, stage: str, srs: list[SuperRegion], svg: bool,
                 name, notes: list[str]) -> list[str]:
    written = []
    for sr in srs:
        base = os.path.join(dot_dir, f"{idx:02d}-{stage}-{sr.id}")
        with open(base + ".dot", "w") as f:
            f.write(sr.to_dot(f"{stage} {sr.id}", name))
        written.append(base + ".dot")
        if svg:
            try:
                subprocess.run(["dot", "-Tsvg", "-o", base + ".svg", base + ".dot"],
                               check=True, capture_output=True, timeout=120)
                written.append(base + ".svg")
            except (subprocess.SubprocessError, OSError) as exc:
                notes.append(f"no SVG of {base}.dot: dot failed ({exc})")
    return written


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except (DbrError, MemoryViewError, ConfigError) as exc:
        print(f"dbr analyze: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:                 # output piped into head & co.
        sys.stderr.close()
        return 0


def function_entries(mem: ElfMemoryView) -> FunctionEntries:
    """The known function entries of the files ``mem`` maps (FDE starts and symbols,
    region/functions.py), as the service knows a client's: selection offline then
    chooses the entry sites and hot functions the service would, and nodes and entries
    are named after them (FunctionEntries.name)."""
    maps = []
    for r in mem.ranges():
        if r.module:
            st = os.stat(r.module)
            maps.append((r.start, r.end, os.path.abspath(r.module),
                         (os.major(st.st_dev), os.minor(st.st_dev)), st.st_ino))
    return FunctionEntries(module_at=CfiSource(lambda: maps).module_at)


def _is_pie(path: str) -> bool:
    with open(path, "rb") as f:
        head = f.read(18)
    return len(head) == 18 and int.from_bytes(head[16:18], "little") == 3     # ET_DYN


def _check_placement(args: argparse.Namespace, mem: ElfMemoryView,
                     samples: Samples) -> str | None:
    """Fail, saying why, when no sample lies in executable code of the view; the
    warning to give when most do not.  The usual cause is a PIE binary analysed at its
    link addresses from text samples of run-time addresses."""
    code = [r for r in mem.ranges() if "x" in r.perms]
    total = sum(samples.ips.values())
    inside = sum(n for ip, n in samples.ips.items() if any(r.contains(ip) for r in code))
    if inside >= total / 2:
        return None
    hint = ""
    if args.base is None and _is_pie(args.binary) and code:
        guess = (min(samples.ips) & ~0xfff) - (code[0].start & ~0xfff)
        hint = (f"; {args.binary} is position-independent (PIE) and is analysed at its link "
                f"addresses: pass --base with its load address (the start of its first "
                f"mapping in /proc/PID/maps), or give --samples a perf.data file, which "
                f"needs none; if the lowest sample is in its first code page, that is "
                f"--base {guess:#x}")
    spans = ", ".join(f"{r.start:#x}-{r.end:#x}" for r in code[:4]) or "none"
    what = (f"{total - inside:g} of {total:g} samples lie outside the executable code of "
            f"the view ({spans}){hint}")
    if not inside:
        raise SamplesError(what)
    return what


def _perf_samples(args: argparse.Namespace) -> tuple[Samples, dict, list[str]]:
    ps = read_perf_data(args.samples, args.binary, dso=args.dso)
    bias = args.base or 0
    samples = Samples(ips={a + bias: n for a, n in ps.ips.items()})
    top = ", ".join(f"{d} {n} ({n / ps.total:.0%})" for d, n in ps.top_other(TOP_DSOS))
    info = {"source": "perf.data", "file": args.samples, "recorded_as": ps.dso,
            "total": ps.total, "in_binary": ps.in_binary,
            "other_dsos": [{"dso": d, "samples": n} for d, n in ps.top_other(MAX_DSOS)]}
    if not ps.in_binary:
        hint = "" if args.dso else ("; if perf recorded it under another path, name that "
                                    "path with --dso")
        raise SamplesError(f"{args.samples}: none of its {ps.total} samples is in "
                           f"{args.binary}; they are in {top}{hint}")
    warnings = []
    if ps.in_binary < ps.total / 2:
        out = ps.total - ps.in_binary
        warnings.append(f"{out} of {ps.total} samples ({out / ps.total:.0%}) are not in "
                        f"{args.binary} but in {top}; regions are selected from the "
                        f"{ps.in_binary} in it")
    return samples, info, warnings


def _samples(args: argparse.Namespace, mem: ElfMemoryView) -> tuple[Samples, dict, list[str]]:
    """The samples, the JSON ``samples`` section and the warnings about them."""
    if args.samples != "-" and is_perf_data(args.samples):
        samples, info, warnings = _perf_samples(args)
    else:
        if args.dso is not None:
            raise SamplesError("--dso applies to a perf.data file only")
        samples = _read_text_samples(args.samples)
        if not samples.ips:
            raise SamplesError(f"{args.samples}: no samples")
        info = {"source": "text", "file": args.samples, "total": sum(samples.ips.values())}
        warnings = []
    placement = _check_placement(args, mem, samples)
    if placement:
        warnings.append(placement)
    return samples, info, warnings


def _run(args: argparse.Namespace) -> int:
    pipe = _pipeline()
    _load_config(args.options, pipe)            # bad -o keys fail before any work
    mem = ElfMemoryView(args.binary, base=args.base, libs=args.lib)
    samples, info, warnings = _samples(args, mem)
    for w in warnings:
        print(f"warning: {w}", file=sys.stderr)
    cfg = _load_config(args.options, pipe, sum(samples.ips.values()))
    functions = function_entries(mem)
    hot_text = bool(getattr(cfg, "hot_text", False))
    first = hot_code_discovery(samples.ips, mem,
                               jumps_from_hot_limit=cfg.jumps_from_hot_limit,
                               branch_samples=samples.branches or None,
                               entries=functions.count_samples(samples.ips) if hot_text else ())
    functions.add(call_targets(first))
    first.info["function_entries"] = functions     # entry sites and hot functions
    name = functions.name
    st = first.info["discovery"]
    notes: list[str] = []
    stages: list[tuple[str, list[SuperRegion]]] = [("discovery", [first])]
    if pipe is None:
        notes.append(f"{PIPELINE_MODULE} is not available; showing discovery only")
        regions = [first]
    else:
        result = pipe.run_pipeline(first, mem, cfg)
        if hot_text:            # as select_regions: the hottest functions, up to the budget
            result.regions = pipe.hot_text_budget(result.regions, cfg.hot_text_max_bytes,
                                                  result.counters.setdefault("prune-code", {}))
        regions = list(result.regions)
        stages = [(stage, list(srs)) for stage, srs in result.stages] or stages
        notes += [f"{f.region_id} dropped by {f.pass_name}: {f.error}"
                  for f in getattr(result, "failures", [])]
    doc = {"schema": SCHEMA, "binary": os.path.abspath(args.binary), "base": args.base,
           "samples": info, "warnings": warnings, "notes": notes,
           "discovery": {"blocks": len(first), "entry_count": st.entries,
                         "jump_tables": st.jump_tables, "unsupported": st.unsupported,
                         "samples_unplaced": st.samples_unplaced},
           "regions": [region_json(sr, name) for sr in regions], "dot_files": []}
    quiet: list[str] = []                       # notes for stderr, not the result's text
    if args.dot_dir:
        os.makedirs(args.dot_dir, exist_ok=True)
        svg = args.svg and shutil.which("dot") is not None
        if args.svg and not svg:
            quiet.append("graphviz 'dot' is not installed; wrote DOT files only")
        for i, (stage, srs) in enumerate(stages):
            doc["dot_files"] += _write_stage(args.dot_dir, i, stage, srs, svg, name, quiet)
    elif args.svg:
        quiet.append("--svg needs --dot-dir")
    for text in quiet:
        print(f"note: {text}", file=sys.stderr)
    if args.json:
        doc["notes"] = notes + quiet
        print(json.dumps(doc, indent=2))
        return 0
    print(f"discovery: {len(first)} blocks, {st.entries} entries, {st.jump_tables} jump "
          f"tables, {st.unsupported} unsupported, {st.samples_unplaced:g} samples not placed")
    for text in notes:
        print(f"note: {text}")
    print(f"{len(regions)} super-region(s)")
    for sr in regions:
        print("  " + _summary(sr, name))
        for k, bb in _sorted_blocks(sr):
            flag = " unpatchable" if bb.unpatchable else ""
            print(f"    {fmt_node(k)}{_paren(name(bb.start))} {bb.size}B {bb.term.value} "
                  f"samples={bb.samples:g}{flag}")
    if args.dot_dir:
        print(f"wrote {sum(len(s) for _, s in stages)} DOT file(s) to {args.dot_dir}")
    return 0
