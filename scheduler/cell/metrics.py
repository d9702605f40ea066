"""The scheduler's Prometheus metrics, defined once and recorded through any metrics backend.

The backend is a module-like object with `Counter`, `Gauge` and `Histogram` classes taking `(name,
description, [boundaries,] tag_keys)`: `ray.util.metrics` in the Ray actor (served on Ray's /metrics
with a `ray_` prefix: `ray_pdserve_ttft_seconds`, ...), or `RecordingBackend` here, which keeps
every value in memory so tests can read what would have been exported.
"""

from __future__ import annotations

from typing import Any

from scheduler.outputs import RequestOutput

_LATENCY_S = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120]
_TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048]
_BYTES = [1e4, 1e5, 1e6, 1e7, 1e8, 1e9]


class CellMetrics:
    """Request latencies, queue states, slots, step sizes and durations, handoffs, failures."""

    def __init__(self, mode: str, backend: Any) -> None:
        self.tags = {"mode": mode}
        mode_tag = ("mode",)
        worker_tags = ("mode", "worker")
        self.ttft = backend.Histogram(
            "pdserve_ttft_seconds", "Time to first token.", _LATENCY_S, mode_tag
        )
        self.tpot = backend.Histogram(
            "pdserve_tpot_seconds", "Time per output token after the first.", _LATENCY_S, mode_tag
        )
        self.e2e = backend.Histogram(
            "pdserve_e2e_seconds", "Request latency, arrival to finish.", _LATENCY_S, mode_tag
        )
        self.finished = backend.Counter(
            "pdserve_requests_finished_total",
            "Finished requests by finish reason.",
            ("mode", "reason"),
        )
        self.requests = backend.Gauge(
            "pdserve_requests",
            "Requests by state: waiting, prefilling, decoding.",
            ("mode", "state"),
        )
        self.slots_used = backend.Gauge(
            "pdserve_slots_in_use",
            "Requests running per worker (of its max_num_seqs).",
            worker_tags,
        )
        self.kv_usage = backend.Gauge(
            "pdserve_kv_cache_usage",
            "KV blocks in use per worker, a fraction of its blocks (vLLM's kv_cache_usage_perc).",
            worker_tags,
        )
        self.step_tokens = backend.Histogram(
            "pdserve_step_tokens", "Tokens computed per step.", _TOKENS, worker_tags
        )
        self.step_seconds = backend.Histogram(
            "pdserve_step_seconds", "Step duration on the worker.", _LATENCY_S, ("mode", "kind")
        )
        self.handoff_bytes = backend.Histogram(
            "pdserve_kv_handoff_bytes", "KV bytes per handoff.", _BYTES, mode_tag
        )
        self.handoff_seconds = backend.Histogram(
            "pdserve_kv_handoff_seconds",
            "Export plus import time per handoff.",
            _LATENCY_S,
            mode_tag,
        )
        transport_tags = ("mode", "transport")
        self.transfer_bytes = backend.Counter(
            "pdserve_kv_transfer_bytes_total",
            "KV bytes decode workers fetched, per transport.",
            transport_tags,
        )
        self.transfer_seconds = backend.Counter(
            "pdserve_kv_transfer_seconds_total",
            "Seconds decode workers spent fetching KV, per transport.",
            transport_tags,
        )
        self.transfer_failures = backend.Counter(
            "pdserve_kv_transfer_failures_total",
            "KV transfers that could not complete, per transport.",
            transport_tags,
        )
        self.role_changes = backend.Counter(
            "pdserve_role_changes_total",
            "Workers moved between the prefill and decode pools, by the pool they joined.",
            ("mode", "to"),
        )
        self.preemptions = backend.Counter(
            "pdserve_preemptions_total", "Requests preempted for more urgent ones.", mode_tag
        )
        self.recomputes = backend.Counter(
            "pdserve_recomputes_total", "Requests recomputed after a lost cache.", mode_tag
        )
        self.prefix_hit_rate = backend.Gauge(
            "pdserve_prefix_cache_hit_rate",
            "Prompt tokens served from the worker's prefix cache, as a fraction of prompt tokens.",
            worker_tags,
        )
        self.prefix_blocks_used = backend.Gauge(
            "pdserve_prefix_cache_blocks_used",
            "KV blocks named by their tokens (cached, in use or not) per worker.",
            worker_tags,
        )

    def on_step(
        self,
        worker: str,
        kind: str,
        slots_used: int,
        num_tokens: int,
        num_preempted: int,
        step_s: float,
        kv_cache: dict[str, float] | None = None,
    ) -> None:
        tags = self.tags | {"worker": worker}
        if kv_cache is not None:
            self.prefix_hit_rate.set(kv_cache["hit_rate"], tags=tags)
            self.prefix_blocks_used.set(kv_cache["blocks_cached"], tags=tags)
            self.kv_usage.set(kv_cache["usage"], tags=tags)
        self.step_tokens.observe(num_tokens, tags=tags)
        self.step_seconds.observe(step_s, tags=self.tags | {"kind": kind})
        self.slots_used.set(slots_used, tags=tags)
        if num_preempted:
            self.preemptions.inc(num_preempted, tags=self.tags)

    def on_states(self, scheds: list[Any]) -> None:
        """Requests waiting, prefilling and decoding on the cell's workers (their `Scheduler`s)."""
        running = [r for sched in scheds for r in sched.running]
        decoding = sum(r.is_decoding for r in running)
        waiting = sum(sched.num_waiting for sched in scheds)
        for state, value in (
            ("waiting", waiting),
            ("prefilling", len(running) - decoding),
            ("decoding", decoding),
        ):
            self.requests.set(value, tags=self.tags | {"state": state})

    def on_handoff(self, num_bytes: int, seconds: float) -> None:
        self.handoff_bytes.observe(num_bytes, tags=self.tags)
        self.handoff_seconds.observe(seconds, tags=self.tags)

    def on_kv_transfer(self, transport: str, num_bytes: int, seconds: float, failures: int) -> None:
        tags = self.tags | {"transport": transport}
        for counter, value in (
            (self.transfer_bytes, num_bytes),
            (self.transfer_seconds, seconds),
            (self.transfer_failures, failures),
        ):
            if value > 0:  # (Ray's counters take positive increments only)
                counter.inc(value, tags=tags)

    def on_role_change(self, kind: str) -> None:
        self.role_changes.inc(tags=self.tags | {"to": kind})

    def on_recompute(self) -> None:
        self.recomputes.inc(tags=self.tags)

    def on_finish(self, out: RequestOutput) -> None:
        assert out.finish_reason is not None
        self.finished.inc(tags=self.tags | {"reason": out.finish_reason})
        m = out.metrics
        if out.finish_reason in ("stop", "length"):
            self.ttft.observe(m["ttft_s"], tags=self.tags)
            if m.get("tpot_s"):
                self.tpot.observe(m["tpot_s"], tags=self.tags)
            self.e2e.observe(m["e2e_s"], tags=self.tags)


class _Recorded:
    """One metric of the recording backend: every observation, and the last value per tag set."""

    def __init__(self, name: str, description: str, *args: Any) -> None:
        self.name = name
        self.description = description
        self.observations: list[tuple[float, dict[str, str]]] = []
        self.values: dict[tuple[tuple[str, str], ...], float] = {}

    def observe(self, value: float, tags: dict[str, str]) -> None:
        self.observations.append((value, tags))

    def set(self, value: float, tags: dict[str, str]) -> None:
        self.values[tuple(sorted(tags.items()))] = value

    def inc(self, value: float = 1.0, tags: dict[str, str] | None = None) -> None:
        key = tuple(sorted((tags or {}).items()))
        self.values[key] = self.values.get(key, 0.0) + value


class RecordingBackend:
    """A metrics backend that keeps everything in memory (for tests and the stub-worker
    benchmark)."""

    def __init__(self) -> None:
        self.metrics: dict[str, _Recorded] = {}

    def _make(self, name: str, description: str, *args: Any) -> _Recorded:
        return self.metrics.setdefault(name, _Recorded(name, description, *args))

    Counter = Gauge = Histogram = _make
