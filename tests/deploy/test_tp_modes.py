"""`--tensor-parallel-size` from the flag to the workers: a TP-2 engine in local and colocated
mode gives TP-1's tokens, a dead rank restarts its worker whole, and what TP cannot serve yet is
refused before anything starts."""

import os
import signal

import pytest
from pydantic import ValidationError

from deploy.cli import build_parser, config_from_args
from deploy.config import EngineConfig
from deploy.driver import RayEngine, open_engine
from scheduler.request import SamplingParams
from tests.deploy.engine_configs import BASE
from tests.factories import make_requests

NGRAM = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'


def test_the_flag_reaches_the_config_and_unserved_combinations_are_refused():
    args = build_parser().parse_args(
        ["generate", "--input", "x", "--output", "y", "--tensor-parallel-size", "2"]
    )
    assert config_from_args(args).tensor_parallel_size == 2
    assert EngineConfig().tensor_parallel_size == 1
    pools = EngineConfig(mode="disaggregated", decode_tensor_parallel_size=2)
    assert (pools.tp_size("prefill"), pools.tp_size("decode")) == (1, 2)
    with pytest.raises(ValidationError, match="size the pools of disaggregated mode"):
        EngineConfig(mode="colocated", decode_tensor_parallel_size=2)
    planned = EngineConfig(mode="disaggregated", pool_planner=True, decode_tensor_parallel_size=2)
    cell = planned.cell_config(capacity=256, bytes_per_token=64)
    assert (cell.prefill_tensor_parallel_size, cell.decode_tensor_parallel_size) == (1, 2)
    with pytest.raises(ValidationError, match="quantization gguf .* is not served tensor-par"):
        EngineConfig(quantization="gguf", tensor_parallel_size=2)
    draft = {"method": "draft_model", "model": "m", "num_speculative_tokens": 2}
    with pytest.raises(ValidationError, match="a draft model .* is not served tensor-parallel"):
        EngineConfig(speculative_config=draft, tensor_parallel_size=2)
    EngineConfig(quantization="int8", speculative_config=NGRAM, tensor_parallel_size=2)
    with pytest.raises(ValidationError, match="LoRA adapters is not served tensor-parallel"):
        EngineConfig(enable_lora=True, tensor_parallel_size=2)
    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        EngineConfig(tensor_parallel_size=0)


def _requests():
    seeded = SamplingParams(temperature=0.8, top_k=40, seed=3)
    greedy = make_requests(4, [5, 31, 12, 47], [17, 6, 25, 9])
    return greedy + make_requests(6, [20], [12], seeded)[4:]  # ids r4, r5


def _tokens(engine) -> dict[str, list[int]]:
    return {k: c.token_ids for k, c in engine.run(_requests()).items()}


@pytest.mark.slow
def test_tp2_local_and_colocated_give_tp1_local_tokens(ray_session, uneven_checkpoint):
    config = dict(BASE | {"model": uneven_checkpoint})
    with open_engine(EngineConfig(**config)) as engine:
        expected = _tokens(engine)
    with open_engine(EngineConfig(**config, tensor_parallel_size=2)) as engine:
        assert _tokens(engine) == expected
    colocated = EngineConfig(**config, mode="colocated", tensor_parallel_size=2)
    with RayEngine(colocated) as engine:
        assert _tokens(engine) == expected
        workers = _workers(ray_session.get(engine.handle.ready.remote()))
    assert [w["tensor_parallel_size"] for w in workers] == [2]  # one worker, of two ranks
    assert len(expected) == 6 and len({t for ids in expected.values() for t in ids}) > 10


@pytest.mark.slow
def test_tp2_int8_weights_and_ngram_drafts_give_tp1s_tokens(ray_session, qwen3_tp_checkpoint):
    """int8 weights at TP-2 hold TP-1's quants (a row-parallel slice takes its whole row's
    scale), and n-gram drafts verify on every rank: TP-1's tokens, with drafts taken."""
    config = dict(BASE | {"model": qwen3_tp_checkpoint, "quantization": "int8"})
    with open_engine(EngineConfig(**config)) as engine:
        expected = _tokens(engine)
    speculative = EngineConfig(**config, speculative_config=NGRAM, tensor_parallel_size=2)
    with open_engine(speculative) as engine:
        assert _tokens(engine) == expected
        spec = engine.engine.scheduler.spec_stats.as_dict()
    assert spec["num_accepted_tokens"] > 0


@pytest.mark.slow
def test_a_dead_rank_restarts_its_worker_whole_and_requests_recompute(
    ray_session, uneven_checkpoint
):
    """Rank 1 of the one colocated TP-2 worker is killed once the first request has finished: the
    worker restarts whole (rank 0 ends with it), the cell recomputes what was running, and every
    output is still TP-1 local mode's."""
    config = dict(BASE | {"model": uneven_checkpoint})
    with open_engine(EngineConfig(**config)) as engine:
        expected = _tokens(engine)
    colocated = EngineConfig(**config, mode="colocated", tensor_parallel_size=2)
    with RayEngine(colocated) as engine:
        (worker,) = _workers(ray_session.get(engine.handle.ready.remote()))
        (rank1,) = worker["ranks"]
        killed = []

        def kill_rank1(_completion):
            if not killed:
                os.kill(rank1["pid"], signal.SIGKILL)
                killed.append(rank1["pid"])

        results = engine.run(_requests(), on_finish=kill_rank1)
        (restarted,) = _workers(ray_session.get(engine.handle.ready.remote()))
    assert killed
    assert {k: c.token_ids for k, c in results.items()} == expected
    assert restarted["incarnation"] != worker["incarnation"]
    assert restarted["ranks"][0]["pid"] != rank1["pid"]


def _workers(placement: dict) -> list[dict]:
    return [p for p in placement.values() if isinstance(p, dict) and "kv_cache" in p]


def test_the_gpu_check_counts_every_rank_of_every_worker():
    config = EngineConfig(
        mode="disaggregated", prefill_tensor_parallel_size=2, decode_tensor_parallel_size=4
    )
    assert config.num_ranks() == 6
    assert config.gpus_for(6) == 1.0
    with pytest.raises(ValueError, match="6 worker ranks of 1 GPU each need 6 GPUs"):
        config.gpus_for(4)


def test_a_cell_says_which_resources_a_tp_group_lacks():
    """Ranks run on their rank 0's node: one node must hold a whole group."""
    config = EngineConfig(
        mode="disaggregated",
        prefill_tensor_parallel_size=1,
        decode_tensor_parallel_size=4,
        num_cpus_per_worker=1,
    )
    two_gpu_nodes = [{"CPU": 16.0, "GPU": 2.0}] * 3
    with pytest.raises(
        ValueError,
        match="decode worker of tensor-parallel size 4 needs 4 CPU and "
        "4 GPU on one node .* the largest node has 16 CPU and 2 GPU",
    ):
        config.check_tp_groups(two_gpu_nodes, 1.0)
    config.check_tp_groups([*two_gpu_nodes, {"CPU": 8.0, "GPU": 4.0}], 1.0)
    with pytest.raises(ValueError, match="needs 4 CPU on one node .* largest node has 2 CPU"):
        config.check_tp_groups([{"CPU": 2.0}] * 4, 0.0)
