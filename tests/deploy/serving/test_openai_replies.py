"""Replies in OpenAI's shapes from a scripted engine: log-probs (chat and completions), echo, n
choices, streamed and not, and failures, refusals and disconnects that must abort every choice."""

import asyncio
import itertools

import pytest

from deploy.serving.schemas import APIError, ChatBody, CompletionBody
from tests.deploy.serving.fake_engine import FakeEngine, make_server, reply, sampled_ids, script
from tests.factories import tiny_tokenizer

MESSAGES = [{"role": "user", "content": "paris is in"}]


def text_of(request) -> str:  # type: ignore[no-untyped-def]
    return "".join(out.text for out in script(request))


def token_texts(ids: list[int]) -> list[str]:
    return [tiny_tokenizer().decode([t]) for t in ids]


def streamed_choices(chunks: list[dict]) -> dict[int, list[dict]]:
    """Each choice's chunk choices, in order (usage-only chunks left out)."""
    by_index: dict[int, list[dict]] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            by_index.setdefault(choice["index"], []).append(choice)
    return by_index


def test_chat_logprobs_whole_and_streamed():
    engine = FakeEngine()
    server = make_server(engine)
    body = dict(
        model="tiny", messages=MESSAGES, max_tokens=5, seed=3, logprobs=True, top_logprobs=2
    )
    whole = reply(server, ChatBody(**body))
    (request,) = engine.requests.values()
    ids = sampled_ids(request)
    choice = whole["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": text_of(request)}
    content = choice["logprobs"]["content"]
    assert [c["token"] for c in content] == token_texts(ids)
    assert [c["logprob"] for c in content] == [-0.25 * (j + 1) for j in range(5)]
    for c in content:
        assert c["bytes"] == list(c["token"].encode()) and set(c) == {
            "token",
            "logprob",
            "bytes",
            "top_logprobs",
        }
        assert [t["logprob"] for t in c["top_logprobs"]] == [-0.1, -9999.0]  # -inf is not JSON
        assert all(set(t) == {"token", "logprob", "bytes"} for t in c["top_logprobs"])

    chunks = reply(server, ChatBody(**body, stream=True))
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    deltas = streamed_choices(chunks[1:])[0]
    assert "".join(d["delta"].get("content", "") for d in deltas) == text_of(request)
    assert [c for d in deltas if d["logprobs"] for c in d["logprobs"]["content"]] == content
    # a token whose text is held back still brings its log-prob, in a chunk with no content yet
    assert any(d["delta"] == {} and d["logprobs"] for d in deltas)
    assert [d["finish_reason"] for d in deltas][-1] == "length"


def test_completion_logprobs_with_echo_whole_and_streamed():
    engine = FakeEngine()
    server = make_server(engine)
    body = dict(model="tiny", prompt="hello world", max_tokens=4, seed=1, logprobs=2, echo=True)
    whole = reply(server, CompletionBody(**body))
    (request,) = engine.requests.values()
    prompt_ids, ids = request.prompt_ids, sampled_ids(request)
    choice = whole["choices"][0]
    assert choice["text"] == "hello world" + text_of(request)
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == token_texts(prompt_ids + ids)
    num_prompt = len(prompt_ids)
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert logprobs["token_logprobs"][1:] == [-0.25 * (p + 1) for p in range(num_prompt - 1)] + [
        -0.25 * (j + 1) for j in range(4)
    ]
    for token, top in zip(logprobs["tokens"][1:], logprobs["top_logprobs"][1:], strict=True):
        # sampled + 2 most likely
        assert next(iter(top)) == token and len(top) <= 3 and -9999.0 in top.values()
    assert logprobs["text_offset"] == list(
        itertools.accumulate([0] + [len(t) for t in logprobs["tokens"][:-1]])
    )
    assert whole["usage"] == {
        "prompt_tokens": num_prompt,
        "completion_tokens": 4,
        "total_tokens": num_prompt + 4,
        "prompt_tokens_details": {"cached_tokens": 0},
    }

    chunks = streamed_choices(reply(server, CompletionBody(**body, stream=True)))[0]
    assert chunks[0]["text"].startswith("hello world")
    assert "".join(c["text"] for c in chunks) == choice["text"]
    with_logprobs = [c["logprobs"] for c in chunks if c["logprobs"]]
    assert sum((lp["tokens"] for lp in with_logprobs), []) == logprobs["tokens"]
    assert sum((lp["top_logprobs"] for lp in with_logprobs), []) == logprobs["top_logprobs"]
    returned = 0  # each chunk's offsets start where the text returned before it ends
    for c in chunks:
        if c["logprobs"]:
            assert c["logprobs"]["text_offset"][0] == returned
        returned += len(c["text"])


