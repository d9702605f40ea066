"""`python -m benchmarks.gpu_sim`: how many prefill and decode workers a traffic pattern needs,
and what the pool planner buys, answered by the real scheduler and planner on Ray actors driving
stub workers whose steps take the time a GPU would.

A stub worker computes nothing: for each step plan it sleeps the step's cost under a cost model,
times `--time-scale`, and samples a fixed token (requests end by length). Prefill step =
a + b x tokens + c x (tokens x context attended); decode step = d + e x batch + f x KV tokens read;
a handoff's import = its KV bytes / the link's bandwidth; a worker answers its first `ready`
after the model's start-up time, so a pool that grows waits for it. Everything the scheduler sees
(step times, arrivals, the planner's window and its ITL SLO) runs on the scaled clock; latencies
are reported back in GPU seconds.

The control plane's own costs (Ray calls, planning, applying results) are not scaled, so the
default `--time-scale` is 1: GPU time replays in real time. Below 1 they weigh 1/scale times what
they would: between two calls of a busy decode worker this 2-core host spends 1.2-5.5 ms (p10-p90,
measured 2026-12-03), which at 0.25 reads as 5-22 ms of a 40 ms GPU step, and a decode worker whose
ITL p50 is 47.7 ms at scale 1 reads 58 ms at 0.25, the same trace. A smaller scale is for a quick
look, not for figures measured against an ITL SLO.

    python -m benchmarks.gpu_sim --workers 4 --splits 1:3,2:2,3:1 --planner --minutes 12
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import sys
import time
from dataclasses import asdict
from typing import Any

import ray

from benchmarks.ceiling import RoundRobin
from benchmarks.pool_floor import pool_floor
from benchmarks.traces import TRACES, days_trace, offered_load
from deploy.bench.cost_model import A10_LLAMA_8B, MODELS, CostModel, load_cost_model
from deploy.engine_client import EngineClient, complete
from scheduler.cell.actor import CellActor
from scheduler.cell.state import CellConfig
from scheduler.messages import KVImport, KVPiece, Samples, StepResult, unpack_plans
from scheduler.request import Request
from workers.arrivals import ArrivalSchedule, run_at_arrivals

SIM_TOKEN = 5


class SimWorker:
    """A worker of either pool that sleeps each step's modelled time (x the time scale)."""

    def __init__(self, index: int, cost: CostModel, scale: float) -> None:
        self.index = index
        self.cost = cost
        self.scale = scale
        self.created = time.perf_counter()

    def ready(self) -> dict[str, Any]:
        """Answers once the worker has started: the model's start-up time after its creation."""
        _sleep_until(self.created + self.cost.startup_s * self.scale)
        return {"index": self.index, "sim": self.cost.name}

    def connect(self, peers: list[dict[str, Any]]) -> str:
        return "sim"

    def prefetch(self, pieces: list[KVPiece]) -> None:
        pass

    def step(
        self, packed: bytes, imports: list[KVImport], incarnation: str | None = None
    ) -> list[StepResult]:
        start = time.perf_counter()
        num_bytes = sum(
            p.num_bytes for i in imports for p in i.handoff.pieces[i.handoff.imported :]
        )
        import_s = num_bytes / self.cost.link_bytes_per_s * self.scale
        results = []
        for plan in unpack_plans(packed):
            seconds = self.cost.step_s(plan) * self.scale + import_s
            import_s = 0.0
            _sleep_until(start + seconds)
            sampled = {c.req_id: SIM_TOKEN for c in plan.chunks if c.sample}
            pieces = [
                KVPiece(
                    r, first, end - first, None, self.cost.kv_bytes_per_token * (end - first), 0
                )
                for r, _, first, end in plan.exports
            ]
            elapsed = time.perf_counter() - start
            results.append(StepResult(Samples(sampled), kv_pieces=pieces, step_s=elapsed))
            start = time.perf_counter()
        results[0].import_s = {i.handoff.req_id: 0.0 for i in imports if i.final}
        return results


def _sleep_until(deadline: float) -> None:
    while (left := deadline - time.perf_counter()) > 0:
        time.sleep(left if left > 0.002 else 0)


