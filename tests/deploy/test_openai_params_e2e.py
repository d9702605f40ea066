"""The OpenAI parameters through Ray Serve (colocated) with the official `openai` client, against
transformers and against the local engine."""

import json
import re

import httpx
import jsonschema
import openai
import pytest
import torch

from deploy.config import EngineConfig
from deploy.driver import open_engine
from deploy.params import GenerationParams
from deploy.prompts import encode_prompt
from tests.factories import served_app, tiny_hf_model

pytestmark = pytest.mark.slow
ARGS = dict(
    mode="colocated",
    slots=4,
    max_model_len=256,
    token_budget=32,
    prefill_chunk=8,
    tool_call_parser="hermes",
)
MESSAGES = [{"role": "user", "content": "paris is in"}]


@pytest.fixture(scope="module")
def client(ray_session, tiny_checkpoint):
    with served_app(tiny_checkpoint, "params", **ARGS) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def local(checkpoint, max_tokens, prompt=None, messages=None, **params):
    """The local engine's completion for the same prompt and parameters."""
    with open_engine(EngineConfig(model=checkpoint, max_model_len=256)) as engine:
        ids = encode_prompt(engine.tokenizer, prompt=prompt, messages=messages)
        request = GenerationParams(**params).request(
            "x",
            ids,
            max_tokens=max_tokens,
            eos_token_ids=engine.eos_token_ids,
            vocab_size=len(engine.tokenizer),
        )
        return engine.run([request])["x"], ids


def hf_logprobs(tokens):
    with torch.no_grad():
        return torch.log_softmax(
            tiny_hf_model("llama")(torch.tensor([tokens])).logits[0].double(), dim=-1
        )


def test_chat_logprobs_equal_transformers(client, tiny_checkpoint):
    got = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2
    )
    done, prompt = local(tiny_checkpoint, 8, messages=MESSAGES, temperature=0)
    content = got.choices[0].logprobs.content
    assert got.choices[0].message.content == done.text and len(content) == len(done.token_ids)
    lp = hf_logprobs(prompt + done.token_ids)
    for i, (entry, token) in enumerate(zip(content, done.token_ids, strict=True)):
        assert entry.logprob == pytest.approx(lp[len(prompt) - 1 + i, token].item(), abs=1e-4)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(
            lp[len(prompt) - 1 + i].topk(2).values.tolist(), abs=1e-4
        )
        # greedy: the top one
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-6)
    streamed = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        stream=True,
    )
    entries = [
        e
        for c in streamed
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert [e.logprob for e in entries] == pytest.approx([e.logprob for e in content], abs=1e-6)


def test_echo_scores_the_prompt_as_transformers_does(client, tiny_checkpoint):
    """What evaluation harnesses send: echo, logprobs, max_tokens 0 -> the prompt's own
    log-probs."""
    prompt = "the quick brown fox jumps over the lazy dog"
    got = client.completions.create(
        model="tiny", prompt=prompt, echo=True, logprobs=1, max_tokens=0
    )
    with open_engine(EngineConfig(model=tiny_checkpoint, max_model_len=256)) as engine:
        ids = encode_prompt(engine.tokenizer, prompt=prompt)
    choice, lp = got.choices[0], hf_logprobs(ids)
    assert choice.text == prompt and got.usage.completion_tokens == 0
    assert len(choice.logprobs.tokens) == len(ids) and choice.logprobs.token_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(
        [lp[i - 1, ids[i]].item() for i in range(1, len(ids))], abs=1e-4
    )
    with_output = client.completions.create(
        model="tiny", prompt=prompt, echo=True, logprobs=2, max_tokens=5, temperature=0
    )
    done, _ = local(tiny_checkpoint, 5, prompt=prompt, temperature=0)
    assert with_output.choices[0].text == prompt + done.text
    assert len(with_output.choices[0].logprobs.token_logprobs) == len(ids) + len(done.token_ids)
    # as lm-eval-harness batches them: several prompts in one request, each scored as it is alone
    batch = client.completions.create(
        model="tiny", prompt=["paris is in france", prompt], echo=True, logprobs=1, max_tokens=0
    )
    alone = client.completions.create(
        model="tiny", prompt="paris is in france", echo=True, logprobs=1, max_tokens=0
    )
    assert [c.text for c in batch.choices] == ["paris is in france", prompt]
    assert batch.choices[0].logprobs.token_logprobs == alone.choices[0].logprobs.token_logprobs
    assert batch.choices[1].logprobs.token_logprobs == choice.logprobs.token_logprobs
    assert batch.usage.prompt_tokens == alone.usage.prompt_tokens + got.usage.prompt_tokens


def test_n_seeded_choices_equal_separate_requests(client):
    got = client.completions.create(
        model="tiny", prompt="once upon a time", n=3, seed=5, temperature=0.9, max_tokens=10
    )
    assert [c.index for c in got.choices] == [0, 1, 2]
    alone = [
        client.completions.create(
            model="tiny", prompt="once upon a time", seed=5 + i, temperature=0.9, max_tokens=10
        ).choices[0]
        for i in range(3)
    ]
    assert [c.text for c in got.choices] == [c.text for c in alone]
    assert len({c.text for c in got.choices}) > 1
    assert got.usage.completion_tokens == sum(
        client.completions.create(
            model="tiny", prompt="once upon a time", seed=5 + i, temperature=0.9, max_tokens=10
        ).usage.completion_tokens
        for i in range(3)
    )
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            n=2,
            seed=9,
            temperature=0.9,
            max_tokens=10,
            stream=True,
        )
    )
    texts = {
        i: "".join(
            c.choices[0].delta.content or ""
            for c in chunks
            if c.choices and c.choices[0].index == i
        )
        for i in range(2)
    }
    whole = client.chat.completions.create(
        model="tiny", messages=MESSAGES, n=2, seed=9, temperature=0.9, max_tokens=10
    )
    assert texts == {c.index: c.message.content for c in whole.choices}


