"""Measurement studies behind docs/BENCHMARKS.md: scripts run with `python -m
benchmarks.studies.<name>`."""
