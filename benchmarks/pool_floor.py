"""The fewest worker-seconds a trace's load needs: the planner's sizing applied to the true rate.

A planner sees the load only after it has arrived, through noisy windows, and must wait a start-up
for a new worker. The floor is what a planner with perfect foresight would use with the same
sizing model (`scheduler.pool_planner.PoolPlanner.needs`): each window's pools sized for the
highest rate the trace's phases give it (not the arrivals drawn), the workers' speeds exactly
those of the cost model, every new worker started one start-up ahead of the window that needs it
(the start-up counts as worker-seconds, as it does in `benchmarks.gpu_sim`'s runs) and released
the moment no window needs it; the first window's pools are there at the start. No real planner
beats it; how close one comes is what its hysteresis and its blindness to the future cost.

    python -m benchmarks.gpu_sim --trace daily --floor --scaling 3:2 --window-s 10
"""

from __future__ import annotations

import math
from typing import Any

from deploy.bench.cost_model import CostModel
from scheduler.load_window import LoadWindow
from scheduler.pool_planner import PoolPlanner, Speeds

Phase = tuple[tuple[float, float], tuple[int, int], tuple[int, int]]


def _mean(low: int, high: int) -> float:
    return (low + high) / 2


def phase_planner(
    phase: Phase,
    cost: CostModel,
    slo_ttft_s: float,
    slo_itl_s: float,
    bounds: tuple[int, int],
    decode_slots: int,
) -> tuple[PoolPlanner, LoadWindow]:
    """A planner that knows the phase's mix and the workers' speeds exactly, and a window of that
    mix (its rate is passed to `needs` separately)."""
    _, (p_low, p_high), (o_low, o_high) = phase
    prompt, output = _mean(p_low, p_high), _mean(o_low, o_high)
    lengths = [p_low + (p_high - p_low) * (i + 0.5) / 100 for i in range(100)]
    service_s = sum(
        cost.prefill_fixed_s
        + cost.prefill_per_token_s * n
        + cost.prefill_per_token_context_s * n * n / 2
        for n in lengths
    ) / len(lengths)
    # a decode step's per-sequence cost includes reading its KV: prompt + half the answer
    per_seq_s = cost.decode_per_seq_s + cost.decode_per_kv_token_s * (prompt + output / 2)
    planner = PoolPlanner(
        slo_itl_s=slo_itl_s,
        decode_slots=decode_slots,
        slo_ttft_s=slo_ttft_s,
        max_prefill=bounds[0],
        max_decode=bounds[1],
        speeds=Speeds(
            prefill_tok_s=prompt / service_s,
            decode_fixed_s=cost.decode_fixed_s,
            decode_per_seq_s=per_seq_s,
        ),
    )
    spread = (p_high - p_low) ** 2 / 12 / prompt**2  # uniform lengths' squared CV
    many = 10_000
    window = LoadWindow(
        seconds=1.0,
        arrivals=many,
        prompt_tokens=round(many * prompt),
        prompt_tokens_sq=round(many * prompt**2 * (1 + spread)),
        finished=many,
        output_tokens=round(many * output),
    )
    return planner, window


def pool_floor(
    phases: list[Phase],
    minutes: float,
    cost: CostModel,
    slo_ttft_s: float,
    slo_itl_s: float,
    window_s: float,
    bounds: tuple[int, int] = (64, 64),
    decode_slots: int = 64,
    release_delay_s: float = 0.0,
) -> dict[str, Any]:
    """Per window the pools the load needs, and the worker-seconds they take with each start
    after the first window's pools paid `cost.startup_s` ahead (the first window's are ready at
    the start, as a run's starting pools and a fixed deployment's are); beside them those of the
    fixed deployment sized for the peak (the most workers of each kind a window needs, within
    `bounds`) for the whole trace. With `release_delay_s`, a worker stays that long after the
    last window that needs it, as the planner's releases wait."""
    length = minutes * 60 / len(phases)
    windows = math.ceil(minutes * 60 / window_s)
    planners = [
        phase_planner(phase, cost, slo_ttft_s, slo_itl_s, bounds, decode_slots) for phase in phases
    ]
    pools: list[tuple[int, int]] = []
    for number in range(windows):
        start, end = number * window_s, min(minutes * 60, (number + 1) * window_s)
        want = (1, 1)
        # every phase the window overlaps, at its highest rate within the window
        for index in range(int(start // length), min(len(phases), math.ceil(end / length))):
            (first, last), _, _ = phases[index]
            rates = [
                first + (last - first) * (max(0.0, min(length, t - index * length)) / length)
                for t in (start, end)
            ]
            planner, window = planners[index]
            need = planner.needs(window, rate=max(rates))
            assert need is not None
            target = planner._target(*need)
            want = (max(want[0], target.prefill), max(want[1], target.decode))
        pools.append(want)
    held = math.ceil(release_delay_s / window_s - 1e-9)
    pools = [
        (
            max(p for p, _ in pools[max(0, n - held) : n + 1]),
            max(d for _, d in pools[max(0, n - held) : n + 1]),
        )
        for n in range(len(pools))
    ]
    starts = sum(
        max(0, now[0] - before[0]) + max(0, now[1] - before[1])
        for before, now in zip(pools, pools[1:], strict=False)
    )
    serving_s = sum((p + d) * window_s for p, d in pools)
    worker_s = serving_s + starts * cost.startup_s
    peak = (max(p for p, _ in pools), max(d for _, d in pools))
    fixed_s = (peak[0] + peak[1]) * minutes * 60
    return {
        "window_s": window_s,
        "release_delay_s": release_delay_s,
        "pools": pools,
        "starts": starts,
        "worker_seconds": round(worker_s, 1),
        "fixed": f"{peak[0]}:{peak[1]}",
        "fixed_worker_seconds": round(fixed_s, 1),
        "ratio_to_fixed": round(worker_s / fixed_s, 3),
    }
