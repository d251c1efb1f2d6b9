"""Flame graphs from folded stacks: an SVG drawn without external tools.

Input is Brendan Gregg's folded format, one stack a line, outermost frame first:
``main;f;g 42``.  The stacks are merged into a tree (equal prefixes are one frame);
each frame is a rectangle whose width is its share of all samples, stacked on its
caller, children sorted by name (as flamegraph.pl does).  Each frame is an SVG group
``<g class="frame">`` holding a ``<title>`` (the tooltip: name, samples, share), a
``<rect>`` and, when the rectangle is wide enough, a ``<text>`` label cut to fit.
Frames narrower than ``min_width`` pixels are left out (their samples still count in
their callers' widths).  Every name is XML-escaped: names come from the client's
files.
"""

from __future__ import annotations

import zlib
from collections import Counter
from dataclasses import dataclass, field
from xml.sax.saxutils import escape

WIDTH = 1200
FRAME_H = 16
TOP = 36          # room for the title
BOTTOM = 8
FONT = 11
CHAR_W = 6.6      # average glyph width of an 11 px sans font
MIN_WIDTH = 0.1


@dataclass
class Node:
    name: str
    count: int = 0
    children: dict[str, Node] = field(default_factory=dict)


def build_tree(folded: Counter) -> Node:
    """The merged frame tree of folded stacks ({tuple of names: count})."""
    root = Node("all")
    for stack, n in folded.items():
        if n <= 0:
            continue
        root.count += n
        node = root
        for name in stack:
            node = node.children.setdefault(name, Node(name))
            node.count += n
    return root


def _depth(node: Node) -> int:
    return 1 + max((_depth(c) for c in node.children.values()), default=0)


def _colour(name: str) -> str:
    """A warm colour chosen by the name, so a function has one colour everywhere."""
    h = zlib.crc32(name.encode("utf-8", "replace"))
    r = 205 + h % 50
    g = 80 + (h >> 8) % 150
    b = (h >> 16) % 55
    return f"rgb({r},{g},{b})"


def render_svg(folded: Counter, title: str = "Flame graph", *, width: int = WIDTH,
               min_width: float = MIN_WIDTH, subtitle: str = "") -> str:
    """The SVG document of the flame graph of ``folded``."""
    root = build_tree(folded)
    total = max(root.count, 1)
    depth = _depth(root)
    height = TOP + depth * FRAME_H + BOTTOM
    scale = (width - 20) / total
    out = [
        '<?xml version="1.0" encoding="UTF-8" standalone="no"?>',
        f'<svg xmlns="http://www.w3.org/2000/svg" version="1.1" width="{width}" '
        f'height="{height}" viewBox="0 0 {width} {height}">',
        "<style>text { font-family: Verdana, sans-serif; font-size: "
        f"{FONT}px; fill: #000; }} .title {{ font-size: 16px; }} "
        "g.frame:hover rect { stroke: #000; stroke-width: 0.5; }</style>",
        f'<rect x="0" y="0" width="{width}" height="{height}" fill="#f8f8f0"/>',
        f'<text class="title" x="{width / 2:.1f}" y="20" text-anchor="middle">'
        f"{escape(title)}</text>",
    ]
    if subtitle:
        out.append(f'<text x="{width / 2:.1f}" y="32" text-anchor="middle">'
                   f"{escape(subtitle)}</text>")
    # iterative walk: (node, x in samples, level); the root is the bottom row
    work = [(root, 0, 0)]
    while work:
        node, x0, level = work.pop()
        w = node.count * scale
        if w < min_width:
            continue
        x = 10 + x0 * scale
        y = height - BOTTOM - (level + 1) * FRAME_H
        share = 100.0 * node.count / total
        label = node.name if level else f"all ({total} samples)"
        tip = f"{node.name} ({node.count} samples, {share:.2f}%)"
        out.append('<g class="frame">')
        out.append(f"<title>{escape(tip)}</title>")
        out.append(f'<rect x="{x:.2f}" y="{y}" width="{w:.2f}" height="{FRAME_H - 1}" '
                   f'fill="{_colour(node.name) if level else "rgb(200,200,200)"}" '
                   f'rx="2" ry="2" data-samples="{node.count}"/>')
        fits = int((w - 6) / CHAR_W)
        if fits >= 3:
            text = label if len(label) <= fits else label[:fits - 2] + ".."
            out.append(f'<text x="{x + 3:.2f}" y="{y + FRAME_H - 4}">{escape(text)}</text>')
        out.append("</g>")
        cx = x0
        for name in sorted(node.children):
            child = node.children[name]
            work.append((child, cx, level + 1))
            cx += child.count
    out.append("</svg>")
    return "\n".join(out) + "\n"
