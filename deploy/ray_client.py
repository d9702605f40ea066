"""Starts the scheduler actor for a Ray mode and drives requests through it from a driver process."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import ray

from deploy.config import EngineConfig
from scheduler.outputs import Completion
from scheduler.request import Request

log = logging.getLogger(__name__)


def init_ray(config: EngineConfig) -> None:
    """Join the cluster in RAY_ADDRESS (as under `ray job submit`; `RAY_ADDRESS=auto` joins a cluster
    started here with `ray start`), or start a new local Ray with CPUs enough for every worker
    (logically: two workers on a 2-core laptop share its cores)."""
    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=True)
        return
    workers = config.decode_workers + (config.prefill_workers if config.mode == "disaggregated" else 0)
    num_cpus = max(os.cpu_count() or 1, int(workers * config.num_cpus_per_worker + 0.999))
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=True)


def start_scheduler(config: EngineConfig, name: str | None = None) -> Any:
    """Create the scheduler actor (which creates the workers) and wait until every worker is ready."""
    from scheduler.actor import SchedulerActor

    init_ray(config)
    options: dict[str, Any] = {"num_cpus": 0, "max_concurrency": 100_000}
    if name:
        options |= {"name": name, "get_if_exists": True}
    handle = ray.remote(SchedulerActor).options(**options).remote(config)
    placement = ray.get(handle.ready.remote())
    log.info("scheduler ready: %s", placement)
    return handle


async def stream(handle: Any, request: Request) -> Completion:
    """Send one request and gather its stream into a Completion."""
    done = Completion(request.req_id, len(request.prompt_ids))
    async for ref in handle.generate.remote(request):
        out = await ref
        done.token_times_s += [time.perf_counter()] * len(out.token_ids)
        done.token_ids += out.token_ids
        done.text += out.text
        if out.finished:
            done.finish_reason, done.error, done.metrics = out.finish_reason, out.error, out.metrics
    return done


def run_requests(
    handle: Any,
    requests: list[Request],
    arrival_s: dict[str, float] | None = None,
    on_finish: Callable[[Completion], None] | None = None,
) -> dict[str, Completion]:
    """Submit every request at its arrival offset, concurrently; return completions by id."""

    async def one(request: Request, t0: float) -> Completion:
        delay = (arrival_s or {}).get(request.req_id, 0.0) - (time.perf_counter() - t0)
        if delay > 0:
            await asyncio.sleep(delay)
        done = await stream(handle, request)
        if on_finish is not None:
            on_finish(done)
        return done

    async def everything() -> list[Completion]:
        t0 = time.perf_counter()
        return await asyncio.gather(*(one(r, t0) for r in requests))

    return {c.req_id: c for c in asyncio.run(everything())}
