"""`pdserve gpu-bench`'s roofline: each decode step's time against the bytes it must read at the
measured copy bandwidth, and each prefill's against its FLOPs at the measured bf16 matmul peak.

The models are random-weight shapes built on the device (`gpu_model.random_model`) and stepped
through the engine's own `ModelRunner` KV pool, filled with random blocks rather than prefilled. A
decode point is timed as an eager forward over a layout packed beforehand and, where the runner
captured CUDA graphs (`runner.graphs`), as the graphs' replay of the same rows (which includes
copying the rows' inputs in).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch

from deploy.bench.baselines import synchronize

# the grids run on a GPU; the must-have points of the targets first, so a cut keeps them
DECODE_GRID = "1x1024,64x1024,8x1024,256x1024,1x128,64x128,256x128,1x4096,8x4096,64x4096"
PREFILL_GRID = "4096,512,1024,2048,8192"
CPU_DECODE_GRID = "1x32,4x64"
CPU_PREFILL_GRID = "32,64"
BLOCK_SIZE = 16
# timed calls per point after two warm-up calls (kept small: the whole bench has ~4 minutes)
DECODE_REPEATS = 5
PREFILL_REPEATS = 3
NOTES = {
    "decode_bytes": "every parameter once (the embedding rows looked up besides) + K and V of "
    "each row's context, every layer; KV writes and activations not counted",
    "roofline_ms": "bytes / the copy's GB/s (bytes read + written), so a step reading at the "
    "copy's full speed has a ratio of 1.0",
    "eager_ms": "DecoderLM forward over a layout packed beforehand (no host packing timed)",
    "graph_ms": "runner.graphs.run(rows): the captured decode graph's replay, inputs copied in",
    "prefill_flops": "2 x the layers' matmul weights x tokens + 2 x hidden x vocab (one logits "
    "row) + causal attention 4 x layers x heads x head_dim x tokens (tokens + 1) / 2",
}


@dataclasses.dataclass(frozen=True)
class DecodePoint:
    """What one decode step of `rows` rows, each at `context` tokens, must read."""

    rows: int
    context: int
    weight_bytes: float
    kv_bytes: float

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes

    def roofline_ms(self, copy_gb_s: float) -> float:
        return self.bytes / (copy_gb_s * 1e9) * 1e3


def weight_bytes_read(model: Any, decode_tokens: float) -> float:
    """Bytes of weights one decode step reads: every parameter once (a tied embedding is the
    lm_head, read whole once), and for an untied embedding only the rows looked up."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.model.embed_tokens.weight
    row = embed.shape[1] * embed.element_size()
    if not model.spec.tie_word_embeddings:
        total -= embed.numel() * embed.element_size()
    return total + decode_tokens * row


def decode_point(model: Any, rows: int, context: int) -> DecodePoint:
    """The bytes of a decode step of `rows` rows over `context` tokens each (the new one's K and V
    read back as it is attended)."""
    from workers.kv_cache import PagedKVCache

    spec = model.spec
    dtype = model.model.embed_tokens.weight.dtype
    per_token = PagedKVCache.bytes_per_token(
        spec.num_layers, spec.num_kv_heads, spec.head_dim, dtype
    )
    return DecodePoint(rows, context, weight_bytes_read(model, rows), rows * context * per_token)


