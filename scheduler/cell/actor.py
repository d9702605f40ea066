"""The scheduler's Ray actor: a thin shell of loops and remote calls around the pure `Coordinator`.

Nothing in `scheduler/` imports this module. Its workers come from an injected `spawn_worker(kind,
index, num_blocks, block_size) -> actor handle` (deploy passes `workers.actors.spawn_worker`; the
stub-worker benchmark passes stubs), so the imports point one way: deploy -> workers -> scheduler.

Consumers (the batch driver, each ingress replica) `submit` requests under a consumer id and `poll`:
one call returns every output of all their requests since the last poll, so a step costs one message
per consumer, not one per token per request. A consumer that stops polling for `consumer_timeout_s`
is taken for gone and its requests are aborted. `drain` closes the scheduler to new requests (a cell
being scaled down) and returns when its open ones have ended.

A Serve cell's scheduler is a detached actor that Ray restarts (`deploy/serving/cell_actors.py`):
with a `worker_namespace`, its workers are detached too, named after it, so a restarted scheduler
finds them again by name (`spawn_worker(..., name=...)`), has them forget every request, and
starts afresh; the consumers continue their streams by recompute. `adopt` hands the scheduler to
another replica when its owner has died.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import time
import uuid
from collections.abc import Callable
from typing import Any

import ray
import ray.util.metrics
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from scheduler.cell.bursts import BurstSizer, plan_call
from scheduler.cell.call_clock import CallClock
from scheduler.cell.coordinator import Coordinator
from scheduler.cell.deadlines import expire
from scheduler.cell.gc_pauses import freeze_startup_objects
from scheduler.cell.mailboxes import Mailboxes
from scheduler.cell.serving_metrics import ServingMetrics
from scheduler.cell.state import CellClosed, CellConfig, WorkerState, WorkerStatus
from scheduler.cell.timeline import StepTimeline
from scheduler.messages import WorkerRestarted, pack_plans
from scheduler.outputs import RequestOutput
from scheduler.request import Request

log = logging.getLogger(__name__)

# a worker died, restarts, or was restarted since the scheduler last heard from it
_WORKER_ERRORS = (RayActorError, ActorUnavailableError, WorkerRestarted)
_RESTART_TIMEOUT_S = 300.0
_EXPIRY_PERIOD_S = 0.1  # how often deadlines are checked (how late a request may end past one)


class CellActor:
    """Creates the workers of a cell and runs one stepping loop per worker, so a decode step never
    waits for a prefill step. Decisions are the coordinator's; this class only moves messages."""

    def __init__(
        self,
        config: CellConfig,
        spawn_worker: Callable[[str, int, int, int], Any],
        tokenizer: Any = None,
        metrics_backend: Any = None,
        consumer_timeout_s: float = 30.0,
        worker_namespace: str | None = None,
        owner: tuple[str, Any] | None = None,
        orphan_timeout_s: float | None = None,
    ) -> None:
        self.coordinator = Coordinator(
            config, tokenizer, metrics_backend or ray.util.metrics, wake=self._wake
        )
        # a restarted scheduler has a new one: it knows no earlier request
        self.instance = uuid.uuid4().hex
        self.config = config
        self.consumer_timeout_s = consumer_timeout_s
        self.spawn_worker = spawn_worker
        context = ray.get_runtime_context()
        # Ray restarted this actor: its workers (found again by name) hold requests it never knew
        self.restarted = context.was_current_actor_reconstructed
        self.num_restarts = _num_restarts(context.get_actor_id()) if self.restarted else 0
        # named workers: "<this actor's name>/<worker actor>" in `worker_namespace`, detached
        self.worker_namespace = worker_namespace
        self.adopting = asyncio.Lock()
        self.owner = owner  # (replica id, its actor handle): the Serve replica this cell serves
        # a cell with an owner: stop once no replica has adopted it (its health check does, every
        # few seconds) for this long and no request is open: its app was deleted while its
        # replica was dead
        self.orphan_timeout_s = orphan_timeout_s
        self.adopted_s = time.monotonic()
        self.handles = {w.actor: self._spawn(w) for w in self.coordinator.workers}
        self.wakeups = {w.actor: asyncio.Event() for w in self.coordinator.workers}
        self.mailboxes = Mailboxes()
        self.started: asyncio.Future[None] | None = None  # workers ready, loops running
        # set (then replaced) when a request's last output is published
        self.request_ended = asyncio.Event()
        self.timeline = StepTimeline()
        self.last_result_s: dict[str, float] = {}  # per actor: when its last step's result arrived
        # seconds per token per worker; when prompt-finishing calls should return
        self.clock = CallClock()
        # set (then replaced) when such a step's results are applied
        self.handoff_applied = asyncio.Event()
        self.tasks: list[asyncio.Task[None]] = []
        self.loops: dict[str, asyncio.Task[None]] = {}  # each worker's stepping loop
        # prefetch calls in flight (held until answered)
        self.prefetching: set[asyncio.Future[Any]] = set()
        self.bursts = BurstSizer(config.max_burst_ms / 1000)
        self.closed = False  # draining: new requests are refused with CellClosed
        self.serving = ServingMetrics()  # what /metrics reads (vLLM's names)

    # ---- lifecycle
    def _spawn(self, worker: WorkerState) -> Any:
        blocks = worker.step_planner.blocks
        named: dict[str, Any] = {}
        if self.worker_namespace is not None:
            name = f"{ray.get_runtime_context().get_actor_name()}/{worker.actor}"
            named = {"name": name, "namespace": self.worker_namespace}
        return self.spawn_worker(
            worker.kind, worker.index, blocks.num_blocks, blocks.block_size, **named
        )

    async def ready(self) -> dict[str, Any]:
        """Wait until every worker has loaded the model; start the loops (once). Returns where
        workers run."""
        self._resume(force=True)
        assert self.started is not None
        await asyncio.shield(self.started)
        return {w.name: w.ready_info for w in self.coordinator.workers} | {
            "capacity": self.config.capacity,
            "scheduler_worker_id": ray.get_runtime_context().get_worker_id(),
            "scheduler_pid": os.getpid(),
        }

    def _resume(self, force: bool = False) -> None:
        """Start the cell (once): at `ready`, or at the first call a restarted actor gets."""
        if self.started is None and (force or self.restarted):
            self.started = asyncio.ensure_future(self._start_cell())

    async def _start_cell(self) -> None:
        for worker in self.coordinator.workers:
            handle = self.handles[worker.actor]
            worker.ready_info = await handle.ready.remote()
            if self.restarted:
                await handle.reset.remote()
        for worker in self.coordinator.prefill:
            await self._connect(worker)
        freeze_startup_objects()
        self.loops = {w.actor: asyncio.create_task(self._loop(w)) for w in self.coordinator.workers}
        self.tasks = list(self.loops.values())
        self.tasks.append(asyncio.create_task(self._reap_consumers()))
        if self.config.pool_planner:
            self.tasks.append(asyncio.create_task(self._plan_pools()))
        self.tasks.append(asyncio.create_task(self._expire_deadlines()))
        if self.orphan_timeout_s is not None:
            self.tasks.append(asyncio.create_task(self._stop_when_orphaned()))
        if self.restarted:
            log.warning("scheduler restarted (%d); its workers re-adopted", self.num_restarts)

    async def adopt(self, replica: str, handle: Any) -> str:
        """Serve `replica` (its actor `handle`) from now on, unless another live replica does:
        "adopted", "held" (by another), or "broken" (a worker pool is gone: stop it instead)."""
        self._resume()
        if self.coordinator.pool_exhausted():
            return "broken"
        async with self.adopting:
            if self.owner is not None and self.owner[0] != replica:
                try:
                    await asyncio.wait_for(self.owner[1].__ray_ready__.remote(), 5.0)
                    return "held"
                except Exception:  # its owner is gone
                    log.warning("cell adopted by %s (%s is gone)", replica, self.owner[0])
            self.owner = (replica, handle)
            self.adopted_s = time.monotonic()
        return "adopted"

    async def owner_replica(self) -> str | None:
        return None if self.owner is None else self.owner[0]

    async def _connect(self, worker: WorkerState) -> None:
        """Have a prefill worker choose the transport of the KV it sends to the decode pool (the
        worker raises, naming the reason, when the configured one cannot serve a pair)."""
        peers = [w.ready_info for w in self.coordinator.decode]
        worker.ready_info["kv_transport"] = await self.handles[worker.actor].connect.remote(peers)

    async def _plan_pools(self) -> None:
        """Every planner window, let the coordinator resize the pools (role changes)."""
        while True:
            await asyncio.sleep(self.config.planner_window_s)
            for decision in self.coordinator.end_window():
                log.info("pool planner: %s", decision)
            self.coordinator.roles.finish()
            await self._after_role_changes()

    async def _start(self, worker: WorkerState) -> None:
        """A worker the planner added: once its actor answers (Ray places it when resources are
        free; on an autoscaling cluster, a node is started for it), it joins its pool and steps."""
        started = time.monotonic()
        worker.ready_info = await self.handles[worker.actor].ready.remote()
        worker.status = WorkerStatus.UP
        self.coordinator.pools.on_started(time.monotonic() - started)
        log.info("%s started in the %s pool", worker.actor, worker.kind)
        if worker.kind == "prefill":
            await self._connect(worker)
        else:
            for prefill in self.coordinator.prefill:
                if prefill.status is WorkerStatus.UP:
                    await self._connect(prefill)
        self.coordinator.wake(worker)
        await self._loop(worker)

    async def change_role(self, name: str, kind: str) -> dict[str, Any]:
        """Move the worker now named `name` to pool `kind`: it takes no new work from now on and
        joins that pool once what it holds has run to the end. Raises ValueError for a worker or
        pool that does not exist, when its pool would keep no worker taking new work, or when the
        pools' workers hold different numbers of ranks (a worker keeps its ranks)."""
        worker = next((w for w in self.coordinator.workers if w.name == name), None)
        if worker is None or kind not in ("prefill", "decode") or not self.coordinator.prefill:
            raise ValueError(f"cannot move {name!r} to a {kind!r} pool in this cell")
        ranks = (self.config.prefill_tensor_parallel_size, self.config.decode_tensor_parallel_size)
        if kind != worker.kind and ranks[0] != ranks[1]:
            raise ValueError(
                f"a worker keeps its tensor-parallel ranks: {name!r} cannot join the {kind} pool "
                f"(prefill workers of {ranks[0]}, decode workers of {ranks[1]}); the pool "
                f"planner moves whole workers between such pools"
            )
        pool = self.coordinator.prefill if worker.kind == "prefill" else self.coordinator.decode
        if kind != worker.kind and sum(w.accepts for w in pool if w is not worker) < 1:
            raise ValueError(f"the {worker.kind} pool keeps one worker that takes new work")
        self.coordinator.roles.begin(worker, kind)
        await self._after_role_changes()
        return {"actor": worker.actor, "name": worker.name, "leaving_for": worker.next_kind}

    async def _after_role_changes(self) -> None:
        """A worker that changed pools: each prefill worker chooses its transport again (a
        worker that joined sends KV now; one that joined the decode pool is a new peer)."""
        roles = self.coordinator.roles
        moved = roles.take_switched()
        for worker in moved:
            log.info("%s joined the %s pool as %s", worker.actor, worker.kind, worker.name)
            # (its timings, kept by actor, were of its old role)
            self.clock.forget(worker.actor)
            self.bursts.forget(worker.actor)
            self.last_result_s.pop(worker.actor, None)
        for worker in roles.take_released():
            log.info("%s left the cell", worker.actor)
            if (loop := self.loops.pop(worker.actor, None)) is not None:
                loop.cancel()
            ray.kill(self.handles.pop(worker.actor))
        for worker in [w for w in self.coordinator.workers if w.actor not in self.handles]:
            self.handles[worker.actor] = self._spawn(worker)
            self.wakeups[worker.actor] = asyncio.Event()
            task = asyncio.create_task(self._start(worker))
            self.loops[worker.actor] = task
            self.tasks.append(task)
        if moved:
            for worker in self.coordinator.prefill:
                if worker.status is WorkerStatus.UP:
                    await self._connect(worker)

    async def shutdown(self) -> None:
        for task in self.tasks:
            task.cancel()
        for handle in self.handles.values():
            ray.kill(handle)

    async def check_health(self) -> None:
        """Raise when a worker pool has no worker left. Idle workers are asked whether they live:
        one that died for good while it had no work (no step failed to say so) is gone."""
        self._resume()
        if self.started is not None and self.started.done():
            await self._probe_idle_workers()
        if self.coordinator.pool_exhausted():
            raise RuntimeError("a worker pool has no worker left")

    async def _probe_idle_workers(self) -> None:
        for worker in list(self.coordinator.workers):
            idle = self.coordinator.roles.holds_nothing(worker)
            if worker.status is not WorkerStatus.UP or not idle:
                continue  # (a worker with work learns of its death from its next step)
            if await _dead_for_good(self.handles[worker.actor]):
                self.coordinator.worker_died(worker)
                self.coordinator.worker_gone(worker)
                self._deliver()

    async def drain(self) -> None:
        """Refuse new requests (CellClosed) from now on, and return when the last open one has
        ended."""
        self.closed = True
        while self.coordinator.consumers:
            with contextlib.suppress(TimeoutError):
                # (a reaped consumer's end sets nothing)
                await asyncio.wait_for(self.request_ended.wait(), 1.0)

    async def num_open(self) -> int:
        """Requests here that have not ended: the cell's load, for routing and autoscaling."""
        return len(self.coordinator.consumers)

    # ---- stepping: one loop per worker, one call in flight ahead
    def _wake(self, worker: WorkerState) -> None:
        self.wakeups[worker.actor].set()

    async def _loop(self, worker: WorkerState) -> None:
        """Keep one call in flight ahead: call N+1 is planned and sent before call N's results are
        applied, so planning, applying and publishing overlap the worker's forward. The policy plans
        N+1 as if N's tokens were known (the worker feeds them in), never past max_tokens, and drops
        what N+1 samples for a request that stopped in N. A decode worker plans N+1 late when a
        handoff is due before N ends (`_await_handoff`), so the handed-off request joins N+1, not
        N+2. A call carries several decode steps (a burst, `scheduler/cell/bursts.py`) when the
        worker only decodes."""
        handle = self.handles[worker.actor]
        wakeup = self.wakeups[worker.actor]
        in_flight: tuple[Any, ...] | None = None  # (plans, result ref, planning seconds, send time)
        while True:
            if worker.kind == "decode" and in_flight is not None:
                await self._await_handoff(worker, in_flight[0], in_flight[1], in_flight[3])
            t0 = time.perf_counter()
            call = plan_call(self.coordinator, worker, self.bursts.length(worker.actor))
            sent = None
            if call is not None:
                plans, imports = call
                t1 = time.perf_counter()
                sent = (plans, self._send(handle, worker, plans, imports), t1 - t0, t1)
                if worker.kind == "prefill" and any(c.sample for c in plans[0].prefill):
                    self.clock.finishing_sent(
                        worker.actor, t1, _tokens(plans), queued=in_flight is not None
                    )
            elif in_flight is None:
                self._deliver()  # a preempted request's reroute may have failed it
                wakeup.clear()
                await wakeup.wait()
                continue
            if in_flight is not None:
                if not await self._finish_step(worker, *in_flight):
                    if sent is not None:  # the worker died: the call sent after it is lost too
                        await asyncio.gather(self._results(worker, sent[1]), return_exceptions=True)
                    sent = None
                elif sent is not None:  # it starts now
                    self.clock.started(worker.actor, sent[3], _tokens(sent[0]), time.perf_counter())
            in_flight = sent

    @staticmethod
    def _send(handle: Any, worker: WorkerState, plans: list[Any], imports: list[Any]) -> Any:
        """Send a step call naming the start of the worker this scheduler knows (`ready()`'s
        incarnation): a worker restarted since refuses it (WorkerRestarted). No local keeps the
        result's ref: an idle loop must not hold the last result in the object store."""
        worker.calls_in_flight += 1
        return handle.step.remote(pack_plans(plans), imports, worker.ready_info.get("incarnation"))

    @staticmethod
    async def _results(worker: WorkerState, ref: Any) -> Any:
        """A call's results (or its error); either way the call is no longer in flight."""
        try:
            return await ref
        finally:
            worker.calls_in_flight -= 1

    async def _await_handoff(
        self, worker: WorkerState, plans: list[Any], ref: Any, sent_s: float
    ) -> None:
        """Before planning a decode worker's next step while its step N runs: if a prefill worker's
        call that finishes a prompt is expected back before N ends (`CallClock.handoff_due`), wait
        for that handoff, or for N, whichever comes first. Waiting never changes an output, only
        which step a handed-off request joins; when no handoff is due it costs nothing."""
        start = max(sent_s, self.last_result_s.get(worker.actor, sent_s))
        n_ends = self.clock.ends(worker.actor, _tokens(plans), start)
        if n_ends == math.inf or not self.clock.handoff_due(n_ends):
            return
        arrived = asyncio.ensure_future(self.handoff_applied.wait())
        done = asyncio.ensure_future(asyncio.gather(ref, return_exceptions=True))
        await asyncio.wait(
            [arrived, done],
            timeout=max(0.0, n_ends - time.perf_counter()) + 0.05,
            return_when=asyncio.FIRST_COMPLETED,
        )
        for task in (arrived, done):
            task.cancel()
        # (retrieved: no "never retrieved" logs)
        await asyncio.gather(arrived, done, return_exceptions=True)

    async def _finish_step(
        self, worker: WorkerState, plans: list[Any], ref: Any, plan_s: float, sent_s: float
    ) -> bool:
        """Wait for a call's results and apply them step by step; False if the worker died (then it
        has been recovered)."""
        try:
            results = await self._results(worker, ref)
        except _WORKER_ERRORS as e:
            self.clock.lost(worker.actor)
            await self._recover(worker, e)
            return False
        # the step raised (a bug): end this worker's requests with it, keep serving
        except Exception as e:
            self.clock.lost(worker.actor)
            self._fail_requests(worker, "a step", e)
            self._deliver()
            return False
        t2 = time.perf_counter()
        kind = worker.kind  # (the role these calls were planned for, if applying them ends it)
        worker_s = sum(r.step_s for r in results)
        tokens = _tokens(plans)
        self.clock.observe(worker.actor, worker_s, tokens)
        period = t2 - max(sent_s, self.last_result_s.get(worker.actor, 0.0))
        self.last_result_s[worker.actor] = t2
        if tokens:
            self.bursts.observe(worker.actor, len(plans), period, worker_s)
        try:
            for plan, result in zip(plans, results, strict=True):
                self.coordinator.apply(worker, plan, result)
        # a bug: say so loudly, end this worker's requests, keep the loop alive
        except Exception as e:
            self._fail_requests(worker, "applying a step", e)
        # pieces for a decode worker's node
        for name, pieces in self.coordinator.kv.take_prefetches().items():
            self._send_prefetch(name, pieces)
        await self._after_role_changes()
        t3 = time.perf_counter()
        # handoffs are queued: wake
        if kind == "prefill" and any(c.sample for c in plans[0].prefill):
            self.handoff_applied.set()
            self.handoff_applied = asyncio.Event()
        self.clock.returned(worker.actor, sent_s)
        self._deliver()
        if tokens:
            self.timeline.record(
                kind,
                steps=len(plans),
                period=period,
                plan=plan_s,
                round_trip=t2 - sent_s,
                worker_step=worker_s,
                forward=sum(r.forward_s for r in results),
                apply=t3 - t2,
                publish=time.perf_counter() - t3,
                tokens=tokens,
            )
        return True

    def _fail_requests(self, worker: WorkerState, what: str, error: Exception) -> None:
        """End a worker's requests after a bug: each client gets a short message naming its
        request id; the traceback (paths, hosts, process ids: the server's business) goes to this
        actor's log under those ids."""
        cause = getattr(error, "cause", None) or error  # a RayTaskError's: the worker's own
        req_ids = self.coordinator.fail_worker_requests(
            worker, f"internal error on {worker.name} ({type(cause).__name__})"
        )
        log.error(
            "%s of %s failed; requests ended with an error: %s",
            what,
            worker.name,
            ", ".join(req_ids) or "none",
            exc_info=error,
        )

    def _send_prefetch(self, name: str, pieces: list[Any]) -> None:
        """Name pieces to the decode worker that will import them; a failed call only costs the head
        start."""
        task = asyncio.ensure_future(
            asyncio.gather(self.handles[name].prefetch.remote(pieces), return_exceptions=True)
        )
        self.prefetching.add(task)
        task.add_done_callback(self.prefetching.discard)

    # ---- consumers
    async def submit(self, request: Request, consumer: str) -> str:
        """Queue a request whose outputs go to `consumer`'s polls; returns this scheduler's instance
        id. Raises ValueError (nothing queued) for a request that cannot run, QueueFullError when
        too many wait, CellClosed while the cell drains."""
        if self.closed:
            raise CellClosed("this cell is draining: it takes no new request")
        self._resume()
        request.arrival_s = time.perf_counter()
        self.mailboxes.seen(consumer)
        self.coordinator.admit(request, consumer)
        self.serving.on_admit(len(request.prompt_ids), request.is_continuation)
        self._deliver()
        return self.instance

    async def submit_many(
        self, entries: list[tuple[Request, str]]
    ) -> list[str | ValueError | CellClosed]:
        """`submit` each (request, consumer) in order, in one call: for each, this scheduler's
        instance id, or what refused it (ValueError, QueueFullError included, or CellClosed); a
        refusal does not stop the others."""
        answers: list[str | ValueError | CellClosed] = []
        for request, consumer in entries:
            try:
                answers.append(await self.submit(request, consumer))
            except (ValueError, CellClosed) as e:
                answers.append(e)
        return answers

    async def poll(self, consumer: str, timeout_s: float = 1.0) -> tuple[str, list[RequestOutput]]:
        """This scheduler's instance id and every output for the consumer's requests since its last
        poll, each request's successive outputs joined into one; waits up to `timeout_s` for one (an
        empty list means none came)."""
        self._resume()
        return self.instance, await self.mailboxes.take(consumer, timeout_s)

    async def abort(self, req_id: str, instance: str | None = None) -> bool:
        """End a request here; with `instance`, only if this is the scheduler instance that took
        it (a restarted scheduler may already run the request's continuation under its id)."""
        if instance is not None and instance != self.instance:
            return False
        aborted = self.coordinator.abort(req_id)
        self._deliver()
        return aborted

    def _deliver(self) -> None:
        now = time.perf_counter()
        for consumer, outputs in self.coordinator.take_outputs().items():
            for out in outputs:
                self.serving.on_output(out, now)
            self.mailboxes.put(consumer, outputs)
            if any(out.finished for out in outputs):
                self.request_ended.set()
                self.request_ended = asyncio.Event()

    async def _reap_consumers(self) -> None:
        """Abort the requests of consumers that stopped polling (a driver or ingress replica
        died)."""
        while True:
            await asyncio.sleep(min(5.0, self.consumer_timeout_s / 2))
            for consumer in self.mailboxes.take_silent(self.consumer_timeout_s):
                aborted = self.coordinator.abort_consumer(consumer)
                if aborted:
                    log.warning(
                        "consumer %s stopped polling; aborted its %d requests", consumer, aborted
                    )

    async def _stop_when_orphaned(self) -> None:
        """Stop this scheduler and its workers once no replica has adopted it for
        `orphan_timeout_s` while no request is open (a replica that serves it adopts it at every
        health check; a dead one is replaced and adopted again in seconds)."""
        assert self.orphan_timeout_s is not None
        while True:
            await asyncio.sleep(min(1.0, self.orphan_timeout_s / 4))
            alone_s = time.monotonic() - self.adopted_s
            if alone_s > self.orphan_timeout_s and not self.coordinator.consumers:
                break
        log.warning("no replica adopted this cell for %.0f s: stopping it", alone_s)
        for handle in self.handles.values():
            ray.kill(handle, no_restart=True)
        ray.kill(ray.get_runtime_context().current_actor, no_restart=True)

    async def _expire_deadlines(self) -> None:
        """End the requests past their queue deadline or their own timeout
        (`scheduler/cell/deadlines.py`)."""
        while True:
            await asyncio.sleep(_EXPIRY_PERIOD_S)
            passed = expire(self.coordinator, time.perf_counter())
            for deadline in passed:
                self.serving.on_timeout(deadline)
            if passed:
                self._deliver()

    async def _recover(self, worker: WorkerState, error: Exception) -> None:
        """A worker died: the coordinator moves its requests; wait for Ray to restart it. Once its
        restarts are spent it is gone, and this loop parks for good."""
        log.warning("%s failed (%s)", worker.name, type(error).__name__)
        self.coordinator.worker_died(worker)
        self._deliver()
        deadline = time.monotonic() + _RESTART_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                ready_info = await self.handles[worker.actor].ready.remote()
                self.coordinator.worker_back(worker, ready_info)
                if worker.kind == "prefill":
                    await self._connect(worker)
                return
            except ActorDiedError:
                break  # restarts spent
            except _WORKER_ERRORS:
                await asyncio.sleep(0.2)
        self.coordinator.worker_gone(worker)
        self._deliver()
        await asyncio.Event().wait()

    # ---- introspection
    async def worker_handles(self) -> dict[str, Any]:
        """The worker actors by name (prefill-0, decode-1, ...), e.g. for a fault-injection test."""
        return dict(self.handles)

    async def stats(self) -> dict[str, Any]:
        """Slots and queues per worker, live handoffs, counts, and the step timeline."""
        stats = self.coordinator.stats() | {"timeline": self.timeline.summary()}
        stats["counters"] |= self._restart_counts()
        return stats

    async def metrics(self) -> dict[str, Any]:
        """What `/metrics` reads of this cell: its stats (gauges, counts) and its vLLM-style
        counters and histograms (`ServingMetrics.snapshot`), and its instance id (a restarted
        scheduler counts afresh under a new one)."""
        stats = self.coordinator.stats()
        stats["counters"] |= self._restart_counts()
        return {"stats": stats, "serving": self.serving.snapshot(), "instance": self.instance}

    def _restart_counts(self) -> dict[str, int]:
        return {"scheduler_restarts": self.num_restarts}

    async def reset_timeline(self) -> None:
        """Start the step timeline and the prefix caches' hit counts afresh (a benchmark after its
        warm-up)."""
        self.timeline.reset()
        for worker in self.coordinator.workers:
            worker.step_planner.blocks.reset_counters()
            worker.step_planner.peak_running = len(worker.step_planner.running)


async def _dead_for_good(handle: Any) -> bool:
    """The actor answers ActorDiedError twice in a row (a call that meets the death itself may
    be followed by Ray's restart); restarting, slow or alive: False."""
    for attempt in range(2):
        try:
            await asyncio.wait_for(handle.__ray_ready__.remote(), 5.0)
            return False
        except ActorDiedError:
            if attempt == 0:
                await asyncio.sleep(0.5)
        except Exception:  # restarting, or busy: its steps will tell
            return False
    return True


def _num_restarts(actor_id: str) -> int:
    """How many times Ray has restarted this actor (GCS's actor table; at least once here)."""
    try:
        from ray._private.state import actors

        return max(1, int(actors(actor_id)["NumRestarts"]))
    except Exception:  # (a private table: its shape may change)
        return 1


def _tokens(plans: list[Any]) -> int:
    return sum(p.num_tokens for p in plans)
