"""A tensor-parallel worker's ranks 1..N-1: Ray actors on rank 0's node, owned by rank 0, that
each hold their shard of the model and their KV pool and run every plan rank 0 runs."""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any

import ray
import torch
import torch.distributed as dist
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

import workers
from scheduler.messages import KVImport
from scheduler.plan import StepPlan
from workers.kv_transfer import KVReceiver
from workers.loader import load_model
from workers.runner import ModelRunner

# how long rank 0 waits for its followers to join the group (they load nothing before joining)
_JOIN_TIMEOUT = timedelta(minutes=5)


def init_rank(address: str, rank: int, size: int, device: str) -> None:
    """Join this process to its worker's `torch.distributed` group (its default group): NCCL
    between GPUs, gloo on the CPU; `PDSERVE_TP_BACKEND=gloo` takes gloo on GPUs too (it takes
    CUDA tensors, and any number of ranks on one GPU, where NCCL may refuse two)."""
    backend = "nccl" if device.startswith("cuda") else "gloo"
    backend = os.environ.get("PDSERVE_TP_BACKEND", backend)
    dist.init_process_group(
        backend, init_method=f"tcp://{address}", rank=rank, world_size=size, timeout=_JOIN_TIMEOUT
    )


class FollowerRank:
    """Rank `rank` (1..N-1) of a tensor-parallel worker: joins the group, loads its shard, then
    builds its KV pool when rank 0 knows the blocks (`start`) and runs the plans rank 0 sends."""

    def __init__(
        self,
        address: str,
        rank: int,
        size: int,
        model: str,
        dtype: str,
        device: str,
        num_threads: int,
        quantization: str | None = None,
    ) -> None:
        torch.set_num_threads(max(1, num_threads))
        init_rank(address, rank, size, device)
        self.rank = rank
        # loading is a collective with rank 0's (int8 and fp8 scales of whole rows)
        self.model = load_model(model, dtype, device, quantization, size, rank).model
        self.runner: ModelRunner | None = None  # and its KV pool's receiver: built by start()
        self.receiver: KVReceiver | None = None

    def start(self, num_blocks: int, block_size: int, kv_cache_dtype: str) -> dict[str, Any]:
        """Build its KV pool of `num_blocks` blocks (the scheduler's, as rank 0's); what it runs."""
        self.runner = ModelRunner(self.model, num_blocks, block_size, kv_cache_dtype=kv_cache_dtype)
        kv_heads = self.model.tp.shard.kv_heads
        self.receiver = KVReceiver(self.runner.cache, kv_heads=kv_heads)
        return {
            "rank": self.rank,
            "pid": os.getpid(),
            "threads": torch.get_num_threads(),
            "kv_heads": self.runner.cache.k.shape[2],
            "kv_head_range": (kv_heads.start, kv_heads.stop),
            "code": os.path.dirname(workers.__file__),
        }

    def export_spans(self, spans: list[tuple[list[int], int, int]]) -> torch.Tensor:
        """Its KV heads' rows of the spans, `[layers, 2, its KV heads, tokens, width]`, on the
        host (rank 0 puts every head's in one piece)."""
        return self._started().cache.export_spans(spans).cpu()

    def import_all(self, imports: list[KVImport]) -> list[str]:
        """Its KV heads' rows of the imports, into its blocks; the requests it could not import."""
        self._started()
        assert self.receiver is not None  # (built with the runner)
        return self.receiver.import_all(imports).failed

    def execute(self, plan: StepPlan) -> None:
        self._started().execute(plan)

    def _started(self) -> ModelRunner:
        if self.runner is None:
            raise RuntimeError(f"rank {self.rank} was sent work before start()")
        return self.runner

    def alive(self) -> bool:
        return True

    def reset(self) -> None:
        """Forget the tokens it last fed (rank 0's worker forgot every request)."""
        if self.runner is not None:
            self.runner.last_sampled = {}


