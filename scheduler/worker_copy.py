"""What a worker holds for each request, as its step planner keeps track: a step message sends only
what changed."""

from __future__ import annotations

from scheduler.plan import History
from scheduler.request import Request, SamplingParams


class WorkerCopy:
    """A request's sampling parameters go to a worker once, with its first chunk there; its history
    (what penalties count and a grammar follows) once, with its first sampling chunk there, when its
    sampling needs it. When the request leaves the worker, or its cache there is lost, the worker is
    told to forget both (`take_forgotten`), and its next chunk there, if any, sends them again."""

    def __init__(self) -> None:
        self.params: set[str] = set()  # requests whose sampling parameters the worker holds
        self.states: set[str] = set()  # of those, the ones whose sampling state it holds
        # forgotten since the last plan: the worker may drop what it holds
        self.forgotten: list[str] = []

    def send(self, request: Request, sample: bool) -> tuple[SamplingParams | None, History | None]:
        """What a chunk of the request carries: its sampling parameters and history, each None if
        the worker holds it already (or, for history, does not need it)."""
        req_id = request.req_id
        params = request.sampling
        history = None
        if sample and params.needs_history and req_id not in self.states:
            history = (tuple(request.prompt_ids), tuple(request.output_ids))
            self.states.add(req_id)
        if req_id in self.params:
            return None, history
        self.params.add(req_id)
        return params, history

    def forget(self, req_id: str) -> None:
        """The request left the worker, or what the worker holds for it is void (it recomputes)."""
        if req_id in self.params:
            self.params.discard(req_id)
            self.states.discard(req_id)
            self.forgotten.append(req_id)

    def take_forgotten(self) -> list[str]:
        forgotten, self.forgotten = self.forgotten, []
        return forgotten
