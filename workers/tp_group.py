"""A tensor-parallel worker's ranks 1..N-1: Ray actors, in one placement group with rank 0, that
each hold their shard of the model and their KV pool and run every plan rank 0 runs."""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any

import ray
import torch
import torch.distributed as dist
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

import workers
from scheduler.plan import StepPlan
from workers.loader import load_model
from workers.runner import ModelRunner

# how long rank 0 waits for its followers to join the group (they load nothing before joining)
_JOIN_TIMEOUT = timedelta(minutes=5)


def init_rank(address: str, rank: int, size: int, device: str) -> None:
    """Join this process to its worker's `torch.distributed` group (its default group): NCCL
    between GPUs, gloo on the CPU."""
    backend = "nccl" if device.startswith("cuda") else "gloo"
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
    ) -> None:
        torch.set_num_threads(max(1, num_threads))
        init_rank(address, rank, size, device)
        self.rank = rank
        self.model = load_model(model, dtype, device, None, size, rank).model
        self.runner: ModelRunner | None = None

    def start(self, num_blocks: int, block_size: int, kv_cache_dtype: str) -> dict[str, Any]:
        """Build its KV pool of `num_blocks` blocks (the scheduler's, as rank 0's); what it runs."""
        self.runner = ModelRunner(self.model, num_blocks, block_size, kv_cache_dtype=kv_cache_dtype)
        return {
            "rank": self.rank,
            "pid": os.getpid(),
            "threads": torch.get_num_threads(),
            "kv_heads": self.runner.cache.k.shape[2],
            "code": os.path.dirname(workers.__file__),
        }

    def execute(self, plan: StepPlan) -> None:
        if self.runner is None:
            raise RuntimeError(f"rank {self.rank} was sent a plan before start()")
        self.runner.execute(plan)

    def alive(self) -> bool:
        return True

    def reset(self) -> None:
        """Forget the tokens it last fed (rank 0's worker forgot every request)."""
        if self.runner is not None:
            self.runner.last_sampled = {}


class TPFollowers:
    """Rank 0's handle on ranks 1..N-1: `start` spawns them and joins rank 0 (this process) to
    their group; every plan then goes to each once (`execute`, `wait`)."""

    def __init__(self, actors: list[Any], group: Any, own_group: bool) -> None:
        self.actors = actors
        self.placement = group
        self.own_group = own_group  # made here, so removed here

    @classmethod
    def start(
        cls,
        size: int,
        model: str,
        dtype: str,
        device: str,
        num_threads: int,
        group: Any = None,
    ) -> TPFollowers:
        """Spawn ranks 1..`size`-1 into bundles 1.. of placement `group` (bundle 0 is rank 0's;
        without one, a STRICT_PACK group of `size` bundles of `num_threads` CPUs, or of one GPU
        each, is made here), then join rank 0 to them: returns once all are in the group."""
        gpu = device.startswith("cuda")
        bundle = {"GPU": 1} if gpu else {"CPU": num_threads}
        own_group = group is None
        if own_group:
            group = placement_group([bundle] * size, strategy="STRICT_PACK")
            ray.get(group.ready())
        address = f"{ray.util.get_node_ip_address()}:{_free_port()}"
        actor = ray.remote(FollowerRank)
        actors = [
            actor.options(
                num_cpus=0 if gpu else num_threads,
                num_gpus=1 if gpu else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    group, placement_group_bundle_index=rank
                ),
                enable_task_events=False,
            ).remote(address, rank, size, model, dtype, device, num_threads)
            for rank in range(1, size)
        ]
        followers = cls(actors, group, own_group)
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
        return ray.get(starts)

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
        """Leave the group and stop the followers (and the placement group made for them)."""
        if dist.is_initialized():
            dist.destroy_process_group()
        for actor in self.actors:
            ray.kill(actor)
        if self.own_group:
            remove_placement_group(self.placement)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]
