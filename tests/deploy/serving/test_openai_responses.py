"""`POST /v1/responses` on a scripted engine: the input becomes the chat prompt it stands for, the
reply's text becomes output items (reasoning, message, function calls), whole and as events that
build the same items, and what is not implemented answers 400 naming the parameter.
tests/deploy/test_openai_params_e2e.py runs it through Serve with the `openai` client."""

import asyncio
import copy
import json

import pytest
from fastapi.responses import StreamingResponse
from pydantic import ValidationError

from deploy.serving.openai_api import OpenAIServer
from deploy.serving.responses.request import ResponsesBody
from deploy.serving.schemas import APIError, ChatBody, validation_error
from tests.deploy.serving.fake_engine import FakeEngine, Says, reply
from tests.deploy.serving.tool_scripts import HERMES, TOOL_TEMPLATE, server
from tests.factories import tiny_tokenizer

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [
    {"type": "function", "name": "get_weather", "description": "Forecast", "parameters": WEATHER},
    {"type": "function", "name": "now"},
]


def body(**fields) -> ResponsesBody:  # type: ignore[no-untyped-def]
    return ResponsesBody.model_validate_json(
        json.dumps({"model": "tiny", "input": "weather in paris?", **fields})
    )


def respond(srv: OpenAIServer, b: ResponsesBody) -> dict | list[dict]:
    """The Response object, or a stream's events (each `event:` line checked against its data's
    type)."""

    async def run() -> dict | list[dict]:
        response = await srv.respond(b)
        if not isinstance(response, StreamingResponse):
            return json.loads(response.body)
        events = []
        async for raw in response.body_iterator:
            head, data = raw.split("\n", 1)
            event = json.loads(data.removeprefix("data: "))
            assert head == f"event: {event['type']}" and raw.endswith("\n\n")
            events.append(event)
        return events

    return asyncio.run(run())


def built(events: list[dict]) -> dict:
    """The final Response of a stream, after checking that the events build its output: numbered in
    order, every delta on an item added before and not yet done, each done item equal to what its
    deltas built."""
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    items: dict[int, dict] = {}
    done: set[int] = set()
    for e in events[2:-1]:
        kind, index = e["type"], e.get("output_index")
        if kind == "response.output_item.added":
            assert index == len(items) and not (items.keys() - done), (
                "an item opens after the one before is done"
            )
            items[index] = copy.deepcopy(e["item"])
            continue
        assert index in items and index not in done, kind
        item = items[index]
        if kind in ("response.output_text.delta", "response.reasoning_text.delta"):
            item["content"][e["content_index"]]["text"] += e["delta"]
            if kind == "response.output_text.delta":
                item["content"][e["content_index"]]["logprobs"] += e["logprobs"]
        elif kind == "response.function_call_arguments.delta":
            item["arguments"] += e["delta"]
        elif kind == "response.function_call_arguments.done":
            assert e["arguments"] == item["arguments"]
        elif kind in ("response.output_text.done", "response.reasoning_text.done"):
            assert e["text"] == item["content"][e["content_index"]]["text"]
        elif kind == "response.output_item.done":
            assert e["item"] == item | {"status": e["item"]["status"]}
            items[index] = e["item"]
            done.add(index)
        else:
            assert kind in ("response.content_part.added", "response.content_part.done"), kind
    final = events[-1]["response"]
    assert done == set(items) and final["output"] == [items[i] for i in sorted(items)]
    return final


def texts(output: list[dict]) -> list[tuple]:
    """Each item's type and what it says, without ids."""
    said = []
    for item in output:
        if item["type"] == "function_call":
            assert item["call_id"].startswith("call_") and item["id"].startswith("fc_")
            said.append(("function_call", item["name"], json.loads(item["arguments"])))
        else:
            said.append((item["type"], item["content"][0]["text"]))
    return said


@pytest.mark.parametrize("step", [1, 4, 1000])
def test_text_comes_back_as_one_message_whole_and_streamed(step):
    engine = Says("Paris is sunny today.", step)
    whole = respond(
        server(engine),
        body(
            max_output_tokens=30,
            temperature=0.5,
            seed=3,
            store=True,
            reasoning={"effort": "low"},
            stream_options={"include_obfuscation": False},
        ),
    )
    assert (
        whole["id"].startswith("resp_")
        and whole["object"] == "response"
        and whole["status"] == "completed"
    )
    assert texts(whole["output"]) == [("message", "Paris is sunny today.")]
    message = whole["output"][0]
    assert (message["role"], message["status"], message["content"][0]["type"]) == (
        "assistant",
        "completed",
        "output_text",
    )
    request = engine.requests[0]
    assert (request.max_tokens, request.sampling.temperature, request.sampling.seed) == (30, 0.5, 3)
    usage = whole["usage"]
    assert usage["input_tokens"] == len(request.prompt_ids) and usage["output_tokens"] == -(
        -21 // step
    )
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    final = built(respond(server(Says("Paris is sunny today.", step)), body(stream=True)))
    assert final["status"] == "completed" and texts(final["output"]) == texts(whole["output"])


