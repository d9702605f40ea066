"""Serving statistics: percentiles, latency summaries and SLO goodput (as DistServe and vLLM define
it)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from deploy.bench.workload import Workload
from scheduler.outputs import Completion


class BenchFailed(RuntimeError):
    """A run produced no figures worth reporting: every request failed, or the engine cut requests
    short."""


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


def goodput(
    ttft_s: Sequence[float],
    tpot_s: Sequence[float],
    duration_s: float,
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
) -> float:
    """Requests per second that met every SLO given (all requests count when none is given)."""
    if duration_s <= 0:
        raise ValueError("duration must be positive")
    good = sum(
        1
        for ttft, tpot in zip(ttft_s, tpot_s, strict=True)
        if (slo_ttft_ms is None or ttft * 1000 <= slo_ttft_ms)
        and (slo_tpot_ms is None or tpot * 1000 <= slo_tpot_ms)
    )
    return good / duration_s


def summarize_run(
    work: Workload,
    results: dict[str, Completion],
    elapsed: float,
    slo_ttft_ms: float | None,
    slo_tpot_ms: float | None,
    exact: bool = True,
) -> dict[str, Any]:
    """Throughput, goodput, and mean/p50/p90/p99 of TTFT, TPOT, inter-token latency and end-to-end
    latency over the requests that succeeded; failed ones are counted (and never count as good).
    With `exact` (the engine in process), a request that made fewer tokens than asked is a bug and
    raises; an endpoint that does not honour `ignore_eos` may stop early, and its real token counts
    are used."""
    # (a steady stream that follows another is not run once the long prompts are done: no result)
    every = [
        results[str(i)]
        for i in range(len(work.prompts))
        if str(i) in results or not work.after or work.after[i] is None
    ]
    failed = [c for c in every if c.error is not None or c.finish_reason in ("error", "abort")]
    done = [c for c in every if c.error is None and c.finish_reason not in ("error", "abort")]
    if not done:
        raise BenchFailed(
            f"every request failed, e.g. {failed[0].error or failed[0].finish_reason}"
        )
    short = [
        (c.req_id, len(c.token_ids), work.output_lens[int(c.req_id)])
        for c in done
        if len(c.token_ids) != work.output_lens[int(c.req_id)]
    ]
    if short and exact:
        raise BenchFailed(
            f"requests ended early (id, tokens, asked): {short[:5]}; finish reasons: "
            f"{sorted({str(c.finish_reason) for c in done})}"
        )
    ttft_s = [c.metrics["ttft_s"] for c in done]
    tpot_s = [c.metrics["tpot_s"] for c in done]
    summary: dict[str, Any] = {
        "output_tok_s": sum(len(c.token_ids) for c in done) / elapsed,
        "requests_per_s": len(done) / elapsed,
        "duration_s": elapsed,
        "failed_requests": len(failed),
        "goodput_req_s": goodput(ttft_s, tpot_s, elapsed, slo_ttft_ms, slo_tpot_ms),
        "slo_ttft_ms": slo_ttft_ms,
        "slo_tpot_ms": slo_tpot_ms,
        "preemptions": sum(c.metrics.get("preemptions", 0) for c in done),
    }
    if failed:
        summary["failures"] = sorted({c.error or str(c.finish_reason) for c in failed})[:3]
    if short:
        summary["requests_ended_early"] = len(short)
    summary |= summarize("ttft_ms", [1000 * t for t in ttft_s])
    summary |= summarize(
        "tpot_ms", [1000 * c.metrics["tpot_s"] for c in done if len(c.token_ids) > 1]
    )
    summary |= summarize("itl_ms", [1000 * gap for c in done for gap in c.inter_token_s()])
    summary |= summarize("e2e_ms", [1000 * c.metrics["e2e_s"] for c in done])
    for phase in ("queue", "prefill", "handoff", "decode"):
        key = "kv_handoff_s" if phase == "handoff" else f"{phase}_s"
        if any(key in c.metrics for c in done):
            summary[f"{phase}_ms_mean"] = (
                1000 * sum(c.metrics.get(key, 0.0) for c in done) / len(done)
            )
    summary |= handoff_gaps("handoff_gap_ms", done)
    if work.steady:  # interference: the steady streams' pace, the long prompts' wait
        steady = [c for c in done if work.steady[int(c.req_id)]]
        long = [c for c in done if not work.steady[int(c.req_id)]]
        summary |= summarize(
            "steady_itl_ms", [1000 * gap for c in steady for gap in c.inter_token_s()]
        )
        summary["steady_streams"] = len(steady)
        summary |= {
            "steady_tpot_ms_p99": percentile([1000 * c.metrics["tpot_s"] for c in steady], 99),
            "long_ttft_ms_p50": percentile([1000 * c.metrics["ttft_s"] for c in long], 50),
            "long_ttft_ms_p99": percentile([1000 * c.metrics["ttft_s"] for c in long], 99),
        }
        # (the steady streams are handed off too)
        summary |= handoff_gaps("long_handoff_gap_ms", long)
    if work.conversation:  # a chat: the turns that find the conversation so far cached, or not
        summary |= later_turns(work, results, done)
    if any(work.urgent) and not all(work.urgent):
        for label, want in (("urgent", True), ("normal", False)):
            values = [
                1000 * c.metrics["ttft_s"] for c in done if work.urgent[int(c.req_id)] == want
            ]
            summary |= {
                f"{label}_ttft_ms_p50": percentile(values, 50),
                f"{label}_ttft_ms_p99": percentile(values, 99),
            }
    return summary


def later_turns(
    work: Workload, results: dict[str, Completion], done: list[Completion]
) -> dict[str, float]:
    """A chat's turns after the first: their TTFT, and the prompt tokens each computed beyond its
    own new tokens (the new message, and the last reply token, whose KV the reply never made): 0
    when the whole conversation before it came from the cache (needs the cached count: every
    engine mode, and endpoints that report `prompt_tokens_details`)."""
    later = [c for c in done if work.after[int(c.req_id)] is not None]
    out = {
        "later_turn_ttft_ms_p50": percentile([1000 * c.metrics["ttft_s"] for c in later], 50),
        "later_turn_ttft_ms_p90": percentile([1000 * c.metrics["ttft_s"] for c in later], 90),
    }
    extra = []
    for c in later:
        i = int(c.req_id)
        j = work.after[i]
        assert j is not None
        if "cached_tokens" not in c.metrics or str(j) not in results:
            continue
        new = len(work.prompts[i]) - len(work.prompts[j]) - len(results[str(j)].token_ids) + 1
        extra.append(len(work.prompts[i]) - int(c.metrics["cached_tokens"]) - new)
    if extra:
        out |= {
            "later_turn_extra_computed_mean": sum(extra) / len(extra),
            "later_turn_extra_computed_max": max(extra),
        }
    return out


def handoff_gaps(name: str, done: list[Completion]) -> dict[str, float]:
    """p50 and p99 of the handed-off requests' first token (sampled on the prefill worker) to their
    second (the decode worker's first); nothing when none was handed off."""
    gaps = [
        1000 * (c.token_times_s[1] - c.token_times_s[0])
        for c in done
        if c.metrics.get("kv_handoff_bytes") and len(c.token_times_s) > 1
    ]
    return (
        {f"{name}_p50": percentile(gaps, 50), f"{name}_p99": percentile(gaps, 99)} if gaps else {}
    )
