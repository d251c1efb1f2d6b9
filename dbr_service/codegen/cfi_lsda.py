"""LSDAs (``.gcc_except_table``): parse an original's, build one for a copy.

Layout (the Itanium C++ ABI's exception-handling tables as gcc emits them and
libstdc++'s ``__gxx_personality_v0`` / libgcc's ``__gcc_personality_v0`` read them,
``parse_lsda_header`` in ``unwind-pe``/``eh_personality.cc``)::

    u8  LPStart encoding; [LPStart]          landing pads are LPStart + lp (default:
                                             the FDE's pc_begin, "region start")
    u8  TType encoding; [uleb TType offset]  TType base = end of this field + offset
    u8  call-site encoding; uleb table length
    call-site table: {start, length, landing pad (all call-site encoding; start is
                      relative to the region start, 0 lp = none), uleb action}, sorted
    action table:    {sleb filter, sleb next (self-relative, 0 = end)}; action a > 0
                     names the record at action_table + a - 1
    type table:      entry i (filter i > 0) at TType base - i * size, TType-encoded
    exception specs: at TType base + (-filter - 1), uleb type indexes ending with 0

The personality looks up ``ip - 1`` (the return address minus one) in the call-site
table of the FDE that covers it; an address in no entry means std::terminate.  A copy's
LSDA therefore maps each copied byte to its original byte's entry (same landing pad,
same action), with LPStart explicitly 0 (absolute) so that landing pads can stay in the
original code; the action table and exception specs are copied verbatim (their offsets
are relative) and the type table is re-encoded as absolute 8-byte pointers (indirect
kept), valid wherever the LSDA sits.
"""

from __future__ import annotations

import bisect
import struct
from dataclasses import dataclass

from dbr_service.codegen.cfi_encoding import (
    ABSPTR, INDIRECT, OMIT, ULEB, CfiError, Image, uleb)


@dataclass(frozen=True)
class CallSite:
    """Original code [start, end) (link-time addresses); ``landing_pad`` 0 = none;
    ``action`` 0 = cleanup only, else 1 + offset of its record in the action table."""

    start: int
    end: int
    landing_pad: int
    action: int


@dataclass(frozen=True)
class Lsda:
    addr: int
    #: Encoding that determined LPStart (the FDE's pc_begin encoding when omitted).
    lp_enc: int
    call_sites: tuple[CallSite, ...]
    actions: bytes
    ttype_enc: int
    #: Type table entries 1..N: (value, encoding); value 0 = catch-all.
    types: tuple[tuple[int, int], ...]
    specs: bytes

    def site_at(self, addr: int) -> CallSite | None:
        i = bisect.bisect_right([c.start for c in self.call_sites], addr) - 1
        if i >= 0 and addr < self.call_sites[i].end:
            return self.call_sites[i]
        return None


