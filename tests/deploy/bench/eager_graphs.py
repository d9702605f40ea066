"""A stand-in for a runner's CUDA graphs on a CPU, for the GPU tools' tests."""

import torch


class EagerGraphs:
    """A stand-in for the runner's decode graphs (`runner.graphs`) on a CPU: same `run(rows)`,
    `buckets` and `capture_seconds`, computed by the eager forward."""

    buckets = [1, 2]
    capture_seconds = 0.0

    def __init__(self, runner):
        self.runner = runner
        self.calls = 0

    def run(self, rows):
        from workers.model import BatchLayout

        self.calls += 1
        packed = [(table, [token], position) for table, token, position in rows]
        ids, layout = BatchLayout.pack(packed, len(rows), 16, "cpu")
        return self.runner.model(ids, layout, self.runner.cache, torch.arange(len(rows)))
