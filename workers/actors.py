"""Prefill and decode worker actors: each loads the model once and runs step plans on its own cache."""

from __future__ import annotations

import dataclasses
import os
import time
import warnings
from typing import Any

import ray
import torch

from scheduler.plan import StepPlan
from workers.loader import load_model, resolve_device
from workers.messages import KVHandoff, KVImport, StepResult
from workers.runner import ModelRunner


class _ModelWorker:
    """Loads the model and a slot cache; `torch` uses as many threads as the actor has CPUs."""

    def __init__(self, index: int, model: str, dtype: str, device: str, num_slots: int, capacity: int,
                 num_threads: int) -> None:
        torch.set_num_threads(max(1, num_threads))
        self.index = index
        loaded = load_model(model, dtype, resolve_device(device))
        self.runner = ModelRunner(loaded.model, num_slots=num_slots, capacity=capacity)

    def ready(self) -> dict[str, Any]:
        """Where this worker runs: answered once the model is loaded."""
        return {"index": self.index, "node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid(),
                "device": str(self.runner.device), "threads": torch.get_num_threads()}


class PrefillWorker(_ModelWorker):
    """Runs prompt chunks; when a prompt's last chunk is done, exports its KV rows to the object store."""

    def step(self, plan: StepPlan) -> StepResult:
        start = time.perf_counter()
        sampled = self.runner.execute(plan)
        handoffs = []
        for chunk in plan.chunks:
            if not chunk.sample:
                continue
            export_start = time.perf_counter()
            length = chunk.start_pos + chunk.num_tokens
            rows = self.runner.cache.export_rows(chunk.slot, length)  # the row is free for reuse after this
            ref = ray.put(rows)
            handoffs.append(KVHandoff(chunk.req_id, ref, length, rows.nbytes, time.perf_counter() - export_start,
                                      self.index))
        return StepResult(sampled=sampled, handoffs=handoffs, step_s=time.perf_counter() - start)


class DecodeWorker(_ModelWorker):
    """Imports handed-off KV rows into its slots and runs decode steps (and short or colocated prompts)."""

    def step(self, plan: StepPlan, imports: list[KVImport] = ()) -> StepResult:  # type: ignore[assignment]
        start = time.perf_counter()
        failed: list[str] = []
        import_s: dict[str, float] = {}
        for item in imports:
            t0 = time.perf_counter()
            try:
                rows = ray.get(item.handoff.ref)  # zero-copy view of the object store's shared memory
            except (ray.exceptions.ObjectLostError, ray.exceptions.OwnerDiedError,
                    ray.exceptions.ObjectFetchTimedOutError, ray.exceptions.ObjectReconstructionFailedError):
                failed.append(item.handoff.req_id)
                continue
            with warnings.catch_warnings():  # the shared buffer is read-only; we only read it
                warnings.simplefilter("ignore", UserWarning)
                self.runner.cache.import_rows(item.slot, rows)
            import_s[item.handoff.req_id] = time.perf_counter() - t0
        if failed:
            lost = set(failed)
            plan = dataclasses.replace(plan, decode=[c for c in plan.decode if c.req_id not in lost],
                                       prefill=[c for c in plan.prefill if c.req_id not in lost])
        sampled = self.runner.execute(plan)
        return StepResult(sampled=sampled, failed_imports=failed, import_s=import_s,
                          step_s=time.perf_counter() - start)
