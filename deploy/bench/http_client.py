"""Sends a bench workload to a running OpenAI-compatible endpoint (`pdserve bench --url`),
streaming.

Each request is a `/v1/completions` call with the prompt as token ids, greedy, `ignore_eos` (so
every request makes exactly its output length on servers that honour it, as pdserve and vLLM do) and
`stream_options.include_usage`. Times are taken as the client sees them, the way vLLM's serving
benchmark takes them: TTFT at the first chunk that carries text, inter-token gaps between chunks,
TPOT as (end - first chunk) / (completion tokens - 1) with the token count from `usage`. Requests
the endpoint refuses (e.g. 429 when its queue is full) or breaks are counted as failed, not timed.

Streams are read with aiohttp, as vLLM's serving benchmark reads them: its C parser costs the client
about a third of httpx's CPU per streamed token, which matters when client and server share a
machine's cores. The one-off calls (`wait_ready`, `served_model`) use httpx.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import httpx

from scheduler.outputs import Completion
from workers.arrivals import ArrivalSchedule, run_at_arrivals


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The headers that carry an API key (none without one)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


class EndpointError(RuntimeError):
    """The endpoint cannot be benched at all (unreachable, serves no model, every request
    failed)."""


def session(
    connections: int, timeout_s: float, api_key: str | None = None
) -> aiohttp.ClientSession:
    """A client session for `stream_request`: up to `connections` open at once; `timeout_s` bounds
    connecting and each wait for the next bytes, not a whole stream."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=connections),
        headers=auth_headers(api_key),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=timeout_s, sock_read=timeout_s),
        read_bufsize=1 << 20,
    )  # an SSE line (one chunk, log-probs and all) must fit the buffer


async def stream_request(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any], rid: str, prompt_tokens: int = 0
) -> Completion:
    """POST one streaming completion or chat request (`url` is the endpoint's full address) and time
    it.

    A refusal, an error event, a broken stream (no finish_reason, no usage, no `data: [DONE]`) or a
    transport error makes a failed completion (`error` set) that callers count, rather than raising.
    """
    done = Completion(rid, prompt_tokens)
    start = time.perf_counter()
    first: float | None = None
    completion_tokens = None
    token_ids: list[int] = []
    finished = False
    try:
        async with http.post(url, json=body) as r:
            if r.status != 200:
                done.error = f"status {r.status}: {(await r.read())[:300].decode(errors='replace')}"
                return done
            async for raw in r.content:
                line = raw.rstrip(b"\r\n")
                if line == b"data: [DONE]":
                    finished = True
                    break
                if not line.startswith(b"data: "):
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    done.error = f"error event: {data['error'].get('message', data['error'])}"
                    return done
                if data.get("usage"):
                    completion_tokens = data["usage"]["completion_tokens"]
                    details = data["usage"].get("prompt_tokens_details") or {}
                    if details.get("cached_tokens") is not None:
                        done.metrics["cached_tokens"] = details["cached_tokens"]
                for choice in data.get("choices", []):
                    now = time.perf_counter()
                    if choice.get("token_ids"):  # asked for with `return_token_ids`
                        token_ids.extend(choice["token_ids"])
                    text = choice.get("text") or (choice.get("delta") or {}).get("content")
                    if text:
                        first = first or now
                        done.text += text
                        done.token_times_s.append(now)
                    done.finish_reason = choice.get("finish_reason") or done.finish_reason
    # ValueError: bad JSON, a line too long
    except (TimeoutError, aiohttp.ClientError, ValueError) as e:
        done.error = f"{type(e).__name__}: {e}"
        return done
    end = time.perf_counter()
    if done.finish_reason is None:
        done.error = "the stream ended without a finish_reason"
    elif completion_tokens is None:
        done.error = "no usage in the stream (the server ignores stream_options.include_usage)"
    elif not finished:
        done.error = "the stream ended without data: [DONE]"
    if done.error:
        return done
    assert completion_tokens is not None
    first = first if first is not None else end
    if body.get("return_token_ids") and len(token_ids) != completion_tokens:
        done.error = f"{len(token_ids)} token ids for {completion_tokens} tokens"
        return done
    # which tokens, when asked for; else only how many (the text is kept)
    done.token_ids = token_ids if body.get("return_token_ids") else [0] * completion_tokens
    done.metrics |= {
        "ttft_s": first - start,
        "e2e_s": end - start,
        "tpot_s": (end - first) / (completion_tokens - 1) if completion_tokens > 1 else 0.0,
    }
    return done


