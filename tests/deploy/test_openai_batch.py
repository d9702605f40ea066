"""`pdserve generate` on OpenAI batch lines ({custom_id, method, url, body}): each result is the
body the endpoint answers, a refused body gets its 4xx in its own line while the others run, and a
malformed line stops the job before any work, naming the line."""

import json

import pytest

from deploy.batch import BatchInputError
from deploy.cli import main
from deploy.config import EngineConfig, ReplyConfig
from deploy.driver import open_engine
from deploy.openai_batch import is_openai_batch, read_batch, run_openai_batch
from deploy.params import GenerationParams
from deploy.prompts import encode_prompt

MESSAGES = [{"role": "user", "content": "paris is in"}]
LINES = [
    {
        "custom_id": "chat",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "tiny", "messages": MESSAGES, "max_tokens": 8, "temperature": 0},
    },
    {
        "custom_id": "too-long",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"messages": MESSAGES, "max_tokens": 5000},
    },
    {
        "custom_id": "two-prompts",
        "url": "/v1/completions",
        "body": {
            "prompt": ["paris is in", "rome"],
            "max_tokens": 5,
            "n": 2,
            "seed": 4,
            "logprobs": 1,
        },
    },
    {"custom_id": "streamed", "url": "/v1/completions", "body": {"prompt": "x", "stream": True}},
    {
        "custom_id": "other-model",
        "url": "/v1/completions",
        "body": {"model": "gpt-4", "prompt": "x"},
    },
    {
        "custom_id": "responses",
        "url": "/v1/responses",
        "body": {"input": "paris is in", "max_output_tokens": 8, "temperature": 0},
    },
    {
        "custom_id": "choice",
        "url": "/v1/chat/completions",
        "body": {
            "messages": MESSAGES,
            "guided_choice": ["north", "south"],
            "temperature": 1.0,
            "seed": 1,
        },
    },
]


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def local(checkpoint, max_tokens, **prompt):
    with open_engine(EngineConfig(model=checkpoint, max_model_len=256)) as engine:
        ids = encode_prompt(engine.tokenizer, **prompt)
        request = GenerationParams(temperature=0).request(
            "x",
            ids,
            max_tokens=max_tokens,
            eos_token_ids=engine.eos_token_ids,
            vocab_size=len(engine.tokenizer),
        )
        return engine.run([request])["x"]


def test_each_line_gets_the_reply_its_endpoint_gives(tiny_checkpoint, tmp_path):
    config = ReplyConfig(
        model=tiny_checkpoint, served_model_name="tiny", max_model_len=256, slots=4
    )
    out = run_openai_batch(
        config,
        str(write_jsonl(tmp_path / "in.jsonl", LINES)),
        str(tmp_path / "out.jsonl"),
        progress=False,
    )
    assert [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()] == out
    assert [line["custom_id"] for line in out] == [line["custom_id"] for line in LINES]
    assert all(line["id"].startswith("batch_req_") and line["error"] is None for line in out)
    got = {
        line["custom_id"]: (line["response"]["status_code"], line["response"]["body"])
        for line in out
    }

    greedy = local(tiny_checkpoint, 8, messages=MESSAGES)
    status, chat = got["chat"]
    assert status == 200 and chat["object"] == "chat.completion" and chat["model"] == "tiny"
    assert chat["choices"][0]["message"]["content"] == greedy.text
    assert chat["usage"]["completion_tokens"] == len(greedy.token_ids)
    status, response = got["responses"]
    assert (
        status == 200
        and response["object"] == "response"
        and response["output"][0]["type"] == "message"
    )
    # the same conversation, greedy
    assert response["output"][0]["content"][0]["text"] == greedy.text
    status, completions = got["two-prompts"]
    texts = [choice["text"] for choice in completions["choices"]]
    assert (
        status == 200
        and len(texts) == 4
        and all(c["logprobs"]["tokens"] for c in completions["choices"])
    )
    assert got["choice"][0] == 200 and got["choice"][1]["choices"][0]["message"]["content"] in (
        "north",
        "south",
    )
    for custom_id, status, param in [
        ("too-long", 400, "max_tokens"),
        ("streamed", 400, "stream"),
        ("other-model", 404, "model"),
    ]:
        assert got[custom_id][0] == status and got[custom_id][1]["error"]["param"] == param, got[
            custom_id
        ]


@pytest.mark.parametrize(
    "row, message",
    [
        ('{"custom_id": "a", "url": "/v1/chat/completions", "body": ', "in.jsonl:2"),  # not JSON
        ({"custom_id": "a", "url": "/v1/embeddings", "body": {}}, "url"),
        ({"custom_id": "a", "url": "/v1/completions"}, "body"),
        ({"custom_id": "a", "method": "GET", "url": "/v1/completions", "body": {}}, "method"),
        ({"custom_id": "first", "url": "/v1/completions", "body": {}}, "repeats line 1"),
    ],
)
def test_a_malformed_line_stops_the_job_naming_it(tmp_path, row, message):
    path = write_jsonl(
        tmp_path / "in.jsonl", [{"custom_id": "first", "url": "/v1/completions", "body": {}}, row]
    )
    assert is_openai_batch(path)
    with pytest.raises(BatchInputError) as info:
        read_batch(path)
    assert "in.jsonl:2" in str(info.value) and message in str(info.value)


def test_the_cli_reads_either_kind_of_line(tiny_checkpoint, tmp_path, capsys):
    batch = write_jsonl(tmp_path / "batch.jsonl", LINES[:2])
    assert (
        main(
            [
                "generate",
                "--model",
                tiny_checkpoint,
                "--input",
                str(batch),
                "--output",
                str(tmp_path / "b.out"),
                "--max-model-len",
                "256",
                "--served-model-name",
                "tiny",
                "--quiet",
            ]
        )
        == 0
    )
    assert "2 OpenAI batch results (1 failed)" in capsys.readouterr().err
    own = write_jsonl(
        tmp_path / "own.jsonl", [{"id": "a", "prompt": "paris is in", "max_tokens": 3}]
    )
    assert not is_openai_batch(own)
    assert (
        main(
            [
                "generate",
                "--model",
                tiny_checkpoint,
                "--input",
                str(own),
                "--output",
                str(tmp_path / "o.out"),
                "--max-model-len",
                "256",
                "--quiet",
            ]
        )
        == 0
    )
    assert json.loads((tmp_path / "o.out").read_text())["id"] == "a"
