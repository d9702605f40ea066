"""OpenAI parameters at the HTTP edge: a value out of range answers 400 naming it, what is refused
stays refused, and what is accepted reaches the engine requests (n of them, with their seeds)."""

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
from tests.deploy.serving.fake_engine import make_server

MESSAGES = [{"role": "user", "content": "paris is in"}]


def parse(schema, **fields):  # type: ignore[no-untyped-def]
    """A body as the ingress parses it (from JSON), with the fields a request of that kind needs."""
    needed = {"messages": MESSAGES} if schema is ChatBody else {"prompt": "hello world"}
    return schema.model_validate_json(json.dumps({"model": "tiny", **needed, **fields}))


def refusal(schema, **fields) -> APIError:  # type: ignore[no-untyped-def]
    """The 400 the ingress answers for a body that does not validate."""
    with pytest.raises(ValidationError) as info:
        parse(schema, **fields)
    return validation_error(info.value.errors())


@pytest.mark.parametrize(
    "schema, fields, param",
    [
        (CompletionBody, {"n": 0}, "n"),
        (ChatBody, {"n": 17}, "n"),
        (CompletionBody, {"presence_penalty": 2.5}, "presence_penalty"),
        (ChatBody, {"frequency_penalty": -2.1}, "frequency_penalty"),
        (CompletionBody, {"repetition_penalty": 0}, "repetition_penalty"),
        (ChatBody, {"repetition_penalty": 2.5}, "repetition_penalty"),
        (CompletionBody, {"min_tokens": -1}, "min_tokens"),
        (ChatBody, {"logit_bias": {"abc": 1}}, "logit_bias"),
        (CompletionBody, {"logit_bias": {"5": 101}}, "logit_bias"),
        (CompletionBody, {"logit_bias": {"-1": 1}}, "logit_bias"),
        (CompletionBody, {"logprobs": 6}, "logprobs"),
        (CompletionBody, {"logprobs": -1}, "logprobs"),
        (ChatBody, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        (ChatBody, {"top_logprobs": 2}, "top_logprobs"),
        (CompletionBody, {"best_of": 2}, "best_of"),
        (CompletionBody, {"n": 2, "best_of": 3}, "best_of"),
        (CompletionBody, {"max_tokens": 0}, "max_tokens"),
        (ChatBody, {"response_format": "json"}, "response_format"),
        # with the generation prompt
        (ChatBody, {"continue_final_message": True}, "continue_final_message"),
        # user last
        (
            ChatBody,
            {"continue_final_message": True, "add_generation_prompt": False},
            "continue_final_message",
        ),
        (ChatBody, {"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
        (ChatBody, {"min_p": 1.5}, "min_p"),
        (ChatBody, {"guided_regex": "a", "structured_outputs": {"regex": "b"}}, "guided_regex"),
        (CompletionBody, {"structured_outputs": ["json"]}, "structured_outputs"),
        (CompletionBody, {"min_p": -0.1}, "min_p"),
    ],
)
def test_out_of_range_values_get_400_naming_the_parameter(schema, fields, param):
    error = refusal(schema, **fields)
    assert (error.status, error.param) == (400, param), error.message


@pytest.mark.parametrize(
    "schema, name, value",
    [
        # chat has them (tools.py)
        (CompletionBody, "tools", [{"type": "function", "function": {"name": "f"}}]),
        (CompletionBody, "tool_choice", "auto"),
        (CompletionBody, "functions", [{"name": "f"}]),  # chat has them (the legacy form of tools)
        (CompletionBody, "suffix", "the end"),
        (CompletionBody, "guided_whitespace_pattern", " "),
        (ChatBody, "guided_decoding_backend", "outlines"),
        (ChatBody, "structural_tag", "{}"),
        (ChatBody, "echo", True),  # echo, best_of and top_logprobs exist on the other endpoint only
        (ChatBody, "best_of", 2),
        (CompletionBody, "top_logprobs", 2),
    ],
)
def test_unimplemented_parameters_are_still_refused(schema, name, value):
    error = refusal(schema, **{name: value})
    assert (error.status, error.param, error.code) == (400, name, "unsupported_parameter")
    assert "not supported" in error.message
    assert "Unrecognized" in refusal(schema, frobnicate=1).message


@pytest.mark.parametrize(
    "schema, fields",
    [
        (
            ChatBody,
            {
                "user": "u-1",
                "metadata": {"k": "v"},
                "store": False,
                "stream_options": {"include_usage": True},
            },
        ),
        (
            CompletionBody,
            {"user": "u-1", "stream": True, "stream_options": {"include_usage": True}},
        ),
        (
            ChatBody,
            {
                "n": 1,
                "presence_penalty": 0,
                "logprobs": False,
                "top_logprobs": 0,
                "tool_choice": "none",
                "response_format": {"type": "text"},
                "best_of": 1,
                "echo": False,
            },
        ),
        (
            CompletionBody,
            {
                "n": 3,
                "best_of": 3,
                "echo": True,
                "max_tokens": 0,
                "logprobs": 5,
                "logit_bias": {"7": -100},
            },
        ),
        (ChatBody, {"n": None, "presence_penalty": None, "min_tokens": None, "logit_bias": None}),
    ],
)
def test_descriptive_fields_and_no_op_values_are_accepted(schema, fields):
    parse(schema, **fields)


@pytest.mark.parametrize("schema", [ChatBody, CompletionBody])
def test_a_body_without_model_is_for_the_served_model_and_another_name_gets_404(schema):
    server = make_server()
    job = server.chat_job if schema is ChatBody else server.completion_job
    assert job(parse(schema, model=None)).requests
    with pytest.raises(APIError) as info:
        job(parse(schema, model="gpt-4"))
    assert info.value.status == 404 and info.value.code == "model_not_found"


def test_values_checked_against_the_tokenizer_and_grammar_get_400_when_the_request_is_built():
    server = make_server()
    cases = [
        (parse(CompletionBody, logit_bias={"384": 1}), "logit_bias", "vocabulary"),
        (
            parse(ChatBody, structured_outputs={"regex": "("}),
            "structured_outputs",
            "structured_outputs.regex",
        ),
        (
            parse(CompletionBody, guided_choice=[]),
            "structured_outputs",
            "structured_outputs.choice",
        ),
        (
            parse(
                CompletionBody,
                structured_outputs={"choice": ["a"]},
                response_format={"type": "json_object"},
            ),
            "structured_outputs",
            "not both",
        ),
        (parse(ChatBody, response_format={"type": "xml"}), "response_format", "response_format"),
        (parse(ChatBody, min_tokens=5, max_completion_tokens=4), "min_tokens", "max_tokens (4)"),
        (parse(CompletionBody, min_tokens=5, max_tokens=4), "min_tokens", "max_tokens (4)"),
        (parse(ChatBody, stop_token_ids=[3, 384]), "stop_token_ids", "vocabulary"),
    ]
    for body, param, contains in cases:
        with pytest.raises(APIError) as info:
            server.chat_job(body) if isinstance(body, ChatBody) else server.completion_job(body)
        assert (info.value.status, info.value.param) == (400, param)
        assert contains in info.value.message


def test_n_choices_are_n_requests_with_consecutive_seeds_forking_the_first():
    server = make_server()
    body = parse(
        CompletionBody,
        n=3,
        seed=5,
        max_tokens=7,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.2,
        min_tokens=2,
        logit_bias={"5": 10, "9": -100},
        response_format={"type": "json_object"},
        stop=["\n"],
    )
    job = server.completion_job(body)
    requests = job.requests
    assert job.resp_id.startswith("cmpl-") and [r.req_id for r in requests] == [
        f"{job.resp_id}-{i}" for i in range(3)
    ]
    assert [r.sampling.seed for r in requests] == [5, 6, 7]
    assert [r.fork_of for r in requests] == [None, requests[0].req_id, requests[0].req_id]
    for r in requests:
        assert (
            r.prompt_ids == requests[0].prompt_ids
            and r.max_tokens == 7
            and r.stop_strings == ("\n",)
        )
        s = r.sampling
        assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty, s.min_tokens) == (
            0.5,
            -0.5,
            1.2,
            2,
        )
        assert s.logit_bias == ((5, 10.0), (9, -100.0)) and s.structured is not None
        assert s.logprobs is None and s.prompt_logprobs is None
    unseeded = server.completion_job(parse(CompletionBody, n=2)).requests
    assert unseeded[1].sampling.seed == unseeded[0].sampling.seed + 1
    single = server.chat_job(parse(ChatBody)).requests
    assert len(single) == 1 and single[0].fork_of is None and single[0].sampling.structured is None
    assert single[0].sampling.repetition_penalty == 1.0 and single[0].sampling.logit_bias == ()


@pytest.mark.parametrize("schema", [ChatBody, CompletionBody])
def test_null_sampling_fields_and_vllms_top_k_of_minus_one_are_the_defaults(schema):
    """OpenAI's API takes null for temperature, top_p and stream, vLLM null for top_k and min_p
    and -1 for top_k off; clients send them so, and what reaches the engine is the default."""
    server = make_server()
    job = server.chat_job if schema is ChatBody else server.completion_job
    nulls = dict(temperature=None, top_p=None, top_k=-1, min_p=None, stream=None, seed=3)
    body, default = parse(schema, **nulls), parse(schema, seed=3)
    assert (
        body.stream is False and job(body).requests[0].sampling == job(default).requests[0].sampling
    )
    assert parse(schema, top_k=None).top_k == 0 and parse(schema, top_k=5).top_k == 5
    assert refusal(schema, top_k=-2).param == "top_k"
    if schema is ChatBody:
        assert parse(schema, parallel_tool_calls=None).parallel_tool_calls is True


@pytest.mark.parametrize(
    "fields",
    [
        {"skip_special_tokens": True},
        {"spaces_between_special_tokens": True},
        {"include_stop_str_in_output": False},
    ],
)
def test_vllms_detokenizing_options_are_accepted_at_what_pdserve_does(fields):
    """pdserve's text leaves special tokens out and ends before a stop string: those values are
    no-ops, the others are refused by name rather than ignored."""
    parse(ChatBody, **fields)
    ((name, value),) = fields.items()
    error = refusal(CompletionBody, **{name: not value})
    assert (error.status, error.param, error.code) == (400, name, "unsupported_parameter")


@pytest.mark.parametrize(
    "schema, fields, logprobs, prompt_logprobs",
    [
        (ChatBody, {"logprobs": True, "top_logprobs": 3}, 3, None),
        (ChatBody, {"logprobs": True}, 0, None),
        (ChatBody, {"logprobs": False}, None, None),
        (CompletionBody, {"logprobs": 2}, 2, None),
        (CompletionBody, {"logprobs": 2, "echo": True}, 2, 2),
        (CompletionBody, {"echo": True}, None, None),
    ],
)
def test_logprobs_asked_of_the_engine(schema, fields, logprobs, prompt_logprobs):
    server, body = make_server(), parse(schema, **fields)
    job = server.chat_job(body) if schema is ChatBody else server.completion_job(body)
    sampling = job.requests[0].sampling
    assert (sampling.logprobs, sampling.prompt_logprobs) == (logprobs, prompt_logprobs)
    assert job.logprobs == (logprobs is not None)


def test_echo_with_max_tokens_0_runs_one_token_and_drops_it():
    job = make_server().completion_job(parse(CompletionBody, echo=True, max_tokens=0, logprobs=1))
    assert job.requests[0].max_tokens == 1 and job.drop_generation and job.echo == ("hello world",)
    by_ids = make_server().completion_job(parse(CompletionBody, prompt=[275, 288, 304], echo=True))
    assert by_ids.echo == ("héllo world",) and not by_ids.drop_generation


def test_chat_template_options_shape_the_prompt():
    """vLLM's extensions: no generation prompt, continuing the assistant's last message, template
    variables."""
    import copy

    from deploy.serving.openai_api import OpenAIServer, ServedModel
    from tests.deploy.serving.fake_engine import FakeEngine
    from tests.factories import CHAT_TEMPLATE, tiny_tokenizer

    tokenizer = copy.deepcopy(tiny_tokenizer())
    tokenizer.chat_template = "{{ hint | default('') }}" + CHAT_TEMPLATE
    server = OpenAIServer(
        FakeEngine(), ServedModel("tiny", tokenizer, frozenset({tokenizer.eos_token_id}), 256)
    )
    talk = MESSAGES + [{"role": "assistant", "content": "the capital"}]

    def prompt(**fields) -> str:  # type: ignore[no-untyped-def]
        (request,) = server.chat_job(parse(ChatBody, messages=talk, **fields)).requests
        tokenized = server.tokenize(TokenizeBody(messages=talk, **fields))["tokens"]
        assert tokenized == request.prompt_ids  # /tokenize gives the ids the request is given
        return tokenizer.decode(request.prompt_ids)

    assert prompt() == "<|user|>paris is in\n<|assistant|>the capital\n<|assistant|>"
    assert prompt(add_generation_prompt=False) == "<|user|>paris is in\n<|assistant|>the capital\n"
    assert (
        prompt(add_generation_prompt=False, continue_final_message=True)
        == "<|user|>paris is in\n<|assistant|>the capital"
    )
    assert prompt(chat_template_kwargs={"hint": "be brief "}).startswith("be brief <|user|>")


def test_structured_outputs_and_vllms_older_guided_fields_reach_the_engine_as_one_spec():
    server = make_server()

    def spec(schema, **fields):  # type: ignore[no-untyped-def]
        job = (
            server.chat_job(parse(schema, **fields))
            if schema is ChatBody
            else server.completion_job(parse(schema, **fields))
        )
        return {r.sampling.structured for r in job.requests}

    for guided, kind, value in [
        ("guided_choice", "choice", ["yes", "no"]),
        ("guided_regex", "regex", "[a-z]+"),
        ("guided_json", "json", {"type": "object"}),
        ("guided_grammar", "grammar", 'root ::= "a" | "b"'),
    ]:
        for schema in (ChatBody, CompletionBody):
            (wanted,) = spec(schema, structured_outputs={kind: value})
            assert json.loads(wanted)["type"] in ("grammar", "regex", "json_schema")
            assert spec(schema, **{guided: value}) == {wanted}
    assert spec(CompletionBody, n=2, structured_outputs={"json_object": True}) == spec(
        CompletionBody, response_format={"type": "json_object"}
    )
    assert spec(ChatBody, guided_json=None) == {None}  # a no-op value, as clients send unset fields
