"""The load the pool planner expects next: what the same time of the last period (a day, a week)
saw, scaled to how busy today is against it.

Traffic to a service repeats: the morning rise, the evening's long chats, the nightly batch. A
planner that sees only the windows behind it learns of a rise when it has arrived, and a worker it
starts then answers a start-up later, while prompts queue; one that remembers the last period can
start it a start-up ahead, and can release a worker the moment the load falls, knowing whether it
comes back before a new one could start (Dynamo's planner predicts its next interval the same
way, with seasonal models among its predictors).

`SeasonalForecast` keeps each window's arrivals, prompt lengths and output lengths for one period
and a little more. `ahead(horizon_s)` returns, for every window of the last period from now to
`horizon_s` ahead, the load it saw: its arrivals and lengths pooled with those of the window on
each side (one window's count is Poisson-noisy: 30 expected, from 20 to 40 seen), and the window
alone at the lower end of its count (so a sharp edge is not blurred away), times the level (today's
arrivals over the last `level_s` against the same span a period ago, within 0.5-2; 1 while less
than a quarter of that span a period ago has been seen). Nothing until a whole period has been
seen. Pure: the planner feeds it the windows it closes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scheduler.pool_planner import LoadWindow

_LEVEL_BOUNDS = (0.5, 2.0)
_Z = 1.28  # one-sided 90%: a window's count minus this many standard deviations


@dataclass(frozen=True)
class ExpectedLoad:
    """The load one window ahead is expected to bring."""

    in_s: float  # how far ahead the window ends
    rate: float  # requests per second
    mean_prompt: float
    prompt_spread: float  # squared coefficient of variation of the prompts' lengths
    mean_output: float | None  # None: no request finished in those windows


@dataclass
class SeasonalForecast:
    """Windows seen, kept for a period and the level's span (see the module's docstring)."""

    period_s: float
    level_s: float = 120.0
    now_s: float = 0.0  # the end of the last window recorded, since the first began
    # (end, window), oldest first: arrivals, prompt and output counts only
    seen: list[tuple[float, LoadWindow]] = field(default_factory=list)
    level: float = 1.0  # the last `ahead`'s level

    def record(self, window: LoadWindow) -> None:
        self.now_s += window.seconds
        kept = replace(window, prefill_tokens=0, prefill_busy_s=0.0, decode_steps=[])
        kept.ttft_s, kept.itl_s = [], []
        self.seen.append((self.now_s, kept))
        oldest = self.now_s - self.period_s - self.level_s
        while self.seen and self.seen[0][0] <= oldest:
            self.seen.pop(0)

    def ready(self) -> bool:
        """Whether a whole period has been seen."""
        return self.now_s >= self.period_s

    def ahead(self, horizon_s: float) -> list[ExpectedLoad]:
        """The load each window of the last period from now to `horizon_s` ahead saw, pooled
        with its neighbours, then alone at the lower end of its count, each scaled to today's
        level; empty until `ready`."""
        if not self.ready():
            return []
        then = self.now_s - self.period_s
        span = min(self.level_s, then)  # (the first period's start has nothing before it)
        self.level = 1.0
        if span >= self.level_s / 4:
            today = self._arrivals(self.now_s - span, self.now_s)
            before = self._arrivals(then - span, then)
            low, high = _LEVEL_BOUNDS
            self.level = min(high, max(low, (today + 1) / (before + 1)))
        expected = []
        for index, (end, window) in enumerate(self.seen):
            if end <= then or end - window.seconds >= then + horizon_s:
                continue
            pooled = [w for _, w in self.seen[max(0, index - 1) : index + 2]]
            expected.append(self._load(end - then, pooled, 0.0))
            # and the window alone at the lower end of its count: pooling blurs a sharp edge,
            # and the edge of a peak is where its last worker is still needed
            expected.append(self._load(end - then, [window], _Z))
        return [load for load in expected if load is not None]

    def _load(self, in_s: float, windows: list[LoadWindow], z: float) -> ExpectedLoad | None:
        """The load of `windows` together, their count lowered by `z` standard deviations, at
        today's level."""
        arrivals = sum(w.arrivals for w in windows)
        seconds = sum(w.seconds for w in windows)
        if not arrivals or seconds <= 0:
            return None
        prompt = sum(w.prompt_tokens for w in windows) / arrivals
        mean_sq = sum(w.prompt_tokens_sq for w in windows) / arrivals
        spread = max(0.0, mean_sq / prompt**2 - 1) if mean_sq and prompt else 0.0
        finished = sum(w.finished for w in windows)
        output = sum(w.output_tokens for w in windows) / finished if finished else None
        rate = max(0.0, arrivals - z * math.sqrt(arrivals)) / seconds * self.level
        return ExpectedLoad(in_s, rate, prompt, spread, output)

    def _arrivals(self, start: float, end: float) -> int:
        return sum(w.arrivals for t, w in self.seen if start < t <= end)
