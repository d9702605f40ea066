"""Prefill and decode worker actors: each loads the model once and runs step plans on its own
cache."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import os
import time
import warnings
from typing import Any

import ray
import torch

from scheduler.cell.gc_pauses import freeze_startup_objects
from scheduler.messages import KVImport, KVPiece, StepResult, unpack_plans
from scheduler.plan import StepPlan
from workers.loader import load_model, resolve_device
from workers.runner import ModelRunner

_PULL_TIMEOUT_S = 60.0


class _ModelWorker:
    """Loads the model and a paged KV cache; `torch` uses as many threads as the actor has
    CPUs."""

    def __init__(
        self,
        index: int,
        model: str,
        dtype: str,
        device: str,
        num_blocks: int,
        block_size: int,
        num_threads: int,
    ) -> None:
        torch.set_num_threads(max(1, num_threads))
        self.index = index
        loaded = load_model(model, dtype, resolve_device(device))
        self.runner = ModelRunner(
            loaded.model, num_blocks, block_size=block_size, tokenizer=loaded.tokenizer
        )
        freeze_startup_objects()

    def ready(self) -> dict[str, Any]:
        """Where this worker runs: answered once the model is loaded."""
        return {
            "index": self.index,
            "node_id": ray.get_runtime_context().get_node_id(),
            "pid": os.getpid(),
            "device": str(self.runner.device),
            "threads": torch.get_num_threads(),
        }


class PrefillWorker(_ModelWorker):
    """Runs prompt chunks, and puts each chunk's KV rows into the object store as soon as it is
    computed (the plan's exports): when a prompt's last chunk is done, only that piece is left to
    send."""

    def step(self, packed: bytes, imports: list[KVImport]) -> list[StepResult]:
        """Each plan in order (the scheduler sends one at a time here); a result per plan."""
        return [self._step(plan) for plan in unpack_plans(packed)]

    def _step(self, plan: StepPlan) -> StepResult:
        start = time.perf_counter()
        samples = self.runner.execute(plan)
        pieces = []
        # one object for all the step's rows: a put costs about a millisecond however small
        if plan.exports:
            export_start = time.perf_counter()
            rows = self.runner.cache.export_spans(
                [(table, first, end) for _, table, first, end in plan.exports]
            )
            ref = ray.put(rows)
            per_token = rows.nbytes // max(1, rows.shape[3])
            export_s = time.perf_counter() - export_start
            offset = 0
            for req_id, _, first, end in plan.exports:
                pieces.append(
                    KVPiece(
                        req_id, first, end - first, ref, per_token * (end - first), export_s, offset
                    )
                )
                offset += end - first
        return StepResult(
            samples=samples,
            kv_pieces=pieces,
            step_s=time.perf_counter() - start,
            forward_s=self.runner.last_forward_s,
        )


class DecodeWorker(_ModelWorker):
    """Imports handed-off KV into its blocks and runs decode steps (and short or colocated
    prompts). A call may carry several plans (a decode burst): each step is fed the tokens the one
    before sampled."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fetcher = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kv-prefetch")

    def prefetch(self, refs: list[Any]) -> None:
        """Pull KV pieces of prompts still prefilling on another node to this one, in the
        background: their import then reads local memory. Returns at once; a piece that cannot be
        pulled is left to the import, which reports it lost."""
        self.fetcher.submit(_pull, refs)

    def step(self, packed: bytes, imports: list[KVImport]) -> list[StepResult]:
        """Import the KV pieces (of handoffs, and of prompts still prefilling into their reserved
        slots), then run each plan (`packed`: `pack_plans`) in order; a result per plan (the first
        one reports the imports)."""
        start = time.perf_counter()
        plans = unpack_plans(packed)
        failed: list[str] = []
        import_s: dict[str, float] = {}
        for item in imports:
            t0 = time.perf_counter()
            todo = [  # pieces not yet here, but those wholly within what this worker holds
                piece
                for piece in item.handoff.pieces[item.handoff.imported :]
                if piece.start + piece.num_tokens > item.held
            ]
            try:  # zero-copy views of the object store's shared memory, copied once into blocks
                pieces = ray.get([piece.ref for piece in todo])
            except (
                ray.exceptions.ObjectLostError,
                ray.exceptions.OwnerDiedError,
                ray.exceptions.ObjectFetchTimedOutError,
                ray.exceptions.ObjectReconstructionFailedError,
            ):
                failed.append(item.handoff.req_id)
                continue
            with warnings.catch_warnings():  # the shared buffer is read-only; we only read it
                warnings.simplefilter("ignore", UserWarning)
                for piece, rows in zip(todo, pieces, strict=True):
                    # the positions before `held` are here already
                    position = max(piece.start, item.held)
                    first = piece.offset + position - piece.start
                    rows = rows[:, :, :, first : piece.offset + piece.num_tokens]
                    self.runner.cache.import_rows(item.block_table, rows, position)
            if item.final:
                import_s[item.handoff.req_id] = time.perf_counter() - t0
        lost = set(failed)
        results = []
        for plan in plans:
            if lost:
                plan = dataclasses.replace(
                    plan,
                    decode=[c for c in plan.decode if c.req_id not in lost],
                    prefill=[c for c in plan.prefill if c.req_id not in lost],
                )
            samples = self.runner.execute(plan)
            results.append(
                StepResult(
                    samples=samples,
                    step_s=time.perf_counter() - start,
                    forward_s=self.runner.last_forward_s,
                )
            )
            start = time.perf_counter()
        results[0].failed_imports = failed
        results[0].import_s = import_s
        return results


def _pull(refs: list[Any]) -> None:
    with contextlib.suppress(Exception):  # lost or timed out: the import finds out and says so
        ray.get(refs, timeout=_PULL_TIMEOUT_S)


def spawn_worker(config: Any, kind: str, index: int, num_blocks: int, block_size: int) -> Any:
    """Start one worker actor of a pool (`kind` "prefill" or "decode"); returns its handle at once.

    `config` is deploy's EngineConfig (model, dtype, device, resources, restarts, CPUs per worker).
    The scheduler actor calls this (through `functools.partial(spawn_worker, config)`), with the
    number of KV blocks it plans for this worker, so it owns its workers. A worker takes
    `gpus_per_worker` GPUs (one where the cluster has GPUs, by default), `num_cpus_per_worker` CPUs
    and as many torch threads; Ray restarts it `max_worker_restarts` times.
    """
    gpus = config.gpus_for(ray.cluster_resources().get("GPU", 0))
    cls = PrefillWorker if kind == "prefill" else DecodeWorker
    options = {
        "max_restarts": config.max_worker_restarts,
        "max_task_retries": 0,
        "enable_task_events": False,
        "num_cpus": config.num_cpus_per_worker,
        "num_gpus": gpus,
        "resources": config.prefill_resources if kind == "prefill" else config.decode_resources,
    }
    return (
        ray.remote(cls)
        .options(**options)
        .remote(
            index,
            config.model,
            config.dtype,
            config.device,
            num_blocks,
            block_size,
            max(1, int(config.num_cpus_per_worker)),
        )
    )