def test_echo_with_max_tokens_0_returns_the_prompt_and_its_logprobs_only():
    server = make_server()
    body = dict(model="tiny", prompt="paris is in france", max_tokens=0, echo=True, logprobs=1)
    whole = reply(server, CompletionBody(**body))
    choice = whole["choices"][0]
    prompt_ids = tiny_tokenizer()("paris is in france").input_ids
    assert choice["text"] == "paris is in france" and choice["finish_reason"] == "length"
    assert choice["logprobs"]["tokens"] == token_texts(prompt_ids)
    assert len(choice["logprobs"]["token_logprobs"]) == len(prompt_ids)
    assert whole["usage"]["completion_tokens"] == 0
    chunks = reply(
        server, CompletionBody(**body, stream=True, stream_options={"include_usage": True})
    )
    choices = streamed_choices(chunks)[0]
    assert "".join(c["text"] for c in choices) == "paris is in france"
    assert (
        sum((c["logprobs"]["tokens"] for c in choices if c["logprobs"]), [])
        == choice["logprobs"]["tokens"]
    )
    assert (
        choices[-1]["finish_reason"] == "length" and chunks[-1]["usage"]["completion_tokens"] == 0
    )


def test_n_choices_sample_as_single_requests_with_seed_plus_i():
    server = make_server()
    whole = reply(server, CompletionBody(model="tiny", prompt="hello", n=3, seed=10, max_tokens=6))
    singles = [
        reply(server, CompletionBody(model="tiny", prompt="hello", seed=10 + i, max_tokens=6))
        for i in range(3)
    ]
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2]
    assert [c["text"] for c in whole["choices"]] == [s["choices"][0]["text"] for s in singles]
    assert len({c["text"] for c in whole["choices"]}) == 3
    assert all(c["finish_reason"] == "length" and c["logprobs"] is None for c in whole["choices"])
    num_prompt = singles[0]["usage"]["prompt_tokens"]
    assert whole["usage"] == {
        "prompt_tokens": num_prompt,
        "completion_tokens": 18,
        "total_tokens": num_prompt + 18,
        "prompt_tokens_details": {"cached_tokens": 0},
    }

    chunks = reply(
        server,
        CompletionBody(
            model="tiny",
            prompt="hello",
            n=3,
            seed=10,
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        ),
    )
    indexes = [choice["index"] for chunk in chunks for choice in chunk["choices"]]
    assert indexes != sorted(indexes)  # the choices' chunks interleave
    by_index = streamed_choices(chunks)
    assert ["".join(c["text"] for c in by_index[i]) for i in range(3)] == [
        c["text"] for c in whole["choices"]
    ]
    assert all([c["finish_reason"] for c in by_index[i]].count("length") == 1 for i in range(3))
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
    assert len({chunk["id"] for chunk in chunks}) == 1

    chat = reply(server, ChatBody(model="tiny", messages=MESSAGES, n=2, max_tokens=3, stream=True))
    assert [c["choices"][0]["delta"].get("role") for c in chat[:2]] == ["assistant", "assistant"]
    assert sorted(c["choices"][0]["index"] for c in chat[:2]) == [0, 1]


