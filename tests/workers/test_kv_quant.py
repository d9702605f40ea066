"""8-bit KV rows (`--kv-cache-dtype int8|fp8`): the quantization's error bounds, and the C++ cache
write giving the torch ops' bytes."""

import pytest
import torch

from workers import kernels
from workers.kv_quant import QMAX, STORAGE, dequantize, quantize

FORMATS = list(STORAGE)  # int8, fp8


def rows(seed: int, count: int = 512, dim: int = 64) -> torch.Tensor:
    """Rows of every magnitude a model's K and V take (1e-3 to 1e3), one in ten with an outlier
    10x its others, and a row of zeros: `[count, dim]` fp32."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(count, dim, generator=g)
    x *= 10 ** torch.empty(count, 1).uniform_(-3, 3, generator=g)  # [count, dim]
    x[::10, 0] *= 10
    x[1] = 0.0
    return x


@pytest.mark.parametrize("storage", [torch.float32, torch.bfloat16])
def test_an_int8_row_is_within_absmax_over_254_of_the_original(storage):
    """Round to nearest on a grid of absmax / 127: at most half a step off. The scale is stored in
    fp16, about 2^-11 off absmax / 127, which the bound allows for."""
    x = rows(0).to(storage).float()  # [N, D]
    values, scales = quantize(x, torch.int8)
    assert values.dtype == torch.int8 and scales.dtype == torch.float16
    assert values.abs().max() <= 127
    error = (dequantize(values, scales, torch.float32) - x).abs().amax(-1)  # [N]
    bound = x.abs().amax(-1) / 254 * (1 + 2**-10)  # [N]
    assert (error <= bound).all(), (error / bound).max()
    assert not dequantize(values, scales, torch.float32)[1].any()  # zeros stay zeros


def test_an_fp8_value_is_within_e4m3s_rounding_of_the_original():
    """e4m3 keeps 3 mantissa bits: a value rounds to within 2^-4 of itself, and one below e4m3's
    normal range (2^-6 of the scale) to within half its subnormal step, 2^-10 of the scale (both
    with the fp16 scale's 2^-11 of slack)."""
    x = rows(1)  # [N, D]
    values, scales = quantize(x, torch.uint8)
    back = dequantize(values, scales, torch.float32)  # [N, D]
    scale = x.abs().amax(-1, keepdim=True) / 448  # [N, 1]
    bound = torch.maximum(x.abs() * 2**-4, scale * 2**-10) * (1 + 2**-10)  # [N, D]
    assert ((back - x).abs() <= bound).all()
    # the row's largest value maps to e4m3's largest, 448: the whole range is used
    largest = values.view(torch.float8_e4m3fn).float().abs().amax(-1)  # [N]
    assert ((largest - 448).abs() <= 448 * 2**-3)[x.abs().amax(-1) > 0].all()


@pytest.mark.parametrize("kind", FORMATS)
def test_a_rows_bytes_depend_on_that_row_alone(kind):
    """Quantized alone or among others, in any order: the same bytes (so chunks, prefix hits,
    handoffs and recompute agree)."""
    storage = STORAGE[kind]
    x = rows(2)
    values, scales = quantize(x, storage)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    shuffled, shuffled_scales = quantize(x[order], storage)
    assert torch.equal(shuffled, values[order]) and torch.equal(shuffled_scales, scales[order])
    alone, alone_scale = quantize(x[7:8], storage)
    assert torch.equal(alone, values[7:8]) and torch.equal(alone_scale, scales[7:8])


def tie_rows(dim: int, storage: torch.dtype) -> torch.Tensor:
    """V rows whose scale is exactly 1 (absmax = QMAX) and whose other values lie halfway between
    two steps of the format: ties, which both writers must break to even. `[2, dim]`"""
    qmax = QMAX[storage]
    if storage == torch.int8:
        ties = torch.arange(dim) - dim / 2 + 0.5  # k + 0.5
    else:  # halfway between neighbouring e4m3 values: 1 + 1/16, 2 + 1/8, ...
        ties = (1 + (2 * torch.arange(dim) % 8 + 1) / 16) * 2.0 ** (torch.arange(dim) % 5)
    ties[0] = qmax
    return torch.stack((ties, -ties))


@pytest.mark.parametrize("kind", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernels_cache_write_gives_the_torch_ops_bytes(kind, dtype, monkeypatch):
    """The C++ write (rotary, then each k and v row quantized) and the torch ops' give the same q,
    values and scales, ties included: every mode writes the same bytes whichever path runs."""
    if kernels.load_kernels() is None:
        pytest.skip("no C++ compiler here: the kernels cannot be built")
    storage = STORAGE[kind]
    heads, kv_heads, dim, count = 4, 2, 64, 40
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(count, heads + 2 * kv_heads, dim, generator=g)
    qkv *= 10 ** torch.empty(count, 1, 1).uniform_(-2, 2, generator=g)  # [N, H + 2 KVH, D]
    qkv[:2, heads + kv_heads] = tie_rows(dim, storage)  # ties in V (which does not rotate)
    qkv = qkv.to(dtype)
    angle = torch.rand(count, 1, dim, generator=g) * 6  # [N, 1, D]
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    place = torch.randperm(21 * 16, generator=g)[:count]  # no two tokens in one place
    slots, positions = place // 16, place % 16  # block, offset

    def write():
        caches = torch.zeros(2, 21, kv_heads, 16, dim, dtype=storage)  # [2, S, KVH, C, D]
        scales = torch.zeros(2, 21, kv_heads, 16, dtype=torch.float16)  # [2, S, KVH, C]
        q = kernels.rope_and_cache(
            qkv, cos, sin, heads, caches[0], caches[1], slots, positions, (scales[0], scales[1])
        )
        return q, caches, scales

    fused = write()
    monkeypatch.setattr(kernels, "load_kernels", lambda: None)
    eager = write()
    for got, want in zip(fused, eager, strict=True):
        assert torch.equal(got, want)
    assert fused[2].any()  # (something was written)
