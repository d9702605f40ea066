"""Measurement studies behind docs/BENCHMARKS.md: scripts run with `python -m
deploy.bench.studies.<name>`."""
