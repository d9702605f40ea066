"""The packed quantized weights' test cases: the formats, awkward shapes, random weights quantized
by GGUF's own quantizer (or per channel for int8), activations rounded as the kernel rounds them."""

import gguf
import torch

from workers.gguf_blocks import read_quants
from workers.quantized import PackedWeight, quantize_int8

FORMATS = ["q8_0", "q4_0", "q4_1", "int8"]
GGUF_TYPES = {"q8_0": "Q8_0", "q4_0": "Q4_0", "q4_1": "Q4_1"}
# (N, K): neither a multiple of a panel (16 rows) or of a tile (32 rows); K an odd number of blocks
SHAPES = [(40, 96), (33, 160)]


def packed(fmt: str, n: int, k: int, seed: int = 0) -> PackedWeight:
    """A random [n, k] weight quantized to `fmt` (GGUF's own quantizer for the GGUF types)."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    if fmt == "int8":
        return PackedWeight.pack(quantize_int8(w))
    kind = GGUF_TYPES[fmt]
    raw = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType[kind])
    return PackedWeight.pack(read_quants("w", kind, torch.from_numpy(raw), k))


def int8_activations(x: torch.Tensor) -> torch.Tensor:
    """`x [M, K]` as the kernel rounds it: per block of 32, d = amax / 127 and q = round(x / d)
    (in fp32, as the kernel computes them), returned as d * q in float64."""
    blocks = x.view(x.shape[0], -1, 32)  # [M, KB, 32]
    amax = blocks.abs().amax(dim=2, keepdim=True)  # [M, KB, 1]
    inverse = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    q = torch.round(blocks * inverse).clamp(-127, 127)
    return (q.double() * (amax / 127).double()).view_as(x)  # [M, K]
