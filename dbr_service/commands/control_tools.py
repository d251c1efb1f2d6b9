"""Control verbs that work on one client's process beyond its regions: detach (the
agent goes dormant), probes (dbr_service/session/probes.py) and call-stack profiles
(commands/stackjobs.py).  Registered when commands/control.py imports this module."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dbr_service.commands.control_verbs import Arg, client_of, int_arg, verb
from dbr_service.commands.ctlclient import Code, Fault
from dbr_service.common.errors import AgentError, ProtocolError
from dbr_service.session.probes import NoProbe, ProbeRefused

if TYPE_CHECKING:  # pragma: no cover
    from dbr_service.daemon.service import Service

#: The verbs registered here.
NAMES = ("detach", "probe_add", "probe_list", "probe_show", "probe_del", "flamegraph")


@verb("detach", pid=Arg((int,), required=True))
def verb_detach(service: Service, args: dict[str, Any]) -> dict[str, Any]:
    """Remove every patch of a client and end its session; its agent goes dormant until
    `dbr attach` (docs/operators.md, "Attaching").  ``text`` compares the client's
    executable mappings with their files once the agent reverted its sites."""
    from dbr_service.commands.textcheck import compare_text

    s = client_of(service, int_arg(args["pid"], "pid"))
    if not s.alive:
        raise Fault(Code.NO_CLIENT, f"client {s.pid} is no longer connected")
    try:
        removed = service.detach(s)
    except (AgentError, ProtocolError, TimeoutError) as exc:
        raise Fault(Code.AGENT, f"detach of pid {s.pid} failed: {exc}") from None
    return {"pid": s.pid, "regions_removed": removed, "session_ended": not s.alive,
            "text": compare_text(s.pid)}



@verb("probe_add", pid=Arg((int,), required=True), location=Arg((str,), required=True),
      kind=Arg((str,), default="count"), filter=Arg((str,)))
def verb_probe_add(service: Service, args: dict[str, Any]) -> dict[str, Any]:
    """Place a probe (dbr_service/session/probes.py) at a location of a client."""
    return _probe(service, "add", args)


@verb("probe_list", pid=Arg((int,), required=True))
def verb_probe_list(service: Service, args: dict[str, Any]) -> dict[str, Any]:
    return _probe(service, "list", args)


@verb("probe_show", pid=Arg((int,), required=True), id=Arg((int,), required=True),
      last=Arg((int,), default=16))
def verb_probe_show(service: Service, args: dict[str, Any]) -> dict[str, Any]:
    return _probe(service, "show", args)


@verb("probe_del", pid=Arg((int,), required=True), id=Arg((int,), required=True))
def verb_probe_del(service: Service, args: dict[str, Any]) -> dict[str, Any]:
    return _probe(service, "del", args)


def _probe(service: Service, op: str, args: dict[str, Any]) -> Any:
    s = client_of(service, int_arg(args["pid"], "pid"))
    try:
        return s.probe_request(op, args)
    except ProbeRefused as exc:
        raise Fault(Code.PROBE_REFUSED, str(exc)) from None
    except NoProbe as exc:
        raise Fault(Code.NO_PROBE, str(exc)) from None
    except (AgentError, ProtocolError, TimeoutError) as exc:
        raise Fault(Code.AGENT, f"probe {op} in pid {s.pid}: {exc}") from None



@verb("flamegraph", pid=Arg((int,), required=True), seconds=Arg((int, float)))
def verb_flamegraph(service: Service, args: dict[str, Any]) -> dict[str, Any]:
    """Start, poll or collect a client's call-stack profile (commands/stackjobs.py)."""
    from dbr_service.commands.stackjobs import flamegraph

    return flamegraph(service, int_arg(args["pid"], "pid"), args["seconds"])
