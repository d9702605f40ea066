"""Tool calling and reasoning at the HTTP edge: what each tool_choice asks of the engine, how
generated text becomes content, reasoning and tool calls (whole and streamed, which must say the
same), the refusals, and what the chat template is given. A scripted engine stands in for the model;
tests/deploy/test_openai_params_e2e.py runs the grammar for real."""

import copy
import json

import pytest
from pydantic import ValidationError

from deploy.serving.schemas import (
    APIError,
    ChatBody,
    CompletionBody,
    TokenizeBody,
    validation_error,
)
from tests.deploy.serving.fake_engine import FakeEngine, Says, reply
from tests.deploy.serving.tool_scripts import HERMES, TOOL_TEMPLATE, server
from tests.factories import tiny_tokenizer

MESSAGES = [{"role": "user", "content": "weather in paris?"}]
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"],
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Forecast", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "now"}},
]


def chat(**fields) -> ChatBody:  # type: ignore[no-untyped-def]
    return ChatBody.model_validate_json(
        json.dumps({"messages": MESSAGES, "tools": TOOLS, **fields})
    )


def streamed(
    chunks: list[dict], reasoning: list[str] | None = None
) -> tuple[str, list[dict], str | None]:
    """A stream's content, its tool calls joined by index (as the openai client joins them), its
    finish reason; its reasoning, if asked, appended to `reasoning`."""
    content, calls, reason = "", {}, None
    for chunk in chunks:
        for choice in chunk["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            if reasoning is not None:
                reasoning.append(delta.get("reasoning_content") or "")
            for piece in delta.get("tool_calls", []):
                call = calls.setdefault(
                    piece["index"],
                    {"id": None, "type": None, "function": {"name": None, "arguments": ""}},
                )
                if "id" in piece:
                    assert call["id"] is None, (
                        "a call's id and name come once, with its first piece"
                    )
                    call["id"], call["type"], call["function"]["name"] = (
                        piece["id"],
                        piece["type"],
                        piece["function"]["name"],
                    )
                call["function"]["arguments"] += piece["function"]["arguments"]
            reason = choice["finish_reason"] or reason
    return content, [calls[i] for i in sorted(calls)], reason


def without_ids(calls: list[dict]) -> list[tuple[str, dict]]:
    assert all(call["id"].startswith("call_") and call["type"] == "function" for call in calls)
    return [(call["function"]["name"], json.loads(call["function"]["arguments"])) for call in calls]


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_auto_reads_hermes_calls_whole_and_streamed_alike(step):
    whole = reply(server(Says(HERMES, step)), chat(tool_choice="auto"))
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me check."
    expected = [("get_weather", {"city": "Paris", "days": 2}), ("now", {})]
    assert without_ids(choice["message"]["tool_calls"]) == expected
    # auto: the default
    content, calls, reason = streamed(reply(server(Says(HERMES, step)), chat(stream=True)))
    assert (content, without_ids(calls), reason) == ("Let me check.", expected, "tool_calls")


@pytest.mark.parametrize(
    "parser, text",
    [
        (
            "llama3_json",
            '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}; {"name": "now", '
            '"parameters": {}}',
        ),
        (
            "mistral",
            ' [{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}, {"name": "now", '
            # the [TOOL_CALLS] before it is a special token: not in the text
            '"arguments": {}}]',
        ),
        ("pythonic", '[get_weather(city="Paris", days=2),\n now()]'),  # Llama 3.2 and 4
    ],
)
def test_llama3_json_mistral_and_pythonic_read_a_reply_that_opens_with_calls(parser, text):
    expected = [("get_weather", {"city": "Paris", "days": 2}), ("now", {})]
    for step in (1, 6, 1000):
        choice = reply(server(Says(text, step), parser=parser), chat())["choices"][0]
        assert (choice["finish_reason"], choice["message"]["content"]) == ("tool_calls", None)
        assert without_ids(choice["message"]["tool_calls"]) == expected
        content, calls, reason = streamed(
            reply(server(Says(text, step), parser=parser), chat(stream=True))
        )
        assert (content, without_ids(calls), reason) == ("", expected, "tool_calls")
    prose = "  It is sunny in Paris {so no call}."  # not opening with a call: the content, as it is
    for step in (1, 1000):
        choice = reply(server(Says(prose, step), parser=parser), chat())["choices"][0]
        assert (
            choice["message"] == {"role": "assistant", "content": prose}
            and choice["finish_reason"] == "stop"
        )
        assert streamed(reply(server(Says(prose, step), parser=parser), chat(stream=True))) == (
            prose,
            [],
            "stop",
        )


@pytest.mark.parametrize(
    "text, calls, content",
    [
        (
            '[f(a=[1, 2], b={"k": None, "é": True})]\nDone.',
            [("f", {"a": [1, 2], "b": {"k": None, "é": True}})],
            "Done.",
        ),  # Python literals as JSON; the text after the list is content
        # cut by max_tokens: the call not finished is content
        ('[f(a=1), g(b="x', [("f", {"a": 1})], 'g(b="x'),
        ("[1] Introduction", [], "[1] Introduction"),  # a list, but not of calls
        ("[f(x)]", [], "[f(x)]"),  # a positional argument: not a call pythonic tools make
    ],
)
def test_pythonic_reads_the_calls_of_a_list_and_keeps_the_rest_as_content(text, calls, content):
    for step in (1, 4, 1000):
        message = reply(server(Says(text, step), parser="pythonic"), chat())["choices"][0][
            "message"
        ]
        assert (
            without_ids(message.get("tool_calls") or []) == calls
            and (message["content"] or "") == content
        )
        got = streamed(reply(server(Says(text, step), parser="pythonic"), chat(stream=True)))
        assert (got[0], without_ids(got[1])) == (content, calls)


@pytest.mark.parametrize(
    "text, content",
    [
        ("Paris is sunny. <tool_ca", "Paris is sunny. <tool_ca"),  # a tag never finished is text
        (
            '<tool_call>{"name": oops}</tool_call> done',
            '<tool_call>{"name": oops}</tool_call> done',
        ),
        ("  just text, no call \n", "just text, no call"),
    ],
)
def test_auto_keeps_what_is_not_a_call_as_content(text, content):
    for step in (1, 4):
        choice = reply(server(Says(text, step)), chat())["choices"][0]
        assert (choice["message"]["content"], choice["finish_reason"]) == (content, "stop")
        assert "tool_calls" not in choice["message"]
        assert streamed(reply(server(Says(text, step)), chat(stream=True))) == (content, [], "stop")


def test_an_unclosed_call_at_the_end_is_still_a_call():
    text = '<tool_call>\n{"name": "now", "arguments": {}}'
    choice = reply(server(Says(text)), chat())["choices"][0]
    assert without_ids(choice["message"]["tool_calls"]) == [("now", {})]
    assert choice["message"]["content"] is None


def test_a_named_function_forces_its_schema_and_streams_its_arguments():
    args = '{"city": "Paris", "days": 3}'
    engine = Says(args, step=4)
    named = {"type": "function", "function": {"name": "get_weather"}}
    whole = reply(server(engine, parser=None), chat(tool_choice=named))
    (request,) = engine.requests
    assert json.loads(request.sampling.structured)["json_schema"] == {
        "name": "get_weather",
        "schema": WEATHER,
        "strict": False,
    }
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "stop"  # forced, not chosen: OpenAI's reason for a named call
    assert choice["message"]["content"] is None
    assert without_ids(choice["message"]["tool_calls"]) == [("get_weather", json.loads(args))]
    chunks = reply(server(Says(args, step=4), parser=None), chat(stream=True, tool_choice=named))
    pieces = [
        c["choices"][0]["delta"]["tool_calls"][0]
        for c in chunks
        if c["choices"][0]["delta"].get("tool_calls")
    ]
    assert (
        len(pieces) == -(-len(args) // 4)
        and "id" in pieces[0]
        and all("id" not in p for p in pieces[1:])
    )
    assert streamed(chunks)[1:] == (
        [
            {
                "id": pieces[0]["id"],
                "type": "function",
                "function": {"name": "get_weather", "arguments": args},
            }
        ],
        "stop",
    )


def test_required_forces_an_array_of_calls_one_when_not_parallel():
    text = (
        '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, '
        '{"name": "now", "parameters": {}}]'
    )
    engine = Says(text, step=5)
    choice = reply(server(engine, parser=None), chat(tool_choice="required"))["choices"][0]
    assert (choice["finish_reason"], choice["message"]["content"]) == ("tool_calls", None)
    assert without_ids(choice["message"]["tool_calls"]) == [
        ("get_weather", {"city": "Oslo"}),
        ("now", {}),
    ]
    schema = json.loads(engine.requests[0].sampling.structured)["json_schema"]["schema"]
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    assert [item["properties"]["name"]["enum"] for item in schema["items"]["anyOf"]] == [
        ["get_weather"],
        ["now"],
    ]
    assert schema["items"]["anyOf"][0]["properties"]["parameters"] == WEATHER
    # no arguments: {}
    assert schema["items"]["anyOf"][1]["properties"]["parameters"] == {"type": "object"}
    content, calls, reason = streamed(
        reply(server(Says(text, step=5), parser=None), chat(tool_choice="required", stream=True))
    )
    assert (content, without_ids(calls), reason) == (
        "",
        [("get_weather", {"city": "Oslo"}), ("now", {})],
        "tool_calls",
    )
    engine = Says(text)
    reply(server(engine, parser=None), chat(tool_choice="required", parallel_tool_calls=False))
    assert (
        json.loads(engine.requests[0].sampling.structured)["json_schema"]["schema"]["maxItems"] == 1
    )


def test_a_required_reply_cut_by_max_tokens_keeps_its_finished_calls_and_the_rest_as_content():
    text = '[{"name": "now", "parameters": {}}, {"name": "get_weather", "parameters": {"ci'
    for body in (chat(tool_choice="required"), chat(tool_choice="required", stream=True)):
        got = reply(server(Says(text, finish_reason="length"), parser=None), body)
        if isinstance(got, dict):
            message = got["choices"][0]["message"]
            content, calls, reason = (
                message["content"],
                message["tool_calls"],
                got["choices"][0]["finish_reason"],
            )
        else:
            content, calls, reason = streamed(got)
        assert (without_ids(calls), reason) == ([("now", {})], "length")
        assert content == '{"name": "get_weather", "parameters": {"ci'


def test_none_and_no_tools_reply_with_text():
    for body in (chat(tool_choice="none"), ChatBody(messages=MESSAGES)):
        choice = reply(server(Says(HERMES)), body)["choices"][0]
        assert (
            choice["message"] == {"role": "assistant", "content": HERMES}
            and choice["finish_reason"] == "stop"
        )


def refusal(schema, **fields) -> APIError:  # type: ignore[no-untyped-def]
    needed = {"messages": MESSAGES} if schema is ChatBody else {"prompt": "hi"}
    with pytest.raises(ValidationError) as info:
        schema.model_validate_json(json.dumps({**needed, **fields}))
    return validation_error(info.value.errors())


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"tool_choice": "required"}, "tool_choice"),  # nothing to call
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "fly"}}},
            "tool_choice",
        ),
        ({"tools": TOOLS + TOOLS[:1]}, "tools"),  # a name twice
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools"),
        ({"tools": [{"type": "retrieval"}]}, "tools"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
        ),
        (
            {"tools": TOOLS, "tool_choice": "required", "guided_regex": "[0-9]+"},
            "structured_outputs",
        ),
    ],
)
def test_bad_tool_requests_get_400_naming_the_parameter(fields, param):
    error = refusal(ChatBody, **fields)
    assert (error.status, error.param) == (400, param), error.message


