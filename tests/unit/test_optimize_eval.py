"""The evaluator's cold rule: a region is taken out as cold only after ``cold_s``
seconds without samples, so a program that alternates phases keeps both phases'
regions; samples in either its copy or its original code keep it warm."""

from __future__ import annotations

from dbr_service.installation.install import InstallState
from dbr_service.installation.optimize import EvalPolicy, Evaluator


class Reg:
    def __init__(self, rid: int, lo: int, installed_at: float = 0.0) -> None:
        self.region_id, self.state, self.installed_at = rid, InstallState.INSTALLED, installed_at
        self.orig_ranges = [(lo, lo + 0x100)]
        self.code = (lo + 0x10000, lo + 0x10100)
        self.kept = False

    def contains_code(self, ip: int) -> bool:
        return self.code[0] <= ip < self.code[1]


class Inst:
    def __init__(self, *regs: Reg) -> None:
        self.regions = {r.region_id: r for r in regs}


def test_alternating_phases_keep_both_regions():
    a, b = Reg(1, 0x1000), Reg(2, 0x2000)
    ev = Evaluator(Inst(a, b), EvalPolicy(grace_s=0, cold_s=60.0))
    t = 0.0
    for phase in range(6):                     # 20 s phases, A then B, in turn
        hot = a if phase % 2 == 0 else b
        for _ in range(100):
            t += 0.2
            ev.snapshot({hot.code[0]: 30}, now=t)
            assert ev.verdicts(now=t) == [], (phase, t)


def test_a_region_cold_for_cold_s_is_taken_out_and_original_samples_keep_it_warm():
    a, b = Reg(1, 0x1000), Reg(2, 0x2000)
    ev = Evaluator(Inst(a, b), EvalPolicy(grace_s=0, cold_s=60.0, min_samples=10**9))
    ev.snapshot({a.code[0]: 5, 0x2010: 5}, now=1.0)     # b's samples in its original code
    assert ev.verdicts(now=60.5) == []
    ev.snapshot({}, now=61.5)
    assert [(r.region_id, why) for r, why in ev.verdicts(now=61.5)] == [(1, "cold"), (2, "cold")]


def test_a_region_never_sampled_is_cold_cold_s_after_installation():
    r = Reg(1, 0x1000, installed_at=100.0)
    ev = Evaluator(Inst(r), EvalPolicy(grace_s=0, cold_s=30.0))
    ev.snapshot({}, now=120.0)
    assert ev.verdicts(now=129.9) == []
    assert [why for _, why in ev.verdicts(now=130.0)] == ["cold"]


def test_a_kept_region_is_never_judged():
    """A probe's trampoline (kept) is neither cold nor not effective, and its samples
    are nobody's."""
    r, probe = Reg(1, 0x1000, installed_at=100.0), Reg(2, 0x1000, installed_at=100.0)
    probe.kept = True
    ev = Evaluator(Inst(probe, r), EvalPolicy(grace_s=0, cold_s=30.0))
    health = ev.snapshot({0x1010: 5}, now=120.0)
    assert [(h.region.region_id, h.in_original) for h in health] == [(1, 5)]
    assert [reg.region_id for reg, _ in ev.verdicts(now=200.0)] == [1]
