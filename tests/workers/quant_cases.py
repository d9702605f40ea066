"""The packed quantized weights' test cases: the formats, awkward shapes, random weights quantized
by GGUF's own quantizer (or per channel for int8), activations rounded as the kernel rounds them,
a model's logits and how far they moved."""

import torch

from tests.factories import gguf_quantize
from workers.gguf_blocks import read_quants
from workers.kv_cache import PagedKVCache
from workers.model import BatchLayout
from workers.quantized import PackedWeight, quantize_int8

FORMATS = ["q8_0", "q4_0", "q4_1", "int8", "q4_k", "q6_k"]
GGUF_TYPES = {"q8_0": "Q8_0", "q4_0": "Q4_0", "q4_1": "Q4_1", "q4_k": "Q4_K", "q6_k": "Q6_K"}
# (N, K): neither a multiple of a panel (16 rows) or of a tile (32 rows); K an odd number of blocks
SHAPES = [(40, 96), (33, 160)]
# the K-quants' rows are whole super-blocks of 256: one, and three
K_SHAPES = [(40, 256), (33, 768)]


def shapes(fmt: str) -> list[tuple[int, int]]:
    return K_SHAPES if fmt in ("q4_k", "q6_k") else SHAPES


def matmul_cases() -> list[tuple[str, int, int]]:
    """(format, N, K) for every format and each of its shapes."""
    return [(fmt, n, k) for fmt in FORMATS for n, k in shapes(fmt)]


def packed(fmt: str, n: int, k: int, seed: int = 0) -> PackedWeight:
    """A random [n, k] weight quantized to `fmt` (GGUF's blocks for the GGUF types)."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    if fmt == "int8":
        return PackedWeight.pack(quantize_int8(w))
    kind = GGUF_TYPES[fmt]
    raw = gguf_quantize(w.numpy(), kind)
    return PackedWeight.pack(read_quants("w", kind, torch.from_numpy(raw), k))


def int8_activations(x: torch.Tensor) -> torch.Tensor:
    """`x [M, K]` as the kernel rounds it: per block of 32, d = amax / 127 and q = round(x / d)
    (in fp32, as the kernel computes them), returned as d * q in float64."""
    blocks = x.view(x.shape[0], -1, 32)  # [M, KB, 32]
    amax = blocks.abs().amax(dim=2, keepdim=True)  # [M, KB, 1]
    # a true division, as the kernel's 127.f / amax (`127 / amax` is 127 times amax's reciprocal,
    # an ulp away at times, which moves a quant that lands on .5)
    inverse = torch.where(amax > 0, torch.full_like(amax, 127) / amax, torch.zeros_like(amax))
    q = torch.round(blocks * inverse).clamp(-127, 127)
    return (q.double() * (amax / 127).double()).view_as(x)  # [M, K]


def logits(model, ids: list[int]) -> torch.Tensor:
    spec = model.spec
    cache = PagedKVCache(spec.num_layers, 8, spec.num_kv_heads, 16, spec.head_dim)
    input_ids, layout = BatchLayout.pack([(list(range(8)), ids, 0)], 0, 16, "cpu")
    return model(input_ids, layout, cache, torch.arange(len(ids)))  # [T, vocab]


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())
