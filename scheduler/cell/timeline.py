"""Where a Ray step's time goes: plan, the round trip to the worker, its forward, apply, publish."""

from __future__ import annotations

from collections import deque
from typing import Any

PHASES = (
    "period",
    "plan",
    "round_trip",
    "worker_step",
    "forward",
    "apply",
    "publish",
    "tokens",
    "steps",
)


class StepTimeline:
    """The last `window` calls to workers of each kind, phase by phase, in seconds.

    `period` is what a call costs the worker's loop: from the previous call's result (or from
    sending, if the worker was idle) to this one's. `round_trip` is from sending the call to having
    its result; with one call in flight ahead it includes waiting behind the previous one. It
    contains `worker_step` (the steps on the worker), which contains `forward` (the model). `plan`,
    `apply` and `publish` run in the scheduler while the next call is in flight. A call carries
    `steps` steps (more than one in a decode burst). `summary()` gives per kind the median of each
    phase per step (a call's seconds divided by its steps, counted once per step), the mean steps
    per call, the share of the period spent outside the model's forward, and `tok_s_busy`: tokens
    the steps computed per second of their periods, the rate one worker of the kind sustains while
    busy (prefill and decode rates side by side give the ratio of prefill to decode workers a
    workload needs).
    """

    def __init__(self, window: int = 20_000) -> None:
        self.window = window
        self.steps: dict[str, deque[tuple[float, ...]]] = {}

    def record(self, kind: str, **seconds: float) -> None:
        self.steps.setdefault(kind, deque(maxlen=self.window)).append(
            tuple(seconds[p] for p in PHASES)
        )

    def reset(self) -> None:
        self.steps.clear()

    def summary(self) -> dict[str, Any]:
        """Per kind: steps, calls, steps per call, each phase's median per step, the share of the
        period outside the forward and the busy rate."""
        out: dict[str, Any] = {}
        for kind, steps in self.steps.items():
            columns = dict(zip(PHASES, zip(*steps, strict=True), strict=True))
            line: dict[str, Any] = {
                "steps": int(sum(columns["steps"])),
                "calls": len(steps),
                "steps_per_call": sum(columns["steps"]) / len(steps),
            }
            line |= {
                f"{phase}_ms_p50": 1000 * _median_per_step(values, columns["steps"])
                for phase, values in columns.items()
                if phase not in ("tokens", "steps")
            }
            total = sum(columns["period"])
            line["outside_forward_fraction"] = 1 - sum(columns["forward"]) / total if total else 0.0
            line["tok_s_busy"] = sum(columns["tokens"]) / total if total else 0.0
            out[kind] = line
        return out


def _median_per_step(values: tuple[float, ...], steps: tuple[float, ...]) -> float:
    """The median over steps of a call's seconds divided by its steps: a call of K steps counts K
    times, so a few slow single-step calls (those that import handoffs) do not pass for the typical
    step."""
    pairs = sorted((v / n, n) for v, n in zip(values, steps, strict=True))
    half = sum(steps) / 2
    seen = 0.0
    for value, weight in pairs:
        seen += weight
        if seen >= half:
            return value
    return pairs[-1][0] if pairs else 0.0
