"""GPU step-time cost models for `benchmarks.gpu_sim`: the model, its cited constants, and a fit
of the constants to pdserve's own forward timed on a device (`pdserve gpu-bench --fit-cost-model`).
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from scheduler.plan import StepPlan


@dataclass(frozen=True)
class CostModel:
    """Step times of one model on one GPU, in seconds."""

    name: str
    prefill_fixed_s: float  # a
    prefill_per_token_s: float  # b
    prefill_per_token_context_s: float  # c: per (query token, key token) pair
    decode_fixed_s: float  # d
    decode_per_seq_s: float  # e
    decode_per_kv_token_s: float  # f
    kv_bytes_per_token: int
    kv_tokens: int  # KV cache room per worker
    link_bytes_per_s: float  # prefill -> decode
    source: str
    startup_s: float = 0.0  # from a worker's start to its first step

    def step_s(self, plan: StepPlan) -> float:
        """One forward: the weights are read once, whatever the step holds."""
        seconds = 0.0
        if plan.prefill:
            tokens = sum(c.num_tokens for c in plan.prefill)
            pairs = sum(c.num_tokens * (c.start_pos + c.num_tokens / 2) for c in plan.prefill)
            seconds += (
                self.prefill_fixed_s
                + self.prefill_per_token_s * tokens
                + self.prefill_per_token_context_s * pairs
            )
        if plan.decode:
            kv = sum(c.start_pos + 1 for c in plan.decode)
            fixed = 0.0 if plan.prefill else self.decode_fixed_s
            seconds += (
                fixed + self.decode_per_seq_s * len(plan.decode) + self.decode_per_kv_token_s * kv
            )
        return seconds


# Llama-3.1-8B (bf16: 8.03e9 parameters, 16.06 GB; 32 layers, 32 heads and 8 KV heads of 128:
# 131,072 KV bytes per token; its config.json) on an NVIDIA A10 (24 GB at 600 GB/s, 125 TFLOPS
# dense BF16: NVIDIA's A10 datasheet), at an assumed 80% of the bandwidth and 60% (prompts) or
# 50% (attention) of the FLOPS. d: the weights once = 16.06e9 / 480e9; e: 2 x 8.03e9 FLOPs of a
# sequence's token at 50%; f: 131,072 bytes per KV token read; b: 2 x 8.03e9 per prompt token at
# 60%; c: 4 x 32 layers x 4096 per (query, key) pair at 50%; a: the weights once. KV room: 24 GB -
# 16.06 GB weights - 2 GB activations and workspace ~ 5.9 GB = 45,000 tokens. The link: 100 Gb/s.
# A worker's start: the weights read from a local NVMe disk at 2 GB/s (8 s) and the engine's
# warm-up (CUDA graphs, the first compiles), together assumed 30 s.
A10_LLAMA_8B = CostModel(
    name="a10-llama-3.1-8b",
    prefill_fixed_s=0.0335,
    prefill_per_token_s=2 * 8.03e9 / (0.6 * 125e12),
    prefill_per_token_context_s=4 * 32 * 4096 / (0.5 * 125e12),
    decode_fixed_s=16.06e9 / 480e9,
    decode_per_seq_s=2 * 8.03e9 / (0.5 * 125e12),
    decode_per_kv_token_s=131_072 / 480e9,
    kv_bytes_per_token=131_072,
    kv_tokens=45_000,
    link_bytes_per_s=12.5e9,
    source="NVIDIA A10 datasheet (600 GB/s, 125 TFLOPS BF16 dense); Llama-3.1-8B config.json; "
    "efficiencies assumed: 80% bandwidth, 60%/50% FLOPS; start-up assumed 30 s",
    startup_s=30.0,
)
MODELS = {A10_LLAMA_8B.name: A10_LLAMA_8B}


def load_cost_model(name: str) -> CostModel:
    """A named cost model (`MODELS`) or one written by `pdserve gpu-bench --fit-cost-model`."""
    if name in MODELS:
        return MODELS[name]
    path = Path(name)
    if not path.is_file():
        raise ValueError(f"cost model {name!r} is neither one of {sorted(MODELS)} nor a JSON file")
    fields = json.loads(path.read_text())
    return CostModel(
        **{key: fields[key] for key in CostModel.__dataclass_fields__ if key in fields}
    )


# (prompt tokens, tokens already cached) of each timed prefill, and (batch, KV length) of each
# timed decode step: spans from launch-bound to compute- or bandwidth-bound on a GPU.
GPU_PREFILLS = ((64, 0), (256, 0), (1024, 0), (2048, 0), (4096, 0), (1024, 2048), (1024, 6144))
GPU_DECODES = ((1, 256), (1, 1024), (16, 256), (16, 1024), (64, 256), (64, 1024), (256, 1024))
CPU_PREFILLS = ((16, 0), (64, 0), (128, 0), (64, 128))
CPU_DECODES = ((1, 32), (1, 128), (4, 32), (4, 128), (16, 128))
BLOCK = 16


def _median_seconds(run: Any, device: torch.device, repeats: int = 5) -> float:
    for _ in range(2):  # warm-up: kernel selection, allocator growth
        run()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def fit_cost_model(
    loaded: Any,
    device: str,
    name: str,
    link_bytes_per_s: float,
    startup_s: float,
    kv_memory_fraction: float = 0.9,
) -> tuple[CostModel, list[dict[str, Any]]]:
    """Time pdserve's forward (the model alone: no scheduling or sampling) on prompts and decode
    batches of the grid, and fit a, b, c and d, e, f by least squares (negative terms dropped, the
    rest refitted). Returns the model and each timed point beside the fit's prediction."""
    from workers.kv_cache import PagedKVCache
    from workers.model import BatchLayout

    model, spec = loaded.model, loaded.model.spec
    dev = torch.device(device)
    dtype = next(model.parameters()).dtype
    prefills, decodes = (
        (GPU_PREFILLS, GPU_DECODES)
        if dev.type == "cuda"
        else (
            CPU_PREFILLS,
            CPU_DECODES,
        )
    )
    blocks = max(
        max(-(-(t + s) // BLOCK) for t, s in prefills),
        max(b * -(-(n + 1) // BLOCK) for b, n in decodes),
    )
    cache = PagedKVCache(
        spec.num_layers, blocks, spec.num_kv_heads, BLOCK, spec.head_dim, dtype, device
    )
    cache.k.normal_()
    cache.v.normal_()
    generator = torch.Generator().manual_seed(0)

    def ids(count: int) -> list[int]:
        return torch.randint(2, spec.vocab_size, (count,), generator=generator).tolist()

    def timed(rows: list[tuple[list[int], list[int], int]], decode: int, last: list[int]) -> float:
        input_ids, layout = BatchLayout.pack(rows, decode, BLOCK, dev)
        logits_at = torch.tensor(last, device=dev)
        with torch.no_grad():
            return _median_seconds(lambda: model(input_ids, layout, cache, logits_at), dev)

    points: list[dict[str, Any]] = []
    for tokens, cached in prefills:
        table = list(range(-(-(tokens + cached) // BLOCK)))
        seconds = timed([(table, ids(tokens), cached)], 0, [tokens - 1])
        pairs = tokens * (cached + tokens / 2)
        points.append(
            {"kind": "prefill", "tokens": tokens, "cached": cached, "s": seconds}
            | {"terms": [1.0, float(tokens), pairs]}
        )
    for batch, length in decodes:
        per = -(-(length + 1) // BLOCK)
        rows = [(list(range(i * per, (i + 1) * per)), ids(1), length) for i in range(batch)]
        seconds = timed(rows, batch, list(range(batch)))
        points.append(
            {"kind": "decode", "batch": batch, "kv_len": length, "s": seconds}
            | {"terms": [1.0, float(batch), float(batch * (length + 1))]}
        )
    a, b, c = _fit([p for p in points if p["kind"] == "prefill"])
    d, e, f = _fit([p for p in points if p["kind"] == "decode"])
    per_token = PagedKVCache.bytes_per_token(
        spec.num_layers, spec.num_kv_heads, spec.head_dim, dtype
    )
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if dev.type == "cuda":
        del cache
        total = torch.cuda.mem_get_info(dev)[1]
        label = torch.cuda.get_device_name(dev)
    else:
        total = weights + 2**30  # a CPU worker's default KV: 1 GiB
        label = "cpu"
    kv_tokens = int(max(0.0, total * kv_memory_fraction - weights) // per_token)
    cost = CostModel(
        name=name,
        prefill_fixed_s=a,
        prefill_per_token_s=b,
        prefill_per_token_context_s=c,
        decode_fixed_s=d,
        decode_per_seq_s=e,
        decode_per_kv_token_s=f,
        kv_bytes_per_token=per_token,
        kv_tokens=kv_tokens,
        link_bytes_per_s=link_bytes_per_s,
        source=f"pdserve gpu-bench --fit-cost-model on {label} ({torch.__version__}, {dtype}): "
        f"least squares over {len(points)} timed forwards; KV room {kv_memory_fraction:.0%} of "
        f"device memory less the weights; link {link_bytes_per_s / 1e9:.0f} GB/s and start-up "
        f"{startup_s:.0f} s as given",
        startup_s=startup_s,
    )
    for point in points:
        terms = point.pop("terms")
        coefficients = (a, b, c) if point["kind"] == "prefill" else (d, e, f)
        point["fit_s"] = sum(x * k for x, k in zip(terms, coefficients, strict=True))
    return cost, points


def _fit(points: list[dict[str, Any]]) -> tuple[float, float, float]:
    """Least squares of seconds on the three terms, relative to each point (a 10 ms step and a
    1 s step count alike), without negative coefficients: a term whose coefficient comes out
    negative is dropped and the rest refitted. A term that is zero at every point says nothing:
    it is 0 from the start, so the system keeps full rank and the answer does not hang on how a
    LAPACK build treats a singular matrix."""
    keep = [k for k in range(3) if any(p["terms"][k] for p in points)] or [0]
    while True:
        rows = torch.tensor(
            [[p["terms"][k] / p["s"] for k in keep] for p in points], dtype=torch.float64
        )
        ones = torch.ones(len(points), 1, dtype=torch.float64)
        solution = torch.linalg.lstsq(rows, ones, driver="gelsd").solution[:, 0].tolist()
        if min(solution) >= 0 or len(keep) == 1:
            break
        keep.pop(solution.index(min(solution)))
    out = [0.0, 0.0, 0.0]
    for k, value in zip(keep, solution, strict=True):
        out[k] = max(0.0, value)
    return out[0], out[1], out[2]


def cost_model_json(cost: CostModel, points: list[dict[str, Any]]) -> str:
    return json.dumps(asdict(cost) | {"points": points}, indent=2)