@pytest.mark.parametrize("step", [1, 5, 1000])
def test_reasoning_text_and_calls_become_items_in_their_order(step):
    text = "<think>a tool job</think>" + HERMES
    whole = respond(server(Says(text, step), reasoning="qwen3"), body(tools=TOOLS))
    expected = [
        ("reasoning", "a tool job"),
        ("message", "Let me check."),
        ("function_call", "get_weather", {"city": "Paris", "days": 2}),
        ("function_call", "now", {}),
    ]
    assert texts(whole["output"]) == expected and whole["status"] == "completed"
    assert whole["tools"] == TOOLS and whole["tool_choice"] == "auto"
    final = built(
        respond(server(Says(text, step), reasoning="qwen3"), body(tools=TOOLS, stream=True))
    )
    assert texts(final["output"]) == expected


def test_a_reply_cut_by_max_output_tokens_is_incomplete():
    whole = respond(server(Says("Paris is", 3, finish_reason="length")), body(max_output_tokens=3))
    assert whole["status"] == "incomplete" and whole["incomplete_details"] == {
        "reason": "max_output_tokens"
    }
    assert whole["output"][0]["status"] == "incomplete"
    events = respond(server(Says("Paris is", 3, finish_reason="length")), body(stream=True))
    assert events[-1]["type"] == "response.incomplete" and built(events)["status"] == "incomplete"


def test_the_input_is_the_conversation_chat_would_send():
    tokenizer = copy.deepcopy(tiny_tokenizer())
    tokenizer.chat_template = TOOL_TEMPLATE
    engine = Says("ok")
    items = [
        {
            "role": "user",
            "content": [
                {"type": "input_text", "text": "weather in "},
                {"type": "input_text", "text": "paris?"},
            ],
        },
        # earlier thinking: left out, as chat templates do
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city": "Paris"}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "It is sunny."}],
        },
        {"role": "user", "content": "and tomorrow?"},
    ]
    respond(
        server(engine, tokenizer=tokenizer),
        body(input=items, instructions="Be brief.", tools=TOOLS),
    )
    assert tokenizer.decode(engine.requests[0].prompt_ids) == (
        "<|tools|>get_weather,now\n<|system|>Be brief.\n<|user|>weather in paris?\n"
        '<|assistant|>[call get_weather {"city": "Paris"}]\n<|tool|>sunny[for call_1]\n'
        "<|assistant|>It is sunny.\n<|user|>and tomorrow?\n<|assistant|>"
    )


def test_text_format_and_tool_choice_reach_the_engine_as_chat_would_send_them():
    srv = server(FakeEngine())
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}}
    cases = [
        (
            body(
                text={
                    "format": {
                        "type": "json_schema",
                        "name": "thing",
                        "schema": schema,
                        "strict": True,
                    }
                }
            ),
            dict(
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "thing", "schema": schema, "strict": True},
                }
            ),
        ),
        (
            body(text={"format": {"type": "json_object"}}),
            dict(response_format={"type": "json_object"}),
        ),
        (
            body(tools=TOOLS, tool_choice={"type": "function", "name": "get_weather"}),
            dict(
                tools=[
                    {"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
                    for t in TOOLS
                ],
                tool_choice={"type": "function", "function": {"name": "get_weather"}},
            ),
        ),
        (
            body(tools=TOOLS, tool_choice="required", parallel_tool_calls=False, top_k=5),
            dict(
                tools=[
                    {"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
                    for t in TOOLS
                ],
                tool_choice="required",
                parallel_tool_calls=False,
                top_k=5,
            ),
        ),
    ]
    for responses_body, chat_fields in cases:
        responses_body.seed = 1  # type: ignore[attr-defined]  # an extra field, as chat's seed
        respond(srv, responses_body)
        got = list(srv.client.requests.values())[-1].sampling
        chat = ChatBody.model_validate(
            {
                "model": "tiny",
                "messages": [{"role": "user", "content": "weather in paris?"}],
                "seed": 1,
                **chat_fields,
            }
        )
        assert got == srv.chat_job(chat).requests[0].sampling


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"background": True}, "background"),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        (
            {
                "include": ["message.output_text.logprobs"],
                "tools": TOOLS,
                "tool_choice": "required",
            },
            "include",
        ),
        ({"top_logprobs": 21}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "messages"),
        ({"n": 2}, "n"),
        ({"frobnicate": 1}, "frobnicate"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"tool_choice": {"type": "web_search"}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),  # no tools to call
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input",
        ),
        ({"input": [{"role": "wizard", "content": "hi"}]}, "input"),
        ({"text": {"format": {"type": "xml"}}}, "text"),
        ({"max_output_tokens": 1000}, "max_output_tokens"),  # past the context
        ({"temperature": 3}, "temperature"),
    ],
)
def test_what_is_not_implemented_or_out_of_range_gets_400_naming_it(fields, param):
    engine = FakeEngine()
    with pytest.raises((APIError, ValidationError)) as info:
        respond(server(engine), body(**fields))
    # the ingress's
    error = (
        info.value if isinstance(info.value, APIError) else validation_error(info.value.errors())
    )
    assert (error.status, error.param) == (400, param), error.message
    assert not engine.requests
    with pytest.raises(ValidationError) as bad:
        body(max_output_tokens=0)
    assert validation_error(bad.value.errors()).param == "max_output_tokens"


