"""Benchmarks: each writes machine-readable JSON and a PNG plot."""
