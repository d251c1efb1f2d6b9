"""dbr analyze: offline region selection on an ELF file from a samples file.

Runs hot-code discovery (docs/architecture.md, "Region selection") on BINARY loaded at its link
address (PIE: at --base, default 0), then the rest of the region-selection
pipeline when it is available, prints the super-regions it selects (with the
function names of the binary's symbol table, where it has one) and writes
one DOT file per pass (and SVG with graphviz's `dot`).  Settings are the
service's defaults (`dbr_service/config.py`, as its scheduler turns them into
pipeline settings for that many samples), so the regions are those the service
would select from the same samples; `-o KEY=VALUE` changes one.

Samples file: one sample per line, `ADDR [COUNT]` (hex with 0x, or decimal;
COUNT defaults to 1, repeated addresses add up); a branch sample is
`BRANCH -> TARGET [COUNT]` (for a conditional branch the fall-through address
stands for "not taken").  `#` starts a comment.  `perf script` output is not
read directly; turn it into this format first, e.g.
  perf script -F ip | awk '{print "0x" $1}' > samples.txt

examples:
  dbr analyze ./prog --samples samples.txt
  dbr analyze ./pie --base 0x555555554000 --samples s.txt --dot-dir out --svg
  dbr analyze ./prog --samples s.txt --lib /lib/x86_64-linux-gnu/libc.so.6@0x7ffff7c00000
  dbr analyze ./prog --samples s.txt -o jumps_from_hot_limit=3
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import subprocess
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TextIO

import networkx as nx

from dbr_service.codegen.frames import CfiSource
from dbr_service.errors import ConfigError, DbrError, MemoryViewError
from dbr_service.region.discovery import hot_code_discovery
from dbr_service.region.functions import FunctionEntries, call_targets
from dbr_service.region.memview import ElfMemoryView
from dbr_service.region.model import SuperRegion, fmt_node
from dbr_service.symbols import symbols_of

PIPELINE_MODULE = "dbr_service.region.pipeline"


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
                        help="samples file ('-' for stdin)")
    parser.add_argument("--base", type=_addr_arg, default=None, metavar="ADDR",
                        help="load address of a PIE binary (default 0: link addresses)")
    parser.add_argument("--lib", type=_lib_arg, action="append", default=[],
                        metavar="PATH@BASE", help="also map a shared library at BASE")
    parser.add_argument("--dot-dir", metavar="DIR", help="write one DOT file per pass here")
    parser.add_argument("--svg", action="store_true", help="also render SVG (needs graphviz)")
    parser.add_argument("-o", dest="options", action="append", default=[], metavar="KEY=VALUE",
                        help="set a configuration key (e.g. jumps_from_hot_limit=3)")


@dataclass
class _DiscoveryOnlyConfig:
    """Settings used when the pipeline module is not available."""

    jumps_from_hot_limit: int = field(default_factory=lambda: _service_defaults()
                                      .jumps_from_hot_limit)


def _service_defaults():
    from dbr_service.config import Config
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
        from dbr_service.worker import region_config
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


def _read_samples(path: str) -> Samples:
    if path == "-":
        return parse_samples(sys.stdin, "<stdin>")
    try:
        with open(path) as f:
            return parse_samples(f, path)
    except OSError as exc:
        raise SamplesError(f"{path}: cannot read samples: {exc.strerror}") from None


def _pipeline():
    try:
        return importlib.import_module(PIPELINE_MODULE)
    except ModuleNotFoundError as exc:
        if exc.name != PIPELINE_MODULE:
            raise
        return None


def _namer(binary: str, base: int | None):
    """``addr -> " (func+0xoff)"`` for addresses the binary's symbols name, else ""."""
    table = symbols_of(binary)

    def name(addr: int) -> str:
        hit = table.lookup(addr - (base or 0))
        return "" if hit is None else f" ({hit[0]}+{hit[1]:#x})" if hit[1] else f" ({hit[0]})"
    return name


def _summary(sr: SuperRegion, name=lambda a: "") -> str:
    body = sr.g.subgraph(sr.body_nodes())
    nloops = sum(1 for scc in nx.strongly_connected_components(body)
                 if len(scc) > 1 or any(body.has_edge(n, n) for n in scc))
    entries = ", ".join(f"{a:#x}{name(a)}" for a in sr.entry_points()) or "-"
    size = sum(bb.size for _, bb in sr.blocks())
    return (f"{sr.id}: entries [{entries}]  blocks {len(sr)}  bytes {size}  loops {nloops}  "
            f"exits {len(sr.exit_edges())}")


