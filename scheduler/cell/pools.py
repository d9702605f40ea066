"""A cell's pools resized while it serves: the planner's window, its decisions, and what they do.

`PoolPlans` collects the load of each window from the coordinator's hooks, asks the pure
`PoolPlanner` for the pools' next sizes at the end of the window, and starts what moves toward
them: new workers, or a role change or release of the least loaded worker of the pool that
shrinks (`RoleChanges` in scheduler/cell/coordinator.py carries those out). Every decision, and
its reason, is kept for /stats and counted in the metrics.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from scheduler.cell.state import CellConfig, WorkerState, WorkerStatus
from scheduler.load_forecast import SeasonalForecast
from scheduler.load_window import LoadWindow
from scheduler.outputs import RequestOutput
from scheduler.plan import StepPlan
from scheduler.pool_planner import PoolPlanner
from scheduler.request import Request

_DECISIONS_KEPT = 50


RELEASE = "release"  # a worker's `next_kind` when it leaves the cell
# what the planner's decisions do to the pools, as /stats' `pools.changes` counts them
POOL_CHANGES = ("start", "release", "role_change")


class PoolPlans:
    """The planner's inputs over a window, and its decisions."""

    def __init__(self, config: CellConfig) -> None:
        # role changes only (the pools keep the devices they started with), unless a pool may grow
        scaling = config.max_prefill_workers is not None or config.max_decode_workers is not None
        ranks = (config.prefill_tensor_parallel_size, config.decode_tensor_parallel_size)
        devices = config.num_prefill_workers * ranks[0] + config.num_decode_workers * ranks[1]
        self.planner = (
            PoolPlanner(
                slo_itl_s=config.slo_itl_ms / 1000,
                slo_ttft_s=config.slo_ttft_ms / 1000,
                decode_slots=config.decode_slots,
                total=None if scaling else devices,
                prefill_ranks=ranks[0],
                decode_ranks=ranks[1],
                # (a pool without a maximum keeps the size it started with)
                max_prefill=(config.max_prefill_workers or config.num_prefill_workers)
                if scaling
                else devices // ranks[0],
                max_decode=(config.max_decode_workers or config.num_decode_workers)
                if scaling
                else devices // ranks[1],
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
        # a role change keeps the worker's actor where both pools' workers hold as many devices
        self.same_ranks = ranks[0] == ranks[1]
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

    def end_window(
        self,
        pools: tuple[list[WorkerState], list[WorkerState]],
        start: Callable[[str], WorkerState],
        move: Callable[[WorkerState, str], None],
        now_s: float | None = None,
    ) -> list[dict[str, Any]]:
        """Close the window; start the role change, release or starts the planner decides for
        the cell's `pools` (its prefill and decode workers), and return the decisions (one per
        worker). `start(kind)` adds a worker to pool `kind`; `move(worker, kind)` sends a worker
        on its way to pool `kind` or out of the cell (`RELEASE`)."""
        now_s = time.monotonic() if now_s is None else now_s
        window, self.window = self.window, LoadWindow()
        window.seconds = now_s - self.started_s
        self.started_s = now_s
        prefill_pool, decode_pool = pools
        workers = prefill_pool + decode_pool
        if self.planner is None or not prefill_pool:
            return []
        prefill = sum(_counts_as(w, "prefill") for w in workers)
        decode = sum(_counts_as(w, "decode") for w in workers)
        joining = (_joining(workers, "prefill"), _joining(workers, "decode"))
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
            decisions = [decision | {"worker": start(k).name, "to": k} for k in kinds]
            changes = [("start", k) for k in kinds]
        elif target.prefill <= prefill and target.decode <= decode:  # a pool shrinks: release one
            kind = "prefill" if target.prefill < prefill else "decode"
            leaving = _least_loaded_accepting(prefill_pool if kind == "prefill" else decode_pool)
            if not leaving:
                return []
            decisions = [decision | {"worker": leaving[0].name, "to": RELEASE}]
            move(leaving[0], RELEASE)
            changes = [("release", kind)]
        elif self.same_ranks:  # a role change: the worker keeps its actor
            shrinking = "prefill" if target.prefill < prefill else "decode"
            leaving = _least_loaded_accepting(
                prefill_pool if shrinking == "prefill" else decode_pool
            )
            if not leaving:
                return []
            growing = "decode" if shrinking == "prefill" else "prefill"
            decisions = [decision | {"worker": leaving[0].name, "to": growing}]
            move(leaving[0], growing)
            changes = [("role_change", growing)]
        else:  # a role change of whole groups: the shrinking pool's leave, the growing pool's start
            decisions, changes = self._trade(
                decision, pools, {"prefill": prefill, "decode": decode}, start, move
            )
        for line in decisions:
            self._record(line)
        for change, pool in changes:
            counts = self.changes.setdefault(change, {})
            counts[pool] = counts.get(pool, 0) + 1
        return decisions

    def _trade(
        self,
        decision: dict[str, Any],
        pools: tuple[list[WorkerState], list[WorkerState]],
        counts: dict[str, int],
        start: Callable[[str], WorkerState],
        move: Callable[[WorkerState, str], None],
    ) -> tuple[list[dict[str, Any]], list[tuple[str, str]]]:
        """A role change between pools whose workers hold different numbers of devices: the
        shrinking pool's least loaded workers are released and the growing pool's new workers
        started (Ray places them on the devices the released ones free). Counted as role changes
        of the growing pool, one per worker started."""
        shrinking = "prefill" if decision["prefill"] < counts["prefill"] else "decode"
        growing = "decode" if shrinking == "prefill" else "prefill"
        pool = pools[0] if shrinking == "prefill" else pools[1]
        leaving = _least_loaded_accepting(pool, counts[shrinking] - decision[shrinking])
        if not leaving:
            return [], []
        decisions = []
        for worker in leaving:
            decisions.append(decision | {"worker": worker.name, "to": RELEASE})
            move(worker, RELEASE)
        num_joining = decision[growing] - counts[growing]
        for _ in range(num_joining):
            decisions.append(decision | {"worker": start(growing).name, "to": growing})
        return decisions, [("role_change", growing)] * num_joining

    def _record(self, decision: dict[str, Any]) -> None:
        self.decisions = (self.decisions + [decision])[-_DECISIONS_KEPT:]


def _least_loaded_accepting(pool: list[WorkerState], count: int = 1) -> list[WorkerState]:
    """The `count` workers of `pool` holding the least, if the pool keeps another that takes new
    work; else none."""
    candidates = [w for w in pool if w.accepts]
    if len(candidates) <= count:
        return []
    candidates.sort(key=lambda w: len(w.step_planner.running) + w.step_planner.num_waiting)
    return candidates[:count]


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
