"""Random OpenAI bodies against the disaggregated Serve app, many at once: no 5xx, OpenAI's error
shape on every refusal, a greedy or seeded reply streamed equal to the same reply whole, choice i
of n equal to the single request with seed + i, and nothing left running afterwards, even with
clients that hang up mid-stream."""

import asyncio
import json
import random
from typing import Any

import httpx
import pytest

from tests.factories import served_app
from tests.waiting import wait_for

pytestmark = pytest.mark.slow
ARGS = dict(
    mode="disaggregated",
    max_num_seqs=6,
    max_model_len=256,
    token_budget=32,
    prefill_chunk=8,
)
NUM_BODIES = 60
TEXTS = ["paris is in", "héllo wörld", "the quick brown fox " * 6, "🙂 x", "the lazy dog"]


def random_body(rng: random.Random) -> tuple[str, dict[str, Any], bool]:
    """A completions or chat body with a random mix of parameters, and whether it is valid: about
    one in ten carries a value out of range or a prompt over the context (refused with 400)."""
    chat = rng.random() < 0.5
    if chat:
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": ""}]}
        body["messages"][0]["content"] = rng.choice(TEXTS)
    else:
        path = "/v1/completions"
        body = {"prompt": rng.choice([*TEXTS, [5, 6, 7, 8], "x" * 300])}  # 300: over the context
    valid = body.get("prompt") != "x" * 300
    body["max_tokens"] = rng.choice([1, 4, 12, 24])
    maybe = [
        ("temperature", [0, 0.8, 1.5, None]),
        ("seed", [0, 7, 1234]),
        ("top_p", [0.5, 0.9, None]),
        ("top_k", [1, 5, -1, 0]),
        ("n", [1, 2, 3]),
        ("stop", ["the", ["o", "x"]]),
        ("presence_penalty", [0.5, -1.0]),
        ("frequency_penalty", [0.7]),
        ("repetition_penalty", [1.3]),
        ("min_p", [0.1]),
        ("ignore_eos", [True]),
        ("logit_bias", [{"5": 10}, {"3": -100}]),
        ("return_token_ids", [True]),
    ]
    for name, values in maybe:
        if rng.random() < 0.3:
            body[name] = rng.choice(values)
    if rng.random() < 0.2:
        body |= {"logprobs": True, "top_logprobs": 2} if chat else {"logprobs": 2}
    if rng.random() < 0.1:
        bad = [("temperature", 3), ("top_p", 0), ("n", 17), ("min_tokens", 100), ("top_k", -2)]
        body.update([rng.choice(bad)])
        valid = False
    return path, body, valid


def deterministic(body: dict[str, Any]) -> bool:
    return body.get("temperature") == 0 or "seed" in body


def texts(reply: dict[str, Any]) -> dict[int, tuple[str, str]]:
    """Choice index → (text, finish reason) of a whole reply."""
    return {
        c["index"]: (c["message"]["content"] if "message" in c else c["text"], c["finish_reason"])
        for c in reply["choices"]
    }


def streamed_texts(chunks: list[dict[str, Any]]) -> dict[int, tuple[str, str]]:
    """The same, put together from a stream's chunks."""
    text: dict[int, str] = {}
    finish: dict[int, str] = {}
    for chunk in chunks:
        for c in chunk["choices"]:
            piece = c["delta"].get("content") if "delta" in c else c["text"]
            text[c["index"]] = text.get(c["index"], "") + (piece or "")
            if c.get("finish_reason"):
                finish[c["index"]] = c["finish_reason"]
    return {i: (text[i], finish.get(i)) for i in text}


async def stream(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> list[Any]:
    """A stream's chunks (with usage); it must end with [DONE]."""
    chunks: list[Any] = []
    stream_body = body | {"stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", path, json=stream_body) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if line.startswith("data: "):
                chunks.append(line.removeprefix("data: "))
    assert chunks.pop() == "[DONE]", chunks[-1:]
    return [json.loads(chunk) for chunk in chunks]


async def hang_up(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> None:
    """Stream and hang up after the first chunk."""
    async with client.stream("POST", path, json=body | {"stream": True}) as resp:
        async for line in resp.aiter_lines():
            if line.startswith("data: "):
                return


async def check(client: httpx.AsyncClient, path: str, body: dict[str, Any], valid: bool) -> str:
    """One body, whole then streamed; returns its outcome ("200", "400", ...)."""
    whole = await client.post(path, json=body)
    assert whole.status_code < 500 and (whole.status_code == 200) == valid, (body, whole.text)
    if whole.status_code != 200:
        error = whole.json()["error"]
        assert error["message"] and error["type"], (body, error)
        again = await client.post(path, json=body | {"stream": True})
        assert again.status_code == whole.status_code, body
        return str(whole.status_code)
    reply, chunks = whole.json(), await stream(client, path, body)
    assert not [c for c in chunks if "error" in c], (body, chunks)
    assert sorted(texts(reply)) == list(range(len(reply["choices"]))), body
    usage = chunks[-1]["usage"]
    if deterministic(body):
        assert streamed_texts(chunks[:-1]) == texts(reply), body
        # (the whole reply's run cached the prompt: cached_tokens may differ)
        for count in ("prompt_tokens", "completion_tokens"):
            assert usage[count] == reply["usage"][count], body
    n = body.get("n", 1)
    if "seed" in body and n > 1 and not isinstance(body.get("prompt"), list):
        for i in range(n):
            single = await client.post(path, json=body | {"n": 1, "seed": body["seed"] + i})
            assert texts(single.json())[0] == texts(reply)[i], (body, i)
    return "200"


async def run_all(base: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    bodies = [random_body(rng) for _ in range(NUM_BODIES)]
    hang_ups = [random_body(rng) for _ in range(NUM_BODIES // 10)]
    limit = asyncio.Semaphore(8)

    async def one(job: Any) -> str:
        async with limit:
            return await job

    async with httpx.AsyncClient(base_url=base, timeout=120) as client:
        jobs = [check(client, path, body, valid) for path, body, valid in bodies]
        jobs += [hang_up(client, path, body | {"max_tokens": 60}) for path, body, _ in hang_ups]
        outcomes = await asyncio.gather(*(one(job) for job in jobs))
    return [o for o in outcomes if o is not None]


def idle(stats: dict[str, Any]) -> bool:
    """Every worker idle with no block in use, no handoff or stream left."""
    workers = stats["workers"].values()
    busy = [w for w in workers if w["running"] or w["waiting"] or w["kv_cache"]["blocks_used"]]
    return not busy and not stats["live_handoffs"] and not stats["streams"]


def idle_stats(base: str, timeout_s: float = 30.0) -> dict[str, Any]:
    """/stats once every worker is idle."""
    return wait_for(idle, timeout_s, value=lambda: httpx.get(f"{base}/stats", timeout=10).json())


def test_random_bodies_stream_as_they_answer_whole_and_leave_nothing_behind(
    ray_session, tiny_checkpoint
):
    with served_app(tiny_checkpoint, "random-bodies", **ARGS) as base:
        outcomes = asyncio.run(run_all(base, seed=11))
        stats = idle_stats(base)
    assert outcomes.count("200") > NUM_BODIES // 2 and "400" in outcomes, outcomes
    assert stats["counters"]["aborts"] >= 1  # the hang-ups were aborted, and their KV freed
