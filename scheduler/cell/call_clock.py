"""When workers' calls should end, by each worker's seconds per token: whether a handoff is due soon
enough for a decode worker to wait for it before planning its next step."""

from __future__ import annotations

import math

# A prefill call's expected end is off by a fraction of its length either way. Waiting for a handoff
# that comes later than expected costs the decode worker one step's planning ahead (a few ms); not
# waiting for one that comes sooner costs the handed-off request a whole step. So a call counts as
# due this much of its length before its expected end.
HANDOFF_EARLY = 0.25


class CallClock:
    """Each worker's seconds per token (a moving average over its calls that computed tokens) and,
    per prefill worker, its calls in flight that finish a prompt, with when each should end: a call
    starts when the one before it on that worker returned (until then, queued, its end is unknown)
    and lasts its tokens times the worker's seconds per token."""

    def __init__(self, smoothing: float = 0.2) -> None:
        self.smoothing = smoothing
        self.s_per_token: dict[str, float] = {}
        # worker -> sent at -> (end, length)
        self.finishing: dict[str, dict[float, tuple[float, float]]] = {}

    def length(self, worker: str, tokens: int) -> float:
        """How long a call of `tokens` tokens should run on the worker (infinite before its first
        call)."""
        return self.s_per_token.get(worker, math.inf) * max(1, tokens)

    def ends(self, worker: str, tokens: int, start: float) -> float:
        return start + self.length(worker, tokens)

    def observe(self, worker: str, seconds: float, tokens: int) -> None:
        """A call of `tokens` tokens kept the worker busy `seconds` (one that only imported KV says
        nothing)."""
        if tokens:
            rate = seconds / tokens
            self.s_per_token[worker] = (1 - self.smoothing) * self.s_per_token.get(
                worker, rate
            ) + self.smoothing * rate

    def finishing_sent(self, worker: str, sent_s: float, tokens: int, queued: bool) -> None:
        """A call that finishes a prompt was sent at `sent_s`: it runs at once, or (`queued`) after
        the call in flight on that worker."""
        end = math.inf if queued else self.ends(worker, tokens, sent_s)
        self.finishing.setdefault(worker, {})[sent_s] = (end, self.length(worker, tokens))

    def started(self, worker: str, sent_s: float, tokens: int, now: float) -> None:
        """The call before it returned: the call sent at `sent_s` (if it finishes a prompt) runs
        from `now`."""
        calls = self.finishing.get(worker, {})
        if sent_s in calls:
            calls[sent_s] = (self.ends(worker, tokens, now), self.length(worker, tokens))

    def returned(self, worker: str, sent_s: float) -> None:
        self.finishing.get(worker, {}).pop(sent_s, None)

    def lost(self, worker: str) -> None:
        """The worker died: none of its calls will return."""
        self.finishing.pop(worker, None)

    def forget(self, worker: str) -> None:
        """The worker changed roles: its speed per token in the old one says nothing now."""
        self.lost(worker)
        self.s_per_token.pop(worker, None)

    def handoff_due(self, by: float) -> bool:
        """Whether a call that finishes a prompt should be back by `by` (counted `HANDOFF_EARLY`
        early)."""
        return any(
            end - HANDOFF_EARLY * length <= by
            for calls in self.finishing.values()
            for end, length in calls.values()
            if end < math.inf
        )