def test_what_the_server_cannot_do_is_refused_with_nothing_run():
    engine = FakeEngine()
    with pytest.raises(APIError) as info:  # auto without a parser: the calls could not be read
        server(engine, parser=None).chat_job(chat())
    assert (info.value.status, info.value.param) == (
        400,
        "tool_choice",
    ) and "--tool-call-parser" in info.value.message
    bad = [
        {
            "type": "function",
            "function": {
                "name": "f",
                "parameters": {
                    "type": "object",
                    "properties": {"x": {"type": "string", "pattern": "(?<=a)b"}},
                },
            },
        }
    ]  # a look-behind: no grammar can force it
    with pytest.raises(APIError) as info:
        server(engine).chat_job(chat(tools=bad, tool_choice="required"))
    assert (info.value.status, info.value.param) == (400, "tools") and "'f'" in info.value.message
    assert not engine.requests
    error = refusal(CompletionBody, tools=TOOLS)  # completions have no tools
    assert (error.status, error.param, error.code) == (400, "tools", "unsupported_parameter")


def test_the_template_sees_the_tools_earlier_calls_and_tool_results():
    tokenizer = copy.deepcopy(tiny_tokenizer())
    tokenizer.chat_template = TOOL_TEMPLATE
    messages = MESSAGES + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    ids = server(FakeEngine(), tokenizer=tokenizer).tokenize(
        TokenizeBody(messages=messages, tools=TOOLS)
    )["tokens"]
    assert tokenizer.decode(ids) == (
        "<|tools|>get_weather,now\n<|user|>weather in paris?\n"
        # arguments as an object
        '<|assistant|>[call get_weather {"city": "Paris"}]\n'
        "<|tool|>sunny[for call_1]\n<|assistant|>"
    )


