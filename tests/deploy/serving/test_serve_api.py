"""The OpenAI API through Ray Serve, with the official `openai` client and raw HTTP."""

import asyncio
import json

import httpx
import openai
import pytest
from ray import serve

from deploy.config import EngineConfig
from deploy.driver import open_engine
from deploy.prompts import encode_prompt
from deploy.serving.app import OpenAIIngress, build_app
from tests.deploy.serving.servers import local_text
from tests.factories import served_app
from tests.waiting import wait_for

pytestmark = pytest.mark.slow
ARGS = dict(
    mode="disaggregated",
    slots=2,
    prefill_slots=1,
    max_model_len=256,
    token_budget=16,
    prefill_chunk=8,
)


@pytest.fixture(scope="module")
def server(ray_session, tiny_checkpoint):
    with served_app(tiny_checkpoint, "main", **ARGS) as url:
        yield url


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=60)


def test_completion_equals_local_generate_with_usage(client, tiny_checkpoint):
    text, num_prompt, num_out, finish = local_text(tiny_checkpoint, prompt="the quick brown fox")
    got = client.completions.create(
        model="tiny", prompt="the quick brown fox", max_tokens=12, temperature=0
    )
    assert got.choices[0].text == text
    assert got.usage.prompt_tokens == num_prompt and got.usage.completion_tokens == num_out
    assert got.usage.total_tokens == num_prompt + num_out
    assert got.choices[0].finish_reason == finish


def test_streamed_completion_joins_to_the_same_text_and_ends_with_usage(client, tiny_checkpoint):
    text, num_prompt, num_out, finish = local_text(
        tiny_checkpoint, prompt="hello world", max_tokens=20
    )
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt="hello world",
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert (
        chunks[-1].usage.completion_tokens == num_out
        and chunks[-1].usage.prompt_tokens == num_prompt
    )
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == finish


def test_chat_streaming_and_not(client, tiny_checkpoint):
    messages = [{"role": "user", "content": "paris is in"}]
    text, _, num_out, finish = local_text(tiny_checkpoint, messages=messages, max_tokens=15)
    got = client.chat.completions.create(
        model="tiny", messages=messages, max_completion_tokens=15, temperature=0
    )
    assert got.choices[0].message.content == text and got.choices[0].message.role == "assistant"
    assert got.choices[0].finish_reason == finish
    assert got.usage.completion_tokens == num_out
    chunks = list(
        client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=15, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text


def test_raw_sse_ends_with_done_and_models_and_health(server):
    with httpx.stream(
        "POST",
        f"{server}/v1/completions",
        json={
            "model": "tiny",
            "prompt": [5, 6, 7],
            "max_tokens": 5,
            "stream": True,
            "temperature": 0,
        },
        timeout=60,
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"
    models = httpx.get(f"{server}/v1/models").json()
    assert models["data"][0]["id"] == "tiny"
    # the client's models.retrieve
    assert httpx.get(f"{server}/v1/models/tiny").json() == models["data"][0]
    assert_error(httpx.get(f"{server}/v1/models/gpt-4"), 404, "model", "gpt-4")
    assert httpx.get(f"{server}/health").json() == {"status": "ok"}


def assert_error(response, status, param=None, contains=""):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert contains in error["message"]
    if param:
        assert error["param"] == param


@pytest.mark.parametrize(
    "body, status, param, contains",
    [
        ('{"model": "tiny", "prompt": "hi"', 400, None, "Invalid request"),
        ('{"model": "tiny", "prompt": "hi", "max_tokens": "many"}', 400, "max_tokens", ""),
        ('{"model": "tiny", "prompt": "hi", "temperature": -1}', 400, "temperature", ""),
        ('{"model": "nope", "prompt": "hi"}', 404, "model", "nope"),
        (
            '{"model": "tiny", "prompt": "hi", "max_tokens": 300}',
            400,
            "max_tokens",
            "maximum context length is 256",
        ),
        ('{"model": "tiny", "prompt": "hi", "n": 17}', 400, "n", "less than or equal to 16"),
        ('{"model": "tiny", "prompt": "hi", "suffix": "x"}', 400, "suffix", "not supported"),
        (
            '{"model": "tiny", "prompt": "hi", "logit_bias": {"100000": 5}}',
            400,
            "logit_bias",
            "vocabulary",
        ),
        ('{"model": "tiny", "prompt": "hi", "frobnicate": 1}', 400, "frobnicate", "Unrecognized"),
        (
            '{"model": "tiny", "prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}',
            400,
            "stop",
            "at most 4",
        ),
        ('{"model": "tiny", "prompt": [1, 99999]}', 400, "prompt", "vocabulary"),
        ('{"model": "tiny", "prompt": ""}', 400, "prompt", "empty"),
    ],
)
def test_bad_requests_get_openai_errors(server, body, status, param, contains):
    r = httpx.post(
        f"{server}/v1/completions", content=body, headers={"Content-Type": "application/json"}
    )
    assert_error(r, status, param, contains)
    if "300" in body:  # both numbers: the request's and the limit
        assert "300 for the completion" in r.json()["error"]["message"]


def test_parameters_that_change_the_output_are_never_silently_ignored(client, tiny_checkpoint):
    messages = [{"role": "user", "content": "paris is in"}]
    # the legacy form of tools, auto too: it needs a parser
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=4, functions=[{"name": "f"}]
        )
    assert (
        err.value.body["param"] == "function_call"
        and "--tool-call-parser" in err.value.body["message"]
    )
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=4, function_call="auto"
        )
    assert (
        err.value.body["param"] == "function_call"
        and "needs `functions`" in err.value.body["message"]
    )
    # auto, the default with tools, needs a tool-call parser
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=4,
            tools=[{"type": "function", "function": {"name": "f"}}],
        )
    assert (
        err.value.body["param"] == "tool_choice"
        and "--tool-call-parser" in err.value.body["message"]
    )
    # no-op values and fields that only describe the request are served, with the same text
    text, *_ = local_text(tiny_checkpoint, messages=messages, max_tokens=6)
    got = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=6,
        temperature=0,
        n=1,
        presence_penalty=0,
        logprobs=False,
        user="u-1",
        metadata={"k": "v"},
        store=False,
        response_format={"type": "text"},
    )
    assert got.choices[0].message.content == text


