"""Sampling sources, one module each, behind base.SamplingSource.

perf.py (perf_event: cpu-clock everywhere, cycles on a PMU; its kernel ABI in
perf_abi.py), agent_timer.py (the agent's timer ring), recorded.py (replayed
JSON-lines streams: IBS, LBR), detect.py (what the host offers, ``make_source``),
aggregate.py (counts by client and IP), lbr.py (edge profiles from branch stacks:
docs/architecture.md, "Where the design comes from").
"""
