"""The per-client session (cycle steps 1, 6-8): one ClientSession and thread per client and
its parts (threads, sampling windows, regions, speed checks), its cadence, CPU budget,
sampling source, and the threads kept between sessions.
"""
