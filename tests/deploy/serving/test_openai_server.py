"""The OpenAI layer against the real scheduler actor (no Serve): a full queue answers 429 at
once."""

import asyncio

import pytest
import ray

from deploy.config import EngineConfig
from deploy.engine_client import EngineClient
from deploy.ray_cell import start_cell_actor
from deploy.serving.openai_api import OpenAIServer, ServedModel
from deploy.serving.schemas import APIError, CompletionBody
from tests.waiting import wait_for_stats
from workers.loader import load_tokenizer

pytestmark = pytest.mark.slow


def test_full_queue_gets_429_with_retry_after(ray_session, tiny_checkpoint):
    config = EngineConfig(
        model=tiny_checkpoint,
        mode="disaggregated",
        slots=1,
        prefill_slots=1,
        max_model_len=1024,
        token_budget=8,
        prefill_chunk=8,
        max_waiting=1,
    )
    handle = start_cell_actor(config)
    info = load_tokenizer(tiny_checkpoint)
    server = OpenAIServer(
        EngineClient(handle), ServedModel("tiny", info.tokenizer, info.eos_token_ids, 1024)
    )

    async def scenario():
        long = CompletionBody(model="tiny", prompt=[5 + i % 300 for i in range(1000)], max_tokens=4)
        short = CompletionBody(model="tiny", prompt=[5, 6, 7], max_tokens=4)
        first = asyncio.create_task(server.respond(long))  # holds the one prefill row for 125 steps
        await wait_for_stats(handle, lambda s: s["workers"]["prefill-0"]["running"] == 1)
        second = asyncio.create_task(server.respond(short))  # waits for the row
        await wait_for_stats(handle, lambda s: s["workers"]["prefill-0"]["waiting"] == 1)
        with pytest.raises(APIError) as info:
            await server.respond(short)
        return info.value, await first, await second

    try:
        error, first, second = asyncio.run(scenario())
    finally:
        ray.get(handle.shutdown.remote())
    assert (
        error.status == 429 and error.headers == {"Retry-After": "1"} and error.code == "queue_full"
    )
    assert error.body()["error"]["type"] == "rate_limit_error"
    # the queued ones were not disturbed
    assert first.status_code == 200 and second.status_code == 200
