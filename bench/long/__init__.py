"""The long-running benchmark: `python -m bench long`; see bench/long/main.py."""
