"""The scheduler's own ceiling: one scheduler actor driving stub workers that answer every step at once.

The stubs are a test double, not a production path: they sample a fixed token, hand off an empty
reference and import nothing, so every second measured is the control plane's (planning, messages,
applying results, publishing outputs to the consumer). The steps/s and tokens/s it sustains say how
many real decode workers one scheduler can drive: a worker whose forward takes F ms wants 1000 / F
steps/s.

    python -m deploy.bench.ceiling --slots 64 --num-requests 256 --output-len 200
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from typing import Any

import ray

from deploy.driver import RayEngine
from scheduler.actor import SchedulerActor
from scheduler.cell import CellConfig
from scheduler.messages import KVImport, KVPiece, Samples, StepResult
from scheduler.plan import StepPlan
from scheduler.request import Request

STUB_TOKEN = 5


class StubWorker:
    """Answers a step at once: one fixed token per sampling chunk, an empty handoff per finished prompt."""

    def __init__(self, kind: str, index: int) -> None:
        self.kind, self.index = kind, index

    def ready(self) -> dict[str, Any]:
        return {"index": self.index, "stub": True}

    def step(self, plan: StepPlan, imports: list[KVImport]) -> StepResult:
        start = time.perf_counter()
        sampled = {c.req_id: STUB_TOKEN for c in plan.chunks if c.sample}
        pieces = [KVPiece(req_id, first, end - first, None, 0, 0.0) for req_id, _, first, end in plan.exports]
        return StepResult(Samples(sampled), kv_pieces=pieces, import_s={i.handoff.req_id: 0.0 for i in imports},
                          step_s=time.perf_counter() - start)


def spawn_stub(kind: str, index: int, num_slots: int, prefix_blocks: int = 0) -> Any:
    return ray.remote(StubWorker).options(num_cpus=0).remote(kind, index)


def measure(mode: str, slots: int, num_requests: int, prompt_len: int, output_len: int) -> dict[str, Any]:
    capacity = prompt_len + output_len
    cell = CellConfig(mode=mode, num_decode_workers=1, num_prefill_workers=1, decode_slots=slots, prefill_slots=slots,
                      capacity=capacity, token_budget=max(256, slots), prefill_chunk=max(128, prompt_len))
    handle = ray.remote(SchedulerActor).options(num_cpus=0, max_concurrency=100_000).remote(
        cell, functools.partial(spawn_stub))
    ray.get(handle.ready.remote())
    with RayEngine(handle=handle, capacity=capacity) as engine:
        requests = [Request(req_id=str(i), prompt_ids=[7] * prompt_len, max_tokens=output_len)
                    for i in range(num_requests)]
        engine.run(requests[:2])  # warm-up
        engine.reset_profile()
        start = time.perf_counter()
        results = engine.run(requests)
        elapsed = time.perf_counter() - start
        profile = engine.profile()
    tokens = sum(len(c.token_ids) for c in results.values())
    return {"mode": mode, "slots": slots, "requests": num_requests, "output_tokens": tokens,
            "duration_s": round(elapsed, 3), "tok_s": round(tokens / elapsed, 1),
            "decode_steps_per_s": round(profile.get("decode_steps", 0) / elapsed, 1),
            **{k: round(v, 3) for k, v in profile.items() if isinstance(v, int | float)}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy.bench.ceiling", description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default="colocated,disaggregated")
    parser.add_argument("--slots", default="64", help="comma list")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=200)
    args = parser.parse_args(argv)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        for mode in args.modes.split(","):
            for slots in map(int, args.slots.split(",")):
                print(json.dumps(measure(mode, slots, args.num_requests, args.prompt_len, args.output_len)),
                      flush=True)
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
