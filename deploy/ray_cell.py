"""Starts Ray (or joins a cluster) and a cell of a Ray mode: its cell actor, with its workers."""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

import ray

from deploy.config import EngineConfig
from scheduler.cell.actor import CellActor
from workers.actors import spawn_worker
from workers.drafter import draft_kv_bytes_per_token
from workers.loader import TokenizerInfo, kv_bytes_per_token, load_tokenizer
from workers.lora import check_adapter

log = logging.getLogger(__name__)


def init_ray(config: EngineConfig) -> None:
    """Join the cluster in RAY_ADDRESS (as under `ray job submit`; `RAY_ADDRESS=auto` joins a
    cluster started here with `ray start`), or start a new local Ray with CPUs enough for every
    worker (logically: two workers on a 2-core laptop share its cores)."""
    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=True)
        return
    num_cpus = max(
        os.cpu_count() or 1, int(config.num_ranks() * config.num_cpus_per_worker + 0.999)
    )
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=True)


def cell_actor_args(config: EngineConfig, info: TokenizerInfo | None = None) -> tuple[Any, ...]:
    """The cell actor's constructor arguments for a config: its cell, how to spawn its workers
    and the tokenizer its outputs are detokenized with (`info`, or loaded here). Loading the
    tokenizer converts a GGUF once, before the workers look for the converted checkpoint."""
    # fail here, not in a worker's wait
    gpus = config.gpus_for(ray.cluster_resources().get("GPU", 0))
    config.check_tp_groups([n["Resources"] for n in ray.nodes() if n["Alive"]], gpus)
    info = info or load_tokenizer(config.model)
    capacity = config.context_len(info.max_context)
    per_token = kv_bytes_per_token(info, config.dtype, config.device, config.kv_cache_dtype)
    # a draft model's KV takes the same blocks in a cache of its own
    per_token += draft_kv_bytes_per_token(config.speculative, config.dtype, config.device)
    for ref in config.loras.values():  # one that cannot be served fails here, not in a step
        check_adapter(ref, info.config, config.max_lora_rank)
    return (
        config.cell_config(capacity, per_token),
        functools.partial(spawn_worker, config),
        info.tokenizer,
    )


def create_cell_actor(
    config: EngineConfig,
    info: TokenizerInfo | None = None,
    cell: dict[str, Any] | None = None,
    **options: Any,
) -> Any:
    """Create the cell actor (which creates the workers); `options` are Ray actor options (a
    name), `cell` more of CellActor's own arguments (`worker_namespace`, `owner`)."""
    options = {"num_cpus": 0, "max_concurrency": 100_000, "enable_task_events": False} | options
    actor = ray.remote(CellActor).options(**options)
    return actor.remote(*cell_actor_args(config, info), **(cell or {}))


def start_cell_actor(
    config: EngineConfig, name: str | None = None, info: TokenizerInfo | None = None
) -> Any:
    """Create the cell actor and wait until every worker is ready."""
    init_ray(config)
    handle = create_cell_actor(
        config, info, **({"name": name, "get_if_exists": True} if name else {})
    )
    try:
        placement = ray.get(handle.ready.remote())
    except ray.exceptions.RayTaskError as error:  # a worker refused its config: stop them all
        stop_cell_actor(handle)
        cause = error.cause
        raise (cause if isinstance(cause, Exception) else error) from None
    log.info("cell ready: %s", placement)
    for line in kv_pool_lines(placement):
        log.info("%s", line)
    return handle


def kv_pool_lines(ready: dict[str, Any]) -> list[str]:
    """What each worker's KV pool holds, from a cell actor's `ready()` answer: its blocks, tokens
    and GiB, and how many requests of the cell's whole context (`max_model_len`) it could hold."""
    capacity = ready["capacity"]
    lines = []
    for name, placement in sorted(ready.items()):
        pool = placement.get("kv_cache") if isinstance(placement, dict) else None
        if not pool:
            continue
        tokens = pool["blocks"] * pool["block_size"]
        dtype = f"{pool['dtype']}, " if "dtype" in pool else ""
        lines.append(
            f"KV cache of {name}: {pool['blocks']:,} blocks of {pool['block_size']} = "
            f"{tokens:,} tokens, {dtype}{pool['bytes'] / 2**30:.2f} GiB; "
            f"{tokens / capacity:.1f} requests of max_model_len {capacity:,}"
        )
    return lines


def stop_cell_actor(handle: Any) -> None:
    """Stop the cell actor and its workers."""
    try:
        ray.get(handle.shutdown.remote(), timeout=30)
    finally:
        ray.kill(handle)
