"""The yardsticks the engine is measured against: `transformers` serial and static `generate`, and a
copy."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from tqdm import tqdm

from deploy.bench.workload import Workload
from deploy.config import EngineConfig


def synchronize(device: str | torch.device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(
    num_bytes: int, device: str | torch.device = "cpu", trials: int = 5, copies: int = 10
) -> float:
    """GB/s of `dst.copy_(src)` of `num_bytes` on the device, best trial, counting memory traffic:
    bytes read + bytes written (2 x the size). Every bandwidth figure of the bench uses this
    convention: a decode step's traffic is the bytes it reads; a KV handoff's is 2 x its size (each
    byte read once, written once)."""
    # ones: touches every page
    src = torch.ones(max(1, num_bytes // 4), dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    nbytes = src.numel() * src.element_size()
    for _ in range(2):
        dst.copy_(src)
    best = 0.0
    for _ in range(trials):
        synchronize(device)
        start = time.perf_counter()
        for _ in range(copies):
            dst.copy_(src)
        synchronize(device)
        best = max(best, 2 * nbytes * copies / (time.perf_counter() - start) / 1e9)
    return best


def bench_serial(
    hf: Any, work: Workload, limit: int, progress: Callable[[int], Any] | None = None
) -> dict[str, float]:
    """One request at a time through `generate` (greedy, exact output lengths)."""
    tokens = 0
    start = time.perf_counter()
    for prompt, n in list(zip(work.prompts, work.output_lens, strict=True))[:limit]:
        ids = torch.tensor([prompt])
        hf.generate(
            ids.to(hf.device),
            attention_mask=torch.ones_like(ids).to(hf.device),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
        tokens += n
        if progress:
            progress(1)
    elapsed = time.perf_counter() - start
    return {"serial_tok_s": tokens / elapsed, "serial_requests": min(limit, len(work.prompts))}


def bench_static(
    hf: Any, work: Workload, batch_size: int, progress: Callable[[int], Any] | None = None
) -> dict[str, Any]:
    """Fixed batches of `batch_size`, left-padded, each running until its longest output is done:
    only the tokens each request asked for count as useful (taken from what `generate` returned).
    Timed with the device synchronized, so it holds on a GPU too."""
    sync = torch.cuda.synchronize if hf.device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    useful = 0
    for i in range(0, len(work.prompts), batch_size):
        prompts = work.prompts[i : i + batch_size]
        lens = work.output_lens[i : i + batch_size]
        width = max(map(len, prompts))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        out = hf.generate(
            ids.to(hf.device),
            attention_mask=mask.to(hf.device),
            max_new_tokens=max(lens),
            min_new_tokens=max(lens),
            do_sample=False,
            pad_token_id=0,
        )
        useful += sum(min(n, out.shape[1] - width) for n in lens)
        if progress:
            progress(len(prompts))
    sync()
    elapsed = time.perf_counter() - start
    return {
        "static_tok_s": useful / elapsed,
        "static_tokens": useful,
        "static_s": elapsed,
        "static_batch": batch_size,
    }


def run_baselines(
    config: EngineConfig,
    loaded: Any,
    work: Workload,
    baselines: list[str],
    serial_requests: int,
    quiet: bool,
) -> dict[str, Any]:
    """Load the same checkpoint into `transformers` and run the baselines asked for, with progress
    bars."""
    from transformers import AutoModelForCausalLM

    from workers.loader import resolve_checkpoint

    weight = loaded.model.output_weight()
    hf = AutoModelForCausalLM.from_pretrained(resolve_checkpoint(config.model), dtype=weight.dtype)
    hf = hf.to(weight.device).eval()
    out: dict[str, Any] = {}
    with torch.inference_mode():
        if "serial" in baselines:
            with tqdm(
                total=min(serial_requests, len(work.prompts)),
                desc="serial generate",
                unit="req",
                file=sys.stderr,
                leave=False,
                disable=quiet,
            ) as bar:
                out |= bench_serial(hf, work, serial_requests, bar.update)
        if "static" in baselines:
            with tqdm(
                total=len(work.prompts),
                desc=f"static generate, batches of {config.slots}",
                unit="req",
                file=sys.stderr,
                leave=False,
                disable=quiet,
            ) as bar:
                out |= bench_static(hf, work, config.slots, bar.update)
    return out
