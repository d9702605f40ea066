"""A cell's pools resized while it serves: workers that change role, and the planner's window.

A worker leaving its pool (`begin`) takes no new work: nothing is routed, bound or handed to it,
and the prompts still waiting in its queue go to the rest of its pool. What it already holds runs
to the end there (a prefill worker's prompts are prefilled and handed off; a decode worker's
requests finish), so no request is moved, recomputed or changed by a role change. Once it holds
nothing and has no call in flight (`finish`), it joins the other pool under a new name with a
planner for that role; the actor, its cache and its KV transfers stay as they are (its named
prefix blocks are forgotten).

`PoolPlans` collects the load of each window from the coordinator's hooks, asks the pure
`PoolPlanner` for the pools' next sizes at the end of the window, and starts the role change
that moves toward them: the least loaded worker of the pool that shrinks. Every decision, and
its reason, is kept for /stats and counted in the metrics.
"""

from __future__ import annotations

import itertools
import math
import time
from typing import TYPE_CHECKING, Any

from scheduler.cell.state import WorkerState, WorkerStatus
from scheduler.load_forecast import SeasonalForecast
from scheduler.outputs import RequestOutput
from scheduler.plan import StepPlan
from scheduler.pool_planner import LoadWindow, PoolPlanner
from scheduler.request import Request

if TYPE_CHECKING:
    from scheduler.cell.coordinator import Coordinator

_DECISIONS_KEPT = 50


RELEASE = "release"  # a worker's `next_kind` when it leaves the cell
# what the planner's decisions do to the pools, as /stats' `pools.changes` counts them
POOL_CHANGES = ("start", "release", "role_change")


class RoleChanges:
    """Workers on their way from one pool to the other, joining the cell, or leaving it."""

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
        sched = worker.sched
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
            released = worker.sched.worker_copy.take_released()
            worker.sched = cell.new_planner(worker.kind, worker.sched.blocks.num_blocks)
            # (its next call still tells the worker which requests' states to drop)
            worker.sched.worker_copy.released = released
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


