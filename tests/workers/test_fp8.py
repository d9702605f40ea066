"""FP8 weights (`--quantization fp8`, compressed-tensors' FP8): quantized per output row, and the
scaled matmul a GPU runs, checked on CPU tensors (torch's scaled matmul runs there too, slowly)."""

import pytest
import torch
import torch.nn.functional as F

from tests.factories import tiny_hf_model, tiny_model
from workers.loader import pack_weights
from workers.quantized import Fp8Weight, quantize_fp8, scaled_linear


def test_a_weight_is_its_rows_e4m3_values_times_their_scale():
    w = torch.randn(48, 64, generator=torch.Generator().manual_seed(1)) * 3
    weight = quantize_fp8(w, torch.bfloat16)
    scale = w.abs().amax(dim=1) / 448
    assert torch.equal(weight.scale, scale)
    assert torch.equal(weight.q, (w / scale[:, None]).to(torch.float8_e4m3fn))
    # e4m3 keeps 3 mantissa bits: within 2^-4 of each value, relative
    assert ((weight.dequantize() - w).abs() <= w.abs() / 16 + 1e-6).all()
    fused = Fp8Weight.cat([weight, quantize_fp8(w[:16], torch.bfloat16)])
    part = fused.take_rows(torch.arange(48, 64))
    assert part.q.untyped_storage().data_ptr() == fused.q.untyped_storage().data_ptr()
    assert torch.equal(part.dequantize(), weight.dequantize()[:16])


def test_the_scaled_matmul_is_the_fp8_rounded_product():
    """Each activation row rounded to e4m3 with its own scale (its largest |x| / 448), the
    product summed in fp32 and given in bf16: within bf16's rounding of the exact product of
    the rounded operands. A row alone gives its batched result."""
    g = torch.Generator().manual_seed(2)
    weight = quantize_fp8(torch.randn(64, 96, generator=g), torch.bfloat16)
    x = (torch.randn(5, 96, generator=g) * 4).bfloat16()
    bias = torch.randn(64, generator=g).bfloat16()
    got = scaled_linear(x, weight.q, weight.scale, bias)
    assert got.dtype == torch.bfloat16 and got.shape == (5, 64)
    x_scale = x.float().abs().amax(dim=1, keepdim=True) / 448
    x8 = (x.float() / x_scale).to(torch.float8_e4m3fn).double() * x_scale.double()
    exact = F.linear(x8, weight.dequantize().double()) + bias.double()
    assert ((got.double() - exact).abs() <= exact.abs() / 128 + 1e-3).all()
    assert torch.equal(scaled_linear(x[2:3], weight.q, weight.scale, bias)[0], got[2])


def test_fp8_is_refused_on_a_cpu():
    model = tiny_model("llama")
    config = tiny_hf_model("llama").config
    with pytest.raises(ValueError, match="FP8 tensor cores; on a CPU use int8"):
        pack_weights(model, "tiny", "fp8", config, "cpu")