class TPFollowers:
    """Rank 0's handle on ranks 1..N-1: `start` spawns them and joins rank 0 (this process) to
    their group; every plan then goes to each once (`execute`, `wait`).

    The followers are actors this process owns, pinned to its node: they die with it, and free
    what they reserved. (A Ray placement group would outlive it: its lifetime is the job's, so each
    worker the cell stops or replaces would leave its group's CPUs or GPUs reserved.)"""

    def __init__(self, actors: list[Any]) -> None:
        self.actors = actors
        self.kv_heads: list[range] = []  # each follower's KV heads, once started

    @classmethod
    def start(
        cls,
        size: int,
        model: str,
        dtype: str,
        device: str,
        num_threads: int,
        num_cpus: float | None = None,
        num_gpus: float | None = None,
        quantization: str | None = None,
    ) -> TPFollowers:
        """Spawn ranks 1..`size`-1 on this node, each with `num_cpus` CPUs (default: its
        `num_threads`) and `num_gpus` GPUs (default: one on a GPU, else none), loading the model
        with `quantization`, then join rank 0 (this process) to them: returns once all are in the
        group. Rank 0 loads its shard next, beside theirs (`load_model` with the same
        arguments): loading a quantized model is a collective."""
        gpu = device.startswith("cuda")
        node = ray.get_runtime_context().get_node_id()
        address = f"{ray.util.get_node_ip_address()}:{_free_port()}"
        actor = ray.remote(FollowerRank)
        actors = [
            actor.options(
                num_cpus=num_threads if num_cpus is None else num_cpus,
                num_gpus=(1 if gpu else 0) if num_gpus is None else num_gpus,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
                enable_task_events=False,
            ).remote(address, rank, size, model, dtype, device, num_threads, quantization)
            for rank in range(1, size)
        ]
        followers = cls(actors)
        try:
            init_rank(address, 0, size, device)
        except BaseException:
            followers.shutdown()
            raise
        return followers

    def start_runners(
        self, num_blocks: int, block_size: int, kv_cache_dtype: str
    ) -> list[dict[str, Any]]:
        """Build every follower's KV pool; what each reports (rank, pid, threads, KV heads)."""
        starts = [a.start.remote(num_blocks, block_size, kv_cache_dtype) for a in self.actors]
        ranks = ray.get(starts)
        self.kv_heads = [range(*rank["kv_head_range"]) for rank in ranks]
        return ranks

    def export_spans(
        self, own: torch.Tensor, own_heads: range, num_kv_heads: int, spans: list[Any]
    ) -> torch.Tensor:
        """Every KV head's rows of `spans`, `[layers, 2, num_kv_heads, tokens, width]`: rank 0's
        `own` rows of `own_heads`, and each follower's of its heads (a head copied to several
        ranks is the same on each)."""
        theirs = ray.get([actor.export_spans.remote(spans) for actor in self.actors])
        layers, _, _, tokens, width = own.shape
        rows = own.new_empty(layers, 2, num_kv_heads, tokens, width)  # [layers, 2, KVH, T, width]
        rows[:, :, own_heads.start : own_heads.stop] = own
        for heads, part in zip(self.kv_heads, theirs, strict=True):
            rows[:, :, heads.start : heads.stop] = part.to(own.device)
        return rows

    def import_all(self, imports: list[KVImport]) -> list[Any]:
        """Start every follower's import of its KV heads' rows; `ray.get` gives what each lost."""
        return [actor.import_all.remote(imports) for actor in self.actors]

    def execute(self, plan: StepPlan) -> list[Any]:
        return [actor.execute.remote(plan) for actor in self.actors]

    def wait(self, running: list[Any]) -> None:
        ray.get(running)

    def reset(self) -> None:
        ray.get([actor.reset.remote() for actor in self.actors])

    def alive(self) -> bool:
        """Whether every follower still answers (within 10 s)."""
        try:
            ray.get([actor.alive.remote() for actor in self.actors], timeout=10)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return False
        return True

    def shutdown(self) -> None:
        """Leave the group and stop the followers."""
        if dist.is_initialized():
            dist.destroy_process_group()
        for actor in self.actors:
            ray.kill(actor)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]
