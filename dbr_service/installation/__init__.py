"""Installation and evaluation (cycle steps 5-7): placement and emission of selected regions,
the installer and its records, code space and censuses, entry sites, speed checks,
jitdump records.
"""
