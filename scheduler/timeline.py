"""Where a Ray step's time goes: plan, the round trip to the worker, its forward, apply, publish."""

from __future__ import annotations

import statistics
from collections import deque
from typing import Any

PHASES = ("plan", "round_trip", "worker_step", "forward", "apply", "publish")


class StepTimeline:
    """The last `window` steps of each worker kind, phase by phase, in seconds.

    `round_trip` is from sending the step to having its result (it contains `worker_step`, which
    contains `forward`); a whole step, as the scheduler loop sees it, is plan + round_trip + apply +
    publish. `summary()` gives per kind the median of each phase and the share of step time spent
    outside the model's forward.
    """

    def __init__(self, window: int = 20_000) -> None:
        self.window = window
        self.steps: dict[str, deque[tuple[float, ...]]] = {}

    def record(self, kind: str, **seconds: float) -> None:
        self.steps.setdefault(kind, deque(maxlen=self.window)).append(tuple(seconds[p] for p in PHASES))

    def reset(self) -> None:
        self.steps.clear()

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for kind, steps in self.steps.items():
            columns = dict(zip(PHASES, zip(*steps, strict=True), strict=True))
            line: dict[str, Any] = {"steps": len(steps)}
            line |= {f"{phase}_ms_p50": 1000 * statistics.median(values) for phase, values in columns.items()}
            total = sum(sum(columns[p]) for p in ("plan", "round_trip", "apply", "publish"))
            line["outside_forward_fraction"] = 1 - sum(columns["forward"]) / total if total else 0.0
            out[kind] = line
        return out
