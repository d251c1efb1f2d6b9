"""What a session shows of its client: the row of `dbr ctl clients` and the client's
entry of a dbr.run/1 report (a mixin of clients.ClientSession)."""

from __future__ import annotations

import time
from typing import Any

from dbr_service.wire import protocol as P
from dbr_service.common.hotnames import name_hotspots
from dbr_service.region.worker import find_hotspots


class SessionViews:
    """The views part of :class:`dbr_service.session.clients.ClientSession` (a mixin)."""

    def summary(self) -> dict[str, Any]:
        """One row of `dbr ctl clients`."""
        tt, book = self.thread_tracker, self.region_book
        return {"pid": self.pid, "ppid": self.ppid, "uid": self.uid,
                "session": self.session_id, "build_id": self.build_id,
                # the kernel's exe; a different claim beside it, where the table shows it
                "exe": (f"{self.exe} (claims {self.exe_claimed})" if self.exe_mismatch
                        else self.exe),
                "state": self.state.value, "threads": tt.count(self.alive),
                "agent_thread": ("hidden" if self.hello_flags & P.HELLO_HIDDEN_THREAD
                                 else "pthread"),
                # attached (dbr attach): nothing interposed, so no notices and no
                # map-change hooks (docs/agent.md, "Attached")
                "attached": bool(self.hello_flags & P.HELLO_ATTACHED),
                "thread_notices": ("none (attached)" if self.hello_flags & P.HELLO_ATTACHED
                                   else ("on" if tt.thread_notices_on else "off")
                                   if self.hello_flags & P.HELLO_QUIET_THREADS else "always"),
                "thread_notices_received": tt.thread_notices_received,
                "short_thread_windows": tt.short_thread_windows,
                "notices_after_quiet": tt.notices_after_quiet,
                "windows_without_notices": tt.windows_without_notices,
                "threads_switch_gated": tt.switch_gate.refused,
                "threads_timer_sampled": len(tt.timer_sampled_tids),
                "gated_timer_samples": tt.gated_timer_samples,
                "samples": self.samples_total, "snapshots": self.snapshots,
                "paused": self.paused, "source": self.sampling_source_name,
                "operator_hold": ("all" if book.operator_hold_all
                                  else sorted(book.operator_held) or None),
                "map_changes": self.map_changes, "jobs_done": self.jobs_done,
                "hotspots_found": len(self.hotspots),
                "regions": len(book.regions), "patches_installed": self.patches_installed,
                "regions_went_live": self.regions_went_live,
                **self.threads_moved(),
                "sampling_interval_s": self.cadence.sampling_interval_s,
                "quiet_snapshots": self.cadence.quiet_snapshots,
                **self.cpu_budget.to_json(time.monotonic()),
                "jobs_skipped_unchanged": self.cadence.jobs_skipped_unchanged,
                "jobs_skipped_backoff": self.cadence.jobs_skipped_backoff,
                "speed_check": ("running" if self.speed_check is not None else
                                self.speed_checks[-1]["verdict"] if self.speed_checks
                                else None),
                "connected_at": self.connected_at, "ended_at": self.ended_at,
                "exe_claimed": self.exe_claimed, "exe_mismatch": self.exe_mismatch,
                "foreign_tids": tt.foreign_tids,
                "map_changes_refused": self.map_changes_refused,
                "close_reason": self.close_reason, "errors": list(self.errors)[-3:]}

    def report(self) -> dict[str, Any]:
        """This client's entry of a dbr.run/1 report (docs/architecture.md, "Reports"):
        fixed field names, plus hot spots and the region status."""
        ttfp = (None if self.first_patch_mono is None
                else round(self.first_patch_mono - self.connected_mono, 3))
        cfg = self.service.config
        hotspots = find_hotspots(dict(self.ip_counts), self.maps, threshold=cfg.hot_threshold,
                                 top=10)
        name_hotspots(hotspots, self.maps)     # the last maps read while the client lived
        return {
            "pid": self.pid, "ppid": self.ppid, "exe": self.exe,
            "samples": self.samples_total,
            "samples_after_first_patch": self.samples_after_first_patch,
            "samples_in_replacement": self.samples_in_replacement,
            "time_to_first_patch_s": ttfp,
            "patches_installed": self.patches_installed,
            "patches_removed": self.patches_removed,
            "regions_went_live": self.regions_went_live,
            **self.threads_moved(),
            "regions": [r.to_json(self.maps) for r in self.region_book.regions.values()],
            "sampling_source": self.sampling_source_name,
            "snapshots": self.snapshots,
            "hotspots": hotspots,
            "region_status": self.region_status,
            "jobs_done": self.jobs_done,
            **self.cpu_budget.to_json(time.monotonic()),
            "speed_checks": list(self.speed_checks),
            "timeline": dict(self.timeline),
            # given once the session is closed: a reader that waits for it (dbr run's
            # report) then sees the records the session's end writes (its last counts)
            "close_reason": "" if self.alive else self.close_reason,
        }