def test_tokenize_and_detokenize_as_vllm_shapes_them(server, tiny_checkpoint):
    messages = [{"role": "user", "content": "paris is in"}]
    with open_engine(EngineConfig(model=tiny_checkpoint, max_model_len=256)) as engine:
        chat_ids = encode_prompt(engine.tokenizer, messages=messages)
        text_ids = encode_prompt(engine.tokenizer, prompt="hello world")
    r = httpx.post(f"{server}/tokenize", json={"model": "tiny", "prompt": "hello world"})
    assert r.json() == {"count": len(text_ids), "max_model_len": 256, "tokens": text_ids}
    r = httpx.post(f"{server}/tokenize", json={"model": "tiny", "messages": messages})
    assert r.json()["tokens"] == chat_ids
    r = httpx.post(f"{server}/detokenize", json={"model": "tiny", "tokens": text_ids})
    assert r.status_code == 200 and r.json() == {"prompt": "hello world"}
    assert_error(
        httpx.post(f"{server}/detokenize", json={"model": "tiny", "tokens": [10**6]}), 400, "tokens"
    )
    assert_error(httpx.post(f"{server}/tokenize", json={"model": "tiny"}), 400)
    assert_error(
        httpx.post(f"{server}/tokenize", json={"model": "nope", "prompt": "x"}), 404, "model"
    )


def test_chat_errors(server):
    r = httpx.post(f"{server}/v1/chat/completions", json={"model": "tiny", "messages": []})
    assert_error(r, 400, "messages")
    r = httpx.post(
        f"{server}/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "wizard"}]}
    )
    assert_error(r, 400)
    assert_error(httpx.get(f"{server}/v1/nothing"), 404)


def test_disconnected_stream_frees_its_slot(server):
    def slots_used():
        workers = httpx.get(f"{server}/stats").json()["workers"]
        return sum(w["slots_used"] for w in workers.values())

    with httpx.stream(
        "POST",
        f"{server}/v1/completions",
        timeout=60,
        json={
            "model": "tiny",
            "prompt": [5, 6, 7],
            "max_tokens": 240,
            "ignore_eos": True,
            "stream": True,
        },
    ) as r:
        lines = r.iter_lines()
        next(lines)
        assert slots_used() >= 1
    wait_for(lambda used: used == 0, 15, value=slots_used, what="the dropped stream's slot freed")


