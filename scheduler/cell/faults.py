"""A cell's worker faults: a worker that died (its requests recomputed or moved), came back, or is
gone for good, and a failing step's requests ended with an error.

A mixin of `Coordinator` over its pools, handoff book and counts; no Ray.
"""

from __future__ import annotations

import logging
from typing import Any

from scheduler.cell.state import WorkerState, WorkerStatus
from scheduler.request import Request

log = logging.getLogger(__name__)


class CellFaults:
    """The faults half of `Coordinator` (a mixin over its attributes)."""

    prefill: list[WorkerState]
    decode: list[WorkerState]
    counts: Any
    kv: Any
    roles: Any

    def _drop_kv(self, req_id: str) -> None:
        raise NotImplementedError

    def _recompute(self, request: Request, why: str) -> None:
        raise NotImplementedError

    def _fail(
        self,
        request: Request,
        message: str,
        unavailable: bool = False,
        error_code: str | None = None,
    ) -> None:
        raise NotImplementedError

    def wake(self, worker: WorkerState) -> None:
        raise NotImplementedError

    def fail_worker_requests(self, worker: WorkerState, message: str) -> list[str]:
        """End every request of a worker with an error (a bug applying its step: say so on each
        stream, with the request's id, under which the server logs the details); returns their
        ids."""
        failed = list(worker.sched.running) + list(worker.sched.waiting_requests())
        for request in failed:
            worker.sched.evict(request.req_id)
            self._fail(request, f"{message}; the server log has the details under {request.req_id}")
        return [r.req_id for r in failed]

    def worker_died(self, worker: WorkerState) -> None:
        """A worker stopped answering: recompute its running requests (on live workers if any, else
        on it after its restart) and move its waiting ones to live workers of its pool."""
        self.counts.worker_failures += 1
        worker.status = WorkerStatus.RESTARTING
        self.kv.worker_lost(worker)
        log.warning("%s failed; moving its requests", worker.name)
        for request in list(worker.sched.running):
            worker.sched.evict(request.req_id)
            self._drop_kv(request.req_id)  # imported or not, its blocks are gone
            self._recompute(request, f"{worker.name} failed")
        worker.sched.blocks.clear()  # the restarted worker's pool is empty
        worker.sched.held.clear()  # what handed-off prompts found cached there is gone too
        self.move_waiting(worker)

    def worker_back(self, worker: WorkerState, placement: dict[str, Any]) -> None:
        worker.status = WorkerStatus.UP
        worker.placement = placement
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
        for request in list(worker.sched.waiting_requests()):
            target = WorkerState.least_loaded(pool, exclude=worker)
            if target is None or not (target.status is WorkerStatus.UP or gone):
                if gone:
                    worker.sched.evict(request.req_id)
                    self._fail(request, f"every {worker.kind} worker is gone", unavailable=True)
                continue  # stays queued here until the restart
            worker.sched.evict(request.req_id)
            target.sched.submit(request)
            self.wake(target)
