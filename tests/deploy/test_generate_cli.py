"""`pdserve generate` on a save_pretrained checkpoint: outputs, metrics, and bad input."""

import json
import subprocess
import sys

import pytest
import torch

from deploy.cli import main
from tests.factories import save_tiny_checkpoint, tiny_hf_model, tiny_tokenizer


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"))


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


ROWS = [
    {"id": "a", "prompt": "the quick brown fox", "max_tokens": 12, "temperature": 0},
    {
        "id": 7,
        "prompt_token_ids": [5, 9, 14, 100, 200, 3],
        "max_tokens": 20,
        "temperature": 0,
        "ignore_eos": True,
    },
    {
        "id": "chat",
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 9,
        "temperature": 0,
    },
    {
        "id": "s",
        "prompt": "paris is",
        "max_tokens": 15,
        "temperature": 0.8,
        "top_p": 0.9,
        "seed": 3,
    },
]


def test_generate_writes_results_equal_to_transformers_generate(checkpoint, tmp_path):
    out = tmp_path / "out.jsonl"
    args = [
        "generate",
        "--model",
        str(checkpoint),
        "--input",
        str(write_jsonl(tmp_path / "in.jsonl", ROWS)),
        "--output",
        str(out),
        "--mode",
        "local",
        "--slots",
        "2",
        "--token-budget",
        "8",
        "--prefill-chunk",
        "4",
        "--quiet",
    ]
    assert main(args) == 0
    lines = read_jsonl(out)
    assert [line["id"] for line in lines] == ["a", "7", "chat", "s"]
    tok, hf = tiny_tokenizer(), tiny_hf_model("llama")
    for row, line in zip(ROWS[:2], lines[:2], strict=True):
        prompt = tok(row["prompt"]).input_ids if "prompt" in row else row["prompt_token_ids"]
        assert line["prompt_tokens"] == len(prompt)
        with torch.no_grad():
            kwargs = {"eos_token_id": None} if row.get("ignore_eos") else {}
            ref = hf.generate(
                torch.tensor([prompt]),
                max_new_tokens=row["max_tokens"],
                do_sample=False,
                pad_token_id=0,
                **kwargs,
            )[0, len(prompt) :].tolist()
        assert line["token_ids"] == ref
        # a random model may end on half a UTF-8 character: that part is never turned into text
        assert line["text"] == tok.decode(ref, skip_special_tokens=True).rstrip("\ufffd")
        expected = "stop" if ref[-1] == tok.eos_token_id and not row.get("ignore_eos") else "length"
        assert line["finish_reason"] == expected
        assert line["metrics"]["ttft_s"] <= line["metrics"]["e2e_s"]
    assert len(lines[1]["token_ids"]) == 20 and lines[1]["finish_reason"] == "length"
    # the seeded sampled row is reproducible run to run, whatever else is in the batch
    again = tmp_path / "again.jsonl"
    assert (
        main(
            args[:4]
            + [
                str(write_jsonl(tmp_path / "one.jsonl", ROWS[3:])),
                "--output",
                str(again),
                "--quiet",
            ]
        )
        == 0
    )
    assert read_jsonl(again)[0]["token_ids"] == lines[3]["token_ids"]


@pytest.mark.parametrize(
    "bad_row, message",
    [
        ('{"id": "x", "prompt": "hi"', "in.jsonl:2"),
        ({"id": "x", "prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"id": "x", "prompt": "hi", "colour": "red"}, "colour"),
        ({"id": "a", "prompt": "hi"}, "repeats line 1"),
        ({"id": "x"}, "exactly one of prompt"),
        ({"id": "x", "prompt": "hi", "max_tokens": 5000}, "maximum context length"),
    ],
)
def test_bad_lines_fail_naming_the_line_and_write_nothing(
    checkpoint, tmp_path, capsys, bad_row, message
):
    src = write_jsonl(tmp_path / "in.jsonl", [ROWS[0], bad_row])
    out = tmp_path / "out.jsonl"
    assert (
        main(
            [
                "generate",
                "--model",
                str(checkpoint),
                "--input",
                str(src),
                "--output",
                str(out),
                "--quiet",
                "--max-model-len",
                "512",
            ]
        )
        == 2
    )
    assert message in capsys.readouterr().err
    assert not out.exists() and list(tmp_path.iterdir()) == [src]


def test_console_script_runs(checkpoint, tmp_path):
    out = tmp_path / "out.jsonl"
    src = write_jsonl(tmp_path / "in.jsonl", ROWS[:1])
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "deploy.cli",
            "generate",
            "--model",
            str(checkpoint),
            "--input",
            str(src),
            "--output",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    # progress bar and summary
    assert "generate" in proc.stderr and "wrote 1 results" in proc.stderr
    assert len(read_jsonl(out)) == 1


def test_every_engine_setting_is_a_flag_booleans_included():
    from deploy.cli import build_parser, config_from_args

    args = build_parser().parse_args(
        [
            "generate",
            "--input",
            "i",
            "--output",
            "o",
            "--cache-routing",
            "false",
            "--prefix-cache-tokens",
            "0",
        ]
    )
    config = config_from_args(args)
    assert config.cache_routing is False and config.prefix_cache_tokens == 0
    assert config_from_args(
        build_parser().parse_args(["generate", "--input", "i", "--output", "o"])
    ).cache_routing
    with pytest.raises(SystemExit):
        build_parser().parse_args(
            ["generate", "--input", "i", "--output", "o", "--cache-routing", "maybe"]
        )
    # a boolean flag alone means true, as vLLM's --enforce-eager
    bare = ["generate", "--input", "i", "--output", "o", "--enforce-eager", "--slots", "3"]
    config = config_from_args(build_parser().parse_args(bare))
    assert config.enforce_eager is True and config.slots == 3
    assert config_from_args(build_parser().parse_args(bare[:5])).enforce_eager is False


def test_a_chat_template_given_replaces_the_models_and_a_bad_one_fails_at_start(
    checkpoint, tmp_path, capsys
):
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{% endfor %}")
    rows = [
        {
            "id": "c",
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 3,
            "temperature": 0,
        }
    ]
    base = [
        "generate",
        "--model",
        str(checkpoint),
        "--input",
        str(write_jsonl(tmp_path / "in.jsonl", rows)),
        "--output",
        str(tmp_path / "out.jsonl"),
        "--mode",
        "local",
        "--quiet",
    ]
    # a file, or the template itself (as vLLM takes them)
    for given in (str(template), template.read_text()):
        assert main([*base, "--chat-template", given]) == 0
        (line,) = read_jsonl(tmp_path / "out.jsonl")
        assert line["prompt_tokens"] == len(
            tiny_tokenizer()("[user] hello", add_special_tokens=False).input_ids
        )
    assert main([*base, "--chat-template", str(tmp_path / "missing.jinja")]) != 0
    assert "neither a file nor a Jinja template" in capsys.readouterr().err
