"""Cells: each replica of the `Cell` deployment is one scheduler with its own prefill and decode workers.

The ingress places each request on a cell through Serve's handle (`ServeCells`), routed by
`CellRouter`: prefix affinity, else the less loaded of two cells. A request keeps its `Cell.run` call
open while it runs, so Serve counts a cell's open requests as its load: that is what the router
weighs, what autoscaling targets (`target_requests_per_cell`), and what a cell being scaled down
waits for (it takes no new requests and ends when its last one does). Outputs do not pass through
the replica: the ingress polls the cell's scheduler actor directly (one message per step). Nor does
the replica call its scheduler once per request: the requests that reach it while a submission is on
its way go in the next one (`Submissions`), and one call at a time asks which of its requests ended.

The scheduler actor is owned by its replica: if the replica goes, so do the scheduler and the workers,
and when the scheduler dies, the replica's health check fails and Serve replaces the cell. Either way
the ingress continues the cell's streams on another cell (`EngineClient`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from deploy.background import background
from deploy.config import EngineConfig
from deploy.engine_client import Placement, unwrap
from deploy.ray_engine import create_scheduler
from deploy.submissions import Submissions
from scheduler.policy import QueueFullError
from scheduler.request import Request

log = logging.getLogger(__name__)
NAMESPACE = "pdserve-cells"  # the scheduler actors are named "<app>-cell-<replica id>" there
AVOID_S = 60.0  # how long requests avoid the replica of a lost cell (Serve stops routing there sooner or later)


@serve.deployment(name="Cell", max_ongoing_requests=100_000, ray_actor_options={"num_cpus": 0},
                  logging_config={"enable_access_log": False},  # (the ingress logs each HTTP request)
                  health_check_period_s=2, health_check_timeout_s=30,
                  graceful_shutdown_timeout_s=3600, graceful_shutdown_wait_loop_s=1,
                  request_router_config=RequestRouterConfig(request_router_class="deploy.serving.cell_router:CellRouter"))
class Cell:
    """One scheduler (a named actor this replica owns) and the workers it creates."""

    async def __init__(self, config: dict[str, Any]) -> None:
        context = serve.get_replica_context()
        self.replica = context.replica_id.unique_id
        self.name = f"{context.app_name}-cell-{self.replica}"
        self.scheduler = create_scheduler(EngineConfig(**config), name=self.name, namespace=NAMESPACE)
        self.submissions = Submissions(self.scheduler)
        self.running: dict[str, asyncio.Future[None]] = {}  # placed here: done when the request ends
        self.watcher: asyncio.Task[None] | None = None
        await self.scheduler.ready.remote()
        log.info("cell %s ready", self.name)

    async def run(self, request: Request, consumer: str, avoid: tuple[str, ...] = ()) -> AsyncIterator[Placement]:
        """Queue the request (admission errors raise here), say where it runs, then stay open until it ends.
        Cancelled (the ingress gave up on this call), it aborts the request: `Submissions` drops one not yet
        sent and aborts one on its way; here, one placed. (`avoid` is for the router.)"""
        instance = await self.submissions.submit(request, consumer)
        try:
            yield Placement(instance, self.scheduler, replica=self.replica)
            await self._ended(request.req_id)
        except (asyncio.CancelledError, GeneratorExit):
            self.scheduler.abort.remote(request.req_id)
            raise

    async def _ended(self, req_id: str) -> None:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.running[req_id] = future
        if self.watcher is None or self.watcher.done():
            self.watcher = background(self._watch())
        await future

    async def _watch(self) -> None:
        """One call at a time asks the scheduler which of the requests placed here have ended. If it fails,
        the scheduler is gone, and every `run` call open here raises it (the ingress fails them over)."""
        while self.running:
            try:
                ended = await self.scheduler.wait_ended.remote(list(self.running))
            except Exception as e:
                for future in self.running.values():
                    if not future.done():
                        future.set_exception(e)
                self.running = {}
                return
            for req_id in ended:
                future = self.running.pop(req_id, None)
                if future is not None and not future.done():
                    future.set_result(None)
            self.running = {r: f for r, f in self.running.items() if not f.done()}

    async def check_health(self) -> None:
        """Unhealthy when the scheduler is gone or a worker pool has no worker left: Serve replaces the cell."""
        await self.scheduler.check_health.remote()


class ServeCells:
    """Places requests on the cells of a `Cell` deployment handle (see `EngineClient`).

    A call that fails for want of a live cell (one died and Serve has not replaced it yet) is tried
    again until `failover_timeout_s`; a request the engine refuses (ValueError) fails at once, and so
    does a full queue (QueueFullError), except for a continuation, which waits for room like the rest.
    A call not answered within `attempt_timeout_s` is cancelled and tried again: Serve can leave a call
    to a replica that died just after taking it unanswered.
    """

    attempt_timeout_s = 5.0

    def __init__(self, handle: Any, failover_timeout_s: float = 30.0) -> None:
        self.handle, self.failover_timeout_s = handle, failover_timeout_s
        self.gone: dict[str, float] = {}  # replicas of lost cells, when lost: the router avoids them a while

    def lost(self, placement: Placement) -> None:
        if placement.replica is not None:
            self.gone[placement.replica] = time.monotonic()

    async def place(self, request: Request, consumer: str, failing_over: bool = False) -> Placement:
        deadline, delay = time.monotonic() + self.failover_timeout_s, 0.05
        while True:
            self.gone = {r: t for r, t in self.gone.items() if time.monotonic() - t < AVOID_S}
            stream = self.handle.options(stream=True).run.remote(request, consumer, avoid=tuple(self.gone))
            try:
                wait_s = min(self.attempt_timeout_s, max(0.1, deadline - time.monotonic()))
                placed = await asyncio.wait_for(anext(stream), wait_s)
                placed.watch = stream
                return placed
            except Exception as e:
                stream.cancel()
                cause = unwrap(e)
                if isinstance(cause, (ValueError, QueueFullError)) and not failing_over:
                    raise cause from None  # (a continuation was admitted once: it can only be in use still)
                if time.monotonic() + delay > deadline:
                    raise
                log.warning("no cell took %s (%s: %s); trying again", request.req_id, type(cause).__name__, cause)
            await asyncio.sleep(delay)
            delay = min(1.0, delay * 2)


async def cell_stats(app_name: str) -> dict[str, dict[str, Any]]:
    """Every live cell's scheduler stats, by cell name (the scheduler actors' names)."""
    prefix = f"{app_name}-cell-"
    names = sorted(a["name"] for a in await asyncio.to_thread(ray.util.list_named_actors, all_namespaces=True)
                   if a["namespace"] == NAMESPACE and a["name"].startswith(prefix))
    handles = await asyncio.gather(*(asyncio.to_thread(ray.get_actor, n, NAMESPACE) for n in names),
                                   return_exceptions=True)
    live = [(n, h) for n, h in zip(names, handles, strict=True) if not isinstance(h, BaseException)]
    answers = await asyncio.gather(*(h.stats.remote() for _, h in live), return_exceptions=True)
    return {n: a for (n, _), a in zip(live, answers, strict=True) if not isinstance(a, BaseException)}


def combine_stats(cells: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One /stats view of every cell: workers (named `worker@cell` when there are several cells), summed
    counts, and each cell's own stats under `cells`."""
    several = len(cells) > 1
    workers = {(f"{w}@{c.rsplit('-', 1)[-1]}" if several else w): line
               for c, stats in cells.items() for w, line in stats["workers"].items()}
    counters: dict[str, float] = {}
    for stats in cells.values():
        for key, value in stats["counters"].items():
            counters[key] = counters.get(key, 0) + value
    first = next(iter(cells.values()), {})
    return {"num_cells": len(cells), "workers": workers, "counters": counters,
            "live_handoffs": sum(s["live_handoffs"] for s in cells.values()),
            "streams": sum(s["streams"] for s in cells.values()), "max_waiting": first.get("max_waiting"),
            "timeline": first.get("timeline", {}) if not several else {}, "cells": cells}
