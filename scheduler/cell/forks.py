"""n > 1: where a later choice goes to copy its sibling's prompt KV, and the choices waiting for a
handoff."""

from __future__ import annotations

from scheduler.cell.state import WorkerState, WorkerStatus
from scheduler.request import Request


class WaitingForks:
    """Later choices whose sibling (choice 0) is being prefilled on a prefill worker: they wait for
    its handoff and follow it to its decode worker, where they copy its imported KV (one prefill,
    one handoff)."""

    def __init__(self) -> None:
        self.by_sibling: dict[str, list[Request]] = {}

    def __len__(self) -> int:
        return sum(map(len, self.by_sibling.values()))

    def park(self, request: Request, prefill: list[WorkerState]) -> bool:
        """Hold a choice whose sibling is on the prefill pool; False (not held) otherwise, or when
        it needs its own prompt log-probs (echo), which only computing its prompt gives."""
        if (
            request.fork_of is None
            or request.wants_prompt_logprobs
            or not any(request.fork_of in w.step_planner.requests for w in prefill)
        ):
            return False
        self.by_sibling.setdefault(request.fork_of, []).append(request)
        return True

    def take_waiting_on(self, sibling_id: str) -> list[Request]:
        """The choices that waited for this sibling's handoff (it has one now, or left without
        one)."""
        return self.by_sibling.pop(sibling_id, [])

    def take(self, req_id: str) -> Request | None:
        """Remove one waiting choice (aborted); None if it is not waiting here."""
        fork = next(
            (f for waiting in self.by_sibling.values() for f in waiting if f.req_id == req_id), None
        )
        if fork is not None and fork.fork_of is not None:
            self.by_sibling[fork.fork_of].remove(fork)
        return fork


def sibling_worker(request: Request, pool: list[WorkerState]) -> WorkerState | None:
    """The live worker of the pool holding the sibling a choice copies its prompt from."""
    if request.fork_of is None:
        return None
    return next(
        (
            w
            for w in pool
            if w.status is WorkerStatus.UP and request.fork_of in w.step_planner.requests
        ),
        None,
    )
