"""The measurement lab, beside the service and not shipped with it: the GPU-cost simulation, the
scheduler's ceiling and one-off studies, run from a checkout with `python -m benchmarks.<name>`."""
