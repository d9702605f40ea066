"""Runs a function on every rank of a gloo group of spawned processes (one torch thread each), for
the tensor-parallel tests; and the tiny models those tests split."""

from __future__ import annotations

import multiprocessing
import pickle
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

# name -> (config class, its arguments): an uneven split (9 heads on 3 KV groups, odd MLP and vocab
# sizes), a KV head copied to both ranks (with every attention bias), and Qwen3's q/k norms
TP_KINDS = {
    "uneven-9-on-3": (
        "LlamaConfig",
        dict(
            hidden_size=144,
            num_attention_heads=9,
            num_key_value_heads=3,
            intermediate_size=129,
            vocab_size=387,
            tie_word_embeddings=True,
        ),
    ),
    "copied-kv-4-on-1": (
        "LlamaConfig",
        dict(
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=1,
            intermediate_size=128,
            vocab_size=384,
            attention_bias=True,
            tie_word_embeddings=False,
        ),
    ),
    "qwen3-4-on-2": (
        "Qwen3Config",
        dict(
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            intermediate_size=128,
            vocab_size=384,
            tie_word_embeddings=False,
        ),
    ),
}


def tp_hf_model(kind: str) -> Any:
    """A two-layer `transformers` model of `TP_KINDS[kind]`, the same in every process (seeded),
    its weights (and biases) spread wide so that argmax has clear margins."""
    import torch
    import transformers

    name, args = TP_KINDS[kind]
    config = getattr(transformers, name)(
        num_hidden_layers=2,
        max_position_embeddings=512,
        initializer_range=0.25,
        rope_theta=10000.0,
        **args,
    )
    torch.manual_seed(1234)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # biases start at zero: give them values, so a wrong split shows
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.25)
    return model


def save_uneven_checkpoint(path: Path, kind: str = "uneven-9-on-3") -> Path:
    """The uneven kind (9 query heads on 3 KV heads), or another of `TP_KINDS`, as a checkpoint
    directory, with a tokenizer."""
    from tests.factories import tiny_tokenizer

    tp_hf_model(kind).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def _rank_main(
    rank: int, size: int, init_file: str, fn: Callable[[int, int], Any], out: str
) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    result: Any = None
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=size
        )
        try:
            result = fn(rank, size)
        finally:
            dist.destroy_process_group()
    except BaseException:
        result = RuntimeError(f"rank {rank}:\n{traceback.format_exc()}")
    Path(out).write_bytes(pickle.dumps(result))


def run_ranks(
    fn: Callable[[int, int], Any], size: int, tmp: Path, timeout: float = 120, killed_ok=False
) -> list:
    """`fn(rank, size)` on `size` spawned processes in one gloo group; what each returned, by rank
    (None for one killed by a signal, with `killed_ok`). Raises the first rank's failure; kills
    every rank still running after `timeout` seconds."""
    context = multiprocessing.get_context("spawn")
    init_file = tmp / "gloo-init"
    outs = [tmp / f"rank-{rank}.pickle" for rank in range(size)]
    procs = [
        context.Process(target=_rank_main, args=(rank, size, str(init_file), fn, str(out)))
        for rank, out in enumerate(outs)
    ]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + timeout
    try:
        # each one reaped as it ends (a rank that waits on another learns it is gone from its pid)
        while any([proc.is_alive() for proc in procs]) and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
    results = []
    for rank, out in enumerate(outs):
        if not out.exists():
            code = procs[rank].exitcode
            if killed_ok and code is not None and code < 0 and time.monotonic() < deadline:
                results.append(None)
                continue
            raise RuntimeError(f"rank {rank} ended without a result (exit code {code})")
        results.append(pickle.loads(out.read_bytes()))
    for result in results:
        if isinstance(result, RuntimeError):
            raise result
    return results
