"""`deploy.bench.gpu` on the CPU with the tiny preset: the JSON lines, the byte accounting, the
roofline's arithmetic, the time limit."""

import argparse
import json

import pytest
import torch

from deploy.bench.arguments import add_gpu_bench_arguments as add_arguments
from deploy.bench.gpu import main, run_gpu_bench
from deploy.bench.gpu_model import model_shape, random_model
from deploy.bench.roofline import (
    decode_point,
    layer_matmul_params,
    prefill_flops,
    roofline_table,
    run_roofline,
    time_decode,
)
from tests.deploy.bench.eager_graphs import EagerGraphs

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
    runs = [line for line in lines if line["record"] == "sweep"]
    summary = lines[-1]
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
    for run in [line for line in lines if line["record"] == "sweep"]:
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
        tmp_path,
        *["--slots", "1,2,4", "--time-limit", "0.001", "--roofline-seconds", "1e-9"],
        *["--output", tmp_path / "short.jsonl"],
    )
    assert main(argv) == 0
    captured = capsys.readouterr()
    printed = [json.loads(line) for line in captured.out.splitlines()]
    records = [line["record"] for line in printed]
    # the CPU grid's 2 decode and 2 prefill points, each past its time and said so
    assert records == ["roofline"] * 4 + ["roofline_peaks", "sweep", "summary"]
    assert all(line["skipped"] == "past --roofline-seconds" for line in printed[:4])
    assert printed[-1]["roofline_points"] == 0 and printed[-1]["roofline_skipped"] == 4
    assert "skipped: past --roofline-seconds" in captured.err
    assert printed[-1]["stopped_early"] and printed[-1]["skipped_slots"] == [2, 4]
    assert printed[-1]["completed_slots"] == [1]
    assert len((tmp_path / "short.jsonl").read_text().splitlines()) == len(printed)


def test_roofline_lines_divide_what_they_measured(sweep):
    """The CPU roofline of the tiny shape: every point ran, and each ratio is its own numbers'."""
    _, lines = sweep
    points = [line for line in lines if line["record"] == "roofline"]
    decode = [(p["rows"], p["context"]) for p in points if p["kind"] == "decode"]
    assert decode == [(1, 32), (4, 64)]
    assert [p["tokens"] for p in points if p["kind"] == "prefill"] == [32, 64]
    for point in points:
        assert point["shape"] == "tiny" and not point["decode_graphs"]
        if point["kind"] == "decode":
            assert point["bytes"] == point["weight_bytes"] + point["kv_bytes"]
            assert point["roofline_ms"] == pytest.approx(
                point["bytes"] / point["copy_gb_s"] / 1e6, rel=1e-4
            )
            assert point["eager_x_roofline"] == pytest.approx(
                point["eager_ms"] / point["roofline_ms"], rel=1e-4
            )
            assert point["graph"].startswith("none")  # no CUDA graphs on a CPU
        else:
            assert point["tflops"] == pytest.approx(point["flops"] / point["ms"] / 1e9, rel=1e-4)
            assert point["fraction_of_peak"] == pytest.approx(
                point["tflops"] / point["matmul_tflops"], rel=1e-4
            )
    peaks = next(line for line in lines if line["record"] == "roofline_peaks")
    assert peaks["matmul_tflops"] > 0 and peaks["copy_gb_s"] > 0


def test_decode_bytes_of_the_tiny_shape_by_hand():
    """106,880 fp32 parameters (tied 512 x 64 embedding, 2 layers of 37,024, final norm 64); 4 rows
    also read their 4 embedding rows, and 4 x 64 positions of K and V: 2 layers x 2 KV heads x 16
    values x 4 bytes, twice."""
    model = random_model("tiny", torch.float32, "cpu", seed=0)
    assert sum(p.numel() for p in model.parameters()) == 106_880
    point = decode_point(model, rows=4, context=64)
    assert point.weight_bytes == 106_880 * 4 + 4 * 64 * 4
    assert point.kv_bytes == 4 * 64 * 2 * 2 * 2 * 16 * 4 == 131_072
    assert point.roofline_ms(copy_gb_s=2.0) == pytest.approx((427_520 + 1_024 + 131_072) / 2e6)
    # the random weights keep a bf16 forward's logits finite and small
    weights = [p for n, p in model.named_parameters() if not n.endswith("norm.weight")]
    assert all(abs(float(p.std()) - 0.02) < 0.005 for p in weights)


def test_prefill_flops_by_hand():
    """Tiny: a layer's matmuls are q/k/v 64 x (4 + 2 x 2) x 16, o 64 x 64 and the MLP 3 x 64 x 128;
    32 tokens: 2 x 2 layers x 36,864 x 32 + the logits row 2 x 64 x 512 + attention 4 x 2 layers
    x 4 heads x 16 x (32 x 33 / 2)."""
    tiny, _ = model_shape("tiny")
    assert layer_matmul_params(tiny) == 8_192 + 4_096 + 24_576 == 36_864
    assert prefill_flops(tiny, 32) == 4_718_592 + 65_536 + 270_336 == 5_054_464


def test_the_llama3_8b_shape_has_its_8_03b_parameters():
    spec, theta = model_shape("llama3-8b")
    assert theta == 500_000 and not spec.tie_word_embeddings and not spec.qk_norm
    norms = 2 * spec.hidden_size * spec.num_layers + spec.hidden_size
    embeddings = 2 * spec.vocab_size * spec.hidden_size  # embedding and lm_head
    total = spec.num_layers * layer_matmul_params(spec) + embeddings + norms
    assert total == 8_030_261_248


def test_decode_points_time_graph_replay_where_the_runner_has_graphs():
    from workers.runner import ModelRunner

    runner = ModelRunner(random_model("tiny", torch.float32, "cpu", seed=0), 16, 16)
    line = time_decode(runner, rows=2, context=40, device="cpu")
    assert line["graph"].startswith("none") and "graph_ms" not in line and line["eager_ms"] > 0
    runner.graphs = EagerGraphs(runner)
    line = time_decode(runner, rows=2, context=40, device="cpu")
    assert line["graph"] == "replayed" and line["graph_ms"] > 0
    assert runner.graphs.calls == 2 + 5  # warm-up, then the timed replays
    line = time_decode(runner, rows=3, context=40, device="cpu")
    assert line["graph"] == "none: 3 rows exceed the largest bucket 2"


def test_a_shape_that_fails_is_reported_and_the_roofline_goes_on():
    messages = []
    lines = run_roofline(
        ["no-such-shape"], [(1, 16)], [16], torch.float32, "cpu", 1.0, 60.0, messages.append
    )
    failed, peaks = lines
    assert failed["skipped"].startswith("failed: ValueError: unknown preset 'no-such-shape'")
    assert peaks["record"] == "roofline_peaks" and peaks["matmul_tflops"] > 0
    assert "no-such-shape    whole shape  skipped: failed" in roofline_table([failed])
    assert any("no-such-shape: failed" in message for message in messages)
