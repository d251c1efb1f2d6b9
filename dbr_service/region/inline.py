"""INLINE-HOT-CALLS (patent fig. 6, docs/architecture.md): clone hot callees into their
call sites.

A call is inlined, its call instruction becoming a pseudo-instruction that pushes
the *original* return address and falls into a private clone of the callee; or
it is kept as a *real call* (opt-in, ``real_calls``, see below); or the call
block is removed and its predecessors exit to original code at the call.

A call site (block ending in ``call``/indirect call, in any SR) is inlined when:

1. it is hot: its block count >= ``hot_threshold``;
2. its target is known and the target address is a block of some SR (the
   callee's entry);
3. the callee (blocks reachable from its entry) has a path to one of its own
   ``ret`` blocks;
4. the callee has no remaining hot call site: a hot call in it must have been
   inlined first (bottom-up); a callee whose hot call was rejected is never
   inlined, and call sites that wait on each other (recursion) are rejected;
   direct recursion (the call block is in its own callee) is rejected at once;
   a call that never returns (``__cxa_throw``, ``abort``: discovery gave it no
   fall-through) is no hot call here: it exits to original code, where nothing
   comes back to the clone anyway;
5. the caller SR's code growth stays within its budget:
   ``max(inline_min_budget_bytes, inline_budget * body bytes before inlining)``,
   i.e. ``inline_budget`` is a *ratio* (1.0 lets a region double).

Hot sites are decided hottest first, so the budget goes to the hottest calls.
An indirect call with several known targets inlines every eligible target and
becomes a compare cascade; when some target is not inlined (or unknown targets
are possible) the cascade's miss exits to the call instruction itself, which
then runs in original code.

Clones: node key ``CloneKey(path, start)`` where ``path`` is the call-site chain
(call instruction addresses, outermost first); ``clone_of`` = original address;
unpatchable.  Counts are scaled by ``call count / callee entry count`` (at most
1) and subtracted from the originals.  A clone's ``ret`` becomes a RETURN edge to
the continuation block (the call's fall-through address) if that block is in the
caller's SR, else an exit edge to the continuation address.

Decisions go to ``sr.info["inline"]``: ``{"budget": bytes, "growth": bytes,
"sites": {call block key: {...}}}`` where an inlined site records ``call_insn``,
``kind`` ("direct" or "cascade"), ``targets`` {callee address: clone entry key},
``return_address`` (what the pseudo-instruction pushes), ``continuation``,
``fallback_exit`` (cascade miss target or None) and ``bytes``; a site not
inlined records ``decision`` "exit" and ``reason``.

Real calls (``real_calls=True``): a call block that is not inlined stays in its
SR, to be emitted as ``call rel32`` to the original callee whose ``ret`` comes
back into the buffer, when :func:`real_call_refusal` finds nothing against it:

* a direct call (an indirect one: see promotion below);
* with one known callee and a fall-through (a call that never returns exits);
* not a call to the next instruction (``call 1f; 1: pop``: reads its own address);
* the callee lies in the same module as the call (memory view's module of both
  known and equal), because code of other modules may judge its caller by the
  return address (``dlsym(RTLD_NEXT)``, ``dlopen``, ``dladdr``);
* the callee's first instruction, after an ``endbr64``, is no ``[bnd] jmp
  [rip+d]`` (a PLT stub: an external function reached through the GOT) and no
  direct ``jmp`` into another module.

The kept block keeps its fall-through edge to the continuation (so a loop
calling a function stays whole; the continuation needs no entry) and its exit
edge to the callee, marked ``call=callee``; if the continuation is not in the
SR it gets an exit edge to it.  Its site records ``decision`` "call",
``callee``, ``return_address``, ``continuation`` and ``reason`` (why it was not
inlined); a site refused records ``real_call`` = the refusal as well.

Indirect-call promotion (``real_calls``, at most ``icp_targets`` targets a site): an
indirect call block that is not inlined stays in its SR when :func:`promotion` finds
targets to promote: the call returns (a fall-through), its operand is a register or a
memory operand not using ``rsp`` (codegen/calls.py), and among its known targets
(discovery's ``targets``: sampled, jump-table or call-table inference, a believed
literal) some pass :func:`callee_refusal`, the direct call's rules per target.  Those
are promoted, hottest first (the call's exit count per target, then the target's own
entry count), up to ``icp_targets``; the others go to the miss path.  Code generation
emits a compare and a direct real call per promoted target and, on a miss, an exit to
the call instruction itself (codegen/calls.py): any other target, known or not, runs
as before in original code.  The kept block keeps its fall-through edge to the
continuation (or gets an exit to it); its exit edge holds the promoted targets and the
call instruction (the miss), marked ``promoted``.  Its site records ``decision``
"promoted", ``targets`` (promoted, hottest first), ``refused`` {target: why not
promoted, "too-many-targets" included}, ``return_address``, ``continuation``,
``fallback_exit`` (the call instruction) and ``reason``; a site refused records
``real_call`` = why (and ``refused`` per target when it had targets).  Counters:
``icp-sites-promoted``, ``icp-targets-promoted``, ``icp-target-refused-<why>``,
``icp-refused-<why>`` (sites).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Any, Callable

import networkx as nx

from dbr_service.codegen.calls import MAX_PROMOTED, icall_insn
from dbr_service.codegen.relocate import CannotRelocate, Relocator
from dbr_service.common.errors import MemoryViewError
from dbr_service.region.loops import body_bytes, sorted_nodes
from dbr_service.region.model import (END, START, BasicBlock, CloneKey, EdgeKind, NodeKey,
                                      SuperRegion, TermKind)
from dbr_service.region.partition import connect_terminals

CALL_TERMS = (TermKind.CALL, TermKind.ICALL)

Site = tuple[str, NodeKey]          # (sr.id, call block key)
OnError = Callable[[SuperRegion, BaseException], None]


def is_call_block(bb: BasicBlock) -> bool:
    return bb.term in CALL_TERMS


class _Inliner:
    def __init__(self, regions: list[SuperRegion], hot_threshold: float, budget_ratio: float,
                 min_budget_bytes: int, counters: Counter) -> None:
        self.regions = regions
        self.by_id = {sr.id: sr for sr in regions}
        self.thr = hot_threshold
        self.counters = counters
        # Where each original block lives: callee entries are looked up here.
        self.home: dict[int, SuperRegion] = {}
        for sr in regions:
            for k, _ in sr.blocks():
                if isinstance(k, int):
                    self.home.setdefault(k, sr)
            sr.info["inline"] = {
                "budget": max(float(min_budget_bytes), budget_ratio * body_bytes(sr)),
                "growth": 0, "sites": {}}
        #: pending / inlined / rejected, for hot call sites only.
        self.status: dict[Site, str] = {}
        for sr in regions:
            for k, bb in sr.blocks():
                if is_call_block(bb) and bb.count >= self.thr and not bb.never_returns:
                    self.status[(sr.id, k)] = "pending"

    # ---- queries -------------------------------------------------------------
    def routine(self, cs: SuperRegion, entry: int) -> set[NodeKey]:
        """The callee: blocks of ``cs`` reachable from ``entry`` along body edges."""
        body = cs.g.subgraph(cs.body_nodes())
        return {entry} | nx.descendants(body, entry)

    def _site_state(self, sr: SuperRegion, k: NodeKey) -> str:
        bb = sr.block(k)
        if not is_call_block(bb) or bb.count < self.thr or bb.never_returns:
            return "cold"
        return self.status.get((sr.id, k), "pending")

    def check_target(self, sr: SuperRegion, c: NodeKey, t: int) -> tuple[str, object]:
        """('ok', routine) | ('wait', waited sites) | ('no', reason)."""
        cs = self.home.get(t)
        if cs is None or t not in cs.g:
            return "no", "callee-not-in-region"
        R = self.routine(cs, t)
        if cs is sr and c in R:
            return "no", "recursive"
        if not any(isinstance(n, int) and cs.block(n).term == TermKind.RET for n in R):
            return "no", "no-return"
        waits = set()
        for n in R:
            st = self._site_state(cs, n)
            if st == "rejected":
                return "no", "callee-has-hot-calls"
            if st == "pending":
                waits.add((cs.id, n))
        if waits:
            return "wait", waits
        return "ok", R

    # ---- the driver ------------------------------------------------------------
    def run(self, on_error: OnError) -> None:
        while True:
            pending = [s for s, st in self.status.items() if st == "pending"]
            if not pending:
                return
            pending.sort(key=lambda s: -self.by_id[s[0]].block(s[1]).count)
            waits: dict[Site, set[Site]] = {}
            progress = False
            for site in pending:
                if self.status[site] != "pending":
                    continue
                sr = self.by_id[site[0]]
                try:
                    w = self.decide(sr, site[1])
                except Exception as exc:  # isolate: the SR fails, the others go on
                    self.status[site] = "rejected"
                    on_error(sr, exc)
                    progress = True
                    continue
                if w is None:
                    progress = True
                else:
                    waits[site] = w
            if not progress:
                self._reject_cycles(waits)

    def _reject_cycles(self, waits: dict[Site, set[Site]]) -> None:
        """No site could be decided: those waiting on each other are recursion."""
        wg = nx.DiGraph()
        for s, ws in waits.items():
            wg.add_node(s)
            wg.add_edges_from((s, w) for w in ws)
        cyc = [s for comp in nx.strongly_connected_components(wg)
               for s in comp if len(comp) > 1 or wg.has_edge(s, s)]
        if not cyc:  # cannot happen: every wait chain ends in a cycle
            cyc = list(waits)
        for s in cyc:
            self._reject(self.by_id[s[0]], s[1], "recursive")

    def _reject(self, sr: SuperRegion, c: NodeKey, reason: str) -> None:
        self.status[(sr.id, c)] = "rejected"
        self.counters[f"rejected-{reason}"] += 1
        bb = sr.block(c)
        sr.info["inline"]["sites"][c] = {
            "call_insn": bb.last_insn[0], "decision": "exit", "reason": reason,
            "targets": list(bb.targets)}

    def decide(self, sr: SuperRegion, c: NodeKey) -> set[Site] | None:
        """Inline or reject ``c``; return the sites it waits on instead, if any."""
        bb = sr.block(c)
        if not bb.targets:
            self._reject(sr, c, "unknown-target")
            return None
        ok: dict[int, set[NodeKey]] = {}
        waits: set[Site] = set()
        reasons = []
        for t in bb.targets:
            verdict, what = self.check_target(sr, c, t)
            if verdict == "ok":
                ok[t] = what
            elif verdict == "wait":
                waits |= what
            else:
                reasons.append(what)
        if waits:
            return waits
        if not ok:
            self._reject(sr, c, reasons[0])
            return None
        info = sr.info["inline"]
        size = sum(self.home[t].block(n).size for t, R in ok.items() for n in R)
        if info["growth"] + size > info["budget"]:
            self._reject(sr, c, "budget")
            return None
        self.inline(sr, c, ok, size)
        return None

    # ---- the transformation ------------------------------------------------------
    def inline(self, sr: SuperRegion, c: NodeKey, ok: dict[int, set[NodeKey]], size: int) -> None:
        bb = sr.block(c)
        call_insn = bb.last_insn[0]
        path = (c.path if isinstance(c, CloneKey) else ()) + (call_insn,)
        cont = self._continuation(sr, c, bb)
        exit_d = sr.g.edges[c, END] if sr.g.has_edge(c, END) else {"exits": {}, "count": 0.0}
        total = bb.count
        clone_entries = {}
        for t, R in ok.items():
            per_target = exit_d["exits"].get(t) if len(bb.targets) > 1 else None
            call_count = per_target if per_target is not None else total / len(bb.targets)
            clone_entries[t] = self._clone(sr, c, path, self.home[t], t, R, call_count, cont, bb)
        leftover = set(bb.targets) - set(ok)
        fallback = call_insn if (leftover or bb.unknown_target) else None
        rest = sum(cnt for tgt, cnt in exit_d["exits"].items() if tgt not in ok)
        if sr.g.has_edge(c, END):
            sr.g.remove_edge(c, END)
        if fallback is not None:
            sr.add_edge(c, END, EdgeKind.EXIT, rest, target=fallback)
        for v in list(sr.g.successors(c)):
            if v != END and sr.g.edges[c, v]["kind"] == EdgeKind.FALLTHROUGH:
                sr.g.remove_edge(c, v)
        self.status[(sr.id, c)] = "inlined"
        sr.info["inline"]["growth"] += size
        sr.info["inline"]["sites"][c] = {
            "call_insn": call_insn, "decision": "inlined",
            "kind": "cascade" if (len(bb.targets) > 1 or bb.term == TermKind.ICALL) else "direct",
            "targets": clone_entries, "return_address": bb.fallthrough, "continuation": cont,
            "fallback_exit": fallback, "bytes": size}
        self.counters["inlined"] += 1
        self.counters["inlined-bytes"] += size

    @staticmethod
    def _continuation(sr: SuperRegion, c: NodeKey, bb: BasicBlock) -> NodeKey | None:
        if bb.fallthrough is None:
            return None
        key: NodeKey = (CloneKey(c.path, bb.fallthrough) if isinstance(c, CloneKey)
                        else bb.fallthrough)
        return key if key in sr.g else None

    def _clone(self, sr: SuperRegion, c: NodeKey, path: tuple[int, ...], cs: SuperRegion,
               t: int, R: set[NodeKey], call_count: float, cont: NodeKey | None,
               call_bb: BasicBlock) -> CloneKey:
        def ck(n: NodeKey) -> CloneKey:
            if isinstance(n, CloneKey):
                return CloneKey(path + n.path, n.start)
            return CloneKey(path, n)

        entry_count = cs.block(t).count
        f = min(1.0, call_count / entry_count) if entry_count > 0 else 0.0
        snapshot = {n: cs.block(n) for n in R}
        out_edges = [(u, v, dict(d)) for u in sorted_nodes(R)
                     for _, v, d in cs.g.out_edges(u, data=True)]
        for n in sorted_nodes(R):
            obb = snapshot[n]
            key = ck(n)
            dc, ds = obb.count * f, obb.samples * f
            if key in sr.g:  # shared by two targets of one indirect call
                sr.block(key).count += dc
                sr.block(key).samples += ds
            else:
                sr.add_block(replace(obb, insns=list(obb.insns), targets=list(obb.targets),
                                     count=dc, samples=ds, clone_of=obb.start,
                                     unpatchable=True, unpatchable_why="inlined clone"), key)
            obb.count = max(0.0, obb.count - dc)
            obb.samples = max(0.0, obb.samples - ds)
            if self.status.get((cs.id, n)) == "inlined":
                # A call the callee already inlined stays inlined in the clone.
                self.status[(sr.id, key)] = "inlined"
                old = cs.info["inline"]["sites"][n]
                sr.info["inline"]["sites"][key] = dict(
                    old, targets={a: ck(e) for a, e in old["targets"].items()},
                    continuation=None if old["continuation"] is None else ck(old["continuation"]))
        for u, v, d in out_edges:
            if v not in R and v != END:
                continue
            dc = d["count"] * f
            if v == END and isinstance(u, int) and snapshot[u].term == TermKind.RET:
                if cont is not None:
                    sr.add_edge(ck(u), cont, EdgeKind.RETURN, dc)
                elif call_bb.fallthrough is not None:
                    sr.add_edge(ck(u), END, EdgeKind.EXIT, dc, target=call_bb.fallthrough)
                self._scale_original(cs, u, v, f)
                continue
            if v == END:
                for tgt, cnt in d["exits"].items():
                    sr.add_edge(ck(u), END, EdgeKind.EXIT, cnt * f, target=tgt)
            else:
                sr.add_edge(ck(u), ck(v), d["kind"], dc)
            self._scale_original(cs, u, v, f)
        sr.add_edge(c, ck(t), EdgeKind.CALL, call_count)
        if cs.g.has_edge(START, t):  # these calls no longer enter the original callee
            d = cs.g.edges[START, t]
            d["count"] = max(0.0, d["count"] - call_count)
        self.counters["cloned-blocks"] += len(R)
        return ck(t)

    @staticmethod
    def _scale_original(cs: SuperRegion, u: NodeKey, v: NodeKey, f: float) -> None:
        if not cs.g.has_edge(u, v):
            return
        d = cs.g.edges[u, v]
        d["count"] = max(0.0, d["count"] * (1.0 - f))
        if v == END:
            for tgt in d["exits"]:
                d["exits"][tgt] = max(0.0, d["exits"][tgt] * (1.0 - f))


ENDBR64 = bytes.fromhex("f30f1efa")


def real_call_refusal(bb: BasicBlock, mem: Any,
                      patched: Callable[[int], bool] | None = None) -> str | None:
    """None when call block ``bb`` may stay a real call (module docstring), else why
    not.  ``mem`` is the client's memory view (None: nothing can be checked);
    ``patched(addr)`` tells whether a byte belongs to an installed patch."""
    if bb.term != TermKind.CALL:
        return "indirect"
    if bb.fallthrough is None:
        return "never-returns"
    if len(bb.targets) != 1 or bb.unknown_target:
        return "unknown-target"
    return callee_refusal(bb, bb.targets[0], mem, patched)


def callee_refusal(bb: BasicBlock, callee: int, mem: Any,
                   patched: Callable[[int], bool] | None = None) -> str | None:
    """None when call block ``bb`` may call ``callee`` from the buffer (same module, no
    PLT stub, no thunk into another module, no call to the next instruction)."""
    if callee == bb.fallthrough:
        return "reads-return-address"
    if mem is None:
        return "no-memory-view"
    here = bb.module or mem.module_of(bb.last_insn[0])
    there = mem.module_of(callee)
    if here is None or there is None:
        return "unknown-module"
    if here != there:
        return "other-module"
    try:
        head = mem.read(callee, mem.readable_extent(callee, 16))
    except (MemoryViewError, OSError):
        head = b""
    if not head:
        return "callee-unreadable"
    if any(mem.is_excluded(a) or (patched is not None and patched(a))
           for a in range(callee, callee + min(len(head), 5))):
        return None         # another region's patch site: loop code, never a PLT stub
    if head.startswith(ENDBR64):
        head, callee = head[4:], callee + 4
    if head.startswith(b"\xf2"):                     # bnd (MPX-era PLTs)
        head, callee = head[1:], callee + 1
    if head[:2] == b"\xff\x25":
        return "plt-stub"
    dst = None
    if head[:1] == b"\xe9" and len(head) >= 5:
        dst = callee + 5 + int.from_bytes(head[1:5], "little", signed=True)
    elif head[:1] == b"\xeb" and len(head) >= 2:
        dst = callee + 2 + int.from_bytes(head[1:2], "little", signed=True)
    if dst is not None and mem.module_of(dst) != here:
        return "other-module"                      # a thunk into another module
    return None


_RELOC: Relocator | None = None


def promotion(bb: BasicBlock, mem: Any, patched: Callable[[int], bool] | None = None, *,
              exits: dict[int, float] | None = None, max_targets: int = MAX_PROMOTED,
              weight: Callable[[int], float] | None = None
              ) -> tuple[list[int], dict[int, str], str | None]:
    """Indirect-call promotion of call block ``bb`` (module docstring): (the promoted
    targets, hottest first by ``exits`` = the call's count per target, then by
    ``weight(target)``; each target not promoted -> why; why the site is refused, or
    None)."""
    global _RELOC
    if bb.term != TermKind.ICALL:
        return [], {}, "not-indirect"
    if bb.fallthrough is None:
        return [], {}, "never-returns"
    max_targets = min(max_targets, MAX_PROMOTED)
    if max_targets <= 0:
        return [], {}, "indirect"
    a, n = bb.last_insn
    _RELOC = _RELOC or Relocator()
    try:
        icall_insn(_RELOC, bb.data[a - bb.start:a - bb.start + n], a)
    except CannotRelocate as e:
        return [], {}, str(e)
    if not bb.targets:
        return [], {}, "unknown-target"
    refused: dict[int, str] = {}
    ok = []
    for t in dict.fromkeys(bb.targets):
        why = callee_refusal(bb, t, mem, patched)
        if why is None:
            ok.append(t)
        else:
            refused[t] = why
    if not ok:
        return [], refused, next(iter(refused.values()))
    exits, weight = exits or {}, weight or (lambda _t: 0.0)
    ok.sort(key=lambda t: (-exits.get(t, 0.0), -weight(t)))      # stable: discovery's order
    refused.update((t, "too-many-targets") for t in ok[max_targets:])
    return ok[:max_targets], refused, None


def _keep_promoted(sr: SuperRegion, c: NodeKey, bb: BasicBlock, targets: list[int],
                   refused: dict[int, str], sites: dict, counters: Counter) -> None:
    """Keep indirect call block ``c`` with ``targets`` promoted (module docstring)."""
    call_insn = bb.last_insn[0]
    exits = dict(sr.g.edges[c, END]["exits"]) if sr.g.has_edge(c, END) else {}
    if sr.g.has_edge(c, END):
        sr.g.remove_edge(c, END)
    share = bb.count / len(bb.targets)        # when discovery gave the calls no counts
    for t in targets:
        sr.add_edge(c, END, EdgeKind.EXIT, exits.get(t, share), target=t)
    rest = sum(cnt for t, cnt in exits.items() if t not in targets)
    sr.add_edge(c, END, EdgeKind.EXIT, rest, target=call_insn)       # the miss
    sr.g.edges[c, END]["promoted"] = list(targets)
    cont = _Inliner._continuation(sr, c, bb)
    if cont is None:
        sr.add_edge(c, END, EdgeKind.EXIT, bb.count, target=bb.fallthrough)
    prev = sites.get(c, {})
    sites[c] = {"call_insn": call_insn, "decision": "promoted", "targets": list(targets),
                "refused": dict(refused), "return_address": bb.fallthrough,
                "continuation": cont, "fallback_exit": call_insn,
                "reason": prev.get("reason", "cold")}
    counters["icp-sites-promoted"] += 1
    counters["icp-targets-promoted"] += len(targets)
    for why in refused.values():
        counters[f"icp-target-refused-{why}"] += 1


def _keep_real_call(sr: SuperRegion, c: NodeKey, bb: BasicBlock, sites: dict,
                    counters: Counter) -> None:
    """Keep call block ``c`` as a real call (module docstring)."""
    callee = bb.targets[0]
    if not (sr.g.has_edge(c, END) and callee in sr.g.edges[c, END]["exits"]):
        sr.add_edge(c, END, EdgeKind.EXIT, bb.count, target=callee)
    sr.g.edges[c, END]["call"] = callee
    cont = _Inliner._continuation(sr, c, bb)
    if cont is None:
        sr.add_edge(c, END, EdgeKind.EXIT, bb.count, target=bb.fallthrough)
    prev = sites.get(c, {})
    sites[c] = {"call_insn": bb.last_insn[0], "decision": "call", "callee": callee,
                "return_address": bb.fallthrough, "continuation": cont,
                "reason": prev.get("reason", "cold"), "targets": [callee]}
    counters["real-calls-kept"] += 1


def remove_call_blocks(sr: SuperRegion, inlined: set[NodeKey],
                       counters: Counter | None = None, *, real_calls: bool = False,
                       mem: Any = None, patched: Callable[[int], bool] | None = None,
                       icp_targets: int = MAX_PROMOTED,
                       weight: Callable[[int], float] | None = None) -> None:
    """Remove every call block not in ``inlined``: its predecessors exit to the call
    instruction's block in original code; CONNECT-TERMINALS then enters at the
    continuation (or wherever the SR lost its way in).  With ``real_calls``, a call
    block :func:`real_call_refusal` accepts (``mem``: the client's memory view,
    ``patched``: installed patch bytes) stays instead, as a real call, and so does an
    indirect one with up to ``icp_targets`` targets :func:`promotion` promotes
    (``weight(target)``: how often it runs, to order targets without call counts)."""
    counters = counters if counters is not None else Counter()
    conts: Counter = Counter()
    sites = sr.info.setdefault("inline", {"budget": 0, "growth": 0, "sites": {}})["sites"]
    for c in sorted_nodes(sr.body_nodes()):
        bb = sr.block(c)
        if not is_call_block(bb) or c in inlined:
            continue
        refused, not_promoted = None, {}
        if real_calls and bb.term is TermKind.ICALL:
            exits = sr.g.edges[c, END]["exits"] if sr.g.has_edge(c, END) else {}
            promoted, not_promoted, refused = promotion(
                bb, mem, patched, exits=exits, max_targets=icp_targets, weight=weight)
            if refused is None:
                _keep_promoted(sr, c, bb, promoted, not_promoted, sites, counters)
                continue
        elif real_calls:
            refused = real_call_refusal(bb, mem, patched)
            if refused is None:
                _keep_real_call(sr, c, bb, sites, counters)
                continue
        for p in list(sr.g.predecessors(c)):
            if p != START:
                sr.add_edge(p, END, EdgeKind.EXIT, sr.g.edges[p, c]["count"], target=bb.start)
        for v in sr.g.successors(c):
            if v != END:
                conts[v] += sr.g.edges[c, v]["count"]
        sr.g.remove_node(c)
        site = sites.setdefault(c, {"call_insn": bb.last_insn[0], "decision": "exit",
                                    "reason": "never-returns" if bb.never_returns else "cold",
                                    "targets": list(bb.targets)})
        if refused is not None:
            site["real_call"] = refused
            icp = bb.term is TermKind.ICALL
            counters[f"{'icp' if icp else 'real-call'}-refused-{refused}"] += 1
            if not_promoted:
                site["refused"] = dict(not_promoted)
        counters["call-blocks-removed"] += 1
    connect_terminals(sr, prefer=conts, counters=counters)
    # Original code now runs each removed call and comes back at its continuation.
    for v, n in conts.items():
        if sr.g.has_edge(START, v):
            sr.g.edges[START, v]["count"] += n


def inline_hot_calls(regions: list[SuperRegion], *, hot_threshold: float, inline_budget: float,
                     inline_min_budget_bytes: int = 256, counters: Counter | None = None,
                     on_error: OnError | None = None, real_calls: bool = False,
                     mem: Any = None, patched: Callable[[int], bool] | None = None,
                     icp_targets: int = MAX_PROMOTED) -> None:
    """INLINE-HOT-CALLS over all SRs (callees may live in other SRs), then remove
    the call blocks left un-inlined (with ``real_calls``: keep those that may stay
    real calls, see :func:`remove_call_blocks`).  ``on_error(sr, exc)`` is told of a
    failure at one call site; the default re-raises."""
    counters = counters if counters is not None else Counter()

    def _raise(sr: SuperRegion, exc: BaseException) -> None:
        raise exc

    inl = _Inliner(regions, hot_threshold, inline_budget, inline_min_budget_bytes, counters)
    # a function's entry count (taken before inlining moves counts into clones)
    entry = {t: sr.block(t).count for t, sr in inl.home.items()}
    inl.run(on_error or _raise)
    for sr in regions:
        done = {k for (sid, k), st in inl.status.items() if sid == sr.id and st == "inlined"}
        try:
            remove_call_blocks(sr, done, counters, real_calls=real_calls, mem=mem,
                               patched=patched, icp_targets=icp_targets,
                               weight=lambda t: entry.get(t, 0.0))
        except Exception as exc:
            (on_error or _raise)(sr, exc)
