"""`deploy.bench.gpu` on the CPU with the tiny preset: the JSON lines, the byte accounting, the time
limit."""

import argparse
import json

import pytest

from deploy.bench.arguments import add_gpu_bench_arguments as add_arguments
from deploy.bench.gpu import main, run_gpu_bench

PROMPT, OUTPUT = 8, 4
# tiny preset: 2 layers, 2 KV heads of 16, hidden 64, fp32 on the CPU
KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4
FIELDS = {
    "record",
    "preset",
    "device",
    "dtype",
    "slots",
    "requests",
    "requested_tokens",
    "token_budget",
    "prefill_chunk",
    "max_model_len",
    "engine_tokens",
    "engine_tok_s",
    "decode_steps",
    "decode_step_ms",
    "weight_bytes_per_step",
    "kv_bytes_per_step",
    "bytes_per_step",
    "achieved_gb_s",
    "copy_gb_s",
    "bandwidth_fraction",
    "kv_bytes_model",
    "static_tokens",
    "static_tok_s",
    "x_static",
    "elapsed_s",
}


def bench_args(tmp_path, *extra):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return [
        *map(
            str,
            [
                "--preset",
                "tiny",
                "--device",
                "cpu",
                "--prompt-len",
                PROMPT,
                "--output-len",
                OUTPUT,
                "--copy-mib",
                8,
                "--workdir",
                tmp_path / "work",
                "--output",
                tmp_path / "out.jsonl",
                *extra,
            ],
        )
    ], parser


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("gpu-bench")
    argv, parser = bench_args(tmp_path, "--slots", "1,2")
    return tmp_path, run_gpu_bench(parser.parse_args(argv))


def test_sweep_lines_have_the_fields_and_the_file_matches(sweep):
    tmp_path, lines = sweep
    *runs, summary = lines
    assert [r["slots"] for r in runs] == [1, 2]
    for run in runs:
        assert FIELDS <= run.keys(), FIELDS - run.keys()
        assert run["record"] == "sweep" and run["device"] == "cpu" and run["dtype"] == "float32"
        assert run["requests"] == max(4, 2 * run["slots"])
        assert (
            run["engine_tokens"]
            == run["static_tokens"]
            == run["requested_tokens"]
            == run["requests"] * OUTPUT
        )
        assert run["engine_tok_s"] > 0 and run["static_tok_s"] > 0 and run["x_static"] > 0
        assert run["decode_step_ms"] > 0 and run["achieved_gb_s"] > 0 and run["copy_gb_s"] > 0
        assert (
            0
            < run["bandwidth_fraction"]
            == pytest.approx(run["achieved_gb_s"] / run["copy_gb_s"], rel=1e-2)
        )
    assert summary["record"] == "summary" and summary["completed_slots"] == [1, 2]
    assert not summary["stopped_early"] and summary["skipped_slots"] == []
    written = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert written == lines


def test_requests_decode_in_lockstep_and_bytes_follow_the_kv_model(sweep):
    """The auto token budget prefills every slot at once, so each wave of `slots` requests decodes
    together: OUTPUT - 1 decode-only steps a wave (the first token comes from the prefill step),
    each reading `slots` rows of context PROMPT + 1 .. PROMPT + OUTPUT - 1."""
    _, lines = sweep
    for run in lines[:-1]:
        slots = run["slots"]
        assert run["token_budget"] >= slots * PROMPT
        assert run["decode_steps"] == run["requests"] // slots * (OUTPUT - 1)
        assert run["mean_decode_batch"] == slots
        assert run["mean_decode_context"] == PROMPT + OUTPUT / 2
        # the gathered tables hold whole blocks: at most one block past the context
        padded = run["mean_decode_padded_positions"]
        assert run["mean_decode_context"] <= padded < run["mean_decode_context"] + 16
        assert run["kv_bytes_per_step"] == slots * (PROMPT + OUTPUT / 2) * KV_BYTES_PER_TOKEN
        # every fp32 parameter once (the tied embedding is the lm_head) plus the looked-up embedding
        # rows
        assert run["weight_bytes_per_step"] == run["model_params"] * 4 + slots * 64 * 4
        assert run["bytes_per_step"] == run["weight_bytes_per_step"] + run["kv_bytes_per_step"]


def test_time_limit_stops_the_sweep_and_says_so(sweep, capsys):
    tmp_path, _ = sweep  # reuses the saved checkpoint in its workdir
    argv, _ = bench_args(
        tmp_path, "--slots", "1,2,4", "--time-limit", "0.001", "--output", tmp_path / "short.jsonl"
    )
    assert main(argv) == 0
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["record"] for line in printed] == ["sweep", "summary"]
    assert printed[-1]["stopped_early"] and printed[-1]["skipped_slots"] == [2, 4]
    assert printed[-1]["completed_slots"] == [1]
    assert len((tmp_path / "short.jsonl").read_text().splitlines()) == 2
