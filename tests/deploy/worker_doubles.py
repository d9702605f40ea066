"""Workers that make a timing-dependent state certain: the real `Worker` holding a prompt's last
chunk until the test opens a gate, or reporting its decode steps as free so that every call that
may carry a burst does; and the Ray engine of a config started with them."""

from __future__ import annotations

import asyncio
import functools
from typing import Any

import ray

from deploy.config import EngineConfig
from deploy.driver import RayEngine
from deploy.ray_cell import cell_actor_args
from scheduler.cell.actor import CellActor
from scheduler.messages import KVImport, StepResult, unpack_plans
from workers.actors import Worker, spawn_worker


@ray.remote(num_cpus=0)
class Gate:
    """Shut until the test opens it; a held worker's step waits on it."""

    def __init__(self) -> None:
        self.opened = asyncio.Event()
        self.num_waiting = 0

    async def open(self) -> None:
        self.opened.set()

    async def wait(self) -> None:
        self.num_waiting += 1
        await self.opened.wait()

    async def waiting(self) -> int:
        """How many steps have come to the gate (and wait, while it is shut)."""
        return self.num_waiting


class HeldWorker(Worker):
    """A worker whose step that ends a prompt begun in an earlier step (a chunk that samples, past
    position 0) waits until its gate opens, once it has one (`hold_on`): the prompt stays part
    prefilled, its earlier chunks' KV sent out, for as long as the test needs."""

    gate: Any = None

    def hold_on(self, gate: Any) -> None:
        self.gate = gate

    def step(
        self, packed: bytes, imports: list[KVImport], incarnation: str | None = None
    ) -> list[StepResult]:
        plans = unpack_plans(packed)
        if self.gate is not None and any(
            c.sample and c.start_pos > 0 for plan in plans for c in plan.prefill
        ):
            ray.get(self.gate.wait.remote())
        return super().step(packed, imports, incarnation)


class FreeDecodeWorker(Worker):
    """A worker that reports each decode-only step as taking no time. A burst's length is the
    scheduler's reading of measured times (`BurstSizer`: tested on its own); with free steps, any
    call's overhead is worth sharing, so every call that may carry a burst carries the most steps
    it may, whatever the host's load."""

    def step(
        self, packed: bytes, imports: list[KVImport], incarnation: str | None = None
    ) -> list[StepResult]:
        results = super().step(packed, imports, incarnation)
        for plan, result in zip(unpack_plans(packed), results, strict=True):
            if not plan.prefill:
                result.step_s = 0.0
        return results


def start_engine(config: EngineConfig, worker_class: type[Worker], gate: Any = None) -> RayEngine:
    """The Ray engine of `config` (on the tests' Ray) whose workers are `worker_class`; with a
    `gate`, each prefill worker holds on it (`HeldWorker.hold_on`). Returns once every worker is
    ready."""
    cell, _, tokenizer = cell_actor_args(config)
    spawn = functools.partial(_spawn, config, worker_class, gate)
    actor = ray.remote(CellActor).options(num_cpus=0, max_concurrency=100_000)
    handle = actor.remote(cell, spawn, tokenizer)
    ray.get(handle.ready.remote())
    return RayEngine(handle=handle, capacity=cell.capacity)


def _spawn(
    config: EngineConfig,
    worker_class: type[Worker],
    gate: Any,
    kind: str,
    index: int,
    num_blocks: int,
    block_size: int,
    **named: Any,
) -> Any:
    """`spawn_worker` of a `worker_class`; a prefill worker is given `gate` to hold on (its first
    call, so before any step)."""
    worker = spawn_worker(
        config, kind, index, num_blocks, block_size, worker_class=worker_class, **named
    )
    if gate is not None and kind == "prefill":
        worker.hold_on.remote(gate)
    return worker
