"""Service events: published on the events socket (zmq PUB, topic and JSON) and kept
for the ``events`` control verb.  Sessions and the service publish; nothing here
knows who does."""

from __future__ import annotations

import enum
import json
import os
import threading
import time
from collections import deque
from typing import Any

import zmq


def json_default(o: Any) -> Any:
    """JSON for what json.dumps does not take itself (events' and control replies')."""
    if isinstance(o, (set, frozenset, tuple)):
        return list(o)
    if isinstance(o, enum.Enum):
        return o.value
    return str(o)


class EventBus:
    """Publishes events on the PUB socket (topic, JSON) and keeps the last ones."""

    def __init__(self, ctx: zmq.Context | None, path: str | None) -> None:
        self._lock = threading.Lock()
        self._seq = 0
        self.recent: deque[dict[str, Any]] = deque(maxlen=1000)
        self.sock = None
        if ctx is not None and path is not None:
            self.sock = ctx.socket(zmq.PUB)
            self.sock.setsockopt(zmq.LINGER, 0)
            self.sock.bind(f"ipc://{path}")
            os.chmod(path, 0o600)

    def publish(self, name: str, /, **data: Any) -> None:
        """Publish event ``name`` with ``data`` fields (thread-safe; never raises)."""
        with self._lock:
            self._seq += 1
            ev = {**data, "seq": self._seq, "time": time.time(), "event": name}
            self.recent.append(ev)
            if self.sock is not None:
                try:
                    self.sock.send_multipart([name.encode(),
                                              json.dumps(ev, default=json_default).encode()],
                                             flags=zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass

    def since(self, seq: int) -> list[dict[str, Any]]:
        with self._lock:
            return [e for e in self.recent if e["seq"] > seq]

    def close(self) -> None:
        with self._lock:
            if self.sock is not None:
                self.sock.close(0)
                self.sock = None
