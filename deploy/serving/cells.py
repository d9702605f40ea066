"""Cells: each replica of the `Cell` deployment is one scheduler with its own prefill and decode
workers.

The ingress places requests on cells itself (`ServeCells`): it chooses a running cell
(`CellChooser`: prefix affinity, else the less loaded of two) and submits straight to that cell's
scheduler actor, the requests of a burst for one cell in one call (`Submissions`), then polls it for
their outputs (one message per step). No Serve call is made per request: Serve runs the cells
(starts, health-checks, replaces and scales them) and says which ones run (`CellRouter`).

Each replica reports its scheduler's open requests to Serve's autoscaler
(`record_autoscaling_stats`); `target_requests_per_cell` is what autoscaling aims at
(`deploy/serving/autoscaling.py`). A replica being scaled down drains: its scheduler refuses new
requests (`CellClosed`: the ingress places them on another cell) and the replica stops when the last
open one has ended.

The scheduler and its workers do not fate-share with the replica (`deploy/serving/cell_actors.py`):
a killed replica's scheduler serves on, and the replica Serve starts in its place adopts it. A
killed scheduler is restarted by Ray and finds its workers again; the ingress's polls see another
instance, and its streams continue by recompute, on the same cell when no other runs
(`EngineClient`). A cell whose worker pool is gone fails its health check and Serve replaces it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from typing import Any

import ray
from ray import serve
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.serve.config import RequestRouterConfig

from deploy.config import EngineConfig
from deploy.engine_client import Placement, unwrap
from deploy.ray_cell import kv_pool_lines
from deploy.serving.cell_actors import (
    NAMESPACE,
    adopt_or_create,
    cell_name,
    find_scheduler,
    stop_cell,
)
from deploy.serving.cell_choice import CellChooser, live_cells
from deploy.submissions import Submissions
from scheduler.request import Request

log = logging.getLogger(__name__)
serve_log = logging.getLogger("ray.serve")
# how long requests avoid a cell that was lost or refused them (Serve stops listing it sooner or
# later)
AVOID_S = 60.0
_RESTART_WAIT_S = 20.0  # a health check waits this long for a restarting scheduler


@serve.deployment(
    name="Cell",
    max_ongoing_requests=100_000,
    ray_actor_options={"num_cpus": 0},
    # (the ingress logs each HTTP request)
    logging_config={"enable_access_log": False},
    health_check_period_s=2,
    health_check_timeout_s=30,
    graceful_shutdown_timeout_s=3600,
    graceful_shutdown_wait_loop_s=1,
    request_router_config=RequestRouterConfig(
        request_router_class="deploy.serving.cell_router:CellRouter"
    ),
)
class Cell:
    """One scheduler (a named detached actor: adopted from a dead replica, or created) and the
    workers it creates."""

    async def __init__(self, config: dict[str, Any], orphan_timeout_s: float = 60.0) -> None:
        context = serve.get_replica_context()
        self.replica = context.replica_id.unique_id
        self.me = ray.get_runtime_context().current_actor
        self.scheduler: Any = None  # (until then, a stop has nothing to stop)
        self.name, self.scheduler = await adopt_or_create(
            EngineConfig(**config), context.app_name, self.replica, self.me, orphan_timeout_s
        )
        ready = await self.scheduler.ready.remote()
        # (Serve's logger: its INFO lines reach `pdserve serve`'s and `serve run`'s console)
        for line in [f"cell {self.name} ready", *kv_pool_lines(ready)]:
            serve_log.info("%s", line)

    async def check_health(self) -> None:
        """Unhealthy when a worker pool has no worker left, the scheduler is gone for good, or
        another replica serves it: Serve replaces the cell. While the scheduler restarts, the check
        waits for it."""
        deadline = time.monotonic() + _RESTART_WAIT_S
        while True:
            try:
                answer = await self.scheduler.adopt.remote(self.replica, self.me)
                await self.scheduler.check_health.remote()
                break
            # (raised as is, Serve would take it for the death of this replica's own actor)
            except ActorUnavailableError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the scheduler of {self.name} does not answer") from None
                await asyncio.sleep(0.2)
            except RayActorError as e:
                raise RuntimeError(f"the scheduler of {self.name} is gone: {e}") from None
        if answer == "held":
            raise RuntimeError(f"another replica serves {self.name}")

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """The scheduler's open requests: what autoscaling counts per cell."""
        return {"open_requests": await self.scheduler.num_open.remote()}

    async def __del__(self) -> None:
        """Being stopped (scaled down, shut down, or unhealthy): refuse new requests, wait for the
        open ones to end (not in a cell whose pool is gone), then stop the scheduler and its
        workers."""
        if getattr(self, "scheduler", None) is None:  # it never started
            return
        try:
            if await self.scheduler.owner_replica.remote() not in (self.replica, None):
                return  # another replica serves it now
            # a cell with a pool gone (what its health check said) has nothing that could finish
            await self.scheduler.check_health.remote()
            await self.scheduler.drain.remote()
        except Exception as e:  # the scheduler is gone: nothing left to wait for
            log.info("cell %s: no drain (%s)", self.name, e)
        await stop_cell(self.name, self.scheduler)


