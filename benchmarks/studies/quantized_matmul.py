"""Packed quantized weights against fp32 ones on the embedded model: each matmul, and a whole decode
step (docs/BENCHMARKS.md, Quantized weights).

    .venv/bin/python -m benchmarks.studies.quantized_matmul [THREADS]

Matmuls: the embedded model's shapes (the fused qkv, o, the fused gate/up, down, the head) at 1, 8
and 64 rows: the fp32 packed matmul of `workers/kernels.py`, `csrc/quant_linear.cpp` over Q4_1,
Q8_0 and per-channel int8, and `torch`'s own int8 matmul (`_weight_int8pack_mm`: int8 weights, fp32
activations). Then one decode step of the embedded model, dequantized (fp32) and served from its
GGUF blocks, at 1, 8 and 64 running rows of 64 tokens of context. Microseconds, the best of the
passes of a few tenths of a second: the least disturbed by other work on the machine.
"""

import sys
import time

import torch

from workers.kernels import linear
from workers.kv_cache import PagedKVCache
from workers.loader import load_model
from workers.model import BatchLayout
from workers.quantized import PackedWeight, RowQuants, quantize_int8

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
SHAPES["head"] = (49152, 576)
ROWS = (1, 8, 64)
CONTEXT = 64  # tokens each decode row attends to


def best_us(run, seconds: float = 0.3) -> float:
    run()
    best = float("inf")
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        tick = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - tick)
    return best * 1e6


def random_quants(fmt: str, n: int, k: int) -> RowQuants:
    g = torch.Generator().manual_seed(0)
    d = (torch.rand(n, k // 32, generator=g) / 100).half()
    if fmt == "q8_0":
        return RowQuants(fmt, torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g), d)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    return RowQuants(fmt, q, d, (torch.randn(n, k // 32, generator=g) / 100).half())


def matmuls() -> None:
    print("matmul us: rows, shape, fp32, q4_1, q8_0, int8, torch int8 (fp32 activations)")
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k)
        int8 = quantize_int8(w)
        packed = {
            "q4_1": PackedWeight.pack(random_quants("q4_1", n, k)),
            "q8_0": PackedWeight.pack(random_quants("q8_0", n, k)),
            "int8": PackedWeight.pack(int8),
        }
        for rows in ROWS:
            times = matmul_us(torch.randn(rows, k), w, packed, int8)
            print(f"{rows:3d} {name:8s} {n}x{k}: " + "  ".join(f"{t:9.0f}" for t in times))


def matmul_us(
    x: torch.Tensor, w: torch.Tensor, packed: dict[str, PackedWeight], int8: RowQuants
) -> list[float]:
    """`x @ w.T` the five ways, in microseconds."""
    times = [best_us(lambda: linear(x, w))]
    times += [best_us(lambda p=p: p.linear(x)) for p in packed.values()]
    times.append(best_us(lambda: torch.ops.aten._weight_int8pack_mm(x, int8.q, int8.d)))
    return times


def decode_step_us(model, rows: int) -> float:
    spec = model.spec
    blocks = CONTEXT // 16
    cache = PagedKVCache(spec.num_layers, rows * blocks, spec.num_kv_heads, 16, spec.head_dim)
    tables = [list(range(r * blocks, (r + 1) * blocks)) for r in range(rows)]
    batch = [(table, [100 + r], CONTEXT - 1) for r, table in enumerate(tables)]
    ids, layout = BatchLayout.pack(batch, rows, 16, "cpu")
    return best_us(lambda: model(ids, layout, cache, torch.arange(rows)), seconds=2.0)


def decode_steps() -> None:
    models = {"fp32": load_model().model, "gguf": load_model(quantization="gguf").model}
    print(f"decode step ms ({CONTEXT} tokens of context): rows, fp32, gguf (Q4_1 + Q8_0), ratio")
    for rows in ROWS:
        fp32, gguf = (decode_step_us(model, rows) / 1000 for model in models.values())
        print(f"{rows:3d}: {fp32:8.2f} {gguf:8.2f} {fp32 / gguf:5.2f}x")


if __name__ == "__main__":
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
    with torch.inference_mode():
        matmuls()
        decode_steps()
