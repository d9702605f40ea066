"""The batch job's sampling and log-prob fields: checked per line before any work, passed to the
requests, and written back on the result lines. No engine: lines, requests and results are built by
hand."""

import json

import pytest

from deploy.batch import BatchInputError, read_lines, result_line, run_generate, to_requests
from deploy.config import EngineConfig
from scheduler.outputs import Completion
from scheduler.request import TokenLogprob
from tests.factories import tiny_tokenizer


def lines_of(tmp_path, *rows):  # type: ignore[no-untyped-def]
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return read_lines(path)


def requests_of(tmp_path, *rows):  # type: ignore[no-untyped-def]
    tokenizer = tiny_tokenizer()
    return to_requests(
        lines_of(tmp_path, *rows), tokenizer, frozenset({tokenizer.eos_token_id}), 256
    )


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"3": 200}}, "logit_bias"),
        ({"logprobs": 21}, "logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"n": 2}, "n"),  # one result per line: no n
    ],
)
def test_bad_values_fail_naming_the_line_and_the_field(tmp_path, fields, message):
    with pytest.raises(BatchInputError) as info:
        lines_of(tmp_path, {"id": "a", "prompt": "hi"}, {"id": "b", "prompt": "hi", **fields})
    assert "in.jsonl:2" in str(info.value) and message in str(info.value)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"logit_bias": {"384": 1}}, "vocabulary"),
        ({"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"structured_outputs": {"regex": "("}}, "structured_outputs.regex"),
        (
            {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
            "not both",
        ),
    ],
)
def test_values_checked_with_the_tokenizer_or_grammar_fail_naming_the_request(
    tmp_path, fields, message
):
    with pytest.raises(BatchInputError) as info:
        requests_of(tmp_path, {"id": "b", "prompt": "hi", **fields})
    assert "request 'b'" in str(info.value) and message in str(info.value)


def test_a_timeout_reaches_the_request_and_local_mode_refuses_it(tmp_path):
    (request,) = requests_of(tmp_path, {"id": "t", "prompt": "hi", "timeout": 2.5})
    assert request.timeout_s == 2.5
    path = tmp_path / "in.jsonl"  # (written by requests_of)
    with pytest.raises(BatchInputError, match="'t': timeout is enforced in the Ray modes"):
        run_generate(EngineConfig(model="unused"), str(path), str(tmp_path / "out.jsonl"))
    assert not (tmp_path / "out.jsonl").exists()


def test_fields_reach_the_request(tmp_path):
    (request,) = requests_of(
        tmp_path,
        {
            "id": "a",
            "prompt": "hi",
            "max_tokens": 8,
            "presence_penalty": 0.5,
            "frequency_penalty": 0.25,
            "repetition_penalty": 1.3,
            "min_tokens": 2,
            "logit_bias": {"7": -100},
            "logprobs": 3,
            "prompt_logprobs": 1,
            "response_format": {"type": "json_object"},
        },
    )
    s = request.sampling
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty, s.min_tokens) == (
        0.5,
        0.25,
        1.3,
        2,
    )
    assert s.logit_bias == ((7, -100.0),) and (s.logprobs, s.prompt_logprobs) == (3, 1)
    assert s.structured is not None and request.fork_of is None
    (chosen,) = requests_of(
        tmp_path, {"id": "a", "prompt": "hi", "structured_outputs": {"choice": ["x", "y"]}}
    )
    assert json.loads(chosen.sampling.structured)["type"] == "grammar"


def test_result_lines_carry_the_logprobs_asked_for(tmp_path):
    asked, plain = requests_of(
        tmp_path,
        {"id": "a", "prompt": "hello world", "logprobs": 1, "prompt_logprobs": 0},
        {"id": "b", "prompt": "hi"},
    )
    prompt = asked.prompt_ids
    done = Completion(
        "a",
        len(prompt),
        [40, 41],
        "xy",
        "length",
        logprobs=[
            TokenLogprob(40, -0.5, ((40, -0.5),)),
            TokenLogprob(41, float("-inf"), ((9, -0.1),)),
        ],
        prompt_logprobs=[TokenLogprob(t, -1.0) for t in prompt[1:]],
    )
    line = result_line(done, asked)
    assert line["logprobs"] == [
        {"token_id": 40, "logprob": -0.5, "top": [[40, -0.5]]},
        {"token_id": 41, "logprob": -9999.0, "top": [[9, -0.1]]},
    ]
    assert line["prompt_logprobs"][0] is None  # one per prompt token; nothing precedes the first
    assert line["prompt_logprobs"][1:] == [
        {"token_id": t, "logprob": -1.0, "top": []} for t in prompt[1:]
    ]
    json.dumps(line, allow_nan=False)
    assert "logprobs" not in result_line(Completion("b", 1, [5], "z", "length"), plain)
    assert "prompt_logprobs" not in result_line(Completion("b", 1, [5], "z", "length"), plain)
