"""The scheduler's own ceiling: scheduler actors (cells) driving stub workers that answer every step
at once.

The stubs are a test double, not a production path: they sample a fixed token, hand off an empty
reference and import nothing, so every second measured is the control plane's (planning, messages,
applying results, publishing outputs to the consumer). The steps/s and tokens/s it sustains say how
many real decode workers one scheduler can drive: a worker whose forward takes F ms wants 1000 / F
steps/s. With `--cells N`, N schedulers (each with its own stubs) share the requests round robin
through one consumer, as the ingress spreads them over cells.

    python -m benchmarks.ceiling --slots 64 --num-requests 256 --output-len 200 --cells 1,2
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import sys
import time
from typing import Any

import ray

from deploy.engine_client import EngineClient, Placement, complete
from deploy.submissions import Submissions
from scheduler.cell.actor import CellActor
from scheduler.cell.state import CellConfig
from scheduler.messages import KVImport, KVPiece, Samples, StepResult, unpack_plans
from scheduler.request import Request

STUB_TOKEN = 5


class StubWorker:
    """Answers a step at once: one fixed token per sampling chunk, an empty handoff per finished
    prompt."""

    def __init__(self, kind: str, index: int) -> None:
        self.kind = kind
        self.index = index

    def ready(self) -> dict[str, Any]:
        return {"index": self.index, "stub": True}

    def connect(self, peers: list[dict[str, Any]]) -> str:
        return "none"  # (its handoffs carry no bytes)

    def step(
        self, packed: bytes, imports: list[KVImport], incarnation: str | None = None
    ) -> list[StepResult]:
        results = []
        for plan in unpack_plans(packed):
            start = time.perf_counter()
            sampled = {c.req_id: STUB_TOKEN for c in plan.chunks if c.sample}
            pieces = [
                KVPiece(req_id, first, end - first, None, 0, 0.0)
                for req_id, _, first, end in plan.exports
            ]
            results.append(
                StepResult(Samples(sampled), kv_pieces=pieces, step_s=time.perf_counter() - start)
            )
        results[0].import_s = {i.handoff.req_id: 0.0 for i in imports if i.final}
        return results


def spawn_stub(kind: str, index: int, num_slots: int, prefix_blocks: int = 0) -> Any:
    return ray.remote(StubWorker).options(num_cpus=0, enable_task_events=False).remote(kind, index)


class RoundRobin:
    """Places requests on the cells in turn (the `Cells` of deploy.engine_client)."""

    failover_timeout_s = None

    def __init__(self, handles: list[Any]) -> None:
        self.handles = handles
        self.count = 0
        # a burst goes in one call per cell, as the driver's
        self.submissions = [Submissions(h) for h in handles]

    async def place(self, request: Request, consumer: str, failing_over: bool = False) -> Placement:
        index = self.count % len(self.handles)
        self.count += 1
        return Placement(
            await self.submissions[index].submit(request, consumer), self.handles[index]
        )

    def lost(self, placement: Placement) -> None:
        pass

    def done(self, req_id: str) -> None:
        pass


def measure(
    mode: str, slots: int, num_requests: int, prompt_len: int, output_len: int, cells: int = 1
) -> dict[str, Any]:
    capacity = prompt_len + output_len
    cell = CellConfig(
        mode=mode,
        num_decode_workers=1,
        num_prefill_workers=1,
        decode_slots=slots,
        prefill_slots=slots,
        capacity=capacity,
        token_budget=max(256, slots),
        prefill_chunk=max(128, prompt_len),
    )
    handles = [
        ray.remote(CellActor)
        .options(num_cpus=0, max_concurrency=100_000, enable_task_events=False)
        .remote(cell, functools.partial(spawn_stub))
        for _ in range(cells)
    ]
    ray.get([h.ready.remote() for h in handles])
    client = EngineClient(RoundRobin(handles))

    def run(count: int, tag: str) -> list[Any]:
        async def everything() -> list[Any]:
            return await asyncio.gather(
                *(
                    complete(
                        client,
                        Request(
                            req_id=f"{tag}{i}", prompt_ids=[7] * prompt_len, max_tokens=output_len
                        ),
                    )
                    for i in range(count)
                )
            )

        return asyncio.run(everything())

    try:
        run(2 * cells, "warm")
        ray.get([h.reset_timeline.remote() for h in handles])
        start = time.perf_counter()
        results = run(num_requests, "")
        elapsed = time.perf_counter() - start
        timelines = [stats["timeline"] for stats in ray.get([h.stats.remote() for h in handles])]
    finally:
        for handle in handles:
            ray.get(handle.shutdown.remote())
            ray.kill(handle)
    tokens = sum(len(c.token_ids) for c in results)
    decode_steps = sum(t.get("decode", {}).get("steps", 0) for t in timelines)
    first = {
        f"{kind}_{key}": round(value, 3)
        for kind, line in timelines[0].items()
        for key, value in line.items()
    }
    return {
        "mode": mode,
        "cells": cells,
        "slots": slots,
        "requests": num_requests,
        "output_tokens": tokens,
        "duration_s": round(elapsed, 3),
        "tok_s": round(tokens / elapsed, 1),
        "decode_steps_per_s": round(decode_steps / elapsed, 1),
        "polls": client.num_polls,
        **first,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.ceiling", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--modes", default="colocated,disaggregated")
    parser.add_argument("--slots", default="64", help="comma list")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=200)
    parser.add_argument(
        "--cells", default="1", help="comma list: scheduler actors sharing the requests"
    )
    args = parser.parse_args(argv)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        for mode in args.modes.split(","):
            for slots in map(int, args.slots.split(",")):
                for cells in map(int, args.cells.split(",")):
                    print(
                        json.dumps(
                            measure(
                                mode,
                                slots,
                                args.num_requests,
                                args.prompt_len,
                                args.output_len,
                                cells,
                            )
                        ),
                        flush=True,
                    )
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
