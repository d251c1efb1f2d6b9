"""The long-running benchmark (issue 35): `python -m bench long`; see bench/long/main.py."""