def spawn_sim(
    cost: CostModel, scale: float, kind: str, index: int, num_blocks: int, block_size: int
) -> Any:
    actor = ray.remote(SimWorker).options(num_cpus=0, enable_task_events=False)
    return actor.remote(index, cost, scale)


RELEASE_DELAY_S = 30.0  # the planner's wait before it releases a worker, GPU time


def run(
    trace: list[tuple[float, int, int]],
    prefill: int,
    decode: int,
    planner: bool,
    cost: CostModel,
    scale: float,
    slo_ttft_s: float,
    slo_itl_s: float,
    window_s: float,
    max_workers: tuple[int, int] | None = None,
    release_delay_s: float = RELEASE_DELAY_S,
    period_s: float | None = None,
) -> dict[str, Any]:
    """Replay the trace through one cell; per request TTFT and ITL (GPU seconds), the pools'
    sizes every window, and the step timeline (wall seconds: a decode call's `period` against its
    `worker_step` is what the control plane adds)."""
    block_size = 16
    config = CellConfig(
        mode="disaggregated",
        num_decode_workers=decode,
        num_prefill_workers=prefill,
        decode_slots=64,
        prefill_slots=8,
        capacity=8192,
        token_budget=2048,
        prefill_chunk=2048,
        decode_blocks=cost.kv_tokens // block_size,
        prefill_blocks=cost.kv_tokens // block_size,
        block_size=block_size,
        pool_planner=planner,
        max_prefill_workers=max_workers[0] if max_workers else None,
        max_decode_workers=max_workers[1] if max_workers else None,
        slo_itl_ms=slo_itl_s * 1000 * scale,
        slo_ttft_ms=slo_ttft_s * 1000 * scale,
        planner_window_s=window_s * scale,
        planner_release_delay_s=release_delay_s * scale,
        planner_period_s=period_s * scale if period_s else None,
    )
    handle = (
        ray.remote(CellActor)
        .options(num_cpus=0, max_concurrency=100_000, enable_task_events=False)
        .remote(config, functools.partial(spawn_sim, cost, scale))
    )
    ray.get(handle.ready.remote())
    client = EngineClient(RoundRobin([handle]))
    requests = [
        Request(f"r{i}", [7] * prompt, output) for i, (_, prompt, output) in enumerate(trace)
    ]
    arrivals = {r.req_id: t * scale for r, (t, _, _) in zip(requests, trace, strict=True)}
    pools: list[dict[str, Any]] = []

    async def replay() -> list[Any]:
        done = asyncio.Event()

        async def watch() -> None:
            start = time.perf_counter()
            while not done.is_set():
                stats = await handle.stats.remote()
                line = stats["pools"]
                at = (time.perf_counter() - start) / scale
                sizes = {"prefill": line["prefill"], "decode": line["decode"]}
                pools.append({"at_s": round(at, 1)} | sizes | {"window": line["last_window"]})
                await asyncio.sleep(window_s * scale / 2)

        watcher = asyncio.create_task(watch())
        schedule = ArrivalSchedule.by_key(requests, arrivals, None)
        results = await run_at_arrivals(schedule, lambda r: complete(client, r))
        done.set()
        await watcher
        return results

    try:
        completions = asyncio.run(replay())
        stats = ray.get(handle.stats.remote())
    finally:
        ray.get(handle.shutdown.remote())
        ray.kill(handle)
    by_id = {c.req_id: c for c in completions}
    per_request = []
    for request, (arrival, _, output) in zip(requests, trace, strict=True):
        completion = by_id[request.req_id]
        metrics = completion.metrics
        ttft = metrics["ttft_s"] / scale
        itl = metrics["tpot_s"] / scale
        per_request.append(
            {
                "arrival_s": arrival,
                "finish_s": arrival + metrics["e2e_s"] / scale,
                "ttft_s": ttft,
                "itl_s": itl,
                "ok": completion.error is None and len(completion.token_ids) == output,
                "good": ttft <= slo_ttft_s and itl <= slo_itl_s,
            }
        )
    return {
        "split": f"{prefill}:{decode}"
        + (f" up to {max_workers[0]}:{max_workers[1]}" if max_workers else "")
        + (", forecast" if period_s and max_workers else ""),
        "planner": planner,
        "requests": per_request,
        "pools": pools,
        "role_changes": stats["pools"]["role_changes"],
        "decisions": stats["pools"]["decisions"],
        "timeline": stats["timeline"],
    }


