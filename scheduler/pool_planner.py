"""The pool planner: from the last window's load and the workers' measured speeds, how many
prefill and decode workers a cell should have, and why.

Pure: the coordinator feeds a `LoadWindow` (arrivals, finished requests, every step's size and
time) and asks `PoolPlanner.decide` at the end of each window. The model is the one Dynamo's SLA
planner and DistServe's placement use, from measurements instead of a profile:

* prefill demand = arrival rate x mean prompt tokens; one prefill worker supplies the prompt tokens
  per busy second it was measured at, kept below `utilization` of it so prompts do not queue;
* decode demand = arrival rate x mean output tokens; one decode worker runs at most the batch whose
  step time (fitted as d + e x batch from its steps) stays under the inter-token SLO, and supplies
  that batch / that step time tokens per second, again below `utilization`.

A pool whose window p90 (TTFT for prefill, ITL for decode) is past its SLO although the model
says it suffices has its need scaled up by a correction that moves halfway to the observed
overshoot each window (at most 4x) and halves back toward 1 within the SLO. With a fixed number
of workers the split follows the ratio of the two needs; with scaling on each pool is sized to
its need within its bounds, a pool that grows while the other shrinks taking the worker the other
gives up (a role change, not a release and a start), and pools that only grow starting all
their new workers at once. Hysteresis: a new target must be seen in
`patience` windows running before it is acted on (at once when the pool it grows misses its SLO:
the window's p90 TTFT for prefill, p90 ITL for decode), and each decision moves one worker but for
starts. A release waits longer, as autoscalers' downscale delays do: only when every one of the last
`release_after` windows needed fewer workers, down to the most of them. One window's arrivals are
noisy (30 expected at 3 req/s, from 14 to 35 seen), and a worker released on a dip in a rising load
is started again a start-up later, while prompts queue.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class LoadWindow:
    """What one window saw."""

    seconds: float = 0.0
    arrivals: int = 0
    prompt_tokens: int = 0  # of the arrivals
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


@dataclass(frozen=True)
class PoolTarget:
    prefill: int
    decode: int
    reason: str


@dataclass
class Speeds:
    """The workers' measured speeds, kept across windows (a window without a kind of step keeps
    the last figure)."""

    prefill_tok_s: float | None = None  # prompt tokens per busy second of one prefill worker
    decode_fixed_s: float | None = None  # d of step(b) = d + e b
    decode_per_seq_s: float | None = None  # e

    def observe(self, window: LoadWindow) -> None:
        if window.prefill_busy_s > 0 and window.prefill_tokens > 0:
            self.prefill_tok_s = window.prefill_tokens / window.prefill_busy_s
        fit = fit_line(window.decode_steps)
        if fit is not None:
            self.decode_fixed_s, self.decode_per_seq_s = fit

    def decode_batch(self, itl_slo_s: float, max_batch: int) -> int:
        """The largest batch whose step stays under the ITL SLO (max_batch when unknown)."""
        if self.decode_fixed_s is None or self.decode_per_seq_s is None:
            return max_batch
        if self.decode_per_seq_s <= 0:
            return max_batch
        room = (itl_slo_s - self.decode_fixed_s) / self.decode_per_seq_s
        return max(1, min(max_batch, int(room)))

    def decode_tok_s(self, batch: int) -> float | None:
        if self.decode_fixed_s is None or self.decode_per_seq_s is None:
            return None
        return batch / max(1e-9, self.decode_fixed_s + self.decode_per_seq_s * batch)


_MAX_CORRECTION = 4.0


def _corrected(correction: float, ratio: float) -> float:
    if ratio <= 1:
        return max(1.0, correction / 2)
    return max(1.0, (correction + min(_MAX_CORRECTION, ratio)) / 2)


def _p90(values: list[float]) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


def fit_line(points: list[tuple[int, float]]) -> tuple[float, float] | None:
    """Least-squares (d, e) of y = d + e x; None with fewer than two distinct x."""
    if len({x for x, _ in points}) < 2:
        return None
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    var = sum((x - mean_x) ** 2 for x, _ in points)
    cov = sum((x - mean_x) * (y - mean_y) for x, y in points)
    slope = max(0.0, cov / var)
    return max(0.0, mean_y - slope * mean_x), slope


@dataclass
class PoolPlanner:
    """Decides each pool's size at the end of a window (see the module's docstring)."""

    slo_itl_s: float
    decode_slots: int
    slo_ttft_s: float | None = None
    min_prefill: int = 1
    max_prefill: int = 64
    min_decode: int = 1
    max_decode: int = 64
    total: int | None = None  # fixed number of workers (role changes only); None: scaling
    utilization: float = 0.8
    patience: int = 2  # windows a new target must persist before it is acted on
    release_after: int = 3  # windows that must all need fewer workers before one is released
    # with scaling: the targets of the last release_after windows
    recent: list[PoolTarget] = field(default_factory=list)
    speeds: Speeds = field(default_factory=Speeds)
    mean_prompt: float | None = None
    mean_output: float | None = None
    pending: PoolTarget | None = None
    seen: int = 0
    last_needs: tuple[float, float] | None = None  # what the last window needed
    # observed over predicted: a pool that misses its SLO although the model says it suffices
    # needs more than the model says (Dynamo's planner corrects its profile the same way)
    prefill_correction: float = 1.0
    decode_correction: float = 1.0

    def needs(self, window: LoadWindow) -> tuple[float, float] | None:
        """(prefill workers, decode workers) the window's load needs; None when not measurable
        yet."""
        if window.arrivals:
            self.mean_prompt = window.prompt_tokens / window.arrivals
        if window.finished:
            self.mean_output = window.output_tokens / window.finished
        if self.mean_prompt is None or self.mean_output is None:
            return None
        batch = self.speeds.decode_batch(self.slo_itl_s, self.decode_slots)
        decode_rate = self.speeds.decode_tok_s(batch)
        if self.speeds.prefill_tok_s is None or decode_rate is None:
            return None
        rate = window.arrival_rate
        prefill = rate * self.mean_prompt / (self.speeds.prefill_tok_s * self.utilization)
        decode = rate * self.mean_output / (decode_rate * self.utilization)
        return prefill * self.prefill_correction, decode * self.decode_correction

    def correct(self, window: LoadWindow) -> None:
        """Move each correction halfway to how far the window's p90 is past its SLO (at most 4);
        within the SLO, halve it (never below 1)."""
        if window.ttft_s and self.slo_ttft_s is not None:
            ratio = _p90(window.ttft_s) / self.slo_ttft_s
            self.prefill_correction = _corrected(self.prefill_correction, ratio)
        if window.itl_s:
            ratio = _p90(window.itl_s) / self.slo_itl_s
            self.decode_correction = _corrected(self.decode_correction, ratio)

    def decide(self, window: LoadWindow, prefill: int, decode: int) -> PoolTarget | None:
        """The pools' next sizes (one role change or release at most; starts all at once), or
        None to leave them."""
        self.speeds.observe(window)
        self.correct(window)
        need = self.needs(window)
        self.last_needs = None if need is None else (round(need[0], 2), round(need[1], 2))
        if need is None:
            return None
        want = self._target(*need)
        if self.total is None:
            self.recent = (self.recent + [want])[-self.release_after :]
            if want.prefill <= prefill and want.decode <= decode:
                return self._release(want, prefill, decode)
        if (want.prefill, want.decode) == (prefill, decode):
            self.pending = None
            self.seen = 0
            return None
        if self.pending is not None and (self.pending.prefill, self.pending.decode) == (
            want.prefill,
            want.decode,
        ):
            self.seen += 1
        else:
            self.pending = want
            self.seen = 1
        if self.seen < self.patience and not self._missing_slo(window, want, prefill, decode):
            return None
        self.pending = None
        self.seen = 0
        return _one_step(want, prefill, decode, self.total is not None)

    def _release(self, want: PoolTarget, prefill: int, decode: int) -> PoolTarget | None:
        """With scaling, a target no larger than the pools: release one worker if each of the last
        `release_after` windows needed fewer, toward the most they needed."""
        self.pending = None
        self.seen = 0
        if len(self.recent) < self.release_after:
            return None
        most_prefill = max(t.prefill for t in self.recent)
        most_decode = max(t.decode for t in self.recent)
        if most_prefill > prefill or most_decode > decode:
            return None  # (a recent window asked for more: growing waits on its own patience)
        if (most_prefill, most_decode) == (prefill, decode):
            return None
        reason = f"{want.reason}; the last {len(self.recent)} windows needed at most "
        most = PoolTarget(most_prefill, most_decode, reason + f"{most_prefill}:{most_decode}")
        return _one_step(most, prefill, decode, fixed=False)

    def _missing_slo(self, window: LoadWindow, want: PoolTarget, prefill: int, decode: int) -> bool:
        """The pool the target grows is missing its SLO now (p90 of the window's finished
        requests): act without waiting for the target to persist."""
        if want.prefill > prefill and self.slo_ttft_s is not None:
            return _p90(window.ttft_s) > self.slo_ttft_s
        if want.decode > decode:
            return _p90(window.itl_s) > self.slo_itl_s
        return False

    def _target(self, prefill_need: float, decode_need: float) -> PoolTarget:
        reason = (
            f"prefill needs {prefill_need:.2f} workers, decode {decode_need:.2f} "
            f"(ITL SLO {self.slo_itl_s * 1000:.0f} ms)"
        )
        if self.total is not None:
            share = prefill_need / max(1e-9, prefill_need + decode_need)
            prefill = round(self.total * share)
            prefill = min(self.max_prefill, max(self.min_prefill, prefill))
            prefill = min(prefill, self.total - self.min_decode)
            return PoolTarget(prefill, self.total - prefill, reason)
        prefill = min(self.max_prefill, max(self.min_prefill, math.ceil(prefill_need)))
        decode = min(self.max_decode, max(self.min_decode, math.ceil(decode_need)))
        return PoolTarget(prefill, decode, reason)


def _one_step(want: PoolTarget, prefill: int, decode: int, fixed: bool) -> PoolTarget:
    """Move toward `want`. One role change when one pool grows and the other shrinks
    (always, with a fixed total): the worker keeps its weights and its GPU, where releasing it
    and starting another would load them again, and the growing pool is not left short while
    the other releases first. Pools that only grow grow to `want` at once: their new workers
    start side by side, each taking its start-up time. Pools that only shrink release one worker,
    prefill first."""
    if fixed or (want.prefill - prefill) * (want.decode - decode) < 0:
        step = 1 if want.prefill > prefill else -1
        return PoolTarget(prefill + step, decode - step, want.reason)
    if want.prefill >= prefill and want.decode >= decode:
        return want
    if want.prefill != prefill:
        return PoolTarget(prefill - 1, decode, want.reason)
    return PoolTarget(prefill, decode - 1, want.reason)