@pytest.mark.parametrize(
    "parser, text, reasoning, content",
    [
        (
            "qwen3",
            "<think>\nweather is a tool job</think>\n\nIt is sunny.",
            "\nweather is a tool job",
            "\n\nIt is sunny.",
        ),
        # enable_thinking false: no <think>, all content
        ("qwen3", "It is sunny.", None, "It is sunny."),
        ("qwen3", "<think>still thinking when cut", "still thinking when cut", ""),
        # <think> was in the prompt
        ("deepseek_r1", "weather...</think>It is sunny.", "weather...", "It is sunny."),
        ("deepseek_r1", "<think>weather...</think>It is sunny.", "weather...", "It is sunny."),
    ],
)
def test_a_reasoning_parser_splits_the_thinking_off_whole_and_streamed(
    parser, text, reasoning, content
):
    for step in (1, 4, 1000):
        whole = reply(server(Says(text, step), reasoning=parser), ChatBody(messages=MESSAGES))
        message = whole["choices"][0]["message"]
        assert (message["reasoning_content"], message["content"]) == (reasoning, content)
        pieces: list[str] = []
        got = streamed(
            reply(
                server(Says(text, step), reasoning=parser), ChatBody(messages=MESSAGES, stream=True)
            ),
            pieces,
        )
        assert ("".join(pieces) or None, got[0]) == (reasoning, content)
    # no parser: all text
    plain = reply(server(Says(text)), ChatBody(messages=MESSAGES))["choices"][0]["message"]
    assert plain == {"role": "assistant", "content": text}