class PoolPlans:
    """The planner's inputs over a window, and its decisions."""

    def __init__(self, coordinator: Coordinator) -> None:
        self.cell = coordinator
        config = coordinator.config
        # role changes only (the pools keep the sum they started with), unless a pool may grow
        scaling = config.max_prefill_workers is not None or config.max_decode_workers is not None
        self.planner = (
            PoolPlanner(
                slo_itl_s=config.slo_itl_ms / 1000,
                slo_ttft_s=config.slo_ttft_ms / 1000,
                decode_slots=config.decode_slots,
                total=None if scaling else len(coordinator.workers),
                # (a pool without a maximum keeps the size it started with)
                max_prefill=(config.max_prefill_workers or config.num_prefill_workers)
                if scaling
                else len(coordinator.workers) - 1,
                max_decode=(config.max_decode_workers or config.num_decode_workers)
                if scaling
                else len(coordinator.workers) - 1,
                release_after=max(
                    1, math.ceil(config.planner_release_delay_s / config.planner_window_s)
                ),
                forecast=SeasonalForecast(config.planner_period_s)
                if scaling and config.planner_period_s
                else None,
            )
            if config.pool_planner
            else None
        )
        self.window = LoadWindow()
        self.started_s = time.monotonic()
        self.decisions: list[dict[str, Any]] = []  # the last ones, with their reasons
        # every decision since the cell started: {"start" | "release" | "role_change": {pool: n}}
        # (a role change counts in the pool the worker joins)
        self.changes: dict[str, dict[str, int]] = {}
        self.last_window: dict[str, Any] = {}  # what the planner last saw, for /stats

    # hooks: the coordinator calls these as requests come and go and steps return
    def on_arrival(self, request: Request) -> None:
        self.window.arrivals += 1
        self.window.prompt_tokens += len(request.prompt_ids)
        self.window.prompt_tokens_sq += len(request.prompt_ids) ** 2

    def on_finish(self, out: RequestOutput) -> None:
        """(Output tokens are counted as they are published: the window's mean output length is
        the tokens it produced over the requests it finished.)"""
        self.window.finished += 1
        if out.metrics.get("ttft_s"):
            self.window.ttft_s.append(out.metrics["ttft_s"])
        if out.metrics.get("tpot_s"):
            self.window.itl_s.append(out.metrics["tpot_s"])

    def on_step(self, worker: WorkerState, plan: StepPlan, step_s: float) -> None:
        if worker.kind == "prefill":
            self.window.prefill_tokens += plan.num_tokens
            self.window.prefill_busy_s += step_s
        elif plan.decode and not plan.prefill:
            self.window.decode_steps.append((len(plan.decode), step_s))

    def on_started(self, seconds: float) -> None:
        """A worker the planner started answered `seconds` after its start: the forecast looks
        that far ahead (the latest start-up measured)."""
        if self.planner is not None:
            self.planner.startup_s = seconds

    def end_window(self, now_s: float | None = None) -> list[dict[str, Any]]:
        """Close the window; start the role change, release or starts the planner decides, and
        return the decisions (one per worker)."""
        now_s = time.monotonic() if now_s is None else now_s
        window, self.window = self.window, LoadWindow()
        window.seconds = now_s - self.started_s
        self.started_s = now_s
        cell = self.cell
        if self.planner is None or not cell.prefill:
            return []
        prefill = sum(_counts_as(w, "prefill") for w in cell.workers)
        decode = sum(_counts_as(w, "decode") for w in cell.workers)
        joining = (_joining(cell.workers, "prefill"), _joining(cell.workers, "decode"))
        target = self.planner.decide(window, prefill, decode, joining)
        self.last_window = {
            "seconds": round(window.seconds, 3),
            "arrivals": window.arrivals,
            "finished": window.finished,
            "needs": self.planner.last_needs,
            "forecast": self.planner.last_ahead,
        }
        if target is None:
            return []
        decision = {
            "at_s": round(now_s, 3),
            "prefill": target.prefill,
            "decode": target.decode,
            "reason": target.reason,
        }
        if target.prefill >= prefill and target.decode >= decode:  # pools grow: start workers
            kinds = ["prefill"] * (target.prefill - prefill) + ["decode"] * (target.decode - decode)
            decisions = [decision | {"worker": cell.roles.add(k).name, "to": k} for k in kinds]
            changes = [("start", k) for k in kinds]
        elif target.prefill + target.decode < prefill + decode:  # a pool shrinks: release one
            kind = "prefill" if target.prefill < prefill else "decode"
            worker = self._least_loaded_accepting(kind)
            if worker is None:
                return []
            decisions = [decision | {"worker": worker.name, "to": RELEASE}]
            cell.roles.begin(worker, RELEASE)
            changes = [("release", kind)]
        else:  # a role change
            shrinking = "prefill" if target.prefill < prefill else "decode"
            worker = self._least_loaded_accepting(shrinking)
            if worker is None:
                return []
            growing = "decode" if shrinking == "prefill" else "prefill"
            decisions = [decision | {"worker": worker.name, "to": growing}]
            cell.roles.begin(worker, growing)
            changes = [("role_change", growing)]
        for line in decisions:
            self._record(line)
        for change, pool in changes:
            counts = self.changes.setdefault(change, {})
            counts[pool] = counts.get(pool, 0) + 1
        return decisions

    def _least_loaded_accepting(self, kind: str) -> WorkerState | None:
        """The worker of pool `kind` holding the least, if the pool keeps another that takes new
        work."""
        pool = self.cell.prefill if kind == "prefill" else self.cell.decode
        candidates = [w for w in pool if w.accepts]
        if len(candidates) < 2:
            return None
        return min(candidates, key=lambda w: len(w.sched.running) + w.sched.num_waiting)

    def _record(self, decision: dict[str, Any]) -> None:
        self.decisions = (self.decisions + [decision])[-_DECISIONS_KEPT:]


def _counts_as(worker: WorkerState, kind: str) -> bool:
    """A worker counts in the pool it is in, or in the one it is leaving for."""
    if worker.status is WorkerStatus.GONE:
        return False
    return (worker.next_kind or worker.kind) == kind


def _joining(workers: list[WorkerState], kind: str) -> int:
    """Workers on their way into pool `kind`: starting (or restarting after a fault), or leaving
    the other pool for it."""
    return sum(
        w.next_kind == kind or (w.kind == kind and w.status is WorkerStatus.RESTARTING)
        for w in workers
    )
