"""Measuring: workloads, baselines, sweeps, statistics, figures, the HTTP client, load, GPU
bench."""
