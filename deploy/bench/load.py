"""`pdserve load`: N concurrent streaming clients against a running endpoint for a fixed time.

Each client sends chat requests back to back with `stream: true` and checks every response is whole:
status 200, at least one token, a finish_reason, usage, and `data: [DONE]` at the end. Reports
requests, failures, tokens/s and TTFT percentiles, then the server's slots still in use (from
/stats).
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import aiohttp

from deploy.bench.http_client import session, stream_request
from deploy.bench.stats import percentile

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a CPU does.",
    "Name three colours.",
    "How many legs does a spider have?",
    "Say hello in Spanish.",
]


async def _client(
    http: aiohttp.ClientSession,
    url: str,
    model: str,
    max_tokens: int,
    deadline: float,
    rng: random.Random,
    stats: dict[str, Any],
) -> None:
    while time.monotonic() < deadline:
        body = {
            "model": model,
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": max_tokens,
            "temperature": 0.7,
            "seed": rng.randrange(1 << 30),
            "messages": [{"role": "user", "content": rng.choice(PROMPTS)}],
        }
        done = await stream_request(http, f"{url}/chat/completions", body, str(stats["ok"]))
        if done.error is None and not done.token_ids:
            done.error = "no tokens"
        if done.error is not None:
            stats["failures"].append(done.error)
            continue
        stats["ok"] += 1
        stats["chunks"] += len(done.token_times_s)
        stats["ttft"].append(done.metrics["ttft_s"])


async def run_load(
    url: str,
    model: str,
    clients: int,
    duration_s: float,
    max_tokens: int,
    seed: int = 0,
    api_key: str | None = None,
) -> dict[str, Any]:
    stats: dict[str, Any] = {"ok": 0, "chunks": 0, "ttft": [], "failures": []}
    async with session(clients + 4, 300.0, api_key) as http:
        deadline = time.monotonic() + duration_s
        start = time.perf_counter()
        await asyncio.gather(
            *(
                _client(http, url, model, max_tokens, deadline, random.Random(seed + i), stats)
                for i in range(clients)
            )
        )
        elapsed = time.perf_counter() - start
        await asyncio.sleep(1.0)
        base = url.removesuffix("/v1")
        async with http.get(f"{base}/stats") as reply:
            server = await reply.json()
    slots_in_use = sum(w["slots_used"] for w in server["workers"].values())
    return {
        "clients": clients,
        "duration_s": round(elapsed, 1),
        "requests_ok": stats["ok"],
        "failed": len(stats["failures"]),
        "failures": stats["failures"][:5],
        "stream_chunks_per_s": round(stats["chunks"] / elapsed, 1),
        "ttft_s_p50": round(percentile(stats["ttft"], 50), 3),
        "ttft_s_p99": round(percentile(stats["ttft"], 99), 3),
        "slots_in_use_after": slots_in_use,
        "live_handoffs_after": server["live_handoffs"],
    }