class ServeCells:
    """Places requests on the running cells of a `Cell` deployment (see `EngineClient`).

    A cell that refuses a request (it is draining) or cannot be reached, or whose streams were lost,
    is avoided for `AVOID_S` while another runs, and the request tried on another until
    `failover_timeout_s`, as while no cell runs (one died and Serve has not replaced it yet). With
    no other, the cell is tried again (a restarted scheduler answers), and a lost stream's
    continuation goes back to the scheduler it was on even while no replica is listed. A request
    the engine refuses (ValueError) fails at once, and so does a full queue (QueueFullError), except
    for a continuation, which waits for room like the rest. A submission not answered within
    `attempt_timeout_s` is given up and tried on another cell.
    """

    attempt_timeout_s = 5.0

    def __init__(self, handle: Any, app_name: str, failover_timeout_s: float = 30.0) -> None:
        self.handle = handle
        self.app_name = app_name
        self.failover_timeout_s = failover_timeout_s
        self.chooser = CellChooser()
        # cell (replica id) -> its scheduler
        self.links: dict[str, asyncio.Future[tuple[Any, Submissions]]] = {}
        self.where: dict[str, str] = {}  # open request -> the cell it was last placed on
        self.load: Counter[str] = Counter()  # open requests per cell (of `where`)
        self.gone: dict[str, float] = {}  # cells lost or refusing, when: avoided a while

    def lost(self, placement: Placement) -> None:
        if placement.replica is not None:
            self.gone[placement.replica] = time.monotonic()

    def done(self, req_id: str) -> None:
        cell = self.where.pop(req_id, None)
        if cell is not None:
            self.load[cell] -= 1

    def _avoid(self, cell: str, error: BaseException) -> None:
        self.gone[cell] = time.monotonic()
        if isinstance(error, ActorDiedError | LookupError):  # not restarting: look it up again
            self.links.pop(cell, None)
        self.chooser.forget(cell)

    async def place(self, request: Request, consumer: str, failing_over: bool = False) -> Placement:
        deadline = time.monotonic() + self.failover_timeout_s
        delay = 0.05
        previous = self.where.get(request.req_id) if failing_over else None
        while True:
            self.gone = {c: t for c, t in self.gone.items() if time.monotonic() - t < AVOID_S}
            live = live_cells(self.app_name)
            if live is None:  # Serve's router for the cells starts with a first call through it
                self.handle.check_health.remote()
            cells = [c for c in live or () if c not in self.gone] or list(live or ())
            if not cells and previous in self.links:  # (its replica died; its scheduler may not)
                cells = [previous]
            error: BaseException = RuntimeError("no cell is running")
            if cells:
                cell = self.chooser.choose(request, cells, self.load)
                try:
                    scheduler, submissions = await self._link(cell)
                    wait_s = min(self.attempt_timeout_s, max(0.1, deadline - time.monotonic()))
                    instance = await asyncio.wait_for(submissions.submit(request, consumer), wait_s)
                    self.chooser.placed(request, cell)
                    self.done(request.req_id)  # (a continuation: it left the cell it was on)
                    self.where[request.req_id] = cell
                    self.load[cell] += 1
                    self.gone.pop(cell, None)
                    return Placement(instance, scheduler, replica=cell)
                # (QueueFullError too; a continuation was admitted once: it can only wait)
                except ValueError as e:
                    if not failing_over:
                        raise
                    error = e
                except Exception as e:  # draining (CellClosed), gone, or not answering
                    error = unwrap(e)
                    self._avoid(cell, error)
            if time.monotonic() + delay > deadline:
                raise error
            log.warning(
                "no cell took %s (%s: %s); trying again",
                request.req_id,
                type(error).__name__,
                error,
            )
            await asyncio.sleep(delay)
            delay = min(1.0, delay * 2)

    async def _link(self, cell: str) -> tuple[Any, Submissions]:
        """The cell's scheduler actor (looked up once) and the submissions to it."""
        if cell not in self.links:
            self.links[cell] = asyncio.ensure_future(self._connect(cell))
        return await asyncio.shield(self.links[cell])

    async def _connect(self, cell: str) -> tuple[Any, Submissions]:
        scheduler = await find_scheduler(self.app_name, cell)
        return scheduler, Submissions(scheduler)


