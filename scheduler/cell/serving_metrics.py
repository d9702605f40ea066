"""What one cell counts for `/metrics` (vLLM's metrics): cumulative counters and histograms as
plain numbers.

The cell's coordinator feeds it as requests are admitted, publish tokens, finish, time out and
fail over; `snapshot()` is a plain dict the ingress sums over every cell and renders in
Prometheus' text format (`deploy/serving/prometheus.py`). Gauges (requests running and waiting,
KV usage) are read from the cell's stats instead, when scraped.
"""

from __future__ import annotations

import bisect
import time
from collections import Counter
from typing import Any

from scheduler.outputs import RequestOutput

# vLLM's buckets for each histogram (vllm/v1/metrics/loggers.py), so its dashboards' quantiles
# read the same
TTFT_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS_S = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
)  # fmt: skip
REQUEST_BUCKETS_S = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip

# histogram -> (buckets, the finished output's metric it observes; None: observed per token)
HISTOGRAMS: dict[str, tuple[tuple[float, ...], str | None]] = {
    "time_to_first_token_seconds": (TTFT_BUCKETS_S, "ttft_s"),
    "inter_token_latency_seconds": (ITL_BUCKETS_S, None),
    "e2e_request_latency_seconds": (REQUEST_BUCKETS_S, "e2e_s"),
    "request_queue_time_seconds": (REQUEST_BUCKETS_S, "queue_s"),
    "request_prefill_time_seconds": (REQUEST_BUCKETS_S, "prefill_s"),
    "request_decode_time_seconds": (REQUEST_BUCKETS_S, "decode_s"),
}
# finish reasons whose requests ran to their end: only they are observed in the latency histograms
COMPLETED = ("stop", "length")


class Histogram:
    """Cumulative counts per bucket (Prometheus' `le`), their sum and count."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * len(buckets)  # observations in (bucket i-1, bucket i]; +Inf is count
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, times: int = 1) -> None:
        index = bisect.bisect_left(self.buckets, value)
        if index < len(self.buckets):
            self.counts[index] += times
        self.sum += value * times
        self.count += times

    def snapshot(self) -> dict[str, Any]:
        return {
            "buckets": list(self.buckets),
            "counts": list(self.counts),
            "sum": self.sum,
            "count": self.count,
        }


class ServingMetrics:
    """Counters and histograms of one cell since it started, in vLLM's terms.

    Prompt tokens are counted when a request is admitted (a continuation's, already counted by the
    cell it came from, are not), generation tokens as they are published, a request's KV handoff
    seconds when it finishes. Inter-token latency is
    observed per token: a publication of k tokens observes its gap since the request's last token
    divided by k, k times (a decode burst publishes several at once).
    """

    def __init__(self) -> None:
        self.counters: Counter[str] = Counter()
        self.finished: Counter[str] = Counter()  # by finish reason
        self.timeouts: Counter[str] = Counter()  # by deadline: queue, request
        self.histograms = {name: Histogram(b) for name, (b, _) in HISTOGRAMS.items()}
        self.last_token_s: dict[str, float] = {}  # request -> when its last token was published

    def on_admit(self, num_prompt_tokens: int, continuation: bool) -> None:
        if continuation:  # its stream's cell was lost: it continues here
            self.counters["failovers"] += 1
            return
        self.counters["prompt_tokens"] += num_prompt_tokens

    def on_output(self, out: RequestOutput, now: float | None = None) -> None:
        now = time.perf_counter() if now is None else now
        if out.token_ids:
            self.counters["generation_tokens"] += len(out.token_ids)
            last = self.last_token_s.get(out.req_id)
            if last is not None:
                gap = (now - last) / len(out.token_ids)
                self.histograms["inter_token_latency_seconds"].observe(gap, len(out.token_ids))
            self.last_token_s[out.req_id] = now
        if out.finished:
            self.last_token_s.pop(out.req_id, None)
            self._on_finish(out)

    def _on_finish(self, out: RequestOutput) -> None:
        assert out.finish_reason is not None
        self.finished[out.finish_reason] += 1
        self.counters["kv_handoff_seconds"] += float(out.metrics.get("kv_handoff_s", 0.0))
        if out.finish_reason not in COMPLETED:
            return
        for name, (_, key) in HISTOGRAMS.items():
            if key is not None and key in out.metrics:
                self.histograms[name].observe(float(out.metrics[key]))

    def on_timeout(self, deadline: str) -> None:
        self.timeouts[deadline] += 1

    def snapshot(self) -> dict[str, Any]:
        """Plain numbers (picklable, summable): counters, finished by reason, timeouts by
        deadline, histograms."""
        return {
            "counters": dict(self.counters),
            "finished": dict(self.finished),
            "timeouts": dict(self.timeouts),
            "histograms": {name: h.snapshot() for name, h in self.histograms.items()},
        }
