"""The packed fp32 matmul (`workers/csrc/gemm.cpp`) built as for an AVX2 CPU against torch's
`F.linear`, and this CPU's own build, on the embedded model's shapes at 1, 8 and 64 rows
(docs/BENCHMARKS.md, The packed fp32 matmul on AVX2). One thread; microseconds, the best of 50
calls. Hold MKL to AVX2 for the comparison an AVX2 CPU would see:

    MKL_ENABLE_INSTRUCTIONS=AVX2 .venv/bin/python -m benchmarks.studies.packed_gemm
"""

import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.cpp_extension import load

from workers import kernels

SHAPES = {"qkv": (960, 576), "gate_up": (3072, 576), "down": (576, 1536), "head": (49152, 576)}
ROWS = (1, 8, 64)
MODULE = Path(__file__).parents[2] / "tests" / "workers" / "isa_module.cpp"


def build_avx2():
    """gemm.cpp (and the quantized matmul the test module binds) as for a CPU without AVX-512."""
    sources = [str(kernels.CSRC / "gemm.cpp"), str(kernels.CSRC / "quant_linear.cpp"), str(MODULE)]
    return load(
        name="pdserve_matmuls_avx2_study",
        sources=sources,
        extra_include_paths=[str(kernels.CSRC)],
        extra_cflags=[*kernels.CFLAGS, "-mno-avx512f"],
        extra_ldflags=["-fopenmp"],
        build_directory=tempfile.mkdtemp(),
    )


def best_us(run, calls: int = 50) -> float:
    run()
    best = float("inf")
    for _ in range(calls):
        tick = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - tick)
    return best * 1e6


def row_times(avx2, native, n: int, k: int, rows: int) -> list[float]:
    """F.linear, the AVX2 build and this CPU's build on one shape, in microseconds."""
    w = torch.randn(n, k)
    panels = F.pad(w, (0, 0, 0, -n % 64)).view(-1, 64, k).transpose(1, 2).contiguous()
    x = torch.randn(rows, k)
    times = [best_us(lambda: F.linear(x, w))]
    for module in (avx2, native):
        times.append(best_us(lambda m=module: m.packed_linear(x, panels, None, n)))
    return times


def main() -> None:
    torch.set_num_threads(1)
    avx2, native = build_avx2(), kernels.load_kernels()
    print("shape rows: F.linear | packed (AVX2 build) | packed (this CPU) | F.linear / AVX2")
    for name, (n, k) in SHAPES.items():
        for rows in ROWS:
            times = row_times(avx2, native, n, k, rows)
            cells = " ".join(f"{t:9.0f}" for t in times)
            print(f"{name:8s} {rows:3d}: {cells}  {times[0] / times[1]:.2f}x")


if __name__ == "__main__":
    main()