def test_tool_calls_are_read_after_the_reasoning():
    text = "<think>call it</think>" + HERMES
    for body in (chat(), chat(stream=True)):
        got = reply(server(Says(text, 5), reasoning="qwen3"), body)
        if isinstance(got, dict):
            message = got["choices"][0]["message"]
            found = (message["reasoning_content"], message["content"], message["tool_calls"])
        else:
            pieces: list[str] = []
            content, calls, _ = streamed(got, pieces)
            found = ("".join(pieces), content, calls)
        assert found[:2] == ("call it", "Let me check.")
        assert without_ids(found[2]) == [("get_weather", {"city": "Paris", "days": 2}), ("now", {})]


FUNCTIONS = [tool["function"] for tool in TOOLS]  # the legacy form: the functions themselves


def legacy(**fields) -> ChatBody:  # type: ignore[no-untyped-def]
    return ChatBody.model_validate_json(
        json.dumps({"messages": MESSAGES, "functions": FUNCTIONS, **fields})
    )


def streamed_function_call(chunks: list[dict]) -> tuple[dict, str | None]:
    """A legacy stream's `function_call`, its pieces joined as the openai client joins them; its
    finish reason."""
    call, reason = {"name": None, "arguments": ""}, None
    for chunk in chunks:
        for choice in chunk["choices"]:
            assert "tool_calls" not in choice["delta"]
            piece = choice["delta"].get("function_call") or {}
            if "name" in piece:
                assert call["name"] is None, "the name comes once, with the first piece"
                call["name"] = piece["name"]
            call["arguments"] += piece.get("arguments", "")
            reason = choice["finish_reason"] or reason
    return call, reason