def test_a_list_of_prompts_equals_one_request_per_prompt(client):
    prompts = ["once upon a time", "paris is in", "the cat sat on the"]
    got = client.completions.create(
        model="tiny", prompt=prompts, n=2, seed=3, temperature=0.9, max_tokens=8
    )
    alone = [
        client.completions.create(
            model="tiny", prompt=p, n=2, seed=3, temperature=0.9, max_tokens=8
        )
        for p in prompts
    ]
    assert [c.index for c in got.choices] == list(range(6))
    assert [c.text for c in got.choices] == [c.text for a in alone for c in a.choices]
    assert got.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert got.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    root = str(client.base_url).removesuffix("/").removesuffix("/v1")
    ids = httpx.post(f"{root}/tokenize", json={"model": "tiny", "prompt": prompts[1]}).json()[
        "tokens"
    ]
    by_ids = client.completions.create(model="tiny", prompt=[ids, ids], temperature=0, max_tokens=6)
    greedy = (
        client.completions.create(model="tiny", prompt=prompts[1], temperature=0, max_tokens=6)
        .choices[0]
        .text
    )
    assert [c.text for c in by_ids.choices] == [greedy, greedy]


def test_penalties_bias_and_min_tokens_equal_the_local_engine(client, tiny_checkpoint):
    params = dict(presence_penalty=1.2, frequency_penalty=0.7, logit_bias={"42": 6.0, "7": -100.0})
    extra = dict(repetition_penalty=1.3, min_tokens=10, ignore_eos=False)
    got = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=16, temperature=0, extra_body=extra, **params
    )
    done, _ = local(
        tiny_checkpoint,
        16,
        messages=MESSAGES,
        temperature=0,
        presence_penalty=1.2,
        frequency_penalty=0.7,
        logit_bias={"42": 6.0, "7": -100.0},
        repetition_penalty=1.3,
        min_tokens=10,
    )
    plain, _ = local(tiny_checkpoint, 16, messages=MESSAGES, temperature=0)
    assert got.choices[0].message.content == done.text and done.token_ids != plain.token_ids
    assert got.usage.completion_tokens == len(done.token_ids) >= 10 and 7 not in done.token_ids


def test_min_p_and_stop_token_ids_equal_the_local_engine(client, tiny_checkpoint):
    got = client.completions.create(
        model="tiny",
        prompt="paris is in",
        max_tokens=12,
        temperature=1.2,
        seed=4,
        extra_body={"min_p": 0.2},
    )
    done, _ = local(tiny_checkpoint, 12, prompt="paris is in", temperature=1.2, seed=4, min_p=0.2)
    loose, _ = local(tiny_checkpoint, 12, prompt="paris is in", temperature=1.2, seed=4)
    assert got.choices[0].text == done.text and done.token_ids != loose.token_ids
    stop = done.token_ids[5]
    cut = client.completions.create(
        model="tiny",
        prompt="paris is in",
        max_tokens=12,
        temperature=1.2,
        seed=4,
        extra_body={"min_p": 0.2, "stop_token_ids": [stop]},
    )
    first = done.token_ids.index(stop)
    assert cut.choices[0].finish_reason == "stop" and cut.usage.completion_tokens == first + 1


