"""The one driver: run these requests at these arrival times in this config, get their completions.

`open_engine(config)` starts the engine a config asks for (`local`: in this process; `colocated` /
`disaggregated`: a scheduler actor and its workers on Ray) and `Engine.run` drives requests through
it. The batch job, the benchmark and the tests all go through here.
"""

from __future__ import annotations

import abc
import asyncio
import logging
from collections.abc import Callable
from typing import Any

from deploy.config import EngineConfig
from deploy.prompts import use_chat_template
from scheduler.block_pool import combined_stats
from scheduler.outputs import Completion
from scheduler.request import Request
from scheduler.step_planner import StepPlanner
from workers.arrivals import ArrivalSchedule, run_at_arrivals

log = logging.getLogger(__name__)


class Engine(abc.ABC):
    """A started engine of any mode. `capacity` is the tokens a slot holds; `close()` stops it."""

    capacity: int
    tokenizer: Any
    eos_token_ids: frozenset[int]

    @abc.abstractmethod
    def run(
        self,
        requests: list[Request],
        arrival_s: dict[str, float] | None = None,
        on_finish: Callable[[Completion], None] | None = None,
        after: dict[str, str] | None = None,
    ) -> dict[str, Completion]:
        """Submit each request at its arrival offset (seconds from now; 0 if not given), or when the
        request it follows in `after` ends (chains: `scheduler.arrivals.ArrivalSchedule`), and
        return the completion of every request that ran, by id. A request that cannot run raises
        ValueError before anything is submitted."""

    @abc.abstractmethod
    def profile(self) -> dict[str, Any]:
        """Where the time went since the last `reset_profile` (mode-specific figures)."""

    @abc.abstractmethod
    def reset_profile(self) -> None: ...

    @abc.abstractmethod
    def close(self) -> None:
        """Stop what the engine started."""

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class InProcessEngine(Engine):
    """`local` mode: the policy stepping the model in this process."""

    def __init__(self, config: EngineConfig, loaded: Any = None) -> None:
        tp_size = config.tensor_parallel_size
        if loaded is not None and tp_size > 1:
            raise ValueError("a tensor-parallel engine loads its own shards: pass no model")
        # ranks 1.. are Ray actors, as in the Ray modes' workers; this process is rank 0
        self.followers = None if tp_size == 1 else _start_followers(config)
        try:
            self._start(config, loaded)
        except BaseException:
            self.close()  # the other ranks too
            raise

    def _start(self, config: EngineConfig, loaded: Any) -> None:
        """Load the model (a tensor-parallel engine's rank 0 shard), size the KV pool, build the
        runner and the policy."""
        import torch

        from workers.decode_graphs import GraphOptions
        from workers.drafter import Drafter, load_draft_model
        from workers.engine import LocalEngine
        from workers.kv_cache import PagedKVCache
        from workers.loader import load_model
        from workers.lora import ResidentLoras, check_adapter
        from workers.runner import ModelRunner

        loaded = loaded or load_model(
            config.model,
            config.dtype,
            config.device,
            config.quantization,
            config.tensor_parallel_size,
        )
        self.capacity = config.context_len(loaded.max_context)
        self.tokenizer = use_chat_template(loaded.tokenizer, config.chat_template)
        self.eos_token_ids = loaded.eos_token_ids
        # a tensor-parallel rank's KV heads: rank 0's are the most, so every rank's pool fits
        spec = loaded.model.local_spec
        dtype = loaded.model.model.embed_tokens.weight.dtype  # a packed one's: its activations
        per_token = PagedKVCache.bytes_per_token(
            spec.num_layers, spec.num_kv_heads, spec.head_dim, dtype, config.kv_cache_dtype
        )
        draft = load_draft_model(config.speculative, loaded.model, config.dtype, config.device)
        if draft is not None:  # its KV takes the same blocks in a cache of its own
            per_token += Drafter.bytes_per_token(draft)
        num_blocks = config.num_blocks(self.capacity, config.slots, per_token)
        if self.followers is not None:
            ranks = self.followers.start_runners(
                num_blocks, config.block_size, config.kv_cache_dtype
            )
            log.info("tensor-parallel ranks 1..: %s", ranks)
        runner = ModelRunner(
            loaded.model,
            num_blocks,
            block_size=config.block_size,
            tokenizer=loaded.tokenizer,
            kv_cache_dtype=config.kv_cache_dtype,
            drafter=None if draft is None else Drafter(draft, num_blocks, config.block_size),
            loras=(
                ResidentLoras(
                    loaded.model, config.max_loras, config.max_lora_rank, config.lora_dtype
                )
                if config.lora_enabled
                else None
            ),
            followers=self.followers,
            graphs=None if config.enforce_eager else GraphOptions(config.slots, self.capacity),
        )
        for ref in config.loras.values():  # an adapter that cannot be served fails now
            check_adapter(ref, loaded.model, config.max_lora_rank)
        scheduler = StepPlanner(
            config.slots,
            self.capacity,
            config.token_budget,
            config.prefill_chunk,
            config.max_waiting,
            config.max_preemptions,
            num_blocks=num_blocks,
            block_size=config.block_size,
            prefix_caching=config.prefix_caching,
            speculative=config.speculative,
            max_loras=config.max_loras if config.lora_enabled else None,
        )
        log.info(
            "local engine: %s, %d requests at once of up to %d tokens, %d KV blocks of %d "
            "(%d requests of max_model_len), budget %d, chunk %d, torch threads %d",
            loaded.name,
            config.slots,
            self.capacity,
            num_blocks,
            config.block_size,
            num_blocks * config.block_size // self.capacity,
            config.token_budget,
            config.prefill_chunk,
            torch.get_num_threads(),
        )
        self.engine = LocalEngine(runner, scheduler, loaded.tokenizer)

    def run(
        self,
        requests: list[Request],
        arrival_s: dict[str, float] | None = None,
        on_finish: Callable[[Completion], None] | None = None,
        after: dict[str, str] | None = None,
    ) -> dict[str, Completion]:
        finished = self.engine.run(
            requests,
            arrival_s,
            None if on_finish is None else lambda r: on_finish(Completion.from_request(r)),
            after,
        )
        return {req_id: Completion.from_request(r) for req_id, r in finished.items()}

    def profile(self) -> dict[str, Any]:
        prof = self.engine.profile
        return (
            {
                "engine_steps": self.engine.num_steps,
                "model_fraction": prof["model_s"] / max(prof["step_s"], 1e-9),
                "outside_forward_fraction": 1 - prof["model_s"] / max(prof["step_s"], 1e-9),
                "decode_steps": prof["decode_steps"],
                "decode_step_ms": 1000 * prof["decode_step_s"] / max(prof["decode_steps"], 1),
                "decode_model_fraction": prof["decode_model_s"] / max(prof["decode_step_s"], 1e-9),
                "peak_running": self.engine.scheduler.peak_running,
            }
            | combined_stats([self.engine.scheduler.blocks.stats()])
            | spec_summary(self.engine.scheduler.spec_stats.as_dict())
        )

    def reset_profile(self) -> None:
        self.engine.reset_profile()
        self.engine.scheduler.blocks.reset_counters()
        self.engine.scheduler.peak_running = len(self.engine.scheduler.running)

    def close(self) -> None:
        # the model and cache go with the engine; a tensor-parallel one's other ranks stop here
        if self.followers is not None:
            self.followers.shutdown()
            self.followers = None


