"""Edge profiles from sampled taken-branch stacks (LBR-style records; the edge-profiling
reference of docs/architecture.md, "Where the design comes from").

A branch stack is the last N taken branches ``(from, to)`` at the moment of a sample.
Every pair is a taken edge.  Between two consecutive taken branches the program ran
straight through: from the target of the older one to the source of the newer one, so
that address range is a *fall-through range* (every conditional branch inside it was
not taken).  sampling/fulltrace.py decodes those ranges into the not-taken edges, which
completes the *full branch trace* of the stack.

Uniformity: every stack contributes the same number of branches, so that counts stay
proportional to execution counts when stacks are sampled at taken-branch intervals.
With ``anchored`` (the service's way, :data:`CBT_SIZE`) a stack contributes its newest
``cbt_size`` taken branches and the ``cbt_size`` fall-through ranges that end at them,
the entry before them only anchoring the oldest range: a not-taken branch then counts
exactly when the taken branch that ends its range does, so taken and not-taken edges are
seen at the same rate.  Stacks with fewer entries are left out (``short``).  Without it,
a stack's newest ``cbt_size`` entries (all of them for None) give their edges and the
ranges between them.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable, Sequence

BranchPair = tuple[int, int]

#: Branches each stack contributes in the service: one less than the shallowest branch
#: stack hardware keeps (16 entries on AMD BRS and LbrExtV2 and older Intel cores; 32 on
#: Intel since Skylake), because the oldest entry only anchors a range.
CBT_SIZE = 15


@dataclass(slots=True)
class LbrProfile:
    """Counts derived from a set of branch stacks."""

    #: Taken edges: (branch source, branch target) -> count.
    edges: Counter = field(default_factory=Counter)
    #: Fall-through ranges: (first address, address of the next taken branch) -> count.
    fallthroughs: Counter = field(default_factory=Counter)
    #: Stacks used.
    stacks: int = 0
    #: Consecutive pairs whose fall-through range ran backwards (stack discontinuity:
    #: lost entries, a kernel excursion, a filtered branch); not counted as ranges.
    inconsistent: int = 0
    #: Stacks left out for having fewer entries than an anchored chop needs.
    short: int = 0


def _chronological(stack: Sequence[BranchPair], newest_first: bool,
                   keep: int | None) -> Sequence[BranchPair]:
    seq = list(stack)[::-1] if newest_first else list(stack)
    if keep is not None:
        seq = seq[-keep:]
    return seq


def lbr_profile(stacks: Iterable[Sequence[BranchPair]], newest_first: bool = True,
                cbt_size: int | None = None, max_range: int = 1 << 16,
                anchored: bool = False) -> LbrProfile:
    """Derive taken edges and fall-through ranges from branch stacks.

    ``newest_first`` is perf's order (entry 0 is the most recent branch).  Ranges longer
    than ``max_range`` bytes are treated as discontinuities.  ``anchored`` needs a
    ``cbt_size`` (see the module doc).
    """
    if anchored and cbt_size is None:
        raise ValueError("an anchored chop needs a cbt_size")
    prof = LbrProfile()
    keep = cbt_size + 1 if anchored else cbt_size
    for stack in stacks:
        seq = _chronological(stack, newest_first, keep)
        if anchored and len(seq) < keep:
            prof.short += 1
            continue
        if not seq:
            continue
        prof.stacks += 1
        for src, dst in seq[1:] if anchored else seq:
            prof.edges[(src, dst)] += 1
        for (_, older_to), (newer_from, _) in zip(seq, seq[1:]):
            if older_to <= newer_from and newer_from - older_to <= max_range:
                prof.fallthroughs[(older_to, newer_from)] += 1
            else:
                prof.inconsistent += 1
    return prof


def edges_from_lbr(stacks: Iterable[Sequence[BranchPair]], newest_first: bool = True,
                   cbt_size: int | None = None) -> dict[BranchPair, int]:
    """Taken-edge counts ``{(src, dst): count}`` from branch stacks."""
    return dict(lbr_profile(stacks, newest_first, cbt_size).edges)


def fallthroughs_from_lbr(stacks: Iterable[Sequence[BranchPair]], newest_first: bool = True,
                          cbt_size: int | None = None) -> dict[tuple[int, int], int]:
    """Fall-through range counts ``{(start, end): count}`` from branch stacks."""
    return dict(lbr_profile(stacks, newest_first, cbt_size).fallthroughs)
