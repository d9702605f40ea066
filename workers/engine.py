"""The in-process engine (`local` mode): the scheduling policy stepping a model runner in one
thread."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from scheduler.outputs import OutputProcessor, RequestOutput
from scheduler.request import Request
from scheduler.step_planner import StepPlanner
from workers.arrivals import ArrivalSchedule
from workers.runner import ModelRunner


class LocalEngine:
    """Plans a step, runs it, records the sampled tokens, applies stop strings: `step()` is one
    turn.

    `submit` and `abort` may be called from other threads while `run` steps; they take effect at the
    next step. With a tokenizer, each request's `text` is kept up to date and stop strings apply.
    """

    def __init__(self, runner: ModelRunner, scheduler: StepPlanner, tokenizer: Any = None) -> None:
        pool = scheduler.blocks
        cache = runner.cache
        if pool.num_blocks > cache.num_blocks or pool.block_size != cache.block_size:
            raise ValueError(
                f"the scheduler plans {pool.num_blocks} blocks of {pool.block_size} tokens, the "
                f"runner's cache holds {cache.num_blocks} of {cache.block_size}"
            )
        self.runner = runner
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.outputs = OutputProcessor(tokenizer)
        self.reset_profile()
        self._lock = threading.Lock()

    def reset_profile(self) -> None:
        """Zero the step count and the profile: seconds per whole step and inside the model forward,
        overall and for decode-only steps."""
        self.num_steps = 0
        self.profile = {
            "step_s": 0.0,
            "model_s": 0.0,
            "decode_steps": 0,
            "decode_step_s": 0.0,
            "decode_model_s": 0.0,
        }

    def submit(self, request: Request) -> None:
        """Queue a request; raises ValueError (nothing queued) if it can never run."""
        with self._lock:
            self.scheduler.submit(request)
            self.outputs.add(request)

    def abort(self, req_id: str) -> Request | None:
        with self._lock:
            request = self.scheduler.abort(req_id)
            if request is not None:
                self.outputs.close(request)
            return request

    def step(self) -> list[RequestOutput]:
        """One iteration: each request's new tokens and text from it; finished ones carry their
        finish reason."""
        start = time.perf_counter()
        with self._lock:
            plan = self.scheduler.plan()
        samples = self.runner.execute(plan)
        with self._lock:
            update = self.scheduler.take(plan, samples)
            outputs = self.outputs.apply(self.scheduler, update)
        self.num_steps += 1
        elapsed = time.perf_counter() - start
        profile = self.profile
        profile["step_s"] += elapsed
        profile["model_s"] += self.runner.last_forward_s
        if plan.decode and not plan.prefill:
            profile["decode_steps"] += 1
            profile["decode_step_s"] += elapsed
            profile["decode_model_s"] += self.runner.last_forward_s
        return outputs

    @property
    def idle(self) -> bool:
        with self._lock:
            return self.scheduler.idle

    def run(
        self,
        requests: Iterable[Request],
        arrival_s: dict[str, float] | None = None,
        on_finish: Callable[[Request], None] | None = None,
        after: dict[str, str] | None = None,
    ) -> dict[str, Request]:
        """Submit requests (each at its `arrival_s` offset from now, if given, or when the request
        it follows in `after` ends: `ArrivalSchedule`), step until all finish.

        Returns every request that ran by id (a chain's remainder dropped once the rest has ended
        did not). A request that cannot run raises before anything is submitted.
        """
        requests = list(requests)
        StepPlanner.check_batch(requests, self.scheduler.capacity)
        for request in requests:
            self.scheduler.check(request)  # and not in use here already
        by_id = {request.req_id: request for request in requests}
        schedule = ArrivalSchedule.by_key(by_id.values(), arrival_s, after)
        results: dict[str, Request] = {}
        while schedule or not self.idle:
            for request in schedule.due():
                request.arrival_s = time.perf_counter()
                self.submit(request)
            if self.idle and schedule:
                time.sleep(min(schedule.wait_s(), 1.0))
                continue
            for out in self.step():
                if out.finished:
                    results[out.req_id] = by_id[out.req_id]
                    if on_finish is not None:
                        on_finish(by_id[out.req_id])
                    schedule.ended(out.req_id)
        return results
