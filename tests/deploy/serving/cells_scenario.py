"""Run by test_cells in its own process: the Serve app with two cells on simulated nodes, under
streams.

`python -m tests.deploy.serving.cells_scenario CHECKPOINT SCENARIO` prints one JSON line of what it
saw:
* failover: a cell's scheduler is SIGKILLed mid-stream; every stream against the same streams
  unkilled; then a cell whose workers are all gone, and requests sent after.
* scaling: cells autoscale 1 -> 2 -> 1 under streaming load; every request's text against a run
  alone.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from typing import Any

import httpx
import ray
from ray import serve
from ray.cluster_utils import Cluster

from deploy.bench.http_client import session, stream_request
from deploy.serving.app import build_app
from deploy.serving.cells import NAMESPACE
from tests.factories import free_port
from tests.waiting import wait_for_async

ARGS = dict(
    mode="disaggregated",
    slots=16,
    prefill_slots=4,
    max_model_len=512,
    token_budget=32,
    prefill_chunk=16,
    served_model_name="tiny",
    failover_timeout_s=60,
)
# long enough that streams are still running when the failover scenario kills a scheduler
MAX_TOKENS = 400


def prompts(n: int) -> list[str]:
    words = [
        "the quick brown fox",
        "hello world",
        "paris is in france",
        "the lazy dog",
        "héllo wörld",
    ]
    return [f"{words[i % 5]} {words[(i * 3 + 1) % 5]} {i}" for i in range(n)]


async def stream_all(base: str, texts: list[str], max_tokens: int) -> list[Any]:
    async with session(len(texts) + 8, 300.0) as http:
        return await asyncio.gather(
            *(
                stream_request(
                    http,
                    f"{base}/v1/completions",
                    {
                        "model": "tiny",
                        "prompt": text,
                        "max_tokens": max_tokens,
                        "temperature": 0,
                        "ignore_eos": True,
                        "stream": True,
                        "stream_options": {"include_usage": True},
                    },
                    str(i),
                )
                for i, text in enumerate(texts)
            )
        )


def stats(base: str) -> dict[str, Any]:
    reply = httpx.get(f"{base}/stats", timeout=30)
    assert reply.status_code == 200, f"/stats answered {reply.status_code}: {reply.text[:500]}"
    return reply.json()


async def stats_when(base: str, condition: Any, timeout_s: float) -> dict[str, Any]:
    """/stats once `condition(stats)` holds."""
    return await wait_for_async(
        condition, timeout_s, value=lambda: asyncio.to_thread(stats, base), poll_s=0.1
    )


def decoding(stats: dict[str, Any]) -> int:
    """Requests on decode workers, every cell's: each has its first token."""
    return sum(w["running"] for name, w in stats["workers"].items() if name.startswith("decode"))


def outcome(done: list[Any]) -> dict[str, Any]:
    """Each stream's text and token count, the errors, and the longest wait between two of a
    stream's chunks."""
    gaps = [max(d.inter_token_s(), default=0.0) for d in done]
    return {
        "texts": [d.text for d in done],
        "errors": [d.error for d in done if d.error],
        "tokens": [len(d.token_ids) for d in done],
        "max_gap_s": round(max(gaps, default=0.0), 3),
    }


