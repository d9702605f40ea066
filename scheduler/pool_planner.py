"""The pool planner: from the last window's load and the workers' measured speeds, how many
prefill and decode workers a cell should have, and why.

Pure: the coordinator feeds a `LoadWindow` (arrivals, finished requests, every step's size and
time) and asks `PoolPlanner.decide` at the end of each window. The model is the one Dynamo's SLA
planner and DistServe's placement use, from measurements instead of a profile:

* prefill: the prompts are a queue served by the pool (M/G/c). A prompt takes S = its tokens over
  the prompt tokens per busy second a prefill worker was measured at; the load is a = arrival rate
  x mean S. The pool needs the fewest workers c whose p90 TTFT (S plus the p90 wait, from Erlang's
  C formula with the Allen-Cunneen correction for the prompts' spread of lengths) stays under the
  TTFT SLO, as a fraction between c - 1 and c by where a lies between the loads c - 1 and c
  workers hold. One worker holds far less than its full speed within a TTFT SLO a few prompts
  long (S = 0.75 s, SLO 2 s: half of it), several together more (three hold 2.4 of 3). Without
  a TTFT SLO, or when one prompt alone takes longer than it: a / `utilization`;
* decode demand = arrival rate x mean output tokens; one decode worker runs at most the batch whose
  step time (fitted as d + e x batch from its steps) stays under the inter-token SLO, and supplies
  that batch / that step time tokens per second, again below `utilization`.

A pool whose window p90 (TTFT for prefill, ITL for decode) is past its SLO although the model
says it suffices, and no worker is on its way into it (a pool still growing misses for want of
the workers it has asked for, not by a fault of the model), has its need scaled up by a
correction that moves halfway to the observed overshoot each window (at most 4x) and halves back
toward 1 within the SLO (for prefill, the correction scales the load).

With a fixed number of workers the split follows the ratio of the two needs; with scaling on each
pool is sized to its need within its bounds, a decode pool that grows while the prefill pool
shrinks taking a prefill worker (a role change, not a release and a start: a prefill worker is free
within its current prompts), a prefill pool that grows while the decode pool shrinks starting its
workers (a decode worker is free only when its longest answer ends), and pools that only grow
starting all their new workers at once. Hysteresis: a new target must be seen in `patience`
windows running before it is acted on (at once when the pool it grows misses its SLO: the
window's p90 TTFT for prefill, p90 ITL for decode; and, with scaling, when it only starts
workers: a start answers a start-up later, so waiting a window on a rising load costs a window
more of queued prompts), and each decision moves one worker but for starts. A release waits
longer, as autoscalers' downscale delays do: only when each of the last `release_after` windows
needed fewer workers, and so does their load together taken at the upper end of what their
arrivals allow (the count plus 1.28 standard deviations: one-sided 90%), down to the most of
these. One window's arrivals are noisy (30 expected at 3 req/s, from 14 to 35
seen), and a worker released on a dip in a rising load is started again a start-up later, while
prompts queue.

Pools whose workers hold different numbers of devices (tensor-parallel ranks: `prefill_ranks`,
`decode_ranks`) count devices where they trade: a fixed total is one of devices, split in whole
workers of each pool, and a role change moves the fewest whole workers that hold the same devices
on both sides (the least common multiple of the two sizes: a prefill pool of one rank a worker
gives two workers for one decode worker of two ranks, and the reverse). With scaling, a pool that
grows by less than such a group while the other shrinks starts its workers instead.

With scaling and a `SeasonalForecast` that has seen a whole period (scheduler/load_forecast.py),
the forecast decides instead: the pools are sized for the most the last period's windows from
now until a worker started now could answer and serve a window needed (at today's level), or for
this window's load at the lower end of its arrivals when that needs more; growth, role changes
and releases (one a window) follow it at once, with no patience or release delay, for the
forecast's windows are pooled and it knows whether a falling load comes back before a new worker
could start.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from scheduler.load_forecast import SeasonalForecast
from scheduler.load_window import LoadWindow


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


_RATE_Z = 1.28  # one-sided 90%: the rate a release is judged at


def erlang_c(servers: int, load: float) -> float:
    """The probability that an arrival waits, with `servers` and `load` Erlangs (< servers)."""
    blocking = 1.0  # Erlang B, by its recurrence
    for k in range(1, servers + 1):
        blocking = load * blocking / (k + load * blocking)
    return servers * blocking / (servers - load * (1 - blocking))


def p90_ttft(servers: int, load: float, service_s: float, spread: float) -> float:
    """p90 of service + wait in an M/G/c queue: P(wait > t) = C exp(-(c - a) t / (S k)), with
    k = (1 + cs^2) / 2 (Allen-Cunneen; `spread` = cs^2, 0 for prompts of one length)."""
    if load >= servers:
        return math.inf
    waits = erlang_c(servers, load)
    if waits <= 0.1:
        return service_s
    scale = service_s * (1 + spread) / 2
    return service_s + scale * math.log(waits / 0.1) / (servers - load)


def held_load(servers: int, service_s: float, spread: float, slo_s: float) -> float:
    """The most Erlangs `servers` workers hold with the p90 TTFT under `slo_s` (by bisection)."""
    low, high = 0.0, float(servers)
    for _ in range(40):
        middle = (low + high) / 2
        if p90_ttft(servers, middle, service_s, spread) <= slo_s:
            low = middle
        else:
            high = middle
    return low


def queue_need(load: float, service_s: float, spread: float, slo_s: float, most: int) -> float:
    """Workers a prompt queue of `load` Erlangs needs for its p90 TTFT (see the module's
    docstring): c - 1 + how far the load lies from what c - 1 hold to what c hold; past `most`
    workers, by the load `most` hold per worker."""
    below = 0.0
    for servers in range(1, most + 1):
        held = held_load(servers, service_s, spread, slo_s)
        if load <= held:
            return servers - 1 + (load - below) / max(1e-9, held - below)
        below = held
    return load * most / max(1e-9, below)


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
    total: int | None = None  # fixed number of devices (role changes only); None: scaling
    prefill_ranks: int = 1  # devices a prefill worker holds (its tensor-parallel size)
    decode_ranks: int = 1  # devices a decode worker holds
    utilization: float = 0.8
    patience: int = 2  # windows a new target must persist before it is acted on
    release_after: int = 3  # windows that must all need fewer workers before one is released
    # with scaling, the last release_after windows: (arrivals, seconds, the pools they needed)
    recent: list[tuple[int, float, PoolTarget]] = field(default_factory=list)
    speeds: Speeds = field(default_factory=Speeds)
    mean_prompt: float | None = None
    prompt_spread: float = 0.0  # squared coefficient of variation of the prompts' lengths
    mean_output: float | None = None
    pending: PoolTarget | None = None
    seen: int = 0
    last_needs: tuple[float, float] | None = None  # what the last window needed
    # observed over predicted: a pool that misses its SLO although the model says it suffices
    # needs more than the model says (Dynamo's planner corrects its profile the same way)
    prefill_correction: float = 1.0
    decode_correction: float = 1.0
    # with scaling: the last period's load, to size the pools a start-up ahead
    forecast: SeasonalForecast | None = None
    startup_s: float = 60.0  # a started worker's time to answer (the cell measures it)
    last_ahead: tuple[int, int] | None = None  # what the forecast last asked for

    def needs(self, window: LoadWindow, rate: float | None = None) -> tuple[float, float] | None:
        """(prefill workers, decode workers) the window's load needs (at `rate` requests/s
        instead of the window's when given); None when not measurable yet."""
        if window.arrivals:
            self.mean_prompt = window.prompt_tokens / window.arrivals
            if window.prompt_tokens_sq:
                mean_sq = window.prompt_tokens_sq / window.arrivals
                self.prompt_spread = max(0.0, mean_sq / self.mean_prompt**2 - 1)
        if window.finished:
            self.mean_output = window.output_tokens / window.finished
        if self.mean_prompt is None or self.mean_output is None:
            return None
        rate = window.arrival_rate if rate is None else rate
        return self.needs_at(rate, self.mean_prompt, self.prompt_spread, self.mean_output)

    def needs_at(
        self,
        rate: float,
        mean_prompt: float,
        prompt_spread: float,
        mean_output: float,
        speeds: Speeds | None = None,
    ) -> tuple[float, float] | None:
        """(prefill workers, decode workers) `rate` requests/s of this mix need at `speeds` (the
        ones measured last by default); None before the workers' speeds are measured."""
        speeds = self.speeds if speeds is None else speeds
        batch = speeds.decode_batch(self.slo_itl_s, self.decode_slots)
        decode_rate = speeds.decode_tok_s(batch)
        if speeds.prefill_tok_s is None or decode_rate is None:
            return None
        service_s = mean_prompt / speeds.prefill_tok_s
        load = rate * service_s * self.prefill_correction
        if self.slo_ttft_s is None or service_s >= self.slo_ttft_s:
            prefill = load / self.utilization
        else:
            most = max(self.max_prefill, (self.total or 0) // self.prefill_ranks)
            prefill = queue_need(load, service_s, prompt_spread, self.slo_ttft_s, most)
        decode = rate * mean_output / (decode_rate * self.utilization)
        return prefill, decode * self.decode_correction

    def correct(self, window: LoadWindow, joining: tuple[int, int] = (0, 0)) -> None:
        """Move each correction halfway to how far the window's p90 is past its SLO (at most 4);
        within the SLO, halve it (never below 1). A pool with `joining` workers on their way in
        keeps its correction."""
        if window.ttft_s and self.slo_ttft_s is not None and not joining[0]:
            ratio = _p90(window.ttft_s) / self.slo_ttft_s
            self.prefill_correction = _corrected(self.prefill_correction, ratio)
        if window.itl_s and not joining[1]:
            ratio = _p90(window.itl_s) / self.slo_itl_s
            self.decode_correction = _corrected(self.decode_correction, ratio)

    def decide(
        self, window: LoadWindow, prefill: int, decode: int, joining: tuple[int, int] = (0, 0)
    ) -> PoolTarget | None:
        """The pools' next sizes (one role change or release at most; starts all at once), or
        None to leave them. `prefill` and `decode` count the workers on their way into a pool
        (`joining`: how many of them) and not those on their way out."""
        self.speeds.observe(window)
        self.correct(window, joining)
        if self.forecast is not None:
            self.forecast.record(window)
        need = self.needs(window)
        self.last_needs = None if need is None else (round(need[0], 2), round(need[1], 2))
        if need is None:
            return None
        want = self._target(*need)
        ahead = self._ahead(window) if self.total is None else None
        self.last_ahead = None if ahead is None else (ahead.prefill, ahead.decode)
        if ahead is not None:  # the forecast decides, at once: its windows are pooled
            self.pending = None
            self.seen = 0
            if (ahead.prefill, ahead.decode) == (prefill, decode):
                return None
            return _one_step(ahead, prefill, decode, False, self.trade_unit)
        if self.total is None:
            recent = self.recent + [(window.arrivals, window.seconds, want)]
            self.recent = recent[-self.release_after :]
            if want.prefill <= prefill and want.decode <= decode:
                return self._release(window, prefill, decode)
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
        step = _one_step(want, prefill, decode, self.total is not None, self.trade_unit)
        if self.seen < self.patience and not self._now(window, step, prefill, decode):
            return None
        self.pending = None
        self.seen = 0
        return step

    def _ahead(self, window: LoadWindow) -> PoolTarget | None:
        """With a forecast that has seen a period: the most workers of each kind the load
        expected from now until a worker started now could answer and serve a window needs, or,
        if more, what this window needs at the lower end of its arrivals (count - 1.28 standard
        deviations: a load above the last period's by more than noise)."""
        if self.forecast is None or self.mean_output is None:
            return None
        horizon_s = self.startup_s + window.seconds
        expected = self.forecast.ahead(horizon_s)
        targets = []
        for load in expected:
            output = self.mean_output if load.mean_output is None else load.mean_output
            # the speeds measured on that load where it had any (they depend on the mix)
            fit = load.decode_fit
            speeds = Speeds(
                prefill_tok_s=load.prefill_tok_s or self.speeds.prefill_tok_s,
                decode_fixed_s=self.speeds.decode_fixed_s if fit is None else fit[0],
                decode_per_seq_s=self.speeds.decode_per_seq_s if fit is None else fit[1],
            )
            need = self.needs_at(load.rate, load.mean_prompt, load.prompt_spread, output, speeds)
            if need is not None:
                targets.append(self._target(*need))
        if not targets:
            return None
        most = max(targets, key=lambda t: (t.prefill + t.decode, t.prefill))
        ahead = PoolTarget(
            max(t.prefill for t in targets), max(t.decode for t in targets), most.reason
        )
        arrivals = window.arrivals
        low = max(0.0, arrivals - _RATE_Z * math.sqrt(arrivals)) / max(1e-9, window.seconds)
        need = self.needs(window, low)
        now = self._target(*need) if need is not None else ahead
        reason = (
            f"a period ago the next {horizon_s:.0f} s needed at most {ahead.prefill}:"
            f"{ahead.decode} at {self.forecast.level:.2f}x today's level ({ahead.reason}); this "
            f"window at the lower end of its arrivals {now.prefill}:{now.decode}"
        )
        return PoolTarget(max(ahead.prefill, now.prefill), max(ahead.decode, now.decode), reason)

    def _release(self, window: LoadWindow, prefill: int, decode: int) -> PoolTarget | None:
        """With scaling, a target no larger than the pools: release one worker if each of the
        last `release_after` windows needed fewer, and so does their load together at the upper
        end of its arrival rate; toward the most of these."""
        self.pending = None
        self.seen = 0
        if len(self.recent) < self.release_after:
            return None
        arrivals = sum(n for n, _, _ in self.recent)
        seconds = sum(s for _, s, _ in self.recent)
        rate = (arrivals + _RATE_Z * math.sqrt(max(1, arrivals))) / max(1e-9, seconds)
        need = self.needs(window, rate)
        if need is None:
            return None
        targets = [t for _, _, t in self.recent] + [self._target(*need)]
        most_prefill = max(t.prefill for t in targets)
        most_decode = max(t.decode for t in targets)
        if most_prefill > prefill or most_decode > decode:
            return None  # (the load may be rising: growing waits on its own patience)
        if (most_prefill, most_decode) == (prefill, decode):
            return None
        reason = (
            f"{targets[-1].reason}; the last {len(self.recent)} windows needed at most "
            f"{most_prefill}:{most_decode}, {rate:.2f} req/s included (the upper end of their "
            f"{arrivals} arrivals in {seconds:.0f} s)"
        )
        want = PoolTarget(most_prefill, most_decode, reason)
        return _one_step(want, prefill, decode, False, self.trade_unit)

    def _now(self, window: LoadWindow, want: PoolTarget, prefill: int, decode: int) -> bool:
        """Act on the step `want` without waiting for the target to persist: with scaling, when
        it only starts workers (a start answers a start-up later, and a worker started on a noisy
        window goes again after the release delay), or when the pool it grows is missing its SLO
        now (p90 of the window's finished requests)."""
        if self.total is None and want.prefill >= prefill and want.decode >= decode:
            return True
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
            return PoolTarget(*self._split(prefill_need, decode_need), reason)
        prefill = min(self.max_prefill, max(self.min_prefill, math.ceil(prefill_need)))
        decode = min(self.max_decode, max(self.min_decode, math.ceil(decode_need)))
        return PoolTarget(prefill, decode, reason)

    @property
    def trade_unit(self) -> tuple[int, int]:
        """(prefill workers, decode workers) that hold the same devices: what a role change
        moves."""
        devices = math.lcm(self.prefill_ranks, self.decode_ranks)
        return devices // self.prefill_ranks, devices // self.decode_ranks

    def _split(self, prefill_need: float, decode_need: float) -> tuple[int, int]:
        """The fixed total of devices in whole workers of each pool, the prefill pool's devices
        nearest its share of what both pools need in devices (a tie to the rounded share)."""
        assert self.total is not None
        ranks, decode_ranks = self.prefill_ranks, self.decode_ranks
        prefill_devices = prefill_need * ranks
        share = prefill_devices / max(1e-9, prefill_devices + decode_need * decode_ranks)
        ideal = self.total * share  # devices
        splits = [
            (n, (self.total - n * ranks) // decode_ranks)
            for n in range(self.total // ranks + 1)
            if (self.total - n * ranks) % decode_ranks == 0
            and (self.total - n * ranks) // decode_ranks >= self.min_decode
        ]
        bounded = [
            (n, m)
            for n, m in splits
            if self.min_prefill <= n <= self.max_prefill and m <= self.max_decode
        ]
        nearest = round(ideal / ranks)
        return min(bounded or splits, key=lambda s: (abs(s[0] * ranks - ideal), s[0] != nearest))


def _one_step(
    want: PoolTarget, prefill: int, decode: int, fixed: bool, unit: tuple[int, int] = (1, 1)
) -> PoolTarget:
    """Move toward `want`. With a fixed total, one role change. With scaling, a decode pool that
    grows while the prefill pool shrinks takes a prefill worker (a role change: the worker keeps
    its weights and its GPU, and a prefill worker is free within its current prompts); a prefill
    pool that grows while the decode pool shrinks starts its workers instead, for a decode worker
    is free only when its longest answer ends, often later than a start-up, and the decode
    surplus leaves by the release rule. Pools that only grow grow to `want` at once: their new
    workers start side by side, each taking its start-up time. Pools that only shrink release
    one worker, prefill first.

    A role change moves `unit`, the prefill and decode workers that hold the same devices (one
    of each where both pools' workers hold as many); with scaling, only when both pools' targets
    take a whole unit, else the decode pool starts its workers."""
    unit_prefill, unit_decode = unit
    if fixed:
        step = 1 if want.prefill > prefill else -1
        return PoolTarget(prefill + step * unit_prefill, decode - step * unit_decode, want.reason)
    if want.decode > decode and want.prefill < prefill:
        if prefill - unit_prefill >= want.prefill and decode + unit_decode <= want.decode:
            return PoolTarget(prefill - unit_prefill, decode + unit_decode, want.reason)
        return PoolTarget(prefill, want.decode, want.reason)
    if want.prefill > prefill and want.decode < decode:
        return PoolTarget(want.prefill, decode, want.reason)
    if want.prefill >= prefill and want.decode >= decode:
        return want
    if want.prefill != prefill:
        return PoolTarget(prefill - 1, decode, want.reason)
    return PoolTarget(prefill, decode - 1, want.reason)
