"""The central scheduler actor: owns every request, steps each worker, moves KV handoffs, streams tokens."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from scheduler.actor_metrics import SchedulerMetrics
from scheduler.outputs import OutputProcessor, RequestOutput
from scheduler.plan import StepPlan
from scheduler.policy import QueueFullError, Scheduler
from scheduler.request import FinishReason, Request

if TYPE_CHECKING:
    from deploy.config import EngineConfig
    from workers.messages import KVHandoff, StepResult

log = logging.getLogger(__name__)

_WORKER_ERRORS = (RayActorError, ActorUnavailableError)
_RESTART_TIMEOUT_S = 300.0


@dataclass(eq=False)
class WorkerState:
    """One worker actor as the scheduler sees it: its handle, its slots' policy, and whether it is up."""

    kind: str  # "prefill" or "decode"
    index: int
    handle: Any
    sched: Scheduler
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    alive: bool = True  # answering; False while Ray restarts it
    gone: bool = False  # its restarts are spent: it never comes back
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.kind}-{self.index}"

    def load(self) -> tuple[int, int]:
        """Lower is less loaded: (requests here beyond free slots, requests running)."""
        return (len(self.sched.running) + self.sched.num_waiting - self.sched.num_slots, len(self.sched.running))


class SchedulerActor:
    """Creates the worker actors for a mode and runs one stepping loop per worker.

    * disaggregated: prompts are chunk-prefilled on prefill workers; when a prompt's last chunk is
      done, its first token is streamed and its KV handoff goes to the least loaded decode worker,
      which imports it into a slot and decodes it with all its other slots, one forward per step.
      Prompts shorter than `local_prefill_max_tokens` are prefilled on the decode worker instead.
    * colocated: decode workers only, each prefilling and decoding under one decode-first budget.

    Every loop steps on its own, so decode steps never wait for prefill steps. A request whose cache is
    lost (its worker died, its handoff's bytes were lost) is recomputed from prompt + streamed tokens,
    up to `max_recomputes` times, then ends with an error on its own stream.
    """

    def __init__(self, config: EngineConfig) -> None:
        from workers.actors import DecodeWorker, PrefillWorker
        from workers.loader import load_tokenizer

        if config.mode not in ("colocated", "disaggregated"):
            raise ValueError(f"the scheduler actor runs colocated or disaggregated mode, not {config.mode!r}")
        self.config, self.max_recomputes = config, config.max_recomputes
        info = load_tokenizer(config.model)  # converts a GGUF once, before the workers look for it
        self.tokenizer, self.eos_token_ids = info.tokenizer, info.eos_token_ids
        self.capacity = config.context_len(info.max_context)
        self.outputs = OutputProcessor(self.tokenizer)
        self.streams: dict[str, asyncio.Queue[RequestOutput]] = {}
        self.extras: dict[str, dict[str, Any]] = {}  # per-request handoff metrics
        self.handoffs: dict[str, KVHandoff] = {}  # handed off, not yet imported: the only refs we hold
        self.counters = {"handoffs": 0, "handoff_bytes": 0, "recomputes": 0, "worker_failures": 0}
        self.metrics = SchedulerMetrics(config.mode)

        gpus = 1 if ray.cluster_resources().get("GPU", 0) >= 1 else 0
        threads = max(1, int(config.num_cpus_per_worker))

        def make(cls: type, kind: str, index: int, slots: int, resources: dict[str, float]) -> WorkerState:
            options = {"max_restarts": config.max_worker_restarts, "max_task_retries": 0,
                       "num_cpus": config.num_cpus_per_worker, "num_gpus": gpus, "resources": resources}
            handle = ray.remote(cls).options(**options).remote(
                index, config.model, config.dtype, config.device, slots, self.capacity, threads)
            sched = Scheduler(slots, self.capacity, config.token_budget, config.prefill_chunk,
                              max_preemptions=config.max_preemptions)
            return WorkerState(kind, index, handle, sched)

        self.decode = [make(DecodeWorker, "decode", i, config.slots, config.decode_resources)
                       for i in range(config.decode_workers)]
        self.prefill = [] if config.mode == "colocated" else [
            make(PrefillWorker, "prefill", i, config.prefill_slots, config.prefill_resources)
            for i in range(config.prefill_workers)]
        self.tasks: list[asyncio.Task[None]] = []

    # ---- lifecycle --------------------------------------------------------------------------------
    async def ready(self) -> dict[str, Any]:
        """Wait until every worker has loaded the model; start the loops. Returns where workers run."""
        for worker in self.prefill + self.decode:
            worker.info = await worker.handle.ready.remote()
        if not self.tasks:
            self.tasks = [asyncio.create_task(self._loop(w)) for w in self.prefill + self.decode]
        return {w.name: w.info for w in self.prefill + self.decode} | {
            "capacity": self.capacity, "scheduler_worker_id": ray.get_runtime_context().get_worker_id()}

    async def shutdown(self) -> None:
        for task in self.tasks:
            task.cancel()
        for worker in self.prefill + self.decode:
            ray.kill(worker.handle)

    # ---- requests ---------------------------------------------------------------------------------
    async def generate(self, request: Request) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs until it finishes. Raises ValueError (before any output) for a
        request that cannot run, QueueFullError when too many wait. Closing the stream aborts it."""
        self._admit(request)
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.streams[request.req_id] = queue
        try:
            while True:
                out = await queue.get()
                if out.finished:
                    out.metrics |= self.extras.pop(request.req_id, {})
                yield out
                if out.finished:
                    return
        finally:
            self.streams.pop(request.req_id, None)
            self.extras.pop(request.req_id, None)
            if not request.finished:  # the caller went away: free its slot and KV now
                self._abort(request.req_id)

    async def abort(self, req_id: str) -> bool:
        return self._abort(req_id)

    def _admit(self, request: Request) -> None:
        if any(request.req_id in w.sched.requests for w in self.prefill + self.decode):
            raise ValueError(f"request id {request.req_id!r} is already in use")
        Scheduler.check_fits(request, self.capacity)
        num_waiting = sum(w.sched.num_waiting for w in self.prefill + self.decode)
        if self.config.max_waiting is not None and num_waiting >= self.config.max_waiting:
            raise QueueFullError(f"the waiting queue is full ({self.config.max_waiting} requests)")
        request.arrival_s = time.perf_counter()
        self.outputs.add(request)
        self.extras[request.req_id] = {"prefill_worker": None, "decode_worker": None,
                                       "kv_handoff_bytes": 0, "kv_handoff_s": 0.0}
        self._route(request)

    def _route(self, request: Request) -> None:
        """Queue a request whose cache is empty: on the prefill pool, or on a decode worker when the
        mode is colocated or the tokens to compute are fewer than local_prefill_max_tokens."""
        local = not self.prefill or request.num_tokens < self.config.local_prefill_max_tokens
        pool = self.decode if local else self.prefill
        worker = self._pick(pool)
        if worker is None:
            self._fail(request, f"no live {'decode' if local else 'prefill'} worker")
            return
        worker.sched.submit(request)
        worker.wake.set()

    @staticmethod
    def _pick(pool: list[WorkerState], exclude: WorkerState | None = None) -> WorkerState | None:
        """The least loaded live worker; else one being restarted (its queue waits for it); else None."""
        candidates = [w for w in pool if w.alive and w is not exclude] or [
            w for w in pool if not w.gone and w is not exclude]
        return min(candidates, key=WorkerState.load) if candidates else None

    def _abort(self, req_id: str) -> bool:
        for worker in self.prefill + self.decode:
            request = worker.sched.abort(req_id)
            if request is not None:
                self.handoffs.pop(req_id, None)
                self._publish([RequestOutput(req_id, text=self.outputs.close(request), finish_reason="abort",
                                             metrics=request.metrics())])
                return True
        return False

    def _fail(self, request: Request, message: str) -> None:
        """End a request that no scheduler holds with an error on its own stream."""
        self.handoffs.pop(request.req_id, None)
        request.mark_finished(FinishReason.ERROR, message)
        self._publish([RequestOutput(request.req_id, text=self.outputs.close(request), finish_reason="error",
                                     error=message, metrics=request.metrics())])

    def _publish(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if out.finished:
                self.metrics.on_finish(out)
            queue = self.streams.get(out.req_id)
            if queue is not None:
                queue.put_nowait(out)

    # ---- stepping ---------------------------------------------------------------------------------
    async def _loop(self, worker: WorkerState) -> None:
        while True:
            plan = worker.sched.plan()
            if plan.preempted and worker.kind == "decode" and self.prefill:
                for req_id in plan.preempted:  # recompute on the prefill pool; hand off again
                    request = worker.sched.evict(req_id)
                    if request is not None:
                        self._route(request)
            if plan.empty:
                worker.wake.clear()
                await worker.wake.wait()
                continue
            try:
                if worker.kind == "prefill":
                    result = await worker.handle.step.remote(plan)
                else:
                    result = await worker.handle.step.remote(plan, self._imports(plan))
            except _WORKER_ERRORS as e:
                await self._recover(worker, e)
                continue
            try:
                self._apply(worker, plan, result)
            except Exception as e:  # a bug: say so loudly, end this worker's requests, keep the loop alive
                log.exception("applying a step of %s failed", worker.name)
                for request in list(worker.sched.running) + list(worker.sched.waiting_requests()):
                    worker.sched.evict(request.req_id)
                    self._fail(request, f"internal error on {worker.name}: {type(e).__name__}: {e}")

    def _imports(self, plan: StepPlan) -> list[Any]:
        from workers.messages import KVImport

        return [KVImport(c.slot, self.handoffs[c.req_id]) for c in plan.decode if c.req_id in self.handoffs]

    def _apply(self, worker: WorkerState, plan: StepPlan, result: StepResult) -> None:
        sched = worker.sched
        for req_id in result.failed_imports:  # the handoff's bytes died with their prefill worker
            self.handoffs.pop(req_id, None)
            request = sched.evict(req_id)
            if request is not None:
                self._recompute(request, "its KV handoff was lost")
        for req_id, seconds in result.import_s.items():
            handoff = self.handoffs.pop(req_id, None)  # imported: dropping the ref frees the bytes
            if handoff is not None:
                self.metrics.on_handoff(handoff.num_bytes, handoff.export_s + seconds)
                if req_id in self.extras:
                    self.extras[req_id]["kv_handoff_s"] = handoff.export_s + seconds
        finished = sched.update(plan, result.sampled)
        outputs = self.outputs.apply(sched, result.sampled, finished)
        self.metrics.on_step(worker, plan, result.step_s)
        for chunk in plan.chunks:  # who computed what, for the request's metrics
            extras = self.extras.get(chunk.req_id)
            if extras is not None:
                extras[f"{worker.kind}_worker"] = worker.index
        for handoff in result.handoffs:
            request = sched.evict(handoff.req_id) if handoff.req_id in sched.requests else None
            if request is None:
                continue  # finished on its first token, or aborted: the ref is dropped here
            target = self._pick(self.decode)
            if target is None:
                self._fail(request, "no live decode worker")
                continue
            self.handoffs[request.req_id] = handoff
            self.counters["handoffs"] += 1
            self.counters["handoff_bytes"] += handoff.num_bytes
            self.extras[request.req_id]["kv_handoff_bytes"] = handoff.num_bytes
            target.sched.submit(request)
            target.wake.set()
        self.metrics.on_states(self.prefill + self.decode)
        self._publish(outputs)

    def _recompute(self, request: Request, why: str) -> None:
        request.reset_cache()
        request.num_recomputes += 1
        self.counters["recomputes"] += 1
        self.metrics.on_recompute()
        if request.num_recomputes > self.max_recomputes:
            self._fail(request, f"request {request.req_id} lost its cache {request.num_recomputes} times "
                                f"(last: {why}); giving up")
            return
        log.warning("recomputing %s: %s", request.req_id, why)
        self._route(request)

    async def _recover(self, worker: WorkerState, error: Exception) -> None:
        """A worker died: recompute its running requests (on live workers if any, else here after the
        restart), move its waiting ones to live workers, and wait for Ray to restart it. Once its
        restarts are spent it is gone: whatever still waits on it moves on or ends with an error."""
        self.counters["worker_failures"] += 1
        worker.alive = False
        log.warning("%s failed (%s); moving its requests", worker.name, type(error).__name__)
        for request in list(worker.sched.running):
            worker.sched.evict(request.req_id)
            self.handoffs.pop(request.req_id, None)  # imported or not, its slot is gone
            self._recompute(request, f"{worker.name} failed")
        self._move_waiting(worker)
        deadline = time.monotonic() + _RESTART_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                worker.info = await worker.handle.ready.remote()
                worker.alive = True
                log.warning("%s is back", worker.name)
                return
            except ActorDiedError:
                break  # restarts spent
            except _WORKER_ERRORS:
                await asyncio.sleep(0.2)
        log.error("%s is gone; its pool continues without it", worker.name)
        worker.gone = True
        self._move_waiting(worker)
        await asyncio.Event().wait()  # park this loop for good

    def _move_waiting(self, worker: WorkerState) -> None:
        """Hand a dead worker's queue to live workers of its pool (a gone worker's to any that remain)."""
        pool = self.prefill if worker.kind == "prefill" else self.decode
        for request in list(worker.sched.waiting_requests()):
            target = self._pick(pool, exclude=worker)
            if target is None or not (target.alive or worker.gone):
                if worker.gone:
                    worker.sched.evict(request.req_id)
                    self._fail(request, f"every {worker.kind} worker is gone")
                continue  # stays queued here until the restart
            worker.sched.evict(request.req_id)
            target.sched.submit(request)
            target.wake.set()

    # ---- introspection ----------------------------------------------------------------------------
    async def worker_handles(self) -> dict[str, Any]:
        """The worker actors by name (prefill-0, decode-1, ...), e.g. for a fault-injection test."""
        return {w.name: w.handle for w in self.prefill + self.decode}

    async def stats(self) -> dict[str, Any]:
        """Slots and queues per worker, live handoffs and counters: what a test or /metrics reads."""
        workers = {
            w.name: {"alive": w.alive, "slots_used": w.sched.num_slots - len(w.sched.free_slots),
                     "running": len(w.sched.running), "waiting": w.sched.num_waiting}
            for w in self.prefill + self.decode
        }
        pools = self.prefill + self.decode
        counters = dict(self.counters) | {
            "preemptions": sum(w.sched.num_preemptions for w in pools),
            "recomputed_tokens": sum(w.sched.num_recomputed_tokens for w in pools)}
        return {"workers": workers, "live_handoffs": len(self.handoffs), "streams": len(self.streams),
                "counters": counters, "max_waiting": self.config.max_waiting}
