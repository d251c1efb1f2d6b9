"""Every lifecycle in dbr, in one module that imports nothing but the standard library
(so that any layer may use it without an import cycle).

* :class:`RegionState`: a region from selection to removal.  The pipeline's super-region
  moves DISCOVERED -> SELECTED (region/pipeline.py); the session's record of it
  (session_regions.RegionRecord) SELECTED -> GENERATED -> INSTALLED -> REMOVED.  The
  values are the ones `dbr ctl regions` and reports show.
* :class:`InstallState`: the installer's view of one installed copy (installation/install.py): its
  code written, its sites patched, suspended for a speed check, removed, or failed.
* :class:`SessionState`: one client's session (session/clients.py).
"""

from __future__ import annotations

import enum


class RegionState(str, enum.Enum):
    """Lifecycle of a region (checked where patches change)."""

    DISCOVERED = "discovered"
    SELECTED = "selected"
    GENERATED = "generated"
    INSTALLED = "installed"
    REMOVED = "removed"


class InstallState(str, enum.Enum):
    """Lifecycle of one installed copy of a region."""

    WRITTEN = "written"          # bytes in the buffer, no site patched yet
    INSTALLED = "installed"      # at least one entry site patched, or (a region without
                                 # patch sites) at least one thread moved in
    SUSPENDED = "suspended"      # sites restored for a while (a speed check), code and
                                 # REGION kept: resume() patches the same sites again
    REMOVED = "removed"          # every site restored; code space quarantined
    FAILED = "failed"            # nothing patched (agent refused every site)


#: States in which a region's code is in place and depends on the original code: live,
#: or suspended for a speed check (its sites restored for a while).
HELD = frozenset({InstallState.INSTALLED, InstallState.SUSPENDED})


class SessionState(str, enum.Enum):
    """Lifecycle of a client's session."""

    HANDSHAKE = "handshake"
    CONNECTED = "connected"
    CLOSED = "closed"
