"""What `pdserve bench`, `gpu-bench`, `gpu-check` and `load` run: workloads, baselines, sweeps,
statistics, figures, the HTTP client and load, the GPU bench and check."""
