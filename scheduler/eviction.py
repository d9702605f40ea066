"""Making room when a worker's blocks run short: a reservation given back first, then the least
urgent running request evicted (and recomputed later by the one recompute path).

A mixin of `StepPlanner` over its attributes; pure, as the policy is.
"""

from __future__ import annotations

from typing import Any

from scheduler.request import Request


class Eviction:
    """The eviction half of `StepPlanner` (a mixin over its running requests, reservations,
    block tables, queue and counters)."""

    running: list[Request]
    requests: dict[str, Request]
    reserved: dict[str, tuple[int, list[int]]]
    waiting: list[Any]
    tables: Any
    worker_copy: Any
    max_preemptions: int
    num_preemptions: int
    num_recomputed_tokens: int
    # reservations given back for want of blocks since the caller last took them
    # (`take_dropped_reservations`): what was imported into them is void
    dropped_reservations: list[str]

    def unreserve(self, req_id: str) -> None:
        raise NotImplementedError

    def _release_slot(self, request: Request) -> None:
        raise NotImplementedError

    def _enqueue(self, request: Request) -> None:
        raise NotImplementedError

    def can_preempt_for_waiting(self) -> bool:
        """A waiting request could evict a running one: the most urgent one can whenever any can."""
        return bool(self.waiting) and self.victim(self.waiting[0].request) is not None

    def victim(self, candidate: Request) -> Request | None:
        """The running request to evict for `candidate`: strictly less urgent, evicted fewer than
        `max_preemptions` times (so a stream of urgent requests cannot starve it), the least urgent
        of those, then the one with the most work left."""
        evictable = [
            r
            for r in self.running
            if r.priority > candidate.priority and r.num_preemptions < self.max_preemptions
        ]
        if not evictable:
            return None
        return max(
            evictable,
            key=lambda r: (r.priority, r.max_tokens - r.num_outputs_planned + r.num_uncomputed),
        )

    def _grow_or_preempt(self, request: Request, num_tokens: int, preempted: list[str]) -> bool:
        """`_grow`, preempting the least urgent running requests while the pool is short; False if
        `request` itself was the least urgent (it is preempted then)."""
        while not self.tables.grow(request, num_tokens):
            if self._drop_a_reservation():
                continue
            victim = max(self.running, key=lambda r: (r.priority, r.arrival_s))
            self._preempt(victim)
            preempted.append(victim.req_id)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        """Free its seat and blocks now; it waits again and, readmitted, recomputes prompt + output
        so far (what of it is still cached, it finds there)."""
        self._release_slot(request)
        self.num_preemptions += 1
        self.num_recomputed_tokens += request.num_computed
        request.reset_cache()
        request.num_preemptions += 1
        # what the worker sampled for it in flight is void: resend
        self.worker_copy.forget(request.req_id)
        self._enqueue(request)

    def _drop_a_reservation(self) -> bool:
        """Give back the latest reservation of a prompt still prefilling elsewhere (it imports
        its KV whole when it is handed off): a running request that cannot grow, or a waiting one
        that can evict none, goes before a prompt that may not arrive for a while (or, with the
        prefill pool waiting on this worker's queue, ever). A prompt handed off already keeps its
        own: it goes in next. False if there is none to give back."""
        req_id = next((r for r in reversed(self.reserved) if r not in self.requests), None)
        if req_id is None:
            return False
        self.unreserve(req_id)
        self.dropped_reservations.append(req_id)
        return True

    def take_dropped_reservations(self) -> list[str]:
        dropped, self.dropped_reservations = self.dropped_reservations, []
        return dropped