def parse_lsda(image: Image, addr: int, func_start: int, func_enc: int) -> Lsda:
    """Parse the LSDA at ``addr`` of the function starting at ``func_start`` (whose
    pc_begin was encoded with ``func_enc``)."""
    cur = image.cursor(addr)
    lp_enc = cur.u8()
    lpstart = func_start
    if lp_enc != OMIT:
        lpstart, ind = cur.ptr(lp_enc, func=func_start)
        if ind:
            raise CfiError(f"LSDA at {addr:#x}: indirect LPStart")
    else:
        lp_enc = func_enc
    ttype_enc = cur.u8()
    ttype_base = None
    if ttype_enc != OMIT:
        off = cur.uleb()
        ttype_base = cur.addr + off
    cs_enc = cur.u8()
    if cs_enc == OMIT or cs_enc & 0xF0:
        raise CfiError(f"LSDA at {addr:#x}: call-site encoding {cs_enc:#x}")
    n = cur.uleb()
    cur.need(n)
    table_end = cur.pos + n
    sites, prev = [], None
    while cur.pos < table_end:
        start, _ = cur.ptr(cs_enc)
        length, _ = cur.ptr(cs_enc)
        lp, _ = cur.ptr(cs_enc)
        action = cur.uleb()
        s = CallSite(func_start + start, func_start + start + length,
                     lpstart + lp if lp else 0, action)
        if prev is not None and s.start < prev.end or s.end < s.start:
            raise CfiError(f"LSDA at {addr:#x}: call sites out of order")
        if length:
            sites.append(s)
            prev = s
    if cur.pos != table_end:
        raise CfiError(f"LSDA at {addr:#x}: call-site table overruns its length")
    # Action records reachable from the call sites (each visited once: no cycles).
    actions_at = cur.addr
    seen, todo, extent, filters = set(), {s.action - 1 for s in sites if s.action}, 0, set()
    while todo:
        off = todo.pop()
        if off in seen:
            continue
        seen.add(off)
        if off < 0:
            raise CfiError(f"LSDA at {addr:#x}: action record before the table")
        rec = image.cursor(actions_at + off)
        filters.add(rec.sleb())
        disp_addr = rec.addr
        disp = rec.sleb()
        extent = max(extent, rec.addr - actions_at)
        if disp:
            todo.add(disp_addr + disp - actions_at)
    actions = image.cursor(actions_at).bytes(extent) if extent else b""
    ntypes = max([f for f in filters if f > 0], default=0)
    specs, types = b"", []
    if filters - {0} and ttype_base is None:
        raise CfiError(f"LSDA at {addr:#x}: type filters without a type table")
    spec_end, scanned = 0, set()          # lists can share tails: scan each byte once
    for f in filters:
        if f < 0:
            sc = image.cursor(ttype_base + (-f - 1))
            while sc.addr - ttype_base not in scanned:
                scanned.add(sc.addr - ttype_base)
                idx = sc.uleb()
                ntypes = max(ntypes, idx)
                if idx == 0:
                    break
            spec_end = max(spec_end, sc.addr - ttype_base)
    if spec_end:
        specs = image.cursor(ttype_base).bytes(spec_end)
    if ntypes:
        fmt = ttype_enc & 0x0F
        size = {0: 8, 2: 2, 3: 4, 4: 8, 0x0A: 2, 0x0B: 4, 0x0C: 8}.get(fmt)
        if size is None:
            raise CfiError(f"LSDA at {addr:#x}: type table encoding {ttype_enc:#x}")
        if ntypes * size > ttype_base - actions_at:
            raise CfiError(f"LSDA at {addr:#x}: type table overlaps the action table")
        for i in range(1, ntypes + 1):
            types.append(image.cursor(ttype_base - i * size).ptr(ttype_enc, func=func_start)[0])
    return Lsda(addr, lp_enc, tuple(sites), actions, ttype_enc,
                tuple((v, ttype_enc) for v in types), specs)


def map_call_sites(lsda: Lsda, run) -> list[tuple[int, int, int, int]]:
    """The call sites of a contiguous run of a copy (items ``(new_lo, new_hi, orig,
    glue)``): (new_start, new_end, original landing pad, action), sorted and merged."""
    out: list[list[int]] = []
    for lo, hi, orig, glue in run:
        if glue:
            s = lsda.site_at(orig)
            parts = [(lo, hi, s)] if s else []
        else:
            parts = [(lo + max(s.start, orig) - orig, lo + min(s.end, orig + hi - lo) - orig, s)
                     for s in lsda.call_sites if s.start < orig + hi - lo and s.end > orig]
        for a, b, s in parts:
            if out and out[-1][1] == a and out[-1][2:] == [s.landing_pad, s.action]:
                out[-1][1] = b
            else:
                out.append([a, b, s.landing_pad, s.action])
    return [tuple(x) for x in out]


def build_lsda(lsda: Lsda, sites, region_start: int, runtime) -> bytes:
    """An LSDA for a copy's region starting at ``region_start`` with call ``sites`` from
    :func:`map_call_sites`; ``runtime(value, encoding, name)`` turns an original's
    link-time address into a run-time one (or raises CfiError)."""
    cs = bytearray()
    for a, b, lp, action in sites:
        lp_rt = runtime(lp, lsda.lp_enc, "landing pad") if lp else 0
        cs += uleb(a - region_start) + uleb(b - a) + uleb(lp_rt) + uleb(action)
    types = b"".join(struct.pack("<Q", runtime(v, enc, "type-table entry"))
                     for v, enc in reversed(lsda.types))
    cs_part = uleb(len(cs)) + bytes(cs) + lsda.actions
    out = bytearray([ABSPTR]) + bytes(8)                  # LPStart = 0: absolute pads
    if lsda.types or lsda.specs:
        enc = ABSPTR | (lsda.ttype_enc & INDIRECT)
        body = bytes([ULEB]) + cs_part + types
        # TType offset counts from the end of its own uleb to the TType base.
        out += bytes([enc]) + uleb(len(body)) + body + lsda.specs
    else:
        out += bytes([OMIT, ULEB]) + cs_part
    return bytes(out)
