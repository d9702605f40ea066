"""`--quantization`: its values, where each one applies, and the flag reaching the model."""

import json

import pytest
from pydantic import ValidationError

from deploy.cli import build_parser, main
from deploy.config import EngineConfig


def test_unset_keeps_the_weights_dequantized_and_the_values_are_accepted(tiny_checkpoint):
    assert EngineConfig().quantization is None
    assert EngineConfig(quantization="gguf").quantization == "gguf"  # the embedded GGUF
    assert EngineConfig(model="/models/x.Q4_0.gguf", quantization="gguf").quantization == "gguf"
    assert EngineConfig(model=tiny_checkpoint, quantization="int8").quantization == "int8"
    assert EngineConfig(model=tiny_checkpoint, quantization="fp8").quantization == "fp8"


def test_a_bad_value_is_refused_with_the_accepted_ones(capsys):
    with pytest.raises(ValidationError, match="'gguf', 'int8' or 'fp8'"):
        EngineConfig(quantization="int4")
    with pytest.raises(SystemExit):
        build_parser().parse_args(
            ["generate", "--input", "i", "--output", "o", "--quantization", "awq"]
        )
    assert "choose from 'gguf', 'int8', 'fp8'" in capsys.readouterr().err


def test_gguf_needs_a_gguf_file(tiny_checkpoint):
    with pytest.raises(ValidationError, match="neither a .gguf file nor a GGUF alias"):
        EngineConfig(model=tiny_checkpoint, quantization="gguf")
    assert EngineConfig(quantization="int8", device="cuda").quantization == "int8"  # Triton


def test_generate_serves_int8_weights_from_the_flag(tiny_checkpoint, tmp_path):
    rows = [{"id": "a", "prompt_token_ids": [5, 6, 7, 8], "max_tokens": 6, "temperature": 0}]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "out.jsonl"
    argv = ["generate", "--model", tiny_checkpoint, "--input", str(source), "--quiet"]
    assert main([*argv, "--output", str(out), "--quantization", "int8"]) == 0
    (line,) = [json.loads(text) for text in out.read_text().splitlines()]
    assert len(line["token_ids"]) == 6 and line["finish_reason"] == "length"
