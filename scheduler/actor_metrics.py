"""Prometheus metrics of the scheduler actor through `ray.util.metrics` (served on Ray's /metrics).

Names are prefixed `ray_` by Ray's exporter: `ray_pdserve_ttft_seconds`, and so on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ray.util.metrics import Counter, Gauge, Histogram

from scheduler.outputs import RequestOutput
from scheduler.plan import StepPlan

if TYPE_CHECKING:
    from scheduler.actor import WorkerState

_LATENCY_S = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120]
_TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048]
_BYTES = [1e4, 1e5, 1e6, 1e7, 1e8, 1e9]


class SchedulerMetrics:
    """Request latencies, queue states, slots, step sizes and durations, handoffs, failures."""

    def __init__(self, mode: str) -> None:
        self.tags = {"mode": mode}
        worker_tags = ("mode", "worker")
        self.ttft = Histogram("pdserve_ttft_seconds", "Time to first token.", _LATENCY_S, ("mode",))
        self.tpot = Histogram("pdserve_tpot_seconds", "Time per output token after the first.", _LATENCY_S,
                              ("mode",))
        self.e2e = Histogram("pdserve_e2e_seconds", "Request latency, arrival to finish.", _LATENCY_S, ("mode",))
        self.finished = Counter("pdserve_requests_finished_total", "Finished requests by finish reason.",
                                ("mode", "reason"))
        self.requests = Gauge("pdserve_requests", "Requests by state: waiting, prefilling, decoding.",
                              ("mode", "state"))
        self.slots_used = Gauge("pdserve_slots_in_use", "Cache slots (rows) in use per worker.", worker_tags)
        self.step_tokens = Histogram("pdserve_step_tokens", "Tokens computed per step.", _TOKENS, worker_tags)
        self.step_seconds = Histogram("pdserve_step_seconds", "Step duration on the worker.", _LATENCY_S,
                                      ("mode", "kind"))
        self.handoff_bytes = Histogram("pdserve_kv_handoff_bytes", "KV bytes per handoff.", _BYTES, ("mode",))
        self.handoff_seconds = Histogram("pdserve_kv_handoff_seconds", "Export plus import time per handoff.",
                                         _LATENCY_S, ("mode",))
        self.preemptions = Counter("pdserve_preemptions_total", "Requests evicted for more urgent ones.", ("mode",))
        self.recomputes = Counter("pdserve_recomputes_total", "Requests recomputed after a lost cache.", ("mode",))

    def on_step(self, worker: WorkerState, plan: StepPlan, step_s: float) -> None:
        tags = self.tags | {"worker": worker.name}
        self.step_tokens.observe(plan.num_tokens, tags=tags)
        self.step_seconds.observe(step_s, tags=self.tags | {"kind": worker.kind})
        self.slots_used.set(worker.sched.num_slots - len(worker.sched.free_slots), tags=tags)
        if plan.preempted:
            self.preemptions.inc(len(plan.preempted), tags=self.tags)

    def on_states(self, workers: list[WorkerState]) -> None:
        waiting = sum(w.sched.num_waiting for w in workers)
        decoding = sum(1 for w in workers for r in w.sched.running if r.is_decoding)
        prefilling = sum(len(w.sched.running) for w in workers) - decoding
        for state, value in (("waiting", waiting), ("prefilling", prefilling), ("decoding", decoding)):
            self.requests.set(value, tags=self.tags | {"state": state})

    def on_handoff(self, num_bytes: int, seconds: float) -> None:
        self.handoff_bytes.observe(num_bytes, tags=self.tags)
        self.handoff_seconds.observe(seconds, tags=self.tags)

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