def test_a_failed_generation_fails_the_reply_or_ends_the_stream_with_an_error_event():
    with pytest.raises(APIError) as info:
        respond(server(FakeEngine(fail={"0"})), body())
    assert info.value.status == 500
    events = respond(server(FakeEngine(fail={"0"})), body(stream=True))
    assert events[-1]["type"] == "error" and "worker lost" in events[-1]["message"]


def test_a_client_that_goes_away_mid_stream_aborts_its_request():
    engine = FakeEngine()

    async def run() -> None:
        response = await server(engine).respond(body(stream=True, max_output_tokens=40))
        iterator = response.body_iterator
        for _ in range(5):  # created, in_progress and the first item's opening events
            await anext(iterator)
        await iterator.aclose()

    asyncio.run(run())
    assert list(engine.aborted) == list(engine.requests)


def test_log_probs_come_with_the_message_text_as_chat_gives_them():
    asked = dict(
        include=["message.output_text.logprobs"], top_logprobs=2, max_output_tokens=6, seed=1
    )
    whole = respond(server(FakeEngine()), body(**asked))
    (part,) = whole["output"][0]["content"]
    chat = ChatBody.model_validate(
        {
            "messages": [{"role": "user", "content": "weather in paris?"}],
            "seed": 1,
            "max_tokens": 6,
            "logprobs": True,
            "top_logprobs": 2,
        }
    )
    expected = reply(server(FakeEngine()), chat)["choices"][0]
    assert part["text"] == expected["message"]["content"] and len(part["logprobs"]) == 6
    assert part["logprobs"] == expected["logprobs"]["content"]
    assert all(len(entry["top_logprobs"]) == 2 for entry in part["logprobs"])
    final = built(respond(server(FakeEngine()), body(**asked, stream=True)))
    assert final["output"][0]["content"][0]["logprobs"] == part["logprobs"]
    plain = respond(server(FakeEngine()), body(seed=1, max_output_tokens=6))
    assert plain["output"][0]["content"][0]["logprobs"] == []


class EndsWithEos:
    """Two tokens of text, then EOS (a token without text), each with its log-prob."""

    def __init__(self) -> None:
        self.requests: list = []

    async def generate(self, request):  # type: ignore[no-untyped-def]
        from scheduler.outputs import RequestOutput
        from scheduler.request import TokenLogprob

        self.requests.append(request)
        for j, (token, text) in enumerate([(40, "Hi"), (41, " there"), (383, "")]):
            await asyncio.sleep(0)
            yield RequestOutput(
                request.req_id,
                [token],
                text,
                finish_reason="stop" if j == 2 else None,
                logprobs=[TokenLogprob(token, -0.5 * (j + 1))],
            )


def test_the_last_tokens_log_probs_come_even_when_they_bring_no_text():
    asked = dict(include=["message.output_text.logprobs"])
    whole = respond(server(EndsWithEos()), body(**asked))
    # one message, not a second empty one
    assert texts(whole["output"]) == [("message", "Hi there")]
    assert [e["logprob"] for e in whole["output"][0]["content"][0]["logprobs"]] == [
        -0.5,
        -1.0,
        -1.5,
    ]
    final = built(respond(server(EndsWithEos()), body(**asked, stream=True)))
    assert final["output"] == [whole["output"][0] | {"id": final["output"][0]["id"]}]
