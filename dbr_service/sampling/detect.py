"""What sampling the host offers, and which source dbr should use (``dbr ctl status``).

Each probe opens (never enables) an event on the calling thread or looks at sysfs; none
of them needs a client.  The order of :data:`PREFERENCE` is the order of quality: IBS op
gives IP plus branch and load information with no skid, LBR gives taken-branch stacks,
precise cycles less skid than the software clock, and the agent timer works everywhere
the agent runs.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field

from dbr_service.common.errors import SamplingError
from dbr_service.sampling import branchperf, perf
from dbr_service.sampling.agent_timer import AgentTimerSource, StartFn, StopFn
from dbr_service.sampling.base import SamplingSource

#: Source names from best to worst.  Live sources: lbr (branch stacks on taken
#: branches, sampling/branchperf.py), perf-cycles, perf-cpu-clock and agent-timer;
#: ibs-op is parsed from recorded streams only.
PREFERENCE = ("ibs-op", "lbr", "perf-cycles", "perf-cpu-clock", "agent-timer")
LIVE_SOURCES = frozenset({"lbr", "perf-cycles", "perf-cpu-clock", "agent-timer"})

IBS_OP_SYSFS = "/sys/bus/event_source/devices/ibs_op"
CPU_PMU_SYSFS = "/sys/bus/event_source/devices/cpu"


@dataclass(slots=True)
class Capability:
    """One sampling facility: whether it works here and why (not)."""

    name: str
    available: bool
    reason: str


@dataclass(slots=True)
class SamplingReport:
    """Everything detect() found."""

    #: /proc/sys/kernel/perf_event_paranoid (None: no perf in this kernel).
    perf_event_paranoid: int | None
    #: Whether we run with CAP_PERFMON/CAP_SYS_ADMIN-equivalent privileges (euid 0).
    privileged: bool
    capabilities: dict[str, Capability] = field(default_factory=dict)
    #: Best facility the host offers (may be one dbr only replays from recordings).
    best_offered: str = "agent-timer"
    #: Best source dbr can sample with live on this host.
    best: str = "agent-timer"
    #: Branch records: whether the host gives them, the event and filter that open.
    branch_records: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def probe_ibs_op() -> Capability:
    """AMD IBS op: the PMU must be registered in sysfs and accept a sampling event."""
    try:
        with open(os.path.join(IBS_OP_SYSFS, "type")) as f:
            pmu_type = int(f.read())
    except (OSError, ValueError):
        return Capability("ibs-op", False, f"no {IBS_OP_SYSFS} (not an AMD host with IBS)")
    spec = perf.PerfEventSpec("ibs_op", pmu_type, 0, False)
    ok, reason = perf.probe_event(spec)
    return Capability("ibs-op", ok, reason)


def probe_lbr() -> tuple[Capability, branchperf.BranchEvent | None]:
    """Branch stacks (Intel LBR, AMD BRS/LbrExtV2): a taken-branch event with user branch
    stacks opens (sampling/branchperf.py)."""
    flags = _cpu_flags()
    hint = ", ".join(sorted(flags & {"arch_lbr", "brs", "amd_lbr_v2"})) or "no lbr cpu flag"
    branches = os.path.join(CPU_PMU_SYSFS, "caps", "branches")
    if os.path.exists(branches):
        with open(branches) as f:
            hint += f", caps/branches={f.read().strip()}"
    event, reason = branchperf.probe_branch_event()
    return Capability("lbr", event is not None, f"{reason} ({hint})"), event


def detect() -> SamplingReport:
    """Probe every facility and pick the best offered and the best usable source."""
    report = SamplingReport(perf_event_paranoid=perf.read_paranoid(),
                            privileged=os.geteuid() == 0)
    caps = report.capabilities
    ok, reason = perf.PerfSource.available("cpu-clock")
    caps["perf-cpu-clock"] = Capability("perf-cpu-clock", ok, reason)
    ok, reason = perf.PerfSource.available("cycles")
    caps["perf-cycles"] = Capability("perf-cycles", ok, reason)
    caps["ibs-op"] = probe_ibs_op()
    caps["lbr"], event = probe_lbr()
    report.branch_records = {"available": event is not None, "reason": caps["lbr"].reason,
                             **(event.to_json() if event is not None else {})}
    caps["agent-timer"] = Capability("agent-timer", True,
                                     "agent timer: needs the dbr agent in the client")
    offered = [n for n in PREFERENCE if caps[n].available]
    report.best_offered = offered[0]
    report.best = next(n for n in offered if n in LIVE_SOURCES)
    return report


def make_source(name: str, sample_period_us: int = 1000,
                agent_start: StartFn | None = None, agent_stop: StopFn | None = None,
                ring_entries: int = 4096) -> SamplingSource:
    """A live source by its detect() name (``report.best``); the agent timer needs the
    session's start/stop callables."""
    if name in ("perf-cpu-clock", "perf-cycles"):
        return perf.PerfSource(name.removeprefix("perf-"), sample_period_us)
    if name == "lbr":
        event, reason = branchperf.probe_branch_event()
        if event is None:
            raise SamplingError(f"no branch stacks here: {reason}")
        return branchperf.make_branch_source(event, sample_period_us)
    if name == "agent-timer":
        if agent_start is None or agent_stop is None:
            raise SamplingError("agent-timer source needs the agent's start/stop callables")
        return AgentTimerSource(agent_start, agent_stop, sample_period_us, ring_entries)
    raise SamplingError(f"no live sampling source named {name!r} "
                        f"(live: {', '.join(sorted(LIVE_SOURCES))})")