def test_json_schema_replies_validate(client):
    schema = {
        "type": "object",
        "required": ["color", "size"],
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "size": {"type": "integer", "minimum": 0, "maximum": 99},
        },
    }
    for seed in range(3):
        got = client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            max_tokens=40,
            temperature=1.0,
            seed=seed,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "thing", "schema": schema},
            },
        )
        assert got.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(got.choices[0].message.content), schema)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="tiny", messages=MESSAGES, response_format={"type": "xml"}
        )
    assert err.value.body["param"] == "response_format"


CHOICES = ["north", "south", 'the "east"']


def test_structured_outputs_are_followed_whole_and_streamed(client):
    """vLLM's structured_outputs (and its older guided_* names) through the openai client's
    extra_body."""
    pattern = "[0-9]{2,4}-[a-z]{1,6}"
    for seed in range(2):
        args = dict(
            model="tiny",
            prompt="paris is in",
            max_tokens=24,
            temperature=1.0,
            seed=seed,
            extra_body={"structured_outputs": {"regex": pattern}},
        )
        whole = client.completions.create(**args).choices[0]
        assert re.fullmatch(pattern, whole.text) and whole.finish_reason == "stop", whole.text
        assert (
            "".join(c.choices[0].text for c in client.completions.create(**args, stream=True))
            == whole.text
        )
        chosen = client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            max_tokens=24,
            temperature=1.0,
            seed=seed,
            extra_body={"guided_choice": CHOICES},
        )
        assert (
            chosen.choices[0].message.content in CHOICES
            and chosen.choices[0].finish_reason == "stop"
        )
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(
            model="tiny", prompt="x", extra_body={"structured_outputs": {"regex": "("}}
        )
    assert err.value.body["param"] == "structured_outputs" and "regex" in err.value.body["message"]


