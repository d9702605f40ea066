"""The worker actor of both pools: loads the model once and runs step plans on its own cache."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import uuid
from typing import Any

import ray
import torch

from scheduler.cell.gc_pauses import freeze_startup_objects
from scheduler.messages import KVImport, KVPiece, StepResult, WorkerRestarted, unpack_plans
from scheduler.speculation import SpeculativeConfig
from workers.catalog import MAX_DEFAULT_CONTEXT
from workers.decode_graphs import GraphOptions
from workers.drafter import Drafter, load_draft_model
from workers.kv_transfer import (
    ImportReport,
    KVReceiver,
    KVSender,
    choose_transport,
    make_transport,
    usable_transports,
)
from workers.loader import load_model, resolve_device
from workers.lora import ResidentLoras
from workers.runner import ModelRunner
from workers.tp_group import TPFollowers

log = logging.getLogger(__name__)

# a NIXL sender's staging pool: this share of the bytes of its KV cache
_STAGING_SHARE = 4


class Worker:
    """A worker of either pool: loads the model and a paged KV cache once, then runs the step
    plans the scheduler sends. As a prefill worker it sends each chunk's KV rows out as soon as
    they are computed (the plans' exports: when a prompt's last chunk is done, only that piece is
    left to send); as a decode worker it imports handed-off KV into its blocks before a step and
    runs decode steps (and short or colocated prompts). The role is the scheduler's to choose and
    change: one class, so a worker can move between the pools with its cache. `torch` uses as many
    threads as the actor has CPUs."""

    def __init__(
        self,
        index: int,
        model: str,
        dtype: str,
        device: str,
        num_blocks: int,
        block_size: int,
        num_threads: int,
        kv_transport: str = "auto",
        kv_cache_dtype: str = "auto",
        quantization: str | None = None,
        speculative: SpeculativeConfig | None = None,
        max_loras: int | None = None,
        max_lora_rank: int = 16,
        lora_dtype: str = "auto",
        tensor_parallel_size: int = 1,
        num_cpus: float | None = None,
        num_gpus: float | None = None,
        graphs: GraphOptions | None = None,
    ) -> None:
        torch.set_num_threads(max(1, num_threads))
        self.index = index
        device = resolve_device(device)
        # a tensor-parallel worker: this actor is rank 0; its ranks 1.. are actors it starts on its
        # node, each with this actor's `num_cpus` and `num_gpus` (`workers/tp_group.py`)
        self.followers = None
        self.ranks: list[dict[str, Any]] = []  # what ranks 1.. reported
        if tensor_parallel_size > 1:
            self.followers = TPFollowers.start(
                tensor_parallel_size,
                model,
                dtype,
                device,
                num_threads,
                num_cpus,
                num_gpus,
                quantization,
            )
        # beside the followers' loads (a collective, quantized), then their KV pools
        loaded = load_model(model, dtype, device, quantization, tensor_parallel_size)
        if self.followers is not None:
            self.ranks = self.followers.start_runners(num_blocks, block_size, kv_cache_dtype)
        # every worker loads a draft model: the pool planner may move any worker to decode
        draft = load_draft_model(speculative, loaded.model, dtype, device)
        self.runner = ModelRunner(
            loaded.model,
            num_blocks,
            block_size=block_size,
            tokenizer=loaded.tokenizer,
            kv_cache_dtype=kv_cache_dtype,
            drafter=None if draft is None else Drafter(draft, num_blocks, block_size),
            loras=None
            if max_loras is None
            else ResidentLoras(loaded.model, max_loras, max_lora_rank, lora_dtype),
            followers=self.followers,
            graphs=graphs,
        )
        self.kv_transport = kv_transport
        self.transports = usable_transports(self.runner.device, kv_transport)
        tp = loaded.model.tp
        self.sender = KVSender(self.runner.cache, make_transport("object_store"), self._kv_rows)
        self.receiver = KVReceiver(
            self.runner.cache, kv_heads=None if tp is None else tp.shard.kv_heads
        )
        # which start of this actor this is: Ray reruns __init__ when it restarts the actor
        self.incarnation = uuid.uuid4().hex
        freeze_startup_objects()

    def ready(self) -> dict[str, Any]:
        """Where this worker runs, which KV transports it can use and its KV pool: answered once the
        model is loaded."""
        return {
            "index": self.index,
            "node_id": ray.get_runtime_context().get_node_id(),
            "pid": os.getpid(),
            "device": str(self.runner.device),
            "gpu_ids": [str(i) for i in ray.get_gpu_ids()],
            "threads": torch.get_num_threads(),
            "tensor_parallel_size": 1 + len(self.ranks),
            "ranks": self.ranks,
            "incarnation": self.incarnation,
            "transports": self.transports,
            "kv_cache": {
                "blocks": self.runner.cache.num_blocks,
                "block_size": self.runner.cache.block_size,
                "bytes": self.runner.cache.total_bytes,
                "dtype": self.runner.cache.dtype_name,
            },
        }

    def connect(self, peers: list[dict[str, Any]]) -> str:
        """Choose the transport for the KV this worker sends, as a prefill worker, to its decode
        `peers` (what their `ready()` reported); raises ValueError, with the reason, if the
        configured one cannot serve every pair, or a peer keeps its KV in another dtype."""
        name = choose_transport(self.kv_transport, self.ready(), peers)
        if name != self.sender.transport.name:
            cache = self.runner.cache
            # NIXL stages puts in a registered pool; past it, KV goes through the object store
            staging = cache.total_bytes // _STAGING_SHARE
            transport = make_transport(name, cache.k.device, staging)
            self.sender = KVSender(cache, transport, self._kv_rows)
        return name

    def reset(self) -> None:
        """Forget every request (a restarted scheduler knows none): their sampling states and
        last samples. The KV blocks stay as they are: the new scheduler plans them afresh."""
        states = self.runner.states
        states.drop([*states.params, *states.states])
        self.runner.last_sampled = {}
        if self.followers is not None:
            self.followers.reset()

    def prefetch(self, pieces: list[KVPiece]) -> None:
        """Pull KV pieces of prompts still prefilling on another node to this one, in the
        background: their import then reads local memory. Returns at once; a piece that cannot be
        pulled is left to the import, which reports it lost."""
        self.receiver.prefetch(pieces)

    def step(
        self, packed: bytes, imports: list[KVImport], incarnation: str | None = None
    ) -> list[StepResult]:
        """Import the KV pieces (of handoffs, and of prompts still prefilling into their reserved
        blocks), then run each plan (`packed`: `pack_plans`) in order, sending out the rows each
        exports; a result per plan (the first one reports the imports). A call may carry several
        plans (a decode burst): each step is fed the tokens the one before sampled. `incarnation`:
        the one the scheduler last saw in `ready()`; another one raises WorkerRestarted."""
        if incarnation is not None and incarnation != self.incarnation:
            raise WorkerRestarted(f"worker {self.index} was restarted since its last ready()")
        start = time.perf_counter()
        plans = unpack_plans(packed)
        # a tensor-parallel worker's ranks each import their own KV heads' rows, before the plans
        importing = (
            [] if not imports or self.followers is None else self.followers.import_all(imports)
        )
        report = self.receiver.import_all(imports) if imports else ImportReport()
        for failed in ray.get(importing):  # a request one rank could not import is lost to all
            report.failed = sorted(set(report.failed) | set(failed))
        lost = set(report.failed)
        results = []
        for plan in plans:
            if lost:
                plan = dataclasses.replace(
                    plan,
                    decode=[c for c in plan.decode if c.req_id not in lost],
                    prefill=[c for c in plan.prefill if c.req_id not in lost],
                )
            samples = self._execute(plan)
            pieces = self.sender.export(plan.exports) if plan.exports else []
            results.append(
                StepResult(
                    samples=samples,
                    kv_pieces=pieces,
                    step_s=time.perf_counter() - start,
                    forward_s=self.runner.last_forward_s,
                )
            )
            start = time.perf_counter()
        results[0].failed_imports = report.failed
        results[0].import_s = report.import_s
        results[0].kv_transfers = {
            name: (c.bytes, c.seconds, c.failures) for name, c in report.transfers.items()
        }
        return results

    def _kv_rows(self, spans: list[tuple[list[int], int, int]]) -> torch.Tensor:
        """The exported rows of `spans` with every KV head: a tensor-parallel worker's ranks each
        give theirs."""
        own = self.runner.cache.export_spans(spans)  # [layers, 2, its KV heads, tokens, width]
        if self.followers is None:
            return own
        model = self.runner.model
        heads = model.tp.shard.kv_heads
        return self.followers.export_spans(own, heads, model.spec.num_kv_heads, spans)

    def _execute(self, plan: Any) -> Any:
        """The runner's execute. A tensor-parallel worker whose step failed (a rank died, or one
        failed part way, leaving the others inside a collective) ends this process too, so that Ray
        restarts the worker and its ranks whole and the cell recomputes its requests."""
        try:
            return self.runner.execute(plan)
        except Exception:
            if self.followers is not None:
                lost = "lost a rank" if not self.followers.alive() else "failed a step"
                log.exception("tensor-parallel worker %d %s: restarting whole", self.index, lost)
                os._exit(1)
            raise


def spawn_worker(
    config: Any,
    kind: str,
    index: int,
    num_blocks: int,
    block_size: int,
    name: str | None = None,
    namespace: str | None = None,
    worker_class: type[Worker] = Worker,
) -> Any:
    """Start one worker actor of a pool (`kind` "prefill" or "decode"); returns its handle at once.

    `config` is deploy's EngineConfig (model, dtype, device, resources, restarts, CPUs per worker).
    The scheduler actor calls this (through `functools.partial(spawn_worker, config)`), with the
    number of KV blocks it plans for this worker, so it owns its workers. A worker takes
    `gpus_per_worker` GPUs (one where the cluster has GPUs, by default), `num_cpus_per_worker` CPUs
    and as many torch threads; Ray restarts it `max_worker_restarts` times.

    With a `name`, the worker is a detached actor of that name (in `namespace`), or the live one
    already so named: it outlives the scheduler that made it, and a restarted scheduler finds it
    again. Whoever named it stops it (`ray.kill`).

    `worker_class`: `Worker`, or a subclass of it (tests pass workers that hold or time their
    steps).
    """
    gpus = config.gpus_for(ray.cluster_resources().get("GPU", 0))
    # the graphs' block tables are as wide as the longest request (capped as the cell caps it)
    max_model_len = config.max_model_len or MAX_DEFAULT_CONTEXT
    options = {
        "max_restarts": config.max_worker_restarts,
        "max_task_retries": 0,
        "enable_task_events": False,
        "num_cpus": config.num_cpus_per_worker,
        "num_gpus": gpus,
        "resources": config.prefill_resources if kind == "prefill" else config.decode_resources,
    }
    if name is not None:
        options |= {
            "name": name,
            "namespace": namespace,
            "lifetime": "detached",
            "get_if_exists": True,
        }
    return (
        ray.remote(worker_class)
        .options(**options)
        .remote(
            index,
            config.model,
            config.dtype,
            config.device,
            num_blocks,
            block_size,
            config.worker_threads(),
            config.kv_transport,
            config.kv_cache_dtype,
            config.quantization,
            config.speculative,
            config.max_loras if config.lora_enabled else None,
            config.max_lora_rank,
            config.lora_dtype,
            config.tp_size(kind),
            config.num_cpus_per_worker,
            gpus,
            graphs=None if config.enforce_eager else GraphOptions(config.slots, max_model_len),
        )
    )
