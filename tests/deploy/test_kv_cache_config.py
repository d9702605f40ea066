"""Sizing the KV cache the way vLLM users do: by memory (`--kv-cache-memory`), in blocks of
`--block-size` tokens, for `--max-num-seqs` requests at once."""

import subprocess
import sys

import pytest

from deploy.cli import build_parser, config_from_args
from deploy.config import EngineConfig, parse_size

PER_TOKEN = 46_080  # the embedded model's K and V bytes per token in fp32


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("2GiB", 2 * 2**30),
        ("512MiB", 512 * 2**20),
        ("1.5GB", 1_500_000_000),
        ("1073741824", 2**30),
        (4096, 4096),
        (" 3 gib", 3 * 2**30),
    ],
)
def test_sizes_read_as_users_write_them(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("bad", ["2 GiBs", "lots", "-1GiB", 0])
def test_a_size_that_is_not_one_is_refused_naming_it(bad):
    with pytest.raises(ValueError, match="kv_cache_memory"):
        EngineConfig(kv_cache_memory=bad)


def test_memory_gives_the_blocks_and_the_default_gives_every_slot_its_context():
    config = EngineConfig(kv_cache_memory="1GiB", block_size=16)
    assert config.num_blocks(4096, 64, PER_TOKEN) == 2**30 // (PER_TOKEN * 16)  # 1456 blocks
    default = EngineConfig(slots=4, prefix_cache_tokens=1024, block_size=16)
    assert default.num_blocks(1000, 4, PER_TOKEN) == 4 * 63 + 64


def test_memory_too_small_for_one_request_of_max_model_len_fails_with_the_numbers():
    config = EngineConfig(kv_cache_memory="64MiB")
    with pytest.raises(ValueError, match=r"holds 1456 tokens .* max_model_len 4096"):
        config.num_blocks(4096, 16, PER_TOKEN)


def test_vllms_flag_names_reach_the_config():
    args = build_parser().parse_args(
        ["generate", "--input", "x", "--output", "y", "--max-num-seqs", "48"]
        + ["--kv-cache-memory", "512MiB", "--block-size", "32"]
    )
    config = config_from_args(args)
    assert (config.slots, config.kv_cache_memory, config.block_size) == (48, "512MiB", 32)


def test_the_serve_config_takes_max_num_seqs_too():
    assert EngineConfig.model_validate({"max_num_seqs": 40}).slots == 40


def test_the_flags_are_documented_in_help():
    result = subprocess.run(
        [sys.executable, "-m", "deploy.cli", "serve", "--help"], capture_output=True, text=True
    )
    assert "--kv-cache-memory" in result.stdout and "--max-num-seqs" in result.stdout


def test_workers_share_gpus_when_asked_and_too_few_gpus_fail_at_start_with_the_numbers():
    config = EngineConfig(mode="disaggregated", prefill_workers=1, decode_workers=1)
    assert config.gpus_for(0) == 0 and config.gpus_for(2) == 1  # CPU only; a GPU each
    with pytest.raises(ValueError, match=r"2 workers of 1 GPU each need 2 GPUs, the cluster has 1"):
        config.gpus_for(1)
    shared = EngineConfig(mode="disaggregated", gpus_per_worker=0.5)
    assert shared.gpus_for(1) == 0.5  # a prefill and a decode worker on one GPU


def test_start_up_says_what_each_workers_kv_pool_holds():
    from deploy.ray_cell import kv_pool_lines

    # a scheduler's `ready()` answer: each worker's placement with its pool, and the context
    pool = {"blocks": 2912, "block_size": 16, "bytes": 2**30}
    ready = {"decode-0": {"pid": 1, "kv_cache": pool}, "prefill-0": {"pid": 2}, "capacity": 4096}
    assert kv_pool_lines(ready) == [
        "KV cache of decode-0: 2,912 blocks of 16 = 46,592 tokens, 1.00 GiB; "
        "11.4 requests of max_model_len 4,096"
    ]
