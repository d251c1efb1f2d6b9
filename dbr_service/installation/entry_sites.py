"""Which of a region's entry sites may be patched (docs/architecture.md, "Invariants" 3,
region/patchpoints.py).

A site whose first instruction is shorter than 5 bytes is sent only when region
selection named it an entry site, the bytes there still decode to the inner
boundaries it named, the agent takes such sites (HELLO_ENTRY_SITES), and no code that
may still run (live regions, removed ones whose code is not reclaimed) exits into its
bytes 1..4; and a region whose exits lead into an installed entry site's bytes 1..4
is not installed.  :class:`EntrySiteChecks` is the part of install.Installer that
decides this.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from dbr_service.wire import protocol as P
from dbr_service.wire.agentconn import make_site, site_inner
from dbr_service.installation.installed import HELD, Generated, InstalledRegion


class EntrySiteChecks:
    """The entry-site part of :class:`dbr_service.installation.install.Installer` (a mixin: it uses
    the installer's connection, regions, code space and events)."""

    def _make_sites(self, reg: InstalledRegion, gen: Generated,
                    entry_sites: Mapping[int, Sequence[int]]) -> list[P.PatchSite]:
        """The PATCH records of ``gen``'s entries: a site of one >= 5-byte instruction
        as always; an entry site only as the module docstring says (else refused
        here, in ``reg.refused_sites``)."""
        out = []
        takes = bool(getattr(self.conn.hello, "flags", 0) & P.HELLO_ENTRY_SITES)
        for site, target in sorted(gen.entries.items()):
            code = self.read_original(site, 32)
            inner = decode_inner(code, site)
            if inner is None:
                reg.refused_sites[site] = "its instructions do not decode"
            elif not inner:
                out.append(make_site(site, target, code[:P.PATCH_LEN], self.variant,
                                     reg.region_id))
                continue
            elif sorted(entry_sites.get(site, ())) != inner:
                reg.refused_sites[site] = "first instruction shorter than 5 bytes, not a " \
                                          "chosen entry site"
            elif not takes:
                reg.refused_sites[site] = "the agent does not take entry sites"
            elif self._runs_into(site, reg):
                reg.refused_sites[site] = "code that may still run exits into its bytes"
            else:
                out.append(make_site(site, target, code[:P.PATCH_LEN], P.Variant.INT3,
                                     reg.region_id, inner=inner))
                reg.entry_sites[site] = inner
                continue
            self.on_event("entry-site-refused", {"region": reg.name, "site": site,
                                                 "why": reg.refused_sites[site]})
        return out

    def _runnable(self) -> list[InstalledRegion]:
        """Regions whose code may still run: live or suspended, or removed with their
        code not yet reclaimed."""
        return [r for r in list(self.regions.values())
                if r.state in HELD or self.space.retained(r.chunk) is not None]

    def _runs_into(self, site: int, reg: InstalledRegion) -> bool:
        """Whether code that may still run, ``reg``'s included, exits into bytes 1..4 of
        ``site``.  Eviction points there do not count: EVICT drops every point inside an
        installed entry site (evict, evict_removed) and the agent refuses one; a thread
        at such a point stays in the copy until it leaves by an exit.  (A region whose
        entry site is a function's first instructions always has such points: the copies
        of those instructions.)"""
        inside = range(site + 1, site + P.PATCH_LEN)
        return any(t in inside for r in [*self._runnable(), reg] for _, t in r.gen.exits)

    def _installed_entry_sites(self) -> list[tuple[int, list[int]]]:
        return [(s.site, site_inner(s)) for r in list(self.regions.values()) if r.state in HELD
                for s in r.patched_sites + r.suspended_sites if s.flags & P.SITE_F_ENTRY]

    def _inside_entry_site(self, addr: int) -> bool:
        """Whether ``addr`` lies in bytes 1..4 of an installed (or suspended) entry site."""
        return any(site < addr < site + P.PATCH_LEN for site, _ in self._installed_entry_sites())

    def _exits_into_entry_sites(self, gen: Generated) -> int | None:
        """An installed entry site whose bytes 1..4 ``gen`` exits into, or None."""
        for site, _ in self._installed_entry_sites():
            if any(site < t < site + P.PATCH_LEN for _, t in gen.exits):
                return site
        return None


_CS: Any = None


def decode_inner(code: bytes, site: int) -> list[int] | None:
    """The instruction boundaries strictly inside the first PATCH_LEN bytes of
    ``code`` (at ``site``): [] when its first instruction is that long, None when
    the instructions there do not decode that far."""
    global _CS
    if _CS is None:
        import capstone
        _CS = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    inner: list[int] = []
    end = site
    for insn in _CS.disasm(code, site):
        if insn.address >= site + P.PATCH_LEN:
            break
        if insn.address > site:
            inner.append(insn.address)
        end = insn.address + insn.size
        if end >= site + P.PATCH_LEN:
            return inner
    return inner if end >= site + P.PATCH_LEN else None
