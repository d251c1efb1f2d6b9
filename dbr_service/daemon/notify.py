"""systemd notification (``Type=notify``) without libsystemd: datagrams to $NOTIFY_SOCKET.

READY=1 once the sockets are bound, STATUS=... lines, WATCHDOG=1 every half
``$WATCHDOG_USEC``, STOPPING=1 at shutdown.  Without $NOTIFY_SOCKET every call is a no-op.
"""

from __future__ import annotations

import logging
import os
import socket
import time

log = logging.getLogger("dbr.notify")


class Notifier:
    """Sends sd_notify messages; keeps the watchdog schedule."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        env = dict(os.environ) if env is None else env
        addr = env.get("NOTIFY_SOCKET", "")
        self.address: str | bytes | None = None
        if addr:
            # "@name" is the abstract namespace.
            self.address = b"\0" + addr[1:].encode() if addr.startswith("@") else addr
        self._sock: socket.socket | None = None
        usec = env.get("WATCHDOG_USEC", "")
        wd_pid = env.get("WATCHDOG_PID", "")
        self.watchdog_interval: float | None = None
        if usec.isdigit() and int(usec) > 0 and (not wd_pid or wd_pid == str(os.getpid())):
            self.watchdog_interval = int(usec) / 2e6
        self._next_watchdog = time.monotonic()

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, *lines: str) -> bool:
        """Send one notification of ``KEY=VALUE`` lines; False if it could not be sent."""
        if self.address is None:
            return False
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            # Never block the control thread on a receiver that does not read.
            self._sock.sendto("\n".join(lines).encode(), socket.MSG_DONTWAIT, self.address)
            return True
        except BlockingIOError:
            log.debug("sd_notify receiver is full; dropped %s", lines)
            return False
        except OSError as exc:
            log.warning("sd_notify to %r failed: %s", self.address, exc)
            return False

    def ready(self, status: str = "") -> None:
        self.send("READY=1", f"MAINPID={os.getpid()}", *([f"STATUS={status}"] if status else []))

    def status(self, text: str) -> None:
        self.send(f"STATUS={text}")

    def stopping(self) -> None:
        self.send("STOPPING=1")

    def reloading(self) -> None:
        self.send("RELOADING=1")

    def watchdog_due(self) -> float | None:
        """Seconds until the next WATCHDOG=1 is due (None: no watchdog)."""
        if self.watchdog_interval is None:
            return None
        return max(0.0, self._next_watchdog - time.monotonic())

    def watchdog(self) -> None:
        """Send WATCHDOG=1 if it is due."""
        if self.watchdog_interval is None or time.monotonic() < self._next_watchdog:
            return
        self.send("WATCHDOG=1")
        self._next_watchdog = time.monotonic() + self.watchdog_interval

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
