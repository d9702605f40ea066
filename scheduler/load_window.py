"""What one window of the pool planner saw: the load that arrived and finished, and the workers'
steps on it.

The coordinator fills one per window (scheduler/cell/pools.py); the pool planner sizes the pools
from it and the seasonal forecast keeps it for the next period.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LoadWindow:
    """What one window saw."""

    seconds: float = 0.0
    arrivals: int = 0
    prompt_tokens: int = 0  # of the arrivals
    prompt_tokens_sq: int = 0  # the sum of their squares: the spread of prompt lengths
    finished: int = 0
    output_tokens: int = 0  # of the finished requests
    prefill_tokens: int = 0  # computed on prefill workers
    prefill_busy_s: float = 0.0  # their step time, summed
    # decode steps: (batch size, step seconds)
    decode_steps: list[tuple[int, float]] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)  # per finished request: its mean

    @property
    def arrival_rate(self) -> float:
        return self.arrivals / self.seconds if self.seconds > 0 else 0.0