WEATHER = {
    "type": "object",
    "required": ["city", "days"],
    "properties": {
        "city": {"enum": ["paris", "oslo", "lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "now"}},
]  # no parameters: its arguments are {}
SCHEMAS = {"get_weather": WEATHER, "now": {"type": "object", "additionalProperties": False}}


def streamed_calls(stream) -> tuple[list[tuple[str, str]], str | None]:
    """(name, arguments) of each call a stream sent, joined by index as the openai client does; its
    finish reason."""
    calls: dict[int, list[str]] = {}
    reason = None
    for chunk in stream:
        for piece in chunk.choices[0].delta.tool_calls or []:
            call = calls.setdefault(piece.index, ["", ""])
            call[0] += piece.function.name or ""
            call[1] += piece.function.arguments or ""
        reason = chunk.choices[0].finish_reason or reason
    return [tuple(calls[i]) for i in sorted(calls)], reason


def test_forced_tool_calls_follow_their_schemas_whole_and_streamed(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    for tool_choice, parallel in ((named, True), ("required", False), ("required", True)):
        for seed in range(2):
            ask = dict(
                model="tiny",
                messages=MESSAGES,
                tools=TOOLS,
                tool_choice=tool_choice,
                max_tokens=120,
                temperature=1.0,
                seed=seed,
                parallel_tool_calls=parallel,
            )
            choice = client.chat.completions.create(**ask).choices[0]
            calls = choice.message.tool_calls
            # calls without end
            if choice.finish_reason == "length" and tool_choice == "required" and parallel:
                rest = choice.message.content  # the call cut short, if the cut was inside one
                assert rest is None or rest.startswith('{"name": ')
            else:
                assert choice.finish_reason == ("stop" if tool_choice is named else "tool_calls"), (
                    choice
                )
                assert choice.message.content is None
            assert len({call.id for call in calls}) == len(calls)
            assert len(calls) == 1 or tool_choice == "required" and parallel
            for call in calls:
                assert call.function.name in (["get_weather"] if tool_choice is named else SCHEMAS)
                jsonschema.validate(
                    json.loads(call.function.arguments), SCHEMAS[call.function.name]
                )
            assert streamed_calls(client.chat.completions.create(**ask, stream=True)) == (
                [(call.function.name, call.function.arguments) for call in calls],
                choice.finish_reason,
            )


def test_a_legacy_function_call_is_the_named_tool_call(client):
    """The pre-tools API (`functions`, `function_call`), as old clients still send it: the same call
    as the named tool choice with the same seed, in the legacy shape."""
    ask = dict(model="tiny", messages=MESSAGES, max_tokens=120, temperature=1.0, seed=3)
    tool = client.chat.completions.create(
        **ask, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}
    )
    old = client.chat.completions.create(
        **ask, functions=[t["function"] for t in TOOLS], function_call={"name": "get_weather"}
    )
    message = old.choices[0].message
    assert message.tool_calls is None and message.function_call.name == "get_weather"
    assert (
        message.function_call.arguments == tool.choices[0].message.tool_calls[0].function.arguments
    )
    jsonschema.validate(json.loads(message.function_call.arguments), WEATHER)


def test_auto_with_a_parser_answers_in_text_when_the_model_calls_nothing(client, tiny_checkpoint):
    # the tiny template shows no tools
    done, _ = local(tiny_checkpoint, 12, messages=MESSAGES, temperature=0)
    got = client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=12, temperature=0
    )
    choice = got.choices[0]
    assert (choice.message.content, choice.message.tool_calls) == (done.text.strip(), None)
    assert choice.finish_reason == done.finish_reason


def test_the_responses_api_gives_the_chat_reply_as_output_items(client, tiny_checkpoint):
    """`client.responses` (whole, and the SDK's own stream accumulator) against the local engine's
    greedy reply to the same conversation; a forced function call through it follows its schema."""
    done, prompt = local(
        tiny_checkpoint,
        12,
        messages=[{"role": "system", "content": "be brief"}, *MESSAGES],
        temperature=0,
    )
    args = dict(
        model="tiny",
        instructions="be brief",
        input="paris is in",
        max_output_tokens=12,
        temperature=0,
    )
    whole = client.responses.create(**args)
    assert whole.output_text == done.text and whole.usage.input_tokens == len(prompt)
    assert whole.usage.output_tokens == len(done.token_ids)
    assert whole.status == ("incomplete" if done.finish_reason == "length" else "completed")
    # the SDK checks that the events build consistent items
    with client.responses.stream(**args) as stream:
        events = list(stream)
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    # response.completed, or response.incomplete when max_output_tokens cut it
    final = events[-1].response
    assert events[-1].type == f"response.{whole.status}" and final.status == whole.status
    assert deltas == final.output_text == done.text
    scored = client.responses.create(
        **args, include=["message.output_text.logprobs"], top_logprobs=2
    )
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "system", "content": "be brief"}, *MESSAGES],
        max_tokens=12,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    entries = scored.output[0].content[0].logprobs
    expected = [e.logprob for e in chat.choices[0].logprobs.content]
    assert [e.logprob for e in entries] == pytest.approx(expected, abs=1e-5)
    assert [len(e.top_logprobs) for e in entries] == [2] * len(done.token_ids)
    forced = client.responses.create(
        model="tiny",
        input="weather?",
        max_output_tokens=60,
        temperature=1.0,
        extra_body={"seed": 2},
        tools=[{"type": "function", "name": "get_weather", "parameters": WEATHER, "strict": True}],
        tool_choice={"type": "function", "name": "get_weather"},
    )
    (call,) = forced.output
    assert (
        call.type == "function_call"
        and call.name == "get_weather"
        and call.call_id.startswith("call_")
    )
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model="tiny", input="hi", previous_response_id="resp_1")
    assert err.value.body["param"] == "previous_response_id"


def test_usage_counts_the_prompt_tokens_found_in_the_prefix_cache(client):
    messages = [{"role": "user", "content": "zebra crossings at dawn, asked again and again " * 3}]
    first = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=2, temperature=0
    )
    again = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=2, temperature=0
    )
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # whole blocks of 16, all but the last token at most
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert again.usage.prompt_tokens - 16 <= cached < again.usage.prompt_tokens and cached >= 16
    response = client.responses.create(
        model="tiny", input=messages[0]["content"], max_output_tokens=2
    )
    assert response.usage.input_tokens_details.cached_tokens == cached