def test_a_list_of_prompts_gets_n_choices_each_numbered_prompt_by_prompt():
    engine = FakeEngine()
    server = make_server(engine)
    prompts = ["hello world", "paris is in france"]
    body = dict(model="tiny", n=2, seed=4, max_tokens=5, echo=True, logprobs=1)
    whole = reply(server, CompletionBody(prompt=prompts, **body))
    singles = [reply(server, CompletionBody(prompt=prompt, **body)) for prompt in prompts]
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2, 3]
    assert [{k: v for k, v in c.items() if k != "index"} for c in whole["choices"]] == [
        {k: v for k, v in c.items() if k != "index"} for s in singles for c in s["choices"]
    ]
    assert [c["text"][: len(prompts[i // 2])] for i, c in enumerate(whole["choices"])] == [
        prompts[0],
        prompts[0],
        prompts[1],
        prompts[1],
    ]
    # each prompt once, not once per choice
    num_prompt = sum(s["usage"]["prompt_tokens"] for s in singles)
    assert whole["usage"] == {
        "prompt_tokens": num_prompt,
        "completion_tokens": 20,
        "total_tokens": num_prompt + 20,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    forks = [r.fork_of for r in engine.requests.values()][:4]
    assert forks == [None, f"{whole['id']}-0", None, f"{whole['id']}-2"]

    chunks = reply(
        server,
        CompletionBody(prompt=prompts, stream=True, stream_options={"include_usage": True}, **body),
    )
    by_index = streamed_choices(chunks)
    assert ["".join(c["text"] for c in by_index[i]) for i in range(4)] == [
        c["text"] for c in whole["choices"]
    ]
    assert chunks[-1]["usage"] == whole["usage"]

    ids = tiny_tokenizer()("paris is in france").input_ids
    by_ids = reply(
        server, CompletionBody(model="tiny", prompt=[ids, ids[:2]], seed=4, max_tokens=5)
    )
    assert by_ids["choices"][0]["text"] == singles[1]["choices"][0]["text"][len(prompts[1]) :]
    assert len(by_ids["choices"]) == 2


def test_a_prompt_of_a_list_that_cannot_fit_fails_the_request_before_any_runs():
    engine = FakeEngine()
    with pytest.raises(APIError) as info:
        reply(
            make_server(engine),
            CompletionBody(model="tiny", prompt=["hello", "hello " * 600], max_tokens=8),
        )
    assert (
        info.value.status == 400
        and "prompt 1: " in info.value.message
        and "maximum context length" in info.value.message
    )
    with pytest.raises(APIError) as info:
        reply(make_server(engine), CompletionBody(model="tiny", prompt=[[5, 6], []], max_tokens=8))
    assert info.value.status == 400 and "prompt 1: The prompt is empty." in info.value.message
    with pytest.raises(APIError) as info:
        reply(
            make_server(engine),
            CompletionBody(model="tiny", prompt=[[5, 6], [7, 384]], max_tokens=8),
        )
    assert (
        info.value.status == 400
        and info.value.message.startswith("prompt 1: ")
        and "vocabulary" in info.value.message
    )
    assert not engine.requests


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk():
    server = make_server()
    body = dict(model="tiny", messages=MESSAGES, n=2, seed=1, max_tokens=6, stream=True)
    whole = reply(server, ChatBody(**{**body, "stream": False}))
    chunks = reply(
        server,
        ChatBody(**body, stream_options={"include_usage": True, "continuous_usage_stats": True}),
    )
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[0] == 0 and chunks[-1]["usage"] == whole["usage"]
    assert all(c["usage"]["prompt_tokens"] == whole["usage"]["prompt_tokens"] for c in chunks)
    plain = reply(server, ChatBody(**body, stream_options={"include_usage": True}))
    assert all(c["usage"] is None for c in plain[:-1]) and plain[-1]["usage"] == whole["usage"]


def test_a_failed_choice_fails_the_reply_and_aborts_the_others():
    engine = FakeEngine(fail={"1"})
    server = make_server(engine)
    with pytest.raises(APIError) as info:
        reply(server, CompletionBody(model="tiny", prompt="hello", n=3, max_tokens=8))
    assert (info.value.status, info.value.code) == (
        500,
        "engine_error",
    ) and "worker lost" in info.value.message
    assert sorted(r.rsplit("-", 1)[1] for r in engine.aborted) == ["0", "2"]

    engine.aborted.clear()
    chunks = reply(
        server, CompletionBody(model="tiny", prompt="hello", n=3, max_tokens=8, stream=True)
    )
    assert chunks[-1]["error"]["code"] == "engine_error"
    assert sorted(r.rsplit("-", 1)[1] for r in engine.aborted) == ["0", "2"]


def test_a_stream_no_cell_could_continue_answers_503_or_an_error_event_then_done():
    """Failover gave up (no live cell in time): a whole reply is 503 with Retry-After; a stream ends
    with an error event and `[DONE]`, never a cut connection."""
    engine = FakeEngine(fail={"0"}, unavailable=True)
    with pytest.raises(APIError) as info:
        reply(make_server(engine), CompletionBody(model="tiny", prompt="hello", max_tokens=8))
    assert (info.value.status, info.value.code) == (
        503,
        "engine_unavailable",
    ) and info.value.headers["Retry-After"]
    chunks = reply(
        make_server(engine), CompletionBody(model="tiny", prompt="hello", max_tokens=8, stream=True)
    )
    assert chunks[-1]["error"]["code"] == "engine_unavailable"  # (and `reply` saw [DONE] last)


def test_a_refused_choice_aborts_the_admitted_ones_and_answers_429():
    engine = FakeEngine(refuse={"1"})
    with pytest.raises(APIError) as info:
        reply(make_server(engine), ChatBody(model="tiny", messages=MESSAGES, n=3, max_tokens=8))
    assert info.value.status == 429 and info.value.headers == {"Retry-After": "1"}
    assert sorted(r.rsplit("-", 1)[1] for r in engine.aborted) == ["0", "2"]


def test_a_client_that_disconnects_cancels_every_choice():
    engine = FakeEngine()
    server = make_server(engine)

    async def disconnect_after_two_chunks() -> None:
        response = await server.respond(
            CompletionBody(model="tiny", prompt="hello", n=2, max_tokens=20, stream=True)
        )
        events = response.body_iterator
        await anext(events)
        await anext(events)
        await events.aclose()

    asyncio.run(disconnect_after_two_chunks())
    assert sorted(engine.aborted) == sorted(engine.requests) and len(engine.aborted) == 2


@pytest.mark.parametrize("schema", [CompletionBody, ChatBody])
def test_return_token_ids_gives_each_choice_its_prompt_and_generated_ids(schema):
    """vLLM's `return_token_ids`: whole, every choice has `prompt_token_ids` and `token_ids`;
    streamed, the first chunk of a choice has its prompt's ids and the chunks' `token_ids` add up
    to the whole reply's (tokens whose text is held back still come)."""
    server = make_server()
    needed = {"messages": MESSAGES} if schema is ChatBody else {"prompt": "paris is in"}
    body = dict(model="tiny", n=2, seed=3, max_tokens=7, return_token_ids=True) | needed
    whole = reply(server, schema(**body))
    plain = reply(server, schema(**(body | {"return_token_ids": False})))
    assert all("token_ids" not in c and "prompt_token_ids" not in c for c in plain["choices"])
    for choice in whole["choices"]:
        assert len(choice["token_ids"]) == 7
        assert len(choice["prompt_token_ids"]) == whole["usage"]["prompt_tokens"]
        if schema is CompletionBody:
            assert tiny_tokenizer().decode(choice["token_ids"]) == choice["text"]
            assert tiny_tokenizer().decode(choice["prompt_token_ids"]) == "paris is in"
    assert whole["choices"][0]["token_ids"] != whole["choices"][1]["token_ids"]
    # usage counts the one prompt once, whatever n is (OpenAI's and vLLM's usage)
    single = reply(server, schema(**(body | {"n": 1})))
    assert whole["usage"]["prompt_tokens"] == single["usage"]["prompt_tokens"]
    assert whole["usage"]["completion_tokens"] == 2 * single["usage"]["completion_tokens"]
    by_index = streamed_choices(reply(server, schema(**(body | {"stream": True}))))
    for index, choice in enumerate(whole["choices"]):
        chunks = [c for c in by_index[index] if "token_ids" in c]
        assert chunks[0]["prompt_token_ids"] == choice["prompt_token_ids"]
        assert all(c["prompt_token_ids"] is None for c in chunks[1:])
        assert sum((c["token_ids"] for c in chunks), []) == choice["token_ids"]
