"""Sampling sources for a client: what the host offers, and the source a session opens
(perf, with the agent's timer for threads perf leaves out, or the agent's timer alone)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from dbr_service.wire import protocol as P

if TYPE_CHECKING:  # pragma: no cover
    from dbr_service.session.clients import ClientSession
    from dbr_service.common.config import Config

log = logging.getLogger("dbr.service")

#: Ring of a listed timer sampler (sampling/gated.py): it holds the samples of the few
#: threads perf leaves out, a window at most (16 bytes an entry, 64 KiB).
GATED_RING_ENTRIES = 4096


# --------------------------------------------------------------------------- sampling
def sampling_capabilities() -> dict[str, Any]:
    """What this host offers (sampling/detect.py), as JSON for `dbr ctl status`."""
    from dbr_service.sampling import detect

    try:
        return detect.detect().to_json()
    except Exception as exc:  # detection must not stop the service
        log.warning("sampling detection failed: %r", exc)
        return {"best": "agent-timer", "capabilities": {}, "error": repr(exc)}


def is_perf_kind(kind: str) -> bool:
    """Whether a source kind samples through perf_event (lbr: branch stacks)."""
    return kind.startswith("perf-") or kind == "lbr"


def choose_source(configured: str, caps: dict[str, Any]) -> str:
    """The live source to use: lbr | perf-cycles | perf-cpu-clock | agent-timer.  Branch
    stacks are used wherever the host gives them (detected at start)."""
    if configured == "agent-timer":
        return "agent-timer"
    best = caps.get("best", "agent-timer")
    if configured == "perf":
        return best if is_perf_kind(best) else "perf-cpu-clock"
    return best


def make_perf_source(session: ClientSession, cfg: Config, kind: str):
    """perf sampling of every thread of the client (threads added later via THREAD_NEW,
    which the agent sends from now until the window ends).  Threads that switch too
    often for a perf event get the agent's timer, where the agent offers a listed
    sampler (sampling/gated.py).  ``kind`` lbr: branch stacks on taken branches
    (sampling/branchperf.py); where they are refused the client gets the perf clock."""
    from dbr_service.common.errors import SamplingError

    if kind == "lbr":
        try:
            return _open_perf(session, cfg, kind)
        except SamplingError as exc:
            log.warning("pid %d: branch stacks refused (%s); using the perf clock",
                        session.pid, exc)
            session.forced_source = kind = "perf-cpu-clock"
    return _open_perf(session, cfg, kind)


def _open_perf(session: ClientSession, cfg: Config, kind: str):
    from dbr_service.common.errors import SamplingError
    from dbr_service.sampling.branchperf import host_branch_event, make_branch_source
    from dbr_service.sampling.gated import GatedTimerSource
    from dbr_service.sampling.perf import PerfSource

    session.thread_tracker.window_notices()

    pages = 64 if cfg.continuous_sampling else 16
    gate = session.thread_tracker.switch_gate
    if kind == "lbr":
        event = host_branch_event()
        if event is None:
            raise SamplingError("no branch stacks on this host")
        perf = make_branch_source(event, cfg.sample_period_us, pages, gate)
    else:
        perf = PerfSource(event=kind.removeprefix("perf-"),
                          sample_period_us=cfg.sample_period_us, data_pages=pages, gate=gate)
    if not (cfg.gated_thread_timer and cfg.perf_max_switch_rate > 0
            and session.hello_flags & P.HELLO_SAMPLER_LISTED
            and session.thread_tracker.gated_timer_failed is None):
        perf.open(session.pid)
        return perf
    conn = session.conn
    timer = _agent_timer(session, cfg, GATED_RING_ENTRIES, P.SAMPLER_LISTED)
    src = GatedTimerSource(perf, timer, lambda tid, on: conn.sampler_thread(tid, on, timeout=1.0))
    src.open(session.pid)
    return src


def _agent_timer(session: ClientSession, cfg: Config, ring_entries: int, flags: int = 0):
    """An (unopened) source of the agent's per-thread timers, through the ring it hands
    over (SAMPLER_RING); start/stop run on the session thread, the connection's only
    reader.  flags: SAMPLER_LISTED for only the threads named to it."""
    from dbr_service.sampling.agent_timer import AgentTimerSource

    conn = session.conn
    return AgentTimerSource(lambda period, entries: conn.sampler_start(period, entries, flags)[0],
                            lambda: conn.sampler_stop(timeout=1.0),
                            period_us=cfg.sample_period_us, ring_entries=ring_entries)


def make_agent_timer_source(session: ClientSession, cfg: Config):
    """The agent's own timers on every thread of the client."""
    src = _agent_timer(session, cfg, cfg.agent_ring_entries)
    src.open(session.pid)
    return src

