"""`--kv-cache-dtype int8|fp8` from the flag to every worker: the same greedy tokens in local,
colocated and disaggregated mode (handoffs of the 8-bit bytes and their scales, prefix hits, forks
and preemption included), and a value it does not know refused at validation."""

import pytest
import torch
from pydantic import ValidationError

from deploy.cli import build_parser, config_from_args
from deploy.config import EngineConfig
from deploy.driver import RayEngine, open_engine
from scheduler.request import Request, SamplingParams
from tests.deploy.engine_configs import BASE, requests
from tests.factories import prompt_ids
from workers.kv_cache import PagedKVCache

# the tiny model's K and V of one token, 8-bit: 2 layers x K and V x 2 KV heads x (16 + 2) bytes
ROW_BYTES = 2 * 2 * 2 * (16 + 2)


def test_an_unknown_kv_cache_dtype_is_refused_with_the_accepted_values(capsys):
    with pytest.raises(ValidationError, match="'auto', 'int8', 'fp8' or 'fp8_e4m3'"):
        EngineConfig(kv_cache_dtype="int4")
    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "--input", "x", "--output", "y", "--kv-cache-dtype", "int4"])
    assert "invalid choice: 'int4'" in capsys.readouterr().err
    args = parser.parse_args(
        ["generate", "--input", "x", "--output", "y", "--kv-cache-dtype", "fp8_e4m3"]
    )
    config = config_from_args(args)  # vLLM's name of e4m3
    cache = PagedKVCache(1, 1, 1, 16, 64, kv_cache_dtype=config.kv_cache_dtype)
    assert cache.dtype_name == "fp8" and cache.k.dtype == torch.uint8
    assert EngineConfig().kv_cache_dtype == "auto"


def run_local(checkpoint, kind, **overrides):
    config = EngineConfig(model=checkpoint, kv_cache_dtype=kind, **(BASE | overrides))
    with open_engine(config) as engine:
        return {k: c.token_ids for k, c in engine.run(requests()).items()}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kind", "overrides"),
    [
        ("int8", dict(mode="disaggregated")),
        ("int8", dict(mode="colocated", decode_workers=2)),
        ("fp8", dict(mode="disaggregated")),
    ],
    ids=["int8-1P1D", "int8-colocated", "fp8-1P1D"],
)
def test_greedy_tokens_over_an_8bit_cache_are_the_same_in_every_mode(
    ray_session, tiny_checkpoint, kind, overrides
):
    """Every worker holds the cell's kv_cache_dtype; a handoff moves each prompt token's 8-bit rows
    with their scales, and what the decode worker computes from them is local mode's."""
    local = run_local(tiny_checkpoint, kind)
    config = EngineConfig(model=tiny_checkpoint, kv_cache_dtype=kind, **(BASE | overrides))
    with RayEngine(config) as engine:
        results, stats = engine.run(requests()), engine.stats()
    assert {k: c.token_ids for k, c in results.items()} == local
    if overrides["mode"] == "disaggregated":
        for request in requests():
            got = results[request.req_id].metrics["kv_handoff_bytes"]
            assert got == len(request.prompt_ids) * ROW_BYTES, request.req_id
        assert stats["kv_transfer"]["object_store"]["bytes"] > 0


@pytest.mark.slow
def test_prefix_hits_forks_and_preemption_over_an_int8_cache_equal_local(
    ray_session, tiny_checkpoint
):
    """Two prefill and two decode workers of 16 int8 blocks each, the prefix cache on: prompts
    sharing a prefix (handoffs that skip cached blocks), urgent and normal ones (preemption and
    recompute), three choices of one prompt (forks): every output is local mode's (roomy, no
    prefix cache)."""
    system = prompt_ids(37, 5)
    seeded = SamplingParams(temperature=0.8, top_k=40, seed=11)

    def workload():
        return [
            Request(
                req_id=f"r{i}",
                prompt_ids=(system if i % 3 else []) + prompt_ids(5 + 7 * i, 40 + i),
                max_tokens=20 + 9 * (i % 4),
                priority=i % 2,
                sampling=seeded if i % 2 else SamplingParams(),
            )
            for i in range(8)
        ] + [
            Request(
                req_id=f"n-{i}",
                prompt_ids=system + prompt_ids(9, 60),
                max_tokens=24,
                fork_of="n-0" if i else None,
                sampling=SamplingParams(temperature=0.9, seed=70 + i),
            )
            for i in range(3)
        ]

    roomy = EngineConfig(
        model=tiny_checkpoint, kv_cache_dtype="int8", prefix_cache_tokens=0, **BASE
    )
    with open_engine(roomy) as engine:
        expected = {k: c.token_ids for k, c in engine.run(workload()).items()}
    tight = BASE | dict(
        mode="disaggregated",
        prefill_workers=2,
        decode_workers=2,
        kv_cache_memory=16 * 16 * ROW_BYTES,  # 16 blocks of 16 tokens
    )
    with RayEngine(EngineConfig(model=tiny_checkpoint, kv_cache_dtype="int8", **tight)) as engine:
        got = {k: c.token_ids for k, c in engine.run(workload()).items()}
        stats = engine.stats()
    assert got == expected
    assert stats["counters"]["preemptions"] >= 1
    assert sum(w["kv_cache"]["hit_tokens"] for w in stats["workers"].values()) >= 32
    assert all(w["slots_used"] == 0 for w in stats["workers"].values())
