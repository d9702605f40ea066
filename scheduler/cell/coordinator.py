"""The scheduler actor's decisions as plain code: routing, the handoff book, recompute, step
results, worker faults.

No Ray, torch or numpy: the Ray actor (`scheduler/cell/actor.py`) is a thin shell that calls these
methods from its loops and does the remote calls, and tests drive them with hand-built
`StepResult`s.
"""

from __future__ import annotations

import itertools
import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

from scheduler.block_pool import block_names, routing_cost
from scheduler.cell.forks import WaitingForks, sibling_worker
from scheduler.cell.handoffs import HandoffBook
from scheduler.cell.metrics import CellMetrics, RecordingBackend
from scheduler.cell.pools import RELEASE, PoolPlans
from scheduler.cell.state import (
    CellConfig,
    CellCounts,
    RequestRecord,
    TransferTotals,
    WorkerState,
    WorkerStatus,
    prefill_room,
)
from scheduler.messages import KVHandoff, KVImport, StepResult
from scheduler.outputs import OutputProcessor, RequestOutput
from scheduler.plan import StepPlan
from scheduler.request import FinishReason, Request, RequestStatus
from scheduler.step_planner import QueueFullError, SpecStats, StepPlanner

log = logging.getLogger(__name__)


class Coordinator:
    """Owns every request of a cell and decides where it goes and what its stream gets.

    * disaggregated: prompts are chunk-prefilled on prefill workers; when a prompt's last chunk is
      done, its first token is published and its KV handoff goes to the least loaded decode worker,
      which imports it into a slot and decodes it with its other slots. Prompts shorter than
      `local_prefill_max_tokens` are prefilled on the decode worker instead.
    * colocated: decode workers only, each prefilling and decoding under one decode-first budget.

    A request whose cache is lost (its worker died, its handoff's bytes were lost, it was preempted
    on a decode worker) is recomputed from prompt + output so far, up to `max_recomputes` losses,
    then ends with an error on its own stream. Outputs collect per consumer (whoever submitted the
    request) until `take_outputs`. `wake(worker)` is called whenever a worker gets new work.
    """

    def __init__(
        self,
        config: CellConfig,
        tokenizer: Any = None,
        metrics_backend: Any = None,
        wake: Callable[[WorkerState], None] = lambda worker: None,
    ) -> None:
        self.config = config
        self.outputs = OutputProcessor(tokenizer)
        self.metrics = CellMetrics(config.mode, metrics_backend or RecordingBackend())
        self.wake = wake

        def pool(kind: str, count: int, num_blocks: int | None) -> list[WorkerState]:
            return [WorkerState(kind, i, self.new_planner(kind, num_blocks)) for i in range(count)]

        self.decode = pool("decode", config.num_decode_workers, config.decode_blocks)
        self.prefill = (
            []
            if config.mode == "colocated"
            else pool("prefill", config.num_prefill_workers, config.prefill_blocks)
        )
        self.workers = self.prefill + self.decode
        for pool in (self.prefill, self.decode):
            if pool:
                blocks = pool[0].step_planner.blocks
                tokens = blocks.num_blocks * blocks.block_size
                log.info(
                    "%s workers: %d KV blocks of %d tokens each (%d tokens): %d requests of "
                    "max_model_len %d at once",
                    pool[0].kind,
                    blocks.num_blocks,
                    blocks.block_size,
                    tokens,
                    tokens // config.capacity,
                    config.capacity,
                )
        # KV pieces and handoffs in flight: the only refs held to them
        self.kv = HandoffBook(adapter_routing=config.cache_routing)
        self.kv_transfers = TransferTotals()
        self.forks = WaitingForks()
        self.records: dict[str, RequestRecord] = {}
        self.consumers: dict[str, str] = {}  # req_id -> who receives its outputs
        self.outbox: dict[str, list[RequestOutput]] = {}  # consumer -> outputs not yet taken
        self.counts = CellCounts()
        self.lora_requests: Counter[str] = Counter()  # requests admitted, per LoRA adapter
        self.roles = RoleChanges(self)
        self.pools = PoolPlans(config)

    def new_planner(self, kind: str, num_blocks: int | None) -> StepPlanner:
        """The step planner of a worker in pool `kind` whose cache has `num_blocks` blocks."""
        config = self.config
        return StepPlanner(
            config.decode_slots if kind == "decode" else config.prefill_slots,
            config.capacity,
            config.token_budget,
            config.prefill_chunk,
            max_preemptions=config.max_preemptions,
            decodes=kind == "decode",
            num_blocks=num_blocks,
            block_size=config.block_size,
            prefix_caching=config.prefix_caching,
            speculative=config.speculative,
            max_loras=config.max_loras,
        )

    # ---- requests
    def admit(self, request: Request, consumer: str = "") -> None:
        """Queue a new request. Raises ValueError (nothing queued) for one that cannot run, and
        QueueFullError when `max_waiting` requests already wait."""
        if request.req_id in self.consumers:  # every unfinished request has its consumer here
            raise ValueError(f"request id {request.req_id!r} is already in use")
        StepPlanner.check_fits(request, self.config.capacity)
        num_waiting = sum(w.step_planner.num_waiting for w in self.workers) + len(self.forks)
        if self.config.max_waiting is not None and num_waiting >= self.config.max_waiting:
            raise QueueFullError(f"the waiting queue is full ({self.config.max_waiting} requests)")
        self.consumers[request.req_id] = consumer
        if request.lora is not None and not request.is_continuation:
            self.lora_requests[request.lora.name] += 1
        self.outputs.add(request)
        self.records[request.req_id] = RequestRecord()
        self.pools.on_arrival(request)
        self._route(request)

    def abort(self, req_id: str) -> bool:
        """End a request in any state (waiting, prefilling, handed off, decoding): its slot, prefill
        row and handoff are freed at once, its stream gets a final `abort` output, and `aborts`
        counts it."""
        request = next(
            (r for w in self.workers if (r := w.step_planner.abort(req_id)) is not None), None
        ) or self.forks.take(req_id)
        if request is None:
            return False
        if request.finish_reason is None:  # a choice that was waiting for its sibling's handoff
            request.mark_finished(FinishReason.ABORT)
        self._drop_kv(req_id)
        self._send_forks_on(req_id)
        self.counts.aborts += 1
        self._publish(
            [
                RequestOutput(
                    req_id,
                    text=self.outputs.close(request),
                    finish_reason="abort",
                    metrics=request.metrics(),
                )
            ]
        )
        return True

    def abort_consumer(self, consumer: str) -> int:
        """Abort every request of a consumer that went away; returns how many."""
        aborted = sum(
            self.abort(r) for r in [r for r, c in self.consumers.items() if c == consumer]
        )
        self.outbox.pop(consumer, None)
        return aborted

    def take_outputs(self) -> dict[str, list[RequestOutput]]:
        """Every output published since the last call, grouped by consumer."""
        outbox, self.outbox = self.outbox, {}
        return outbox

    def _route(self, request: Request) -> None:
        """Queue a request whose cache is empty: on the prefill pool, or on a decode worker when the
        mode is colocated or the tokens to compute are fewer than local_prefill_max_tokens; on the
        decode worker that holds all but a block and a chunk of it (a conversation's next turn,
        whose earlier turns and replies that worker computed and cached); with the sibling it
        shares a prompt with (n > 1) when that one is still on the pool."""
        local = not self.prefill or request.num_tokens < self.config.local_prefill_max_tokens
        holder = None if local else self._decode_holding(request)
        if holder is not None:
            holder.step_planner.submit(request)
            self.wake(holder)
            return
        if not local and self.forks.park(request, self.prefill):
            return
        pool = self.decode if local else self.prefill
        worker = sibling_worker(request, pool) or self._pick_for_prompt(request, pool)
        if worker is None:
            self._fail(
                request, f"no live {'decode' if local else 'prefill'} worker", unavailable=True
            )
            return
        worker.step_planner.submit(request)
        self.wake(worker)

    def _drop_kv(self, req_id: str) -> None:
        """Drop the refs of a request's KV pieces and handoff: the object store frees their
        bytes."""
        self.kv.drop(req_id)

    def _send_forks_on(self, req_id: str, target: WorkerState | None = None) -> None:
        """The choices waiting for this request's handoff go with it to `target` (where they copy
        its KV), or, when it left without one, on their own way (each computes the prompt)."""
        for fork in self.forks.take_waiting_on(req_id):
            if target is None:
                self._route(fork)
            else:
                target.step_planner.submit(fork)

    def _pick_for_prompt(self, request: Request, pool: list[WorkerState]) -> WorkerState | None:
        """With cache routing, the live worker of least `routing_cost` (queued work and the prompt's
        uncached tokens, and a prompt chunk more per `adapter_miss` where it lacks the request's
        LoRA adapter), then the least loaded; without prefix caches, the least loaded preferring
        one with the adapter; without cache routing, the least loaded."""
        live = [w for w in pool if w.accepts]
        if not self.config.cache_routing or len(live) < 2:
            return WorkerState.least_loaded(pool)
        if not self.config.prefix_caching:  # the least loaded, preferring one with its adapter
            return WorkerState.least_loaded(pool, lora=request.lora)
        chunk = self.config.prefill_chunk  # a missing adapter costs a prompt chunk per request
        return min(
            live,
            key=lambda w: (
                routing_cost(request, w.step_planner.blocks, w.step_planner.requests.values())
                + w.adapter_miss(request.lora) * chunk,
                w.load(),
            ),
        )

    def _decode_holding(self, request: Request) -> WorkerState | None:
        """The live decode worker whose cache holds the most of a prompt, if what it lacks is at
        most a block and a prefill chunk (a conversation's next turn: the new message, and the
        partly filled block the last reply ended in). Computing that there costs its decodes a
        chunk or two, where the prefill pool would compute (and hand over) the whole prompt
        again."""
        if not self.config.prefix_caching or request.wants_prompt_logprobs:
            return None
        best = None
        most = 0
        for worker in self.decode:
            if not worker.accepts:
                continue
            pool = worker.step_planner.blocks
            cached = pool.cached_tokens(block_names(request, pool.block_size))
            if cached > most:
                best = worker
                most = cached
        if best is None:
            return None
        lacking = request.num_tokens - most
        return (
            best
            if lacking <= best.step_planner.blocks.block_size + self.config.prefill_chunk
            else None
        )

    def _fail(
        self,
        request: Request,
        message: str,
        unavailable: bool = False,
        error_code: str | None = None,
    ) -> None:
        """End a request that no scheduler holds with an error on its own stream (`unavailable`:
        this cell cannot serve it, another may; `error_code`: a deadline passed)."""
        self._drop_kv(request.req_id)
        self._send_forks_on(request.req_id)
        request.mark_finished(FinishReason.ERROR, message)
        self._publish(
            [
                RequestOutput(
                    request.req_id,
                    text=self.outputs.close(request),
                    finish_reason="error",
                    error=message,
                    metrics=request.metrics(),
                    unavailable=unavailable,
                    error_code=error_code,
                )
            ]
        )

    def _publish(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            consumer = self.consumers.get(out.req_id)
            if consumer is None:
                continue
            self.pools.window.output_tokens += len(out.token_ids)
            if out.finished:
                self.pools.on_finish(out)
                self.metrics.on_finish(out)
                out.metrics |= self.records.pop(out.req_id).as_metrics()
                del self.consumers[out.req_id]
            self.outbox.setdefault(consumer, []).append(out)
        # a slot or a place in a queue freed: `prefill_room` grew
        if any(out.finished for out in outputs):
            for worker in self.prefill:
                if worker.step_planner.num_waiting:
                    self.wake(worker)

    # ---- stepping
    def next_step(self, worker: WorkerState) -> tuple[StepPlan, list[KVImport]] | None:
        """Plan the worker's next step and the handoffs it imports first (None: no work). A prefill
        worker starts at most `prefill_room` prompts; one preempted on a decode worker is recomputed
        on the prefill pool."""
        prefill = worker.kind == "prefill"
        room = (
            prefill_room(worker, self.prefill, self.decode, self.config.prefill_slots)
            if prefill
            else None
        )
        plan = worker.step_planner.plan(room)
        for req_id in worker.step_planner.take_dropped_reservations():
            self.kv.reservation_dropped(req_id)
        for req_id in plan.preempted:
            self.kv.void_pieces(req_id)
        if plan.preempted and worker.kind == "decode" and self.prefill:
            for req_id in plan.preempted:
                request = worker.step_planner.detach(req_id)
                if request is not None:
                    self._route(request)
        # an idle decode worker gets a step that only imports them
        early = self.kv.early_imports(worker)
        if plan.empty and not early:
            return None
        self.counts.early_imports += len(early)
        return plan, self.kv.final_imports(plan, worker.step_planner.held) + early

    def apply(self, worker: WorkerState, plan: StepPlan, result: StepResult) -> None:
        """Consume a step's results: lost imports go back to be recomputed, sampled tokens are
        applied, finished prompts are handed off to a decode worker, and the outputs are
        published."""
        sched = worker.step_planner
        # of requests still prefilling here in the slot the step was planned for (not aborted or
        # preempted since, nor back in another slot: what that one exports replaces this)
        current = {
            c.req_id
            for c in plan.chunks
            if (r := sched.requests.get(c.req_id)) is not None
            and r.status is RequestStatus.RUNNING
            and c.admission == r.num_admissions
        }
        for piece in result.kv_pieces:
            request = sched.requests.get(piece.req_id)
            if (
                request is not None
                and piece.req_id in current
                and (target := self.kv.add_piece(piece, request, worker, self.decode)) is not None
            ):
                self.wake(target)  # idle, it imports the piece now
        handoffs = [
            self.kv.finish(c.req_id, worker.index)
            for c in plan.prefill
            if worker.kind == "prefill"
            and c.sample
            and c.req_id in result.samples.tokens
            and c.req_id in current
        ]
        for name, (num_bytes, seconds, failures) in result.kv_transfers.items():
            self.kv_transfers.add(name, num_bytes, seconds, failures)
            self.metrics.on_kv_transfer(name, num_bytes, seconds, failures)
        for req_id in result.failed_imports:  # its prefill worker died, or the transfer failed
            self.kv.drop(req_id)
            request = next(
                (r for w in self.workers if (r := w.step_planner.detach(req_id)) is not None), None
            )
            if request is None:
                continue
            if self.config.kv_transfer_failure == "fail":
                self._fail(request, f"the KV transfer of request {req_id} failed")
            else:
                self._recompute(request, "its KV handoff was lost")
        for req_id, seconds in result.import_s.items():
            sched.confirm_import(req_id)
            if (handoff := self.kv.imported(req_id)) is not None:
                self.metrics.on_handoff(handoff.num_bytes, handoff.export_s + seconds)
                if req_id in self.records:
                    self.records[req_id].kv_handoff_s = handoff.export_s + seconds
        samples = result.samples
        update = sched.take(plan, samples)
        outputs = self.outputs.apply(sched, update)
        if plan.num_tokens:  # (not a step that only imported)
            self.metrics.on_step(
                worker.name,
                worker.kind,
                worker.slots_used,
                plan.num_tokens,
                len(plan.preempted),
                result.step_s,
                sched.blocks.stats(),
            )
        computed_by = f"{worker.kind}_worker"  # who computed what, for the request's metrics
        for chunk in plan.chunks:
            if (record := self.records.get(chunk.req_id)) is not None:
                setattr(record, computed_by, worker.index)
        for handoff in handoffs:
            self._hand_off(sched, handoff)
        self.metrics.on_states([w.step_planner for w in self.workers])
        self.pools.on_step(worker, plan, result.step_s)
        self._publish(outputs)
        self.roles.finish()

    def _hand_off(self, sched: StepPlanner, handoff: KVHandoff) -> None:
        request = sched.detach(handoff.req_id) if handoff.req_id in sched.requests else None
        if request is None:
            self.kv.drop(handoff.req_id)
            self._send_forks_on(handoff.req_id)
            return  # finished on its first token, or aborted: the refs are dropped here
        target, handoff = self.kv.hand_over(handoff, self.decode, request)
        if target is None:
            self._fail(request, "no live decode worker", unavailable=True)
            return
        self.kv.book(handoff)
        self.counts.handoffs += 1
        self.counts.handoff_bytes += handoff.num_bytes
        self.records[request.req_id].kv_handoff_bytes = handoff.num_bytes
        target.step_planner.submit(request)
        self._send_forks_on(request.req_id, target)
        self.wake(target)

    def _recompute(self, request: Request, why: str) -> None:
        request.reset_cache()
        request.num_recomputes += 1
        self.counts.recomputes += 1
        self.metrics.on_recompute()
        if request.num_recomputes > self.config.max_recomputes:
            self._fail(
                request,
                f"request {request.req_id} lost its cache {request.num_recomputes} times "
                f"(last: {why}); giving up",
            )
            return
        log.warning("recomputing %s: %s", request.req_id, why)
        self._route(request)

    # ---- faults: a worker that died (its requests recomputed or moved), came back, or is gone
    # for good, and a failing step's requests ended with an error
    def fail_worker_requests(self, worker: WorkerState, message: str) -> list[str]:
        """End every request of a worker with an error (a bug applying its step: say so on each
        stream, with the request's id, under which the server logs the details); returns their
        ids."""
        failed = list(worker.step_planner.running) + list(worker.step_planner.waiting_requests())
        for request in failed:
            worker.step_planner.detach(request.req_id)
            self._fail(request, f"{message}; the server log has the details under {request.req_id}")
        return [r.req_id for r in failed]

    def worker_died(self, worker: WorkerState) -> None:
        """A worker stopped answering: recompute its running requests (on live workers if any, else
        on it after its restart) and move its waiting ones to live workers of its pool."""
        self.counts.worker_failures += 1
        worker.status = WorkerStatus.RESTARTING
        self.kv.worker_lost(worker)
        log.warning("%s failed; moving its requests", worker.name)
        for request in list(worker.step_planner.running):
            worker.step_planner.detach(request.req_id)
            self._drop_kv(request.req_id)  # imported or not, its blocks are gone
            self._recompute(request, f"{worker.name} failed")
        worker.step_planner.blocks.clear()  # the restarted worker's pool is empty
        worker.step_planner.held.clear()  # what handed-off prompts found cached there is gone too
        self.move_waiting(worker)

    def worker_back(self, worker: WorkerState, ready_info: dict[str, Any]) -> None:
        worker.status = WorkerStatus.UP
        worker.ready_info = ready_info
        log.warning("%s is back", worker.name)
        self.roles.finish()  # a leaving worker that died holds nothing now
        self.wake(worker)

    def worker_gone(self, worker: WorkerState) -> None:
        """Its restarts are spent: what still waits on it moves on, or ends with an error."""
        log.error("%s is gone; its pool continues without it", worker.name)
        worker.status = WorkerStatus.GONE
        self.move_waiting(worker)

    def move_waiting(self, worker: WorkerState) -> None:
        """Hand a dead (or leaving) worker's queue to live workers of its pool (a gone worker's to
        any that remain)."""
        pool = self.prefill if worker.kind == "prefill" else self.decode
        gone = worker.status is WorkerStatus.GONE
        for request in list(worker.step_planner.waiting_requests()):
            target = WorkerState.least_loaded(pool, exclude=worker)
            if target is None or not (target.status is WorkerStatus.UP or gone):
                if gone:
                    worker.step_planner.detach(request.req_id)
                    self._fail(request, f"every {worker.kind} worker is gone", unavailable=True)
                continue  # stays queued here until the restart
            worker.step_planner.detach(request.req_id)
            target.step_planner.submit(request)
            self.wake(target)

    # ---- pools
    def end_window(self, now_s: float | None = None) -> list[dict[str, Any]]:
        """Close the pool planner's window and start the workers, the release or the role change it
        decides (`PoolPlans.end_window`); the decisions, one per worker."""
        return self.pools.end_window(
            (self.prefill, self.decode), self.roles.add, self.roles.begin, now_s
        )

    # ---- introspection
    def pool_exhausted(self) -> bool:
        """A pool has no worker left: the cell cannot serve."""
        return any(
            pool and all(w.status is WorkerStatus.GONE for w in pool)
            for pool in (self.prefill, self.decode)
        )

    def stats(self) -> dict[str, Any]:
        """Slots and queues per worker, live handoffs and counts: what a test or /stats reads."""
        workers = {w.name: w.stats() for w in self.workers}
        planners = [w.step_planner for w in self.workers]
        counters = vars(self.counts) | {
            "preemptions": sum(p.num_preemptions for p in planners),
            "recomputed_tokens": sum(p.num_recomputed_tokens for p in planners),
        }
        return {
            "workers": workers,
            "live_handoffs": len(self.kv.handoffs),
            "streams": len(self.consumers),
            "counters": counters,
            "spec_decode": SpecStats.summed([p.spec_stats for p in planners]),
            "kv_transfer": self.kv_transfers.stats(),
            "pools": {
                "prefill": len(self.prefill),
                "decode": len(self.decode),
                "leaving": {w.name: w.next_kind for w in self.workers if w.next_kind},
                "role_changes": self.roles.count,
                "decisions": self.pools.decisions,
                "changes": self.pools.changes,
                "last_window": self.pools.last_window,
            },
            "max_waiting": self.config.max_waiting,
            "lora": self._lora_stats(planners),
        }

    def _lora_stats(self, planners: list[StepPlanner]) -> dict[str, Any]:
        """LoRA adapters: the most a worker runs at once (None: not served), requests running
        and waiting per adapter, requests admitted per adapter, and per pool the adapters its
        workers read (not holding them) since the cell started."""
        running: Counter[str] = Counter()
        waiting: Counter[str] = Counter()
        for planner in planners:
            running.update(r.lora.name for r in planner.running if r.lora is not None)
            waiting.update(e.request.lora.name for e in planner.waiting if e.request.lora)
        return {
            "max_loras": self.config.max_loras,
            "running": dict(running),
            "waiting": dict(waiting),
            "requests": dict(self.lora_requests),
            "loads": {
                pool: sum(w.step_planner.num_adapter_loads for w in workers)
                for pool, workers in (("prefill", self.prefill), ("decode", self.decode))
            },
        }


class RoleChanges:
    """A cell's workers on their way from one pool to the other, joining the cell, or leaving it.

    A worker leaving its pool (`begin`) takes no new work: nothing is routed, bound or handed to
    it, and the prompts still waiting in its queue go to the rest of its pool. What it already
    holds runs to the end there (a prefill worker's prompts are prefilled and handed off; a decode
    worker's requests finish), so no request is moved, recomputed or changed by a role change. Once
    it holds nothing and has no call in flight (`finish`), it joins the other pool under a new name
    with a planner for that role; the actor, its cache and its KV transfers stay as they are (its
    named prefix blocks are forgotten). It changes the coordinator's pools in place, so it lives
    beside it."""

    def __init__(self, coordinator: Coordinator) -> None:
        self.cell = coordinator
        self.switched: list[WorkerState] = []  # since the actor shell last took them
        self.released: list[WorkerState] = []  # likewise: their actors are to be stopped
        self.count = 0
        self.added = 0
        self.removed = 0

    def add(self, kind: str) -> WorkerState:
        """A new worker for pool `kind`, not yet started (`RESTARTING` until its actor answers
        `ready`; the actor shell starts it)."""
        cell = self.cell
        pool = cell.prefill if kind == "prefill" else cell.decode
        taken = {w.index for w in pool}
        index = next(i for i in itertools.count() if i not in taken)
        actors = {w.actor for w in cell.workers} | {w.actor for w in self.released}
        actor = next(
            name
            for n in itertools.count()
            if (name := f"{kind}-{index}" + (f"-{n}" if n else "")) not in actors
        )
        blocks = cell.config.decode_blocks if kind == "decode" else cell.config.prefill_blocks
        worker = WorkerState(
            kind, index, cell.new_planner(kind, blocks), WorkerStatus.RESTARTING, actor=actor
        )
        pool.append(worker)
        cell.workers = cell.prefill + cell.decode
        self.added += 1
        return worker

    def begin(self, worker: WorkerState, kind: str) -> None:
        """Start moving `worker` to pool `kind` (or out of the cell: `RELEASE`): no new work from
        now on."""
        if kind == worker.kind or worker.next_kind is not None:
            return
        worker.next_kind = kind
        cell = self.cell
        if worker.kind == "prefill":  # prompts not started go to the rest of the pool
            cell.move_waiting(worker)
        for req_id in [r for r, w in cell.kv.bound.items() if w is worker]:
            cell.kv.unbind(req_id)  # rebound, with its next piece, to a worker that stays
        self.finish()

    def holds_nothing(self, worker: WorkerState) -> bool:
        sched = worker.step_planner
        kv = self.cell.kv
        return (
            not sched.running
            and not sched.num_waiting
            and not sched.reserved
            and all(w is not worker for w in kv.bound.values())
            and not worker.calls_in_flight
        )

    def finish(self) -> None:
        """Move every leaving worker that holds nothing any more to its new pool."""
        cell = self.cell
        for worker in list(cell.workers):
            if worker.next_kind is None or worker.status is not WorkerStatus.UP:
                continue
            if not self.holds_nothing(worker):
                continue
            source = cell.prefill if worker.kind == "prefill" else cell.decode
            if worker.next_kind == RELEASE:
                source.remove(worker)
                cell.workers = cell.prefill + cell.decode
                worker.status = WorkerStatus.GONE
                worker.next_kind = None
                self.removed += 1
                self.released.append(worker)
                continue
            target = cell.decode if worker.next_kind == "decode" else cell.prefill
            source.remove(worker)
            taken = {w.index for w in target}
            worker.index = next(i for i in itertools.count() if i not in taken)
            worker.kind = worker.next_kind
            worker.next_kind = None
            released = worker.step_planner.worker_copy.take_forgotten()
            worker.step_planner = cell.new_planner(
                worker.kind, worker.step_planner.blocks.num_blocks
            )
            # (its next call still tells the worker which requests' states to drop)
            worker.step_planner.worker_copy.forgotten = released
            target.append(worker)
            cell.workers = cell.prefill + cell.decode
            self.count += 1
            self.switched.append(worker)
            cell.metrics.on_role_change(worker.kind)
            cell.wake(worker)

    def take_switched(self) -> list[WorkerState]:
        switched, self.switched = self.switched, []
        return switched

    def take_released(self) -> list[WorkerState]:
        released, self.released = self.released, []
        return released
