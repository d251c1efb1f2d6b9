"""Client side of the control socket: what `dbr run` and `dbr ctl` need and nothing
more (zmq and json), so that `dbr run` does not import the service's control server,
logging and dataclasses (10 ms) to collect its report after PROG exits.
The server and the verbs are in :mod:`dbr_service.commands.control`."""

from __future__ import annotations

import enum
import json
import os
from typing import Any

import zmq

from dbr_service.common.errors import DbrError

MAX_REQUEST = 64 * 1024
"""Largest request accepted, in bytes; larger ones get TOO_LARGE."""


class Code(enum.IntEnum):
    """Fault codes of the control API (stable; documented in docs/control-api.md)."""

    BAD_REQUEST = 1     # not one frame, not UTF-8 JSON, not an object, no verb string
    UNKNOWN_VERB = 2
    BAD_ARGS = 3        # unknown, missing or wrongly typed argument
    TOO_LARGE = 4       # request above MAX_REQUEST bytes
    NO_CLIENT = 5       # no client with that pid
    NO_REGION = 6       # the client has no region with that id
    NOT_AVAILABLE = 7   # feature not available on this host / not built yet
    CONFIG = 8          # unknown key or bad value in config_set
    AGENT = 9           # the agent refused or did not answer in time
    INTERNAL = 10       # a bug; the message says which
    SHUTTING_DOWN = 11  # the service is stopping
    PROBE_REFUSED = 12  # a probe's location or kind refused (the message says why)
    NO_PROBE = 13       # the client has no probe with that id


class Fault(DbrError):
    """A refused request: an integer code and a message for the operator."""

    def __init__(self, code: Code, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class ControlClient:
    """Client side of the control socket (used by `dbr ctl` and `dbr run`)."""

    def __init__(self, runtime_dir: str | os.PathLike, timeout: float = 1.5) -> None:
        self.path = os.path.join(os.fspath(runtime_dir), "control.sock")
        self.timeout = timeout
        self._ctx = zmq.Context.instance()

    def available(self) -> bool:
        return os.path.exists(self.path)

    def call(self, verb_name: str, args: dict[str, Any] | None = None, *,
             raw: bytes | None = None, timeout: float | None = None) -> dict[str, Any]:
        """Send one request and return the reply dict; TimeoutError if nobody answers."""
        if not self.available():
            raise ConnectionRefusedError(f"no dbr service: {self.path} does not exist")
        sock = self._ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(f"ipc://{self.path}")
            payload = raw if raw is not None else json.dumps(
                {"verb": verb_name, "args": args or {}}).encode()
            sock.send(payload)
            if not sock.poll(int((timeout or self.timeout) * 1000)):
                raise TimeoutError(f"no dbr service answered on {self.path} within "
                                   f"{timeout or self.timeout:.1f}s")
            return json.loads(sock.recv())
        finally:
            sock.close(0)

    def result(self, verb_name: str, args: dict[str, Any] | None = None, **kw: Any) -> Any:
        """``call`` and unwrap: the result, or a Fault carrying the error code."""
        reply = self.call(verb_name, args, **kw)
        if not reply.get("ok"):
            err = reply.get("error", {})
            code = err.get("code")
            raise Fault(Code(code) if code in Code._value2member_map_ else Code.INTERNAL,
                        err.get("message", "?"))
        return reply.get("result")

    def answers(self, timeout: float = 1.0) -> bool:
        """Whether a service answers ``status`` within ``timeout``."""
        try:
            return bool(self.call("status", timeout=timeout).get("ok"))
        except (OSError, TimeoutError, ValueError):
            return False
