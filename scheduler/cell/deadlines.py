"""Request deadlines: which requests of a cell have waited or run too long, ended with an error.

A request carries two deadlines from its arrival at the cell: `max_queue_s` to be given a slot
(the service's `--max-queue-time-s`) and `timeout_s` to finish (the body's `timeout`). The cell's
actor calls `expire` a few times a second; an expired request is taken off its worker's planner
(its slot, blocks and KV freed at once, as an abort) and its stream ends with an error whose
`error_code` says which deadline passed, so the HTTP edge answers 503 + Retry-After for the queue's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from scheduler.request import Request

if TYPE_CHECKING:
    from scheduler.cell.coordinator import Coordinator

QUEUE_TIMEOUT = "queue_timeout"  # never given a slot within max_queue_s
TIMEOUT = "timeout"  # not finished within timeout_s


def deadline_passed(request: Request, now: float) -> str | None:
    """Which deadline of a request has passed at `now`, if any: the queue's first."""
    waited = now - request.arrival_s
    if request.max_queue_s is not None and request.scheduled_s is None:
        if waited > request.max_queue_s:
            return QUEUE_TIMEOUT
    if request.timeout_s is not None and waited > request.timeout_s:
        return TIMEOUT
    return None


def expire(coordinator: Coordinator, now: float) -> list[str]:
    """End every request of the cell past a deadline; returns the deadline each one passed."""
    passed = []
    for worker in coordinator.workers:
        for request in list(worker.step_planner.requests.values()):
            code = deadline_passed(request, now)
            if code is None:
                continue
            worker.step_planner.detach(request.req_id)
            what = "waited in the queue" if code == QUEUE_TIMEOUT else "ran"
            coordinator._fail(
                request,
                f"request {request.req_id} {what} {now - request.arrival_s:.1f} s, past its "
                "deadline",
                error_code=code,
            )
            passed.append(code)
    return passed