def test_bench_against_the_running_endpoint(server, tiny_checkpoint, tmp_path):
    """`pdserve bench --url`: a rate sweep streamed through the app, every request its full
    length."""
    from deploy.bench.workload import make_workload
    from deploy.cli import main

    out = tmp_path / "url.jsonl"
    assert (
        main(
            [
                "bench",
                "--url",
                f"{server}/v1",
                "--model",
                tiny_checkpoint,
                "--num-requests",
                "5",
                "--prompt-len",
                "4:20",
                "--output-len",
                "3:9",
                "--rate",
                "0,100",
                "--output",
                str(out),
                "--quiet",
            ]
        )
        == 0
    )
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    summaries = [line for line in lines if "rid" not in line]
    runs = [(s["mode"], s["served_model"], s["rate"]) for s in summaries]
    assert runs == [("url", "tiny", 0.0), ("url", "tiny", 100.0)]
    assert all(
        s["ttft_ms_p50"] > 0 and s["itl_ms_mean"] > 0 and s["output_tok_s"] > 0 for s in summaries
    )
    # not the bench's to say
    assert all(s["prefill_workers"] is None and s["prefix_cache"] is None for s in summaries)
    asked = make_workload(5, "4:20", "3:9", 384, seed=0).output_lens
    for rate in (0.0, 100.0):
        assert [
            line["tokens"] for line in lines if line.get("rid") and line["rate"] == rate
        ] == asked
    assert out.with_suffix(".png").exists()


def test_load_clients_get_whole_streams_and_leave_no_slot_in_use(server, capsys):
    """`pdserve load`: closed-loop streaming chat clients for a fixed time; every response whole."""
    from deploy.cli import main

    rc = main(
        [
            "load",
            "--url",
            f"{server}/v1",
            "--model-name",
            "tiny",
            "--clients",
            "3",
            "--duration",
            "2",
            "--max-tokens",
            "8",
        ]
    )
    result = json.loads(capsys.readouterr().out)
    assert rc == 0 and result["failed"] == 0 and result["requests_ok"] >= 3, result
    assert result["slots_in_use_after"] == 0 and result["live_handoffs_after"] == 0
    assert 0 < result["ttft_s_p50"] <= result["ttft_s_p99"]


def test_not_ready_scheduler_gives_503():
    class Hanging:
        class check_health:  # noqa: N801 - mimics a handle method
            @staticmethod
            def remote():
                return asyncio.sleep(10)

    ingress = object.__new__(OpenAIIngress.func_or_class)
    ingress.scheduler, ingress._ready = Hanging(), False
    from deploy.serving.schemas import APIError

    with pytest.raises(APIError) as info:
        asyncio.run(ingress._check_ready())
    assert info.value.status == 503 and info.value.headers["Retry-After"]


def test_api_key_and_body_limit(server, tiny_checkpoint, tmp_path):
    """Runs last: it replaces the main app with one that has an API key and a small body limit.
    (A full queue's 429 is tested against the scheduler actor in test_openai_server.py.)"""
    serve.delete("main")
    serve.run(
        build_app(
            {
                "model": tiny_checkpoint,
                "served_model_name": "tiny",
                "api_key": "sekret",
                "max_waiting": 1,
                "max_request_bytes": 4096,
                **ARGS | {"slots": 1, "max_model_len": 1024},
            }
        ),
        name="guarded",
        route_prefix="/guarded",
    )
    base = f"{server}/guarded/v1"
    assert_error(httpx.post(f"{base}/completions", json={"model": "tiny", "prompt": "hi"}), 401)
    assert_error(httpx.get(f"{base}/models"), 401)
    auth = {"Authorization": "Bearer sekret"}
    assert_error(
        httpx.post(
            f"{base}/completions", headers=auth, json={"model": "tiny", "prompt": "x" * 5000}
        ),
        413,
    )
    good = openai.OpenAI(base_url=base, api_key="sekret", max_retries=0, timeout=60)
    assert (
        good.completions.create(model="tiny", prompt="hi", max_tokens=2).usage.completion_tokens
        >= 1
    )

    # `pdserve bench --url` here: a wrong key fails at the warm-up; with the key, 8 requests at once
    # on one slot and a one-request queue get 429s, which the bench counts as failed and does not
    # time
    from deploy.cli import main

    bench = [
        "bench",
        "--url",
        base,
        "--model",
        tiny_checkpoint,
        "--num-requests",
        "8",
        "--prompt-len",
        "8",
        "--output-len",
        "200",
        "--quiet",
    ]
    assert main([*bench, "--api-key", "wrong"]) == 2
    out = tmp_path / "guarded.jsonl"
    assert main([*bench, "--api-key", "sekret", "--output", str(out)]) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    summary, per_request = lines[0], lines[1:]
    refused = [r for r in per_request if "error" in r]
    assert summary["failed_requests"] == len(refused) >= 1 and "status 429" in refused[0]["error"]
    assert summary["requests_per_s"] * summary["duration_s"] == pytest.approx(8 - len(refused))
    assert all(r["tokens"] == 200 for r in per_request if "error" not in r)
