"""The load the pool planner expects next: what the same time of the last period (a day, a week)
saw, scaled to how busy today is against it.

Traffic to a service repeats: the morning rise, the evening's long chats, the nightly batch. A
planner that sees only the windows behind it learns of a rise when it has arrived, and a worker it
starts then answers a start-up later, while prompts queue; one that remembers the last period can
start it a start-up ahead, and can release a worker the moment the load falls, knowing whether it
comes back before a new one could start (Dynamo's planner predicts its next interval the same
way, with seasonal models among its predictors).

`SeasonalForecast` keeps each window's arrivals, prompt lengths, output lengths and the workers'
speeds on them (prompt tokens per busy second, decode step times: both depend on the mix) for one
period and a little more. `ahead(horizon_s)` returns, for every window of the last period from
now to `horizon_s` ahead, the load it saw: its arrivals and lengths pooled with those of the
window on each side (one window's count is Poisson-noisy: 30 expected, from 20 to 40 seen), and
the window alone at the lower end of its count (so a sharp edge is not blurred away), times the
level (today's arrivals over the last `level_s` against the same span a period ago, within 0.5-2;
1 while less than a quarter of that span a period ago has been seen, or while it saw fewer than 20
arrivals: a ratio of a few arrivals is noise, 3 against 6 no sign of a day twice as busy). Nothing
until a whole period has been seen. Pure: the planner feeds it the windows it closes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from scheduler.load_window import LoadWindow

_LEVEL_BOUNDS = (0.5, 2.0)
_Z = 1.28  # one-sided 90%: a window's count minus this many standard deviations
_LEVEL_MIN_ARRIVALS = 20  # fewer a period ago: the level is 1


@dataclass(frozen=True)
class ExpectedLoad:
    """The load one window ahead is expected to bring, and the speeds the workers had on it."""

    in_s: float  # how far ahead the window ends
    rate: float  # requests per second
    mean_prompt: float
    prompt_spread: float  # squared coefficient of variation of the prompts' lengths
    mean_output: float | None  # None: no request finished in those windows
    # prompt tokens per busy second of a prefill worker, measured on these prompts (a long
    # prompt's attention makes it slower per token than a short one's)
    prefill_tok_s: float | None
    # (d, e) of a decode step of b sequences = d + e b, measured on these answers (a longer
    # context reads more KV per sequence)
    decode_fit: tuple[float, float] | None


@dataclass
class _Seen:
    """What one window saw: its load, and its steps' sums for the speeds."""

    seconds: float
    arrivals: int
    prompt_tokens: int
    prompt_tokens_sq: int
    finished: int
    output_tokens: int
    prefill_tokens: int
    prefill_busy_s: float
    decode_sums: tuple[float, float, float, float, float]  # n, sum b, sum s, sum b^2, sum b s


@dataclass
class SeasonalForecast:
    """Windows seen, kept for a period and the level's span (see the module's docstring)."""

    period_s: float
    level_s: float = 120.0
    now_s: float = 0.0  # the end of the last window recorded, since the first began
    seen: list[tuple[float, _Seen]] = field(default_factory=list)  # (its end, it), oldest first
    level: float = 1.0  # the last `ahead`'s level

    def record(self, window: LoadWindow) -> None:
        # to the microsecond: windows timed as differences of a large clock (time.monotonic())
        # sum to 69.99999999999989 s for seven of 10 s, and a period would end a window late
        self.now_s = round(self.now_s + window.seconds, 6)
        steps = window.decode_steps
        sums = (
            float(len(steps)),
            float(sum(b for b, _ in steps)),
            sum(s for _, s in steps),
            float(sum(b * b for b, _ in steps)),
            sum(b * s for b, s in steps),
        )
        kept = _Seen(
            window.seconds,
            window.arrivals,
            window.prompt_tokens,
            window.prompt_tokens_sq,
            window.finished,
            window.output_tokens,
            window.prefill_tokens,
            window.prefill_busy_s,
            sums,
        )
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
        before = self._arrivals(then - span, then)
        if span >= self.level_s / 4 and before >= _LEVEL_MIN_ARRIVALS:
            today = self._arrivals(self.now_s - span, self.now_s)
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

    def _load(self, in_s: float, windows: list[_Seen], z: float) -> ExpectedLoad | None:
        """The load of `windows` together, their count lowered by `z` standard deviations, at
        today's level, and the speeds measured on it."""
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
        busy = sum(w.prefill_busy_s for w in windows)
        prefill = sum(w.prefill_tokens for w in windows) / busy if busy > 0 else None
        sums = [sum(column) for column in zip(*(w.decode_sums for w in windows), strict=True)]
        return ExpectedLoad(in_s, rate, prompt, spread, output, prefill, _fit(*sums))

    def _arrivals(self, start: float, end: float) -> int:
        return sum(w.arrivals for t, w in self.seen if start < t <= end)


def _fit(n: float, sx: float, sy: float, sxx: float, sxy: float) -> tuple[float, float] | None:
    """Least-squares (d, e) of y = d + e x from the sums of x, y, x^2, x y over n points, as
    `scheduler.pool_planner.fit_line` fits them; None without two distinct x."""
    if n < 2:
        return None
    var = sxx - sx * sx / n
    if var <= 1e-9 * max(1.0, sxx):
        return None
    slope = max(0.0, (sxy - sx * sy / n) / var)
    return max(0.0, (sy - slope * sx) / n), slope
