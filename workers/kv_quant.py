"""8-bit KV (`--kv-cache-dtype int8|fp8`): a cache row's values in one byte each and a scale per
row, quantized as K and V are written and dequantized where torch ops read them.

A row is one token's K (or V) of one KV head in one layer: `head_dim` values. Its scale is its
largest magnitude over the format's (127 for int8, 448 for fp8 e4m3) rounded to fp16, so a
row's bytes depend on that row alone: chunking, prefix hits, forks, handoffs and recompute
give the same bytes. The C++ writer (`csrc/kv8.h`, `quantize_row`) follows the same formula
and rounding step for step: `quantize` here and there give the same bytes.
"""

from __future__ import annotations

import torch

# --kv-cache-dtype: auto keeps the model's dtype; fp8_e4m3 is vLLM's name of fp8
KV_CACHE_DTYPES = ("auto", "int8", "fp8", "fp8_e4m3")
# how each 8-bit format is stored: fp8 (e4m3, torch.float8_e4m3fn) as its bytes, since every
# device indexes and copies uint8 and numpy carries it
STORAGE = {"int8": torch.int8, "fp8": torch.uint8}
# the largest magnitude of each stored format: a row's largest value maps to it
QMAX = {torch.int8: 127.0, torch.uint8: 448.0}
# a row's scale: fp16, 2 bytes beside its head_dim bytes (fp32 would lose 2 more per row)
SCALE_DTYPE = torch.float16
SCALE_BYTES = 2


def kv_format(kv_cache_dtype: str) -> str:
    """`kv_cache_dtype` by its one name here: auto, int8 or fp8."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        choices = ", ".join(KV_CACHE_DTYPES)
        raise ValueError(f"unknown kv_cache_dtype {kv_cache_dtype!r}: choose one of {choices}")
    return "fp8" if kv_cache_dtype == "fp8_e4m3" else kv_cache_dtype


def storage_dtype(kv_cache_dtype: str, dtype: torch.dtype) -> torch.dtype:
    """The element dtype of a cache of `kv_cache_dtype` for a model computing in `dtype`."""
    kind = kv_format(kv_cache_dtype)
    return dtype if kind == "auto" else STORAGE[kind]


def is_8bit(values: torch.Tensor) -> bool:
    """Whether cache values are 8-bit (and have scales beside them)."""
    return values.dtype in QMAX


def row_bytes(head_dim: int, dtype: torch.dtype, kv_cache_dtype: str) -> int:
    """Bytes of one cache row (a token's K or V of one KV head in one layer), its scale included."""
    storage = storage_dtype(kv_cache_dtype, dtype)
    element = torch.empty((), dtype=storage).element_size()
    return head_dim * element + (SCALE_BYTES if storage in QMAX else 0)


def quantize(rows: torch.Tensor, storage: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`rows [..., D]` (any float dtype, any device) as 8-bit values `[..., D]` of `storage` and
    their fp16 scales `[...]`: scale = fp16(absmax / QMAX); value = x / scale, rounded to the
    nearest (ties to even) int8, or to the nearest e4m3, within +-QMAX. A row of zeros (or one
    whose scale is below fp16's range) has scale 0 and values 0."""
    qmax = QMAX[storage]
    x = rows.float()  # [..., D]
    scale = (x.abs().amax(-1) / qmax).to(SCALE_DTYPE)  # [...]
    divisor = scale.float()[..., None]  # [..., 1]
    divisor = torch.where(divisor > 0, divisor, torch.ones_like(divisor))
    y = (x / divisor).clamp(-qmax, qmax)  # [..., D]
    if storage == torch.int8:
        return y.round().to(torch.int8), scale
    return y.to(torch.float8_e4m3fn).view(torch.uint8), scale


def dequantize(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """8-bit `values [..., D]` times their `scales [...]`, in fp32, as `dtype`."""
    if values.dtype == torch.uint8:
        values = values.view(torch.float8_e4m3fn)
    return (values.float() * scales.float()[..., None]).to(dtype)  # [..., D]