def layer_matmul_params(spec: Any) -> int:
    """Weights of one layer's matmuls: q, k, v, o and the MLP's gate, up and down."""
    qkv = spec.hidden_size * (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim
    o = spec.num_heads * spec.head_dim * spec.hidden_size
    mlp = 3 * spec.hidden_size * spec.intermediate_size
    return qkv + o + mlp


def prefill_flops(spec: Any, tokens: int) -> float:
    """FLOPs of a prompt of `tokens` from position 0 with logits for its last token: the matmuls,
    2 per weight per token, and causal attention (QK^T and PV, each key once per query that sees
    it)."""
    matmuls = 2 * spec.num_layers * layer_matmul_params(spec) * tokens
    head = 2 * spec.hidden_size * spec.vocab_size
    pairs = tokens * (tokens + 1) // 2
    attention = 4 * spec.num_layers * spec.num_heads * spec.head_dim * pairs
    return float(matmuls + head + attention)


def parse_grid(text: str) -> list[tuple[int, int]]:
    """`"1x1024,64x128"` as [(1, 1024), (64, 128)]: decode rows x context."""
    points = []
    for item in text.split(","):
        rows, _, context = item.strip().partition("x")
        points.append((int(rows), int(context)))
    return points


def timed_ms(call: Callable[[], Any], device: str, repeats: int, warmup: int = 2) -> float:
    """Mean ms of `call` over `repeats` back-to-back calls after `warmup`: CUDA events around the
    loop on a GPU (the host may run ahead; the last event waits for the device)."""
    for _ in range(warmup):
        call()
    synchronize(device)
    if not device.startswith("cuda"):
        start = time.perf_counter()
        for _ in range(repeats):
            call()
        return (time.perf_counter() - start) * 1e3 / repeats
    begin = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(repeats):
        call()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / repeats


def matmul_peak_tflops(device: str, dtype: torch.dtype, size: int, trials: int = 3) -> float:
    """The best TFLOP/s of `size`-square matmuls in `dtype` (2 size^3 FLOPs each) over `trials`
    loops of ten."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    out = torch.empty(size, size, device=device, dtype=dtype)
    best_ms = min(
        timed_ms(lambda: torch.matmul(a, b, out=out), device, 10, warmup=2 if i == 0 else 0)
        for i in range(trials)
    )
    return 2 * size**3 / (best_ms / 1e3) / 1e12


def _decode_rows(rows: int, context: int, vocab: int) -> list[tuple[list[int], int, int]]:
    """Row i: its own blocks (no two rows share one, so no read hits a cache another row warmed),
    a random token, at position context - 1."""
    width = -(-context // BLOCK_SIZE)
    tokens = torch.randint(0, vocab, (rows,)).tolist()
    return [(list(range(i * width, (i + 1) * width)), tokens[i], context - 1) for i in range(rows)]


def time_decode(runner: Any, rows: int, context: int, device: str) -> dict[str, Any]:
    """Eager forward ms and, where the runner has decode graphs that take `rows`, replay ms."""
    from workers.model import BatchLayout

    model = runner.model
    decode_rows = _decode_rows(rows, context, model.spec.vocab_size)
    packed = [(table, [token], position) for table, token, position in decode_rows]
    input_ids, layout = BatchLayout.pack(packed, rows, BLOCK_SIZE, device)
    indices = torch.arange(rows, device=device)
    line: dict[str, Any] = {
        "eager_ms": timed_ms(
            lambda: model(input_ids, layout, runner.cache, indices), device, DECODE_REPEATS
        )
    }
    graphs = getattr(runner, "graphs", None)
    if graphs is None:
        line["graph"] = "none: the runner captured no decode graphs (eager, CPU, or none built)"
    elif rows > max(graphs.buckets):
        line["graph"] = f"none: {rows} rows exceed the largest bucket {max(graphs.buckets)}"
    else:
        try:
            line["graph_ms"] = timed_ms(lambda: graphs.run(decode_rows), device, DECODE_REPEATS)
            line["graph"] = "replayed"
        except Exception as error:  # a point the graphs refuse is reported, the rest still run
            line["graph"] = f"failed: {type(error).__name__}: {error}"
    return line


def time_prefill(runner: Any, tokens: int, device: str) -> float:
    """Ms of one prompt of `tokens` from position 0, logits for its last token only."""
    from workers.model import BatchLayout

    model = runner.model
    ids = torch.randint(0, model.spec.vocab_size, (tokens,)).tolist()
    table = list(range(-(-tokens // BLOCK_SIZE)))
    input_ids, layout = BatchLayout.pack([(table, ids, 0)], 0, BLOCK_SIZE, device)
    last = torch.tensor([tokens - 1], device=device)
    return timed_ms(lambda: model(input_ids, layout, runner.cache, last), device, PREFILL_REPEATS)


def _pool_blocks(
    decode: list[tuple[int, int]], prefill: list[int], per_token: int, device: str
) -> int:
    """Blocks for the largest point, capped at 70% of the device's free memory."""
    needed = max(
        [rows * -(-context // BLOCK_SIZE) for rows, context in decode]
        + [-(-tokens // BLOCK_SIZE) for tokens in prefill]
    )
    if device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info()
        needed = min(needed, int(0.7 * free) // (per_token * BLOCK_SIZE))
    return needed


def run_shape(
    shape: str,
    dtype: torch.dtype,
    device: str,
    decode: list[tuple[int, int]],
    prefill: list[int],
    peaks: dict[str, float],
    deadline: float,
    progress: Callable[[str], None],
) -> list[dict[str, Any]]:
    """One JSON line per point of a shape; points past `deadline` (perf_counter) or beyond the KV
    pool the device holds are reported as skipped."""
    from deploy.bench.gpu_model import random_model
    from workers.kv_cache import PagedKVCache
    from workers.runner import ModelRunner

    began = time.perf_counter()
    model = random_model(shape, dtype, device, seed=0)
    synchronize(device)
    spec = model.spec
    params = sum(p.numel() for p in model.parameters())
    built_s = time.perf_counter() - began
    progress(f"roofline {shape}: {params / 1e9:.2f}B parameters built in {built_s:.1f}s")
    per_token = PagedKVCache.bytes_per_token(
        spec.num_layers, spec.num_kv_heads, spec.head_dim, dtype
    )
    num_blocks = _pool_blocks(decode, prefill, per_token, device)
    began = time.perf_counter()
    runner = ModelRunner(model, num_blocks, BLOCK_SIZE)
    graphs = getattr(runner, "graphs", None)
    runner.cache.k.normal_()  # random keys and values: attention reads real numbers
    runner.cache.v.normal_()
    head = {
        "record": "roofline",
        "shape": shape,
        "params": params,
        "dtype": str(dtype).removeprefix("torch."),
    }
    head |= {"kv_pool_tokens": num_blocks * BLOCK_SIZE, "decode_graphs": graphs is not None}
    if graphs is not None:
        head |= {"graph_buckets": list(graphs.buckets), "capture_s": graphs.capture_seconds}
    progress(f"roofline {shape}: runner and KV pool in {time.perf_counter() - began:.1f}s")
    lines = []
    for rows, context in decode:
        line = head | {"kind": "decode", "rows": rows, "context": context}
        if time.perf_counter() > deadline:
            lines.append(line | {"skipped": "past --roofline-seconds"})
            continue
        if rows * -(-context // BLOCK_SIZE) > num_blocks:
            lines.append(line | {"skipped": f"needs more KV than the {num_blocks} blocks that fit"})
            continue
        point = decode_point(model, rows, context)
        roofline = point.roofline_ms(peaks["copy_gb_s"])
        line |= {"weight_bytes": point.weight_bytes, "kv_bytes": point.kv_bytes}
        line |= {"bytes": point.bytes, "roofline_ms": roofline}
        line |= time_decode(runner, rows, context, device)
        line["eager_x_roofline"] = line["eager_ms"] / roofline
        if "graph_ms" in line:
            line["graph_x_roofline"] = line["graph_ms"] / roofline
        progress(_describe(line))
        lines.append(line)
    for tokens in prefill:
        line = head | {"kind": "prefill", "tokens": tokens}
        if time.perf_counter() > deadline:
            lines.append(line | {"skipped": "past --roofline-seconds"})
            continue
        flops = prefill_flops(spec, tokens)
        ms = time_prefill(runner, tokens, device)
        tflops = flops / (ms / 1e3) / 1e12
        line |= {"flops": flops, "ms": ms, "tflops": tflops}
        line |= {"roofline_ms": flops / (peaks["matmul_tflops"] * 1e12) * 1e3}
        line["fraction_of_peak"] = tflops / peaks["matmul_tflops"]
        progress(_describe(line))
        lines.append(line)
    del runner, model, graphs
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return lines


def _describe(line: dict[str, Any]) -> str:
    if line["kind"] == "prefill":
        return (
            f"roofline {line['shape']}: prefill {line['tokens']} tokens {line['ms']:.2f} ms, "
            f"{line['tflops']:.1f} TFLOP/s, {line['fraction_of_peak']:.2f} of peak"
        )
    graph = f", graph {line['graph_ms']:.2f} ms" if "graph_ms" in line else ""
    return (
        f"roofline {line['shape']}: decode {line['rows']} x {line['context']} roofline "
        f"{line['roofline_ms']:.3f} ms, eager {line['eager_ms']:.2f} ms{graph}"
    )


def roofline_table(lines: list[dict[str, Any]]) -> str:
    """The points as a table: decode rows first, then prefill; skipped points say why."""
    header = (
        f"{'shape':>11} {'point':>14} {'GB read':>8} {'TFLOP':>8} {'roof ms':>8} "
        f"{'eager ms':>9} {'graph ms':>9} {'x roof':>7}"
    )
    rows = [header]
    for ln in lines:
        point = "whole shape"
        if ln["kind"] == "decode":
            point = f"{ln['rows']} x {ln['context']}"
        elif ln["kind"] == "prefill":
            point = f"prefill {ln['tokens']}"
        if "skipped" in ln:
            rows.append(f"{ln['shape']:>11} {point:>14}  skipped: {ln['skipped']}")
            continue
        if ln["kind"] == "decode":
            best = ln.get("graph_x_roofline", ln["eager_x_roofline"])
            graph = f"{ln['graph_ms']:>9.3f}" if "graph_ms" in ln else f"{'-':>9}"
            rows.append(
                f"{ln['shape']:>11} {point:>14} {ln['bytes'] / 1e9:>8.3f} {'-':>8} "
                f"{ln['roofline_ms']:>8.3f} {ln['eager_ms']:>9.3f} {graph} {best:>7.2f}"
            )
        else:
            rows.append(
                f"{ln['shape']:>11} {point:>14} {'-':>8} {ln['flops'] / 1e12:>8.2f} "
                f"{ln['roofline_ms']:>8.3f} {ln['ms']:>9.3f} {'-':>9} "
                f"{ln['ms'] / ln['roofline_ms']:>7.2f}"
            )
    return "\n".join(rows)


def run_roofline(
    shapes: list[str],
    decode: list[tuple[int, int]],
    prefill: list[int],
    dtype: torch.dtype,
    device: str,
    copy_gb_s: float,
    seconds: float,
    progress: Callable[[str], None],
) -> list[dict[str, Any]]:
    """Measure the matmul peak, then every shape's points within `seconds`: one line per point
    (skipped ones too, with the reason) and a closing peaks line."""
    start = time.perf_counter()
    size = 8192 if device.startswith("cuda") else 256
    progress(f"roofline: {dtype} matmul peak ({size} x {size})")
    peaks = {"copy_gb_s": copy_gb_s, "matmul_tflops": matmul_peak_tflops(device, dtype, size)}
    progress(f"roofline: matmul peak {peaks['matmul_tflops']:.1f} TFLOP/s")
    lines = []
    for shape in shapes:
        try:
            lines += run_shape(
                shape, dtype, device, decode, prefill, peaks, start + seconds, progress
            )
        except Exception as error:  # e.g. a shape the device cannot hold: the others still run
            reason = f"failed: {type(error).__name__}: {error}"[:300]
            progress(f"roofline {shape}: {reason}")
            lines.append({"record": "roofline", "shape": shape, "kind": "shape", "skipped": reason})
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
    lines = [line | peaks for line in lines]
    summary = {"record": "roofline_peaks", "matmul_size": size, "notes": NOTES} | peaks
    return lines + [summary | {"seconds": time.perf_counter() - start}]
