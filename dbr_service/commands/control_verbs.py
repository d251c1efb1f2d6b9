"""The control socket's verb registry: how a request frame becomes a verb call and
its reply (strict JSON, checked arguments, faults instead of exceptions), and the
helpers verbs share.  The verbs themselves are in commands/control.py and
commands/control_tools.py."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dbr_service.commands.ctlclient import MAX_REQUEST, Code, Fault
from dbr_service.common.events import json_default

if TYPE_CHECKING:  # pragma: no cover
    from dbr_service.session.clients import ClientSession
    from dbr_service.daemon.service import Service

log = logging.getLogger("dbr.control")

# --------------------------------------------------------------------------- registry
@dataclass(frozen=True)
class Arg:
    """One argument of a verb: accepted JSON types, whether required, default."""

    types: tuple[type, ...]
    required: bool = False
    default: Any = None


Handler = Callable[["Service", dict[str, Any]], Any]
VERBS: dict[str, tuple[Handler, dict[str, Arg]]] = {}


def verb(name: str, **spec: Arg) -> Callable[[Handler], Handler]:
    """Register a handler for ``name`` with its argument specification."""

    def deco(fn: Handler) -> Handler:
        VERBS[name] = (fn, spec)
        return fn

    return deco


def check_args(name: str, spec: dict[str, Arg], args: Any) -> dict[str, Any]:
    """Validate ``args`` against ``spec``; return them with defaults filled in."""
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise Fault(Code.BAD_ARGS, f"{name}: args must be an object")
    unknown = sorted(set(args) - set(spec))
    if unknown:
        raise Fault(Code.BAD_ARGS, f"{name}: unknown argument(s) {', '.join(unknown)}")
    out = {}
    for key, a in spec.items():
        if key not in args or args[key] is None:
            if a.required:
                raise Fault(Code.BAD_ARGS, f"{name}: missing argument {key!r}")
            out[key] = a.default
            continue
        v = args[key]
        # bool is an int in Python: accept it only where bool is asked for.
        if (isinstance(v, bool) and bool not in a.types) or not isinstance(v, a.types):
            want = "/".join(t.__name__ for t in a.types)
            raise Fault(Code.BAD_ARGS, f"{name}: argument {key!r} must be {want}, "
                                       f"not {type(v).__name__}")
        out[key] = v
    return out


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def decode_request(raw: bytes) -> Any:
    """One request frame as a JSON value: strict UTF-8 (json.loads would also take
    UTF-16/32) and strict JSON (no NaN/Infinity); a Fault for anything else."""
    if len(raw) > MAX_REQUEST:
        raise Fault(Code.TOO_LARGE, f"request of {len(raw)} bytes exceeds {MAX_REQUEST}")
    try:
        return json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except UnicodeDecodeError as exc:
        raise Fault(Code.BAD_REQUEST, f"request is not UTF-8: {exc}") from None
    # ValueError: malformed JSON, or an integer beyond Python's digit limit;
    # RecursionError: nesting deeper than the parser's stack.
    except (ValueError, RecursionError) as exc:
        raise Fault(Code.BAD_REQUEST, f"malformed JSON: {exc}") from None


def dispatch(service: Service, raw: bytes) -> dict[str, Any]:
    """Decode one request, run its handler, and build the reply (never raises)."""
    try:
        req = decode_request(raw)
        if not isinstance(req, dict) or not isinstance(req.get("verb"), str):
            raise Fault(Code.BAD_REQUEST, 'request must be {"verb": STRING, "args": {...}}')
        extra = sorted(set(req) - {"verb", "args"})
        if extra:
            raise Fault(Code.BAD_REQUEST, f"unknown request field(s) {', '.join(extra)}")
        name = req["verb"]
        if name not in VERBS:
            raise Fault(Code.UNKNOWN_VERB, f"unknown verb {name!r} (known: "
                                           f"{', '.join(sorted(VERBS))})")
        if service.stopping and name != "status":
            raise Fault(Code.SHUTTING_DOWN, "the service is shutting down")
        fn, spec = VERBS[name]
        result = fn(service, check_args(name, spec, req.get("args")))
        return {"ok": True, "result": result}
    except Fault as f:
        return fault_reply(f.code, f.message)
    except Exception as exc:  # a handler bug: report it, keep serving
        log.exception("control request failed")
        return fault_reply(Code.INTERNAL, f"internal error: {exc!r}")


def fault_reply(code: Code, message: str) -> dict[str, Any]:
    return {"ok": False, "error": {"code": int(code), "message": message}}


def encode_reply(reply: dict[str, Any]) -> bytes:
    """The reply as JSON; one that cannot be encoded (a handler returned a cycle, an
    integer beyond the digit limit...) becomes an INTERNAL fault instead.  ASCII
    output, so ``encode`` cannot fail."""
    try:
        return json.dumps(reply, default=json_default).encode()
    except Exception as exc:
        log.exception("control reply could not be encoded")
        return json.dumps(fault_reply(Code.INTERNAL,
                                      f"reply could not be encoded: {exc!r}")).encode()


# --------------------------------------------------------------------------- helpers
def client_of(service: Service, pid: int) -> ClientSession:
    """The live session of ``pid``, else its most recent ended one."""
    s = service.find_client(pid)
    if s is None:
        raise Fault(Code.NO_CLIENT, f"no client with pid {pid}")
    return s


def int_arg(v: Any, name: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise Fault(Code.BAD_ARGS, f"{name} must be a positive integer")
    return v