async def cell_stats(app_name: str, method: str = "stats") -> dict[str, dict[str, Any]]:
    """Every live cell's scheduler stats (or its answer to another method without arguments:
    `metrics`), by cell name (the scheduler actors' names)."""
    prefix = cell_name(app_name, "")
    names = sorted(
        a["name"]
        for a in await asyncio.to_thread(ray.util.list_named_actors, all_namespaces=True)
        if a["namespace"] == NAMESPACE and a["name"].startswith(prefix)
    )
    handles = await asyncio.gather(
        *(asyncio.to_thread(ray.get_actor, n, NAMESPACE) for n in names), return_exceptions=True
    )
    live = [(n, h) for n, h in zip(names, handles, strict=True) if not isinstance(h, BaseException)]
    answers = await asyncio.gather(
        *(getattr(h, method).remote() for _, h in live), return_exceptions=True
    )
    return {
        n: a for (n, _), a in zip(live, answers, strict=True) if not isinstance(a, BaseException)
    }


def can_serve(stats: dict[str, Any]) -> bool:
    """A cell's every pool (prefill, decode) has a live worker, by its stats."""
    alive: dict[str, bool] = {}
    for name, line in stats["workers"].items():
        pool = name.split("-", 1)[0]
        alive[pool] = alive.get(pool, False) or bool(line.get("alive"))
    return bool(alive) and all(alive.values())


def combine_stats(cells: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One /stats view of every cell: workers (named `worker@cell` when there are several cells),
    summed counts, and each cell's own stats under `cells`."""
    several = len(cells) > 1
    workers = {
        (f"{w}@{c.rsplit('-', 1)[-1]}" if several else w): line
        for c, stats in cells.items()
        for w, line in stats["workers"].items()
    }
    counters: dict[str, float] = {}
    for stats in cells.values():
        for key, value in stats["counters"].items():
            counters[key] = counters.get(key, 0) + value
    transfers: dict[str, dict[str, float]] = {}  # per transport, summed over the cells
    for stats in cells.values():
        for transport, line in (stats.get("kv_transfer") or {}).items():
            total = transfers.setdefault(transport, {})
            for key, value in line.items():
                total[key] = total.get(key, 0) + value
    lora: dict[str, Any] = {"running": {}, "waiting": {}, "requests": {}, "loads": {}}
    for stats in cells.values():
        line = stats.get("lora") or {}
        lora["max_loras"] = line.get("max_loras")
        for which in ("running", "waiting", "requests", "loads"):
            for name, n in (line.get(which) or {}).items():
                lora[which][name] = lora[which].get(name, 0) + n
    first = next(iter(cells.values()), {})
    return {
        "num_cells": len(cells),
        "workers": workers,
        "counters": counters,
        "kv_transfer": transfers,
        "lora": lora,
        "live_handoffs": sum(s["live_handoffs"] for s in cells.values()),
        "streams": sum(s["streams"] for s in cells.values()),
        "max_waiting": first.get("max_waiting"),
        "timeline": first.get("timeline", {}) if not several else {},
        "cells": cells,
    }
