"""The service's runtime directory: opened safely, its sockets and quiet hint
written in it and removed again."""

from __future__ import annotations

import contextlib
import grp
import logging
import os
import socket

from dbr_service.common.errors import ServiceError
from dbr_service.common.paths import (AGENT_SOCKET, CONTROL_SOCKET, EVENTS_SOCKET, QUIET_FILE,
                                      UnsafeDirError, open_safe_dir, quiet_hint_ms, write_ms_file)

log = logging.getLogger("dbr.service")


class RuntimeDir:
    """The runtime-dir part of :class:`dbr_service.daemon.service.Service` (a mixin)."""

    def _prepare_runtime_dir(self) -> None:
        """Open the runtime dir, refusing one that anybody but this service's user could
        change (a symlink, another owner, writable by group or others, an unsafe
        ancestor: paths.open_safe_dir).  Its mode is then set through the descriptor,
        never through a path that could lead elsewhere."""
        d = self.runtime_dir
        group = self.config.socket_group
        try:
            gid = grp.getgrnam(group).gr_gid if group else -1
        except KeyError:
            raise ServiceError(f"socket_group {group!r} does not exist") from None
        try:
            fd = open_safe_dir(d, create=True, mode=0o700)
        except UnsafeDirError as exc:
            raise ServiceError(f"refusing runtime dir: {exc}") from None
        except OSError as exc:
            raise ServiceError(f"runtime dir {d}: {exc}") from None
        try:
            os.fchmod(fd, 0o750 if group else 0o755)
            if group:
                os.fchown(fd, -1, gid)
        except OSError as exc:
            os.close(fd)
            raise ServiceError(f"runtime dir {d}: {exc}") from None
        if self.dir_fd >= 0:
            os.close(self.dir_fd)
        self.dir_fd = fd
        self.short_runs.dir_fd = fd

    def write_quiet_hint(self) -> None:
        """Tell agents how young a client this service samples (paths.QUIET_FILE,
        read by the agent's constructor unless DBR_AGENT_QUIET_MS is set):
        ``min_client_age_s`` in ms, 0 under --aggressive.  An agent makes its thread,
        and connects, only once its program is that old and running (dbr_agent/agent.c,
        "born when the service would look"): a program that ends sooner, or that
        sleeps, pays for no second thread.  A host service cannot set its clients'
        environment.  Written whole (a temporary file renamed), so an agent never reads
        half of it; failing to write it is logged, and agents then keep the default
        quiet (their thread made at once, connecting after 50 ms)."""
        path = self.path(QUIET_FILE)
        ms = quiet_hint_ms(self.config.min_client_age_s)
        self._configure_short_runs(ms)
        try:
            write_ms_file(QUIET_FILE, ms, dir_fd=self.dir_fd)
        except OSError as exc:
            log.warning("cannot write the agents' quiet hint %s: %s", path, exc)

    def _configure_short_runs(self, hint_ms: int) -> None:
        """Programs born late are forgotten when what they were learned under changes;
        with patching off nothing is learned (sampling is then the point)."""
        cfg = self.config
        self.short_runs.configure(cfg.short_run_s if cfg.patching else 0.0,
                                  cfg.short_run_memory_s, hint_ms)

    def _chgrp_sockets(self) -> None:
        group = self.config.socket_group
        if not group:
            return
        gid = grp.getgrnam(group).gr_gid
        for name in (AGENT_SOCKET, CONTROL_SOCKET, EVENTS_SOCKET):
            os.chown(self.path(name), -1, gid)
            os.chmod(self.path(name), 0o660)

    def _refuse_if_running(self) -> None:
        """Another service answering on agent.sock: refuse.  Stale socket files: remove."""
        agent = self.path(AGENT_SOCKET)
        if os.path.exists(agent):
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
            probe.settimeout(0.5)
            try:
                probe.connect(agent)
            except OSError:
                pass  # nobody listening: stale
            else:
                raise ServiceError(f"another dbr service is already running on "
                                   f"{self.runtime_dir} (it answers on {agent}); stop it "
                                   f"first or set DBR_RUNTIME_DIR")
            finally:
                probe.close()
        for name in (AGENT_SOCKET, CONTROL_SOCKET, EVENTS_SOCKET):
            try:
                os.unlink(name, dir_fd=self.dir_fd)
                log.info("removed stale %s", self.path(name))
            except FileNotFoundError:
                pass


    def _release_sockets(self) -> None:
        """Close and remove every socket this service bound (also after a failed start)."""
        if self._control is not None:
            if self._control.thread.is_alive():
                self._control.stop()
            else:
                self._control.sock.close(0)
        self.events.close()
        if self._listen is not None:
            self._listen.close()
            for name in (AGENT_SOCKET, CONTROL_SOCKET, EVENTS_SOCKET):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=self.dir_fd)
            with contextlib.suppress(OSError):   # not ours if it is not a file
                os.unlink(QUIET_FILE, dir_fd=self.dir_fd)
            self.short_runs.remove_stale()
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        if self.dir_fd >= 0:
            self.short_runs.dir_fd = None
            os.close(self.dir_fd)
            self.dir_fd = -1