def failover(base: str) -> dict[str, Any]:
    texts = prompts(16)
    serve.run(
        build_app({"model": CHECKPOINT, "cells": 2, "max_worker_restarts": 0, **ARGS}),
        name="cells",
        route_prefix="/",
    )
    reference = asyncio.run(stream_all(base, texts, MAX_TOKENS))

    async def killed() -> tuple[list[Any], dict[str, Any]]:
        run = asyncio.ensure_future(stream_all(base, texts, MAX_TOKENS))
        now = await stats_when(base, lambda s: decoding(s) == len(texts), 60)
        cell = max(now["cells"], key=lambda c: now["cells"][c]["streams"])
        scheduler = ray.get_actor(cell, NAMESPACE)
        pid = ray.get(scheduler.ready.remote())["scheduler_pid"]
        # still running there, just before the kill
        open_streams = ray.get(scheduler.stats.remote())["streams"]
        os.kill(pid, signal.SIGKILL)
        return await run, {"killed_cell_streams": open_streams, "killed": cell}

    fault, seen = asyncio.run(killed())
    # Serve has replaced the cell
    after = asyncio.run(stats_when(base, lambda s: s["num_cells"] == 2, 120))
    # a cell whose workers are all gone (no restarts left) takes no new requests
    cells = sorted(after["cells"])
    broken = cells[0]
    handles = ray.get(ray.get_actor(broken, NAMESPACE).worker_handles.remote())
    for handle in handles.values():
        ray.kill(handle, no_restart=True)
    later = asyncio.run(stream_all(base, texts[:8], 20))
    final = asyncio.run(
        stats_when(base, lambda s: broken not in s["cells"] and s["num_cells"] == 2, 120)
    )
    serve.delete("cells")
    return {
        "reference": outcome(reference),
        "fault": outcome(fault),
        **seen,
        "failovers": after["ingress"]["failovers"],
        "cells_after_kill": sorted(after["cells"]),
        "broken": broken,
        "later": outcome(later),
        "cells_final": sorted(final["cells"]),
    }


def scaling(base: str) -> dict[str, Any]:
    """Clients loop requests while cells scale: 12 of them (2 cells wanted) until the second cell
    serves streams, then one (1 cell wanted) until a cell has drained and one more request has
    finished."""
    texts = prompts(12)
    autoscale = {
        "metrics_interval_s": 0.5,
        "look_back_period_s": 1.0,
        "upscale_delay_s": 0.0,
        "downscale_delay_s": 2.0,
    }
    serve.run(
        build_app(
            {
                "model": CHECKPOINT,
                "cells": 1,
                "max_cells": 2,
                "target_requests_per_cell": 4,
                "cells_autoscaling": autoscale,
                **ARGS,
            }
        ),
        name="cells",
        route_prefix="/",
    )
    reference = outcome(asyncio.run(stream_all(base, texts, 100)))

    async def load() -> dict[str, Any]:
        seen: dict[str, Any] = {"num_cells": [stats(base)["num_cells"]], "done": []}
        heavy, light = asyncio.Event(), asyncio.Event()

        async def client(i: int, until: asyncio.Event) -> None:
            while not until.is_set():
                (done,) = await stream_all(base, [texts[i]], 100)
                seen["done"].append((i, done.text, done.error))

        clients = [asyncio.ensure_future(client(i, heavy)) for i in range(12)]
        up = await stats_when(
            base,
            lambda s: s["num_cells"] == 2 and all(c["streams"] for c in s["cells"].values()),
            300,
        )
        seen["num_cells"].append(up["num_cells"])
        heavy.set()
        clients.append(asyncio.ensure_future(client(0, light)))
        down = await stats_when(base, lambda s: s["num_cells"] == 1, 300)
        seen["num_cells"].append(down["num_cells"])
        finished = len(seen["done"])
        await wait_for_async(
            lambda: len(seen["done"]) > finished, 120, what="one more request after the drain"
        )
        light.set()
        await asyncio.gather(*clients)
        seen["failovers"] = stats(base)["ingress"]["failovers"]
        return seen

    seen = asyncio.run(load())
    serve.delete("cells")
    mismatched = [i for i, text, error in seen["done"] if error or text != reference["texts"][i]]
    return {
        "reference": reference,
        "num_cells": seen["num_cells"],
        "requests": len(seen["done"]),
        "mismatched": mismatched,
        "errors": [e for _, _, e in seen["done"] if e][:3],
        "failovers": seen["failovers"],
    }


if __name__ == "__main__":
    CHECKPOINT, scenario = sys.argv[1], sys.argv[2]
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        for _ in range(2):
            cluster.add_node(num_cpus=2)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        port = free_port()
        # One proxy: the simulated nodes share this host, and a proxy per node would bind the same
        # port (SO_REUSEPORT), so a request could land on one still starting (404) or draining.
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        result = {"failover": failover, "scaling": scaling}[scenario](f"http://127.0.0.1:{port}")
        print(json.dumps(result))
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()
