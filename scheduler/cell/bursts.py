"""Decode bursts: how many decode steps one call to a worker carries, so Ray's per-call cost is paid
once for several tokens when the model's step is cheap.

A call to a worker actor costs about a millisecond beyond the step itself (dispatch,
(de)serialization, the scheduler's loop), whatever the step holds. On a model whose decode step
takes a few milliseconds that is a large share of every token. A burst sends K plans in one call:
the worker runs them in order, feeding each step the tokens it sampled in the one before (as it does
for the step planned ahead), and returns K results that are applied in order. Outputs are the same
tokens: each plan is an ordinary step planned ahead, a request that stops in one of them (a stop
token, max_tokens, a stop string) drops what the later ones sample for it, and every step's sampling
is seeded by the token's index, not the step.

A burst only forms while nothing else could use the worker sooner: every request on it is decoding,
and either nothing waits for it here or on the prefill pool (whose handoffs could join), or it is
full: no slot is free, none can be preempted for what waits, and no running request has planned its
last token, so nothing, here or still to come from the prefill pool, could start before a running
request ends. Its length keeps the measured per-call overhead near `overhead_share` of the burst's
compute, and never lets a burst run past `max_burst_s`, so a request arriving meanwhile waits at
most about that long and a stream's tokens come at least that often.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from scheduler.cell.state import WorkerState
from scheduler.messages import KVImport
from scheduler.plan import StepPlan

if TYPE_CHECKING:
    from scheduler.cell.coordinator import Coordinator


def plan_call(
    coordinator: Coordinator, worker: WorkerState, max_steps: int
) -> tuple[list[StepPlan], list[KVImport]] | None:
    """The plans of the worker's next call and the handoffs it imports first; None when it has no
    work. More than one plan (up to `max_steps`) only while the first is a decode step that imports
    nothing and `may_burst` holds."""
    step = coordinator.next_step(worker)
    if step is None:
        return None
    plans = [step[0]]
    imports = step[1]
    while (
        len(plans) < max_steps
        and not plans[0].prefill
        and not imports
        and may_burst(worker, coordinator.prefill)
    ):
        more = coordinator.next_step(worker)
        if more is None:
            break
        plans.append(more[0])
        # none while may_burst holds; if any, importing before the first plan is as good
        imports += more[1]
    return plans, imports


def may_burst(worker: WorkerState, prefill_pool: list[WorkerState]) -> bool:
    """The worker's next plan would be a decode step, and no new work for it can come meanwhile:
    none waits here or on the prefill pool, or nothing can start before a running request ends (no
    slot is free, none can be preempted for what waits, and no running request has planned its last
    token: its slot frees when that step is applied). A more urgent handoff that could preempt waits
    at most one burst, as a new request does."""
    sched = worker.step_planner
    if (
        worker.kind != "decode"
        or not sched.running
        or not all(r.is_decoding for r in sched.running)
    ):
        return False
    if not sched.num_waiting and all(p.step_planner.idle for p in prefill_pool):
        return True
    return (
        not sched.free_slots
        and not sched.can_preempt_for_waiting()
        and all(r.num_outputs_planned < r.max_tokens for r in sched.running)
    )


class BurstSizer:
    """Per worker, a moving average of one step's time on the worker and of what a call costs beyond
    its steps; `length` turns them into the next burst's number of steps."""

    def __init__(
        self, max_burst_s: float, max_steps: int = 16, overhead_share: float = 0.1
    ) -> None:
        if max_burst_s < 0 or max_steps < 1 or overhead_share <= 0:
            raise ValueError("max_burst_s must be >= 0, max_steps >= 1 and overhead_share > 0")
        self.max_burst_s = max_burst_s
        self.max_steps = max_steps
        self.overhead_share = overhead_share
        self.step_s: dict[str, float] = {}
        self.overhead_s: dict[str, float] = {}

    def observe(self, worker: str, steps: int, period_s: float, worker_s: float) -> None:
        """A call of `steps` steps took `period_s` of the worker's loop, `worker_s` of them in its
        steps."""
        step = worker_s / max(1, steps)
        overhead = max(0.0, period_s - worker_s)
        for averages, value in ((self.step_s, step), (self.overhead_s, overhead)):
            averages[worker] = 0.8 * averages.get(worker, value) + 0.2 * value

    def forget(self, worker: str) -> None:
        """The worker changed roles: its old steps' times say nothing now."""
        self.step_s.pop(worker, None)
        self.overhead_s.pop(worker, None)

    def length(self, worker: str) -> int:
        """Steps for the worker's next call: 1 until a call has been measured, or when bursts are
        off."""
        step = self.step_s.get(worker)
        overhead = self.overhead_s.get(worker)
        if not self.max_burst_s or step is None or overhead is None:
            return 1
        step = max(step, 1e-6)
        wanted = math.ceil(overhead / (self.overhead_share * step))
        return max(1, min(wanted, self.max_steps, int(self.max_burst_s / step)))
