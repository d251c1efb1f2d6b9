"""Stored profiles of tests/agent_progs/warmwork.c's hot loop (mix), shared by the
warm-selection and kept-code tests."""

from __future__ import annotations

from harness import symbols

from dbr_service.profiles.modkey import module_key
from dbr_service.profiles.profiledata import EntrySite, HotRegion, ModuleProfile


def mix_profile(prog: str, counts: dict[int, float], params: dict) -> ModuleProfile:
    lo, hi = symbols(prog)["mix"]
    hot = [HotRegion([EntrySite(lo, b"\x90")], [(lo, hi)], dict(params))]
    return ModuleProfile(module_key(prog).key, prog, "", 1, 0.0, 0.0, counts, {}, hot)


def loop_insns(prog: str) -> list[int]:
    """File offsets of the instructions of mix's loop (its backward branch's target
    to that branch; in a PIE, offsets are addresses at base 0)."""
    import capstone

    lo, hi = symbols(prog)["mix"]
    with open(prog, "rb") as f:
        f.seek(lo)                      # the text segment's offsets are its addresses
        code = f.read(hi - lo)
    md = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    insns = [(i.address, i.mnemonic, i.op_str) for i in md.disasm(code, lo)]
    back = [(a, int(op, 16)) for a, m, op in insns
            if m.startswith("j") and m != "jmp" and op.startswith("0x") and int(op, 16) < a]
    assert back, insns
    src, dst = back[-1]
    return [a for a, _, _ in insns if dst <= a <= src]


def flat_counts(prog: str) -> dict[int, float]:
    """A whole run's counts where each instruction of mix's loop holds 0.4 % of the
    samples (under the default hot_threshold, 1 %, over --aggressive's 0.2 %): the
    rest on one instruction with no loop around it (_start's first)."""
    counts = {o: 4.0 for o in loop_insns(prog)}
    counts[symbols(prog)["_start"][0]] = 1000.0 - 4.0 * len(counts)
    return counts
