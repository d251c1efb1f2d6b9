"""One exception hierarchy for the whole service, rooted at DbrError."""

from __future__ import annotations


class DbrError(Exception):
    """Root of every error dbr raises on purpose."""


class ProtocolError(DbrError):
    """A message on the agent socket is malformed, unknown or out of order."""


class ConfigError(DbrError):
    """A configuration key is unknown or its value is invalid."""


class AgentError(DbrError):
    """The agent refused a request or the session broke."""


class RegionError(DbrError):
    """Region selection failed for one super-region (others go on)."""


class CodegenError(DbrError):
    """Replacement code could not be generated for a region."""


class SamplingError(DbrError):
    """A sampling source could not be opened or read."""


class MemoryViewError(DbrError):
    """Memory of a client or a binary could not be read."""


class ServiceError(DbrError):
    """The service cannot start (another one runs, the runtime dir is unusable, ...)."""
