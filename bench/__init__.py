"""dbr benchmarks: A/B alternated runs, medians, ratios (never lone absolute times)."""
