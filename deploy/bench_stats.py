"""Serving statistics: percentiles, latency summaries and SLO goodput (as DistServe and vLLM define it)."""

from __future__ import annotations

from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) with linear interpolation between ranks (numpy's default)."""
    if not values:
        return 0.0
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(name: str, values: Sequence[float]) -> dict[str, float]:
    """`{name}_mean`, `_p50`, `_p90`, `_p99` of the values (0 for none)."""
    mean = sum(values) / len(values) if values else 0.0
    return {f"{name}_mean": mean} | {f"{name}_p{q}": percentile(values, q) for q in (50, 90, 99)}


def goodput(ttft_s: Sequence[float], tpot_s: Sequence[float], duration_s: float,
            slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None) -> float:
    """Requests per second that met every SLO given (all requests count when none is given)."""
    if duration_s <= 0:
        raise ValueError("duration must be positive")
    good = sum(1 for ttft, tpot in zip(ttft_s, tpot_s, strict=True)
               if (slo_ttft_ms is None or ttft * 1000 <= slo_ttft_ms)
               and (slo_tpot_ms is None or tpot * 1000 <= slo_tpot_ms))
    return good / duration_s
