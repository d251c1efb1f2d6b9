"""The sampling windows of a session: its source opened and drained on the session
thread, and the samples counted and kept for region selection."""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import TYPE_CHECKING

from dbr_service.common.errors import SamplingError

if TYPE_CHECKING:  # pragma: no cover
    from dbr_service.sampling.base import SamplingSource


class SessionSampling:
    """The sampling part of :class:`dbr_service.session.clients.ClientSession` (a mixin)."""

    def begin_window(self, make_source: Callable[[SessionSampling], SamplingSource]) -> None:
        """Session thread: open (if needed) and enable the sampling source."""
        self.thread_tracker.refresh()
        self._refresh_maps()  # cheap; also catches mappings no agent hook announced
        with self.lock:
            if self.source is None:
                self.source = make_source(self)
                self.source_name = self.source.name
            self.source.enable()

    def end_window(self, keep_open: bool) -> list:
        """Session thread: disable (unless continuous), drain, and return the samples."""
        samples: list = []
        with self.lock:
            src = self.source
            if src is not None:
                if not keep_open:
                    src.disable()
                samples = src.read()
                self.thread_tracker.count_gated_timer(src)
                if not keep_open:
                    self._close_source()
        if not keep_open:
            self.thread_tracker.thread_notices(False)
        return samples

    def _close_source(self) -> None:
        with self.lock:
            src, self.source = self.source, None
            if src is not None:
                try:
                    src.close()
                except SamplingError as exc:
                    self.errors.append(str(exc))
                self.thread_tracker.count_gated_timer(src)

    def _drain_source(self) -> list:
        """Samples still buffered when the session ends (a short client's last window)."""
        with self.lock:
            if self.source is None:
                return []
            try:
                return self.source.read()
            except SamplingError:
                return []

    def add_samples(self, ips: collections.Counter[int],
                    per_thread: dict[int, int] | None = None) -> None:
        """Control thread: account one snapshot's samples of this client."""
        n = sum(ips.values())
        with self.lock:
            self.thread_samples.update(per_thread or {})
            self.ip_counts.update(ips)
            self.samples_total += n
            self.snapshots += 1

    def split_window(self, samples: list, window_start: float
                     ) -> tuple[collections.Counter[int], int]:
        """Control thread: raw IPs of one window, and how many landed in replacement
        code (or in a code buffer: code of a region removed since).  IPs outside both
        feed the next region selection.  Only windows that began
        after the first patch count towards the after-first-patch figures (a window
        straddling it would count samples taken before any replacement code existed)."""
        raw: collections.Counter[int] = collections.Counter(smp.ip for smp in samples)
        if raw:
            self.mark("first_samples")
        # all replacement code lies in the code buffers, also that of a region removed
        # after the window was taken
        bufs = () if self.installer is None else self.installer.buffer_ranges
        in_repl = 0
        outside: collections.Counter[int] = collections.Counter()
        for ip, n in raw.items():
            if any(lo <= ip < hi for lo, hi in bufs):
                in_repl += n
            else:
                outside[ip] = n
        with self.lock:
            self.recent.append(outside)
            if self.first_patch_mono is not None and self.first_patch_mono <= window_start:
                self.samples_in_replacement += in_repl
                self.samples_after_first_patch += sum(raw.values())
        return raw, in_repl

    def selection_input(self) -> dict[int, int]:
        """Samples region selection works from: recent ones outside replacement code."""
        total: collections.Counter[int] = collections.Counter()
        with self.lock:
            for c in self.recent:
                total.update(c)
        return dict(total)

    @property
    def sampling_source_name(self) -> str:
        """The source's name, with "+agent-timer" once the agent's timer has sampled a
        thread perf left out (each window's source starts as plain perf)."""
        name = self.source_name
        if self.thread_tracker.timer_sampled_tids and not name.endswith("+agent-timer"):
            name += "+agent-timer"
        return name
