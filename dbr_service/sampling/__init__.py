"""Sampling sources, one module each, behind base.SamplingSource.

perf.py (perf_event: cpu-clock everywhere, cycles on a PMU; its kernel ABI in
perf_abi.py; branch stacks on taken branches in branchperf.py), agent_timer.py (the
agent's timer ring), recorded.py (replayed JSON-lines streams: IBS, LBR), detect.py
(what the host offers, ``make_source``), aggregate.py (counts by client and IP),
lbr.py (edge profiles from branch stacks) and fulltrace.py (their not-taken edges):
docs/architecture.md, "Branch-trace edge profiles".
"""