def _start_followers(config: EngineConfig) -> Any:
    """Ranks 1.. of a tensor-parallel `local` engine, on a Ray started here (or joined)."""
    from deploy.ray_cell import init_ray
    from workers.tp_group import TPFollowers

    init_ray(config)
    return TPFollowers.start(
        config.tensor_parallel_size,
        config.model,
        config.dtype,
        config.device,
        config.worker_threads(),
        quantization=config.quantization,
    )


class RayEngine(Engine):
    """`colocated` / `disaggregated`: requests stream through a scheduler actor and its workers."""

    def __init__(
        self, config: EngineConfig | None = None, *, handle: Any = None, capacity: int = 0
    ) -> None:
        """Start the scheduler of `config`, or drive a scheduler actor already started (`handle`,
        whose slots hold `capacity` tokens; no tokenizer)."""
        if config is None:
            self.handle = handle
            self.capacity = capacity
            self.tokenizer = None
            self.eos_token_ids = frozenset()
            return
        from deploy.ray_cell import start_cell_actor
        from workers.loader import load_tokenizer

        info = load_tokenizer(config.model)
        self.capacity = config.context_len(info.max_context)
        self.tokenizer = use_chat_template(info.tokenizer, config.chat_template)
        self.eos_token_ids = info.eos_token_ids
        self.handle = start_cell_actor(config, info=info)

    def run(
        self,
        requests: list[Request],
        arrival_s: dict[str, float] | None = None,
        on_finish: Callable[[Completion], None] | None = None,
        after: dict[str, str] | None = None,
    ) -> dict[str, Completion]:
        from deploy.engine_client import EngineClient, complete

        StepPlanner.check_batch(requests, self.capacity)
        client = EngineClient(self.handle)

        async def one(request: Request) -> Completion:
            done = await complete(client, request)
            if on_finish is not None:
                on_finish(done)
            return done

        schedule = ArrivalSchedule.by_key(requests, arrival_s, after)
        return {c.req_id: c for c in asyncio.run(run_at_arrivals(schedule, one))}

    def profile(self) -> dict[str, Any]:
        stats = self.stats()
        workers = stats["workers"].values()
        caches = [w["kv_cache"] for w in workers if "kv_cache" in w]
        timeline = {
            f"{kind}_{key}": value
            for kind, line in stats["timeline"].items()
            for key, value in line.items()
        }
        # each worker's peak, summed: at most what ran at once
        peak = sum(w.get("peak_running", 0) for w in workers)
        spec = spec_summary(stats.get("spec_decode") or {})
        return timeline | {"peak_running": peak} | combined_stats(caches) | spec

    def reset_profile(self) -> None:
        import ray

        ray.get(self.handle.reset_timeline.remote())

    def stats(self) -> dict[str, Any]:
        import ray

        return ray.get(self.handle.stats.remote())

    def close(self) -> None:
        import ray

        try:
            ray.get(self.handle.shutdown.remote())
        finally:
            ray.kill(self.handle)


def open_engine(config: EngineConfig, loaded: Any = None) -> Engine:
    """Start the engine of `config.mode`; `loaded` (a LoadedModel) saves loading it again in local
    mode."""
    return InProcessEngine(config, loaded) if config.mode == "local" else RayEngine(config)


def spec_summary(spec: dict[str, Any]) -> dict[str, Any]:
    """Speculative decoding's counts for a profile (the bench summary): none where it is off."""
    if not spec.get("num_drafts"):
        return {}
    return {
        "spec_drafts": spec["num_drafts"],
        "spec_draft_tokens": spec["num_draft_tokens"],
        "spec_accepted_tokens": spec["num_accepted_tokens"],
        "spec_acceptance_rate": round(spec["acceptance_rate"], 4),
    }