def run_http(
    url: str,
    model: str,
    prompts: list[list[int]],
    output_lens: list[int],
    arrival_s: list[float],
    priorities: list[int],
    api_key: str | None = None,
    on_finish: Callable[[Completion], None] | None = None,
    sequential: bool = False,
    after: list[int | None] | None = None,
    token_ids: bool = False,
    models: list[str | None] | None = None,
) -> tuple[dict[str, Completion], float]:
    """Send every request at its arrival offset, or when the request it follows (`after`, by index)
    ends, concurrently (`sequential`: one at a time, each when the one before has finished, the
    low-load case); return the completions of those sent by id ("0", "1", ...), and the seconds from
    the first request sent to the last one ended (the client's own set-up, such as its TLS context,
    is not timed). A body is built when its request is sent, from `prompts[i]` as it is then
    (`on_finish` may have written it: a chat's next turn). With `token_ids` the endpoint is asked
    for the generated ids (vLLM's `return_token_ids`); otherwise a completion's ids are zeros.
    `models`: per request, the `model` it asks for (None: `model`)."""
    url = url.rstrip("/")

    async def everything() -> tuple[list[Completion], float]:
        async with session(len(prompts) + 4, 600.0, api_key) as http:
            start = time.perf_counter()

            async def send(i: int) -> Completion:
                body = {
                    "model": (models[i] if models else None) or model,
                    "prompt": prompts[i],
                    "max_tokens": output_lens[i],
                    "temperature": 0.0,
                    "ignore_eos": True,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                    "priority": priorities[i],
                }
                if token_ids:
                    body["return_token_ids"] = True
                done = await stream_request(
                    http, f"{url}/completions", body, str(i), len(prompts[i])
                )
                if on_finish is not None:
                    on_finish(done)
                return done

            if sequential:
                done = [await send(i) for i in range(len(prompts))]
            else:
                schedule = ArrivalSchedule.by_key(
                    range(len(prompts)),
                    dict(enumerate(arrival_s)),
                    dict(enumerate(after or [])),
                    key=lambda i: i,
                )
                done = await run_at_arrivals(schedule, send)
            return done, time.perf_counter() - start

    completions, elapsed = asyncio.run(everything())
    return {c.req_id: c for c in completions}, elapsed


def wait_ready(url: str, timeout_s: float = 120.0) -> None:
    """Wait until the endpoint's `/health` (next to `/v1`) answers 200: a service that is still
    starting refuses connections or answers 503. An endpoint without `/health` (404) counts as
    ready. Tries at least once; says on stderr what it waits for."""
    health = f"{url.rstrip('/').removesuffix('/v1')}/health"
    start = next_note = time.monotonic()
    while True:
        try:
            r = httpx.get(health, timeout=10.0)
            if r.status_code in (200, 404):
                return
            last = f"status {r.status_code}: {r.text[:200]}"
        except httpx.HTTPError as e:
            last = f"{type(e).__name__}: {e}"
        waited = time.monotonic() - start
        if waited >= timeout_s:
            raise EndpointError(f"{health} is not ready after {waited:.0f} s ({last})")
        if time.monotonic() >= next_note:
            print(f"waiting for {health} ({last})", file=sys.stderr, flush=True)
            next_note += 10.0
        time.sleep(1.0)


def served_model(url: str, api_key: str | None = None) -> dict[str, Any]:
    """The first model the endpoint lists (`/v1/models`): its id and, on pdserve, its
    max_model_len."""
    try:
        r = httpx.get(f"{url.rstrip('/')}/models", headers=auth_headers(api_key), timeout=30.0)
        r.raise_for_status()
    except httpx.HTTPError as e:
        raise EndpointError(f"{url}: cannot list models: {e}") from None
    models = r.json().get("data", [])
    if not models:
        raise EndpointError(f"{url}: serves no model")
    return models[0]
