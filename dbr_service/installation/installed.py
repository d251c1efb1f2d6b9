"""What the installer keeps of each region in one client: :class:`InstalledRegion`,
its state (:class:`InstallState`, defined in common/states.py), and what codegen hands over to be
installed (:class:`Generated`).  Read by the installer (installation/install.py), its entry-site
checks (installation/entry_sites.py), evaluation (installation/optimize.py) and the session's region
records."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from dbr_service.wire import protocol as P
from dbr_service.installation.codespace import Chunk
from dbr_service.codegen.spoffset import sp_offset
from dbr_service.common.states import HELD, InstallState  # noqa: F401  (importers take them here too)


class Generated(Protocol):
    """What codegen hands over (dbr_service.codegen.emit.GeneratedCode)."""

    code: bytes
    base: int
    entries: dict[int, int]                    # original patch site -> replacement address
    addr_map: list[tuple[int, int, int]]       # (repl_start, repl_end, original address)
    exits: list[tuple[int, int]]               # (replacement address, original target)
    transfers: dict[int, int]                  # original instruction -> replacement address


@dataclass
class InstalledRegion:
    """One region's code in the client and its patch sites."""

    region_id: int
    name: str
    chunk: Chunk
    gen: Generated
    sites: list[P.PatchSite] = field(default_factory=list)
    results: dict[int, int] = field(default_factory=dict)     # site -> dbr_result
    state: InstallState = InstallState.WRITTEN
    installed_at: float = 0.0
    removed_at: float = 0.0
    module: str | None = None
    why_removed: str = ""
    #: Original code ranges the region copies (its blocks), for evaluation.
    orig_ranges: list[tuple[int, int]] = field(default_factory=list)
    #: Threads the agent moved from original code into this region (TRANSFER).
    transferred: int = 0
    #: Threads the agent moved out of this region's code into original code (EVICT).
    evicted: int = 0
    #: While SUSPENDED: the sites that were patched, to patch again on resume.
    suspended_sites: list[P.PatchSite] = field(default_factory=list)
    #: Why the region's real calls were given up (its CFI could not be made), or None.
    cfi_refused: str | None = None
    #: Unwind information blobs named to the agent (FRAMES_ADD).
    frames: int = 0
    #: Entry sites among ``sites``: site -> its inner instruction boundaries.
    entry_sites: dict[int, list[int]] = field(default_factory=dict)
    #: Sites not sent to the agent, and why (an entry site refused here).
    refused_sites: dict[int, str] = field(default_factory=dict)
    #: Original-code ranges named to the agent with REGION (what the code depends on).
    depends: list[tuple[int, int]] = field(default_factory=list)
    #: Regions whose copies its real calls go to (by region id).
    calls_into: list[int] = field(default_factory=list)
    #: Suspended along with this region id (it calls its copy), resumed with it.
    suspended_for: int | None = None
    #: Removed because the original code it copies or exits into changed (no EVICT).
    original_changed: bool = False
    #: The agent refused an EVICT out of its removed code: not asked again.
    evict_refused: bool = False
    #: Entry sites that no edge inside the region targets: its copy passes their
    #: entry only when control comes from original code (speed checks count them).
    free_entries: frozenset[int] = frozenset()
    #: Not judged by evaluation (cold, not effective) nor moved into: a probe's
    #: trampoline, which stays until the operator or the session removes it.
    kept: bool = False

    @property
    def patched_sites(self) -> list[P.PatchSite]:
        return [s for s in self.sites if self.results.get(s.site) == P.Result.OK]

    def code_range(self) -> tuple[int, int]:
        return self.chunk.addr, self.chunk.addr + self.chunk.size

    def contains_code(self, addr: int) -> bool:
        lo, hi = self.code_range()
        return lo <= addr < hi

    def _piece(self, addr: int) -> tuple[int, int, int] | None:
        """The address map's piece (repl_start, repl_end, original) holding ``addr``."""
        return next((p for p in self.gen.addr_map if p[0] <= addr < p[1]), None)

    def original_of(self, addr: int) -> int | None:
        """Original address of a replacement-code address (sample attribution)."""
        piece = self._piece(addr)
        return None if piece is None else piece[2]

    def sp_offset_of(self, addr: int) -> int | None:
        """rsp at replacement address ``addr`` less the original's rsp at the
        instruction it stands for (codegen/spoffset.py); None: unknown."""
        piece = self._piece(addr)
        return None if piece is None else sp_offset(self.gen.code, self.gen.base,
                                                     piece[0], piece[1], addr)