def _write_stage(dot_dir: str, idx: int, name: str, srs: list[SuperRegion], svg: bool) -> None:
    for sr in srs:
        base = os.path.join(dot_dir, f"{idx:02d}-{name}-{sr.id}")
        with open(base + ".dot", "w") as f:
            f.write(sr.to_dot(f"{name} {sr.id}"))
        if svg:
            subprocess.run(["dot", "-Tsvg", "-o", base + ".svg", base + ".dot"], check=True)


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
    chooses the entry sites and hot functions the service would."""
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


def _check_placement(args: argparse.Namespace, mem: ElfMemoryView, samples: Samples) -> None:
    """Fail, saying why, when no sample lies in executable code of the view; warn when
    most do not.  The usual cause is a PIE binary analysed at its link addresses while
    the samples carry its load address (perf script prints run-time addresses)."""
    code = [r for r in mem.ranges() if "x" in r.perms]
    total = sum(samples.ips.values())
    inside = sum(n for ip, n in samples.ips.items() if any(r.contains(ip) for r in code))
    if inside >= total / 2:
        return
    hint = ""
    if args.base is None and _is_pie(args.binary) and code:
        guess = (min(samples.ips) & ~0xfff) - (code[0].start & ~0xfff)
        hint = (f"; {args.binary} is position-independent (PIE) and is analysed at its link "
                f"addresses: pass --base with its load address (the start of its first "
                f"mapping in /proc/PID/maps, or from `perf script --show-mmap-events`); "
                f"if the lowest sample is in its first code page, that is --base {guess:#x}")
    spans = ", ".join(f"{r.start:#x}-{r.end:#x}" for r in code[:4]) or "none"
    what = (f"{total - inside:g} of {total:g} samples lie outside the executable code of "
            f"the view ({spans}){hint}")
    if not inside:
        raise SamplesError(what)
    print(f"warning: {what}", file=sys.stderr)


def _run(args: argparse.Namespace) -> int:
    pipe = _pipeline()
    _load_config(args.options, pipe)            # bad -o keys fail before any work
    mem = ElfMemoryView(args.binary, base=args.base, libs=args.lib)
    samples = _read_samples(args.samples)
    if not samples.ips:
        raise SamplesError(f"{args.samples}: no samples")
    _check_placement(args, mem, samples)
    cfg = _load_config(args.options, pipe, sum(samples.ips.values()))
    first = hot_code_discovery(samples.ips, mem,
                               jumps_from_hot_limit=cfg.jumps_from_hot_limit,
                               branch_samples=samples.branches or None)
    functions = function_entries(mem)
    functions.add(call_targets(first))
    first.info["function_entries"] = functions     # entry sites and hot functions
    st = first.info["discovery"]
    print(f"discovery: {len(first)} blocks, {st.entries} entries, {st.jump_tables} jump tables, "
          f"{st.unsupported} unsupported, {st.samples_unplaced:g} samples not placed")
    stages: list[tuple[str, list[SuperRegion]]] = [("discovery", [first])]
    if pipe is None:
        print(f"note: {PIPELINE_MODULE} is not available; showing discovery only")
        regions = [first]
    else:
        result = pipe.run_pipeline(first, mem, cfg)
        regions = list(result.regions)
        stages = [(name, list(srs)) for name, srs in result.stages] or stages
        for failure in getattr(result, "failures", []):
            print(f"note: {failure.region_id} dropped by {failure.pass_name}: {failure.error}")
    print(f"{len(regions)} super-region(s)")
    name = _namer(args.binary, args.base)
    for sr in regions:
        print("  " + _summary(sr, name))
        for k, bb in sorted(sr.blocks(), key=lambda kb: str(kb[0])):
            flag = " unpatchable" if bb.unpatchable else ""
            print(f"    {fmt_node(k)}{name(bb.start)} {bb.size}B {bb.term.value} "
                  f"samples={bb.samples:g}{flag}")
    if args.dot_dir:
        os.makedirs(args.dot_dir, exist_ok=True)
        svg = args.svg and shutil.which("dot") is not None
        if args.svg and not svg:
            print("note: graphviz 'dot' is not installed; wrote DOT files only", file=sys.stderr)
        for i, (name, srs) in enumerate(stages):
            _write_stage(args.dot_dir, i, name, srs, svg)
        print(f"wrote {sum(len(s) for _, s in stages)} DOT file(s) to {args.dot_dir}")
    elif args.svg:
        print("note: --svg needs --dot-dir", file=sys.stderr)
    return 0
