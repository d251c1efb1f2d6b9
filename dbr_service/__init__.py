"""dbr: a sampling-driven dynamic binary rewriter for Linux x86-64 (the service side)."""

__version__ = "0.1.0"
