"""The Serve app with workers of two tensor-parallel sizes: one prefill worker of one rank hands
its prompts to one decode worker of two, and the embedded model's answers to real questions are
local mode's (TP-1) token for token, with log-probs within 1e-4."""

import concurrent.futures

import httpx
import pytest

from deploy.config import EngineConfig
from deploy.driver import open_engine
from deploy.params import GenerationParams
from deploy.prompts import encode_prompt
from deploy.serving.cell_actors import NAMESPACE, named_actors
from tests.factories import served_app

pytestmark = pytest.mark.slow
QUESTIONS = [
    "What is the capital of France?",
    "Name three colours.",
    "What is 2 + 2?",
    "Write one sentence about the sea.",
]
MAX_TOKENS = 24
ENGINE = dict(max_model_len=256, dtype="float32", device="cpu", token_budget=64, prefill_chunk=32)


def _messages(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}]


def _local() -> list[tuple[list[int], list[float]]]:
    """Each question's greedy tokens and their log-probs in local mode, one worker of one rank."""
    with open_engine(EngineConfig(slots=len(QUESTIONS), **ENGINE)) as engine:
        requests = [
            GenerationParams(temperature=0).request(
                str(i),
                encode_prompt(engine.tokenizer, messages=_messages(q)),
                max_tokens=MAX_TOKENS,
                eos_token_ids=engine.eos_token_ids,
                vocab_size=len(engine.tokenizer),
                logprobs=0,
            )
            for i, q in enumerate(QUESTIONS)
        ]
        done = engine.run(requests)
    return [
        (done[str(i)].token_ids, [entry.logprob for entry in done[str(i)].logprobs])
        for i in range(len(QUESTIONS))
    ]


def _ask(url: str, question: str) -> tuple[list[int], list[float]]:
    body = {
        "model": "tiny",
        "messages": _messages(question),
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "logprobs": True,
        "return_token_ids": True,
    }
    reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    return choice["token_ids"], [entry["logprob"] for entry in choice["logprobs"]["content"]]


def test_a_tp1_prefill_and_a_tp2_decode_worker_answer_like_local_mode(ray_session):
    """Four chats at once through HTTP; every prompt is prefilled by the one-rank worker and
    handed to the two-rank one."""
    expected = _local()
    args = dict(
        ENGINE,
        mode="disaggregated",
        slots=len(QUESTIONS),
        prefill_slots=2,
        prefill_tensor_parallel_size=1,
        decode_tensor_parallel_size=2,
    )
    with served_app("smollm2-135m-instruct", "tp", **args) as url:
        with concurrent.futures.ThreadPoolExecutor(len(QUESTIONS)) as pool:
            got = list(pool.map(lambda q: _ask(url, q), QUESTIONS))
        stats = httpx.get(f"{url}/stats", timeout=30).json()
        (cell,) = named_actors(NAMESPACE, "tp-cell-")
        placement = ray_session.get(ray_session.get_actor(cell, NAMESPACE).ready.remote())
    for question, (tokens, logprobs), (local_tokens, local_logprobs) in zip(
        QUESTIONS, got, expected, strict=True
    ):
        assert tokens == local_tokens, question
        assert max(abs(a - b) for a, b in zip(logprobs, local_logprobs, strict=True)) < 1e-4
    assert all(len(tokens) > 3 for tokens, _ in expected)
    ranks = {
        name: p["tensor_parallel_size"]
        for name, p in placement.items()
        if isinstance(p, dict) and "ranks" in p
    }
    assert ranks == {"prefill-0": 1, "decode-0": 2}
    assert stats["counters"]["handoffs"] == len(QUESTIONS)
