"""What earlier runs learned, kept across runs: the profile store, its data and module keys,
pprof, selections moved between processes, warm start.
"""