def test_the_legacy_functions_are_tools_whose_reply_is_one_function_call():
    args = '{"city": "Paris", "days": 3}'
    engine = Says(args, step=4)
    whole = reply(server(engine, parser=None), legacy(function_call={"name": "get_weather"}))
    assert (
        engine.requests[0].sampling.structured
        == server(Says(""), parser=None)
        .chat_job(chat(tool_choice={"type": "function", "function": {"name": "get_weather"}}))
        .requests[0]
        .sampling.structured
    )
    choice = whole["choices"][0]
    assert choice["message"] == {
        "role": "assistant",
        "content": None,
        "function_call": {"name": "get_weather", "arguments": args},
    }
    assert choice["finish_reason"] == "stop"  # forced: the engine's reason, as for a named tool
    call, reason = streamed_function_call(
        reply(
            server(Says(args, step=4), parser=None),
            legacy(function_call={"name": "get_weather"}, stream=True),
        )
    )
    assert (call, reason) == ({"name": "get_weather", "arguments": args}, "stop")
    # auto (the default) with a parser: the first call, which the model chose
    for step in (1, 1000):
        choice = reply(server(Says(HERMES, step)), legacy())["choices"][0]
        assert (
            choice["finish_reason"] == "function_call"
            and choice["message"]["content"] == "Let me check."
        )
        assert (
            choice["message"]["function_call"]["name"] == "get_weather"
            and "tool_calls" not in choice["message"]
        )
        assert json.loads(choice["message"]["function_call"]["arguments"]) == {
            "city": "Paris",
            "days": 2,
        }
        call, reason = streamed_function_call(
            reply(server(Says(HERMES, step)), legacy(stream=True))
        )
        assert (call["name"], json.loads(call["arguments"]), reason) == (
            "get_weather",
            {"city": "Paris", "days": 2},
            "function_call",
        )
    plain = reply(server(Says("It is sunny.")), legacy(function_call="none"))["choices"][0]
    assert plain["message"] == {"role": "assistant", "content": "It is sunny."}


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"tools": TOOLS}, "functions"),  # both forms at once
        ({"function_call": "auto", "functions": None}, "function_call"),
        ({"function_call": {"name": "nowhere"}}, "function_call"),
    ],
)
def test_the_legacy_functions_are_refused_where_tools_would_be(fields, param):
    error = refusal(ChatBody, **{"messages": MESSAGES, "functions": FUNCTIONS, **fields})
    assert (error.status, error.param) == (400, param), error.message


def test_a_legacy_call_and_its_result_reach_the_template_as_a_tool_call_and_a_tool_message():
    tokenizer = copy.deepcopy(tiny_tokenizer())
    tokenizer.chat_template = TOOL_TEMPLATE
    messages = MESSAGES + [
        {
            "role": "assistant",
            "content": None,
            "function_call": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        },
        {"role": "function", "name": "get_weather", "content": "sunny"},
    ]
    body = ChatBody.model_validate(
        {"messages": messages, "functions": FUNCTIONS, "function_call": "none"}
    )
    ids = server(FakeEngine(), tokenizer=tokenizer).chat_job(body).requests[0].prompt_ids
    assert tokenizer.decode(ids) == (
        "<|tools|>get_weather,now\n<|user|>weather in paris?\n"
        '<|assistant|>[call get_weather {"city": "Paris"}]\n'
        "<|tool|>sunny\n<|assistant|>"
    )