def by_day(result: dict[str, Any], minutes: float, days: int) -> list[dict[str, Any]]:
    """Each day's goodput (requests that arrived that day and met both SLOs, per second of
    the day) and worker-seconds (the last day's until the last answer)."""
    period_s = minutes * 60
    lines = []
    for day in range(days):
        start, end = day * period_s, (day + 1) * period_s
        mine = [r for r in result["requests"] if start <= r["arrival_s"] < end]
        last = math.inf if day == days - 1 else end
        worker_s = sum(
            max(0.0, min(b["at_s"], last) - max(a["at_s"], start)) * (a["prefill"] + a["decode"])
            for a, b in zip(result["pools"], result["pools"][1:], strict=False)
        )
        good = sum(r["good"] for r in mine)
        lines.append(
            {
                "day": day,
                "requests": len(mine),
                "lost": sum(not r["ok"] for r in mine),
                "goodput_req_s": round(good / period_s, 3),
                "slo_attainment": round(good / max(1, len(mine)), 3),
                "worker_seconds": round(worker_s, 1),
            }
        )
    return lines


def summarize(result: dict[str, Any], minutes: float, window_s: float) -> dict[str, Any]:
    requests = result["requests"]
    duration = minutes * 60
    windows = int(duration // window_s) + 1
    good = [0] * windows
    for line in requests:
        if line["good"]:
            good[min(windows - 1, int(line["finish_s"] // window_s))] += 1
    pools = result["pools"]
    worker_s = sum(
        (b["at_s"] - a["at_s"]) * (a["prefill"] + a["decode"])
        for a, b in zip(pools, pools[1:], strict=False)
    )
    return {
        "split": result["split"],
        "planner": result["planner"],
        "worker_seconds": round(worker_s, 1),
        "requests": len(requests),
        "lost": sum(not line["ok"] for line in requests),
        "goodput_req_s": round(sum(line["good"] for line in requests) / duration, 3),
        "slo_attainment": round(sum(line["good"] for line in requests) / len(requests), 3),
        "role_changes": result["role_changes"],
        "role_changes_per_min": round(result["role_changes"] / minutes, 2),
        "goodput_per_window": [round(g / window_s, 3) for g in good],
        "pools": result["pools"],
        "decisions": result["decisions"],
        "timeline": result["timeline"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu_sim", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--model",
        default=A10_LLAMA_8B.name,
        help=f"cost model: one of {sorted(MODELS)}, or a JSON file written by "
        "`pdserve gpu-bench --fit-cost-model`",
    )
    parser.add_argument("--workers", type=int, default=4, help="prefill + decode workers")
    parser.add_argument("--splits", default="1:3,2:2,3:1", help="fixed P:D splits to run")
    parser.add_argument("--planner", action="store_true", help="also run with the pool planner")
    parser.add_argument(
        "--scaling",
        default=None,
        help="P:D: also run the planner with pools that start at --scaling-from and may grow "
        "to P:D",
    )
    parser.add_argument(
        "--scaling-from",
        default="1:1",
        help="P:D the scaling run's pools start at (what the first minutes' load needs)",
    )
    parser.add_argument(
        "--trace",
        default="shifting",
        choices=sorted(TRACES),
        help="shifting: the mix moves at a steady load; daily: the load also rises and falls",
    )
    parser.add_argument("--minutes", type=float, default=12.0, help="trace length, GPU time")
    parser.add_argument(
        "--days",
        type=int,
        default=1,
        help="replay the trace this many times in a row (day k drawn with --seed + k); each "
        "day's figures are in the summary's by_day",
    )
    parser.add_argument(
        "--forecast",
        action="store_true",
        help="the --scaling run's planner remembers the last day (a period of --minutes) and "
        "sizes the pools a start-up ahead by it",
    )
    parser.add_argument(
        "--time-scale", type=float, default=1.0, help="wall s per GPU s (below 1: a quick look)"
    )
    parser.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    parser.add_argument("--slo-itl-ms", type=float, default=60.0)
    parser.add_argument("--window-s", type=float, default=20.0, help="planner window, GPU time")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--floor",
        action="store_true",
        help="print the fewest worker-seconds the trace needs (the planner's sizing with perfect "
        "foresight, within --scaling's bounds) against the fixed deployment sized for its peak, "
        "and run nothing (released at once, and after the runs' release delay)",
    )
    parser.add_argument("--output", help="JSON lines: a summary per run (appended)")
    parser.add_argument(
        "--plot",
        help="PNG: the load and each run's pools and goodput over time, from --output's runs "
        "when given (those of earlier invocations too; --splits '' draws without running)",
    )
    args = parser.parse_args(argv)
    if args.forecast and not (args.scaling and args.days > 1):
        # the forecast sizes pools that scale, once a whole day has been seen
        parser.error("--forecast needs --scaling and --days 2 or more")
    cost = load_cost_model(args.model)
    trace = days_trace(args.minutes, args.seed, TRACES[args.trace], args.days)
    splits = [split for split in args.splits.split(",") if split]
    runs = [(*map(int, split.split(":")), False) for split in splits]
    if args.planner:
        half = args.workers // 2
        runs.append((half, args.workers - half, True))
    scaling = tuple(map(int, args.scaling.split(":"))) if args.scaling else None
    if scaling:
        runs.append((*map(int, args.scaling_from.split(":")), True))
    print(json.dumps({"model": asdict(cost), "trace_requests": len(trace)}), flush=True)
    if args.floor:
        for delay_s in (0.0, RELEASE_DELAY_S):
            floor = pool_floor(
                TRACES[args.trace],
                args.minutes,
                cost,
                args.slo_ttft_ms / 1000,
                args.slo_itl_ms / 1000,
                args.window_s,
                (scaling[0], scaling[1]) if scaling else (64, 64),
                release_delay_s=delay_s,
            )
            print(json.dumps({"trace": args.trace, "floor": floor}), flush=True)
        return 0
    lines = _run_all(args, cost, trace, runs, scaling) if runs else []
    if args.plot:
        from deploy.bench.plot import plot_pools

        if args.output:
            with open(args.output) as f:
                lines = [json.loads(text) for text in f if text.strip()]
        if not lines:
            print("gpu_sim: error: no runs to draw", file=sys.stderr)
            return 2
        others = {line["trace"] for line in lines if line.get("trace", args.trace) != args.trace}
        if others:
            print(
                f"gpu_sim: error: runs of the {', '.join(sorted(others))} trace drawn against "
                f"the {args.trace} trace's load: pass --trace",
                file=sys.stderr,
            )
            return 2
        load = offered_load(trace, args.minutes * args.days, args.window_s)
        plot_pools(lines, load, args.plot)
        print(f"figure: {args.plot} ({len(lines)} runs)", file=sys.stderr)
    return 0


def _run_all(
    args: argparse.Namespace,
    cost: CostModel,
    trace: list[tuple[float, int, int]],
    runs: list[tuple[int, int, bool]],
    scaling: tuple[int, ...] | None,
) -> list[dict[str, Any]]:
    """Each run in turn on one local Ray; their summaries, also printed (and appended to
    --output)."""
    lines = []
    ray.init(include_dashboard=False, log_to_driver=False)
    try:
        for number, (prefill, decode, planner) in enumerate(runs):
            scaled = scaling if scaling and number == len(runs) - 1 else None
            result = run(
                trace,
                prefill,
                decode,
                planner,
                cost,
                args.time_scale,
                args.slo_ttft_ms / 1000,
                args.slo_itl_ms / 1000,
                args.window_s,
                scaled,
                period_s=args.minutes * 60 if scaled and args.forecast else None,
            )
            minutes = args.minutes * args.days
            line = {"trace": args.trace} | summarize(result, minutes, args.window_s)
            if args.days > 1:
                line["by_day"] = by_day(result, args.minutes, args.days)
            lines.append(line)
            print(json.dumps(line), flush=True)
            if args.output:
                with open(args.output, "a") as f:
                    f.write(json.dumps(line) + "\n")
    finally:
        ray.shutdown()
    return lines


if __name__ == "__main__":
    sys.exit(main())
