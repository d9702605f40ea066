"""The stepping loops of a cell's scheduler actor: one per worker, one call in flight ahead.

No Ray here: the actor shell (`scheduler/cell/actor.py`) supplies the worker handles, the errors
that mean a worker died (`worker_errors`) and what to do then (`_recover`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any

from scheduler.cell.bursts import plan_call
from scheduler.cell.state import WorkerState
from scheduler.messages import pack_plans

log = logging.getLogger(__name__)


class CellSteps:
    """The stepping half of `CellActor` (a mixin over its attributes: coordinator, handles,
    wakeups, clock, bursts, timeline)."""

    worker_errors: tuple[type[BaseException], ...] = ()
    coordinator: Any
    handles: dict[str, Any]
    wakeups: dict[str, asyncio.Event]
    clock: Any
    bursts: Any
    timeline: Any
    last_result_s: dict[str, float]
    handoff_applied: asyncio.Event
    prefetching: set[asyncio.Future[Any]]

    def _deliver(self) -> None:
        raise NotImplementedError

    async def _after_role_changes(self) -> None:
        raise NotImplementedError

    async def _recover(self, worker: WorkerState, error: Exception) -> None:
        raise NotImplementedError

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
        return handle.step.remote(pack_plans(plans), imports, worker.placement.get("incarnation"))

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
        except self.worker_errors as e:
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


def _tokens(plans: list[Any]) -> int:
    return sum(p.num_tokens for p in plans)
