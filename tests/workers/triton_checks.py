"""The Triton matmul's checks, run in a process of their own with TRITON_INTERPRET=1 set before
Triton is first imported (it decides then whether its kernels, and `triton.language`'s own helpers,
are compiled or interpreted): `python -m tests.workers.triton_checks FORMAT...` exits 0 when every
check holds. `tests/workers/test_triton_quant.py` runs it."""

import os
import sys

import torch
import torch.nn.functional as F

from tests.workers.quant_cases import packed, shapes
from workers.quantized import FORMATS, PackedWeight


def quant_matmul(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None = None):
    """The kernel on a packed weight, as `PackedWeight.linear` calls it on a GPU."""
    from workers import triton_quant

    args = (weight.qs, weight.scales, weight.mins, bias, FORMATS[weight.format], weight.shape[0])
    return triton_quant.quant_matmul(x, *args)


def check_format(fmt: str) -> None:
    """fp32: the dequantized weight times x in fp32 sums (no int8 activations, unlike the CPU
    kernel): within fp32's rounding of the sums of |x| |w|. A row alone gives its batched bits."""
    for n, k in shapes(fmt):
        weight = packed(fmt, n, k)
        w = weight.dequantize().double()  # [N, K]
        g = torch.Generator().manual_seed(n + k)
        for rows in (1, 5, 17, 40):
            x = torch.randn(rows, k, generator=g)
            bias = torch.randn(n, generator=g)
            got = quant_matmul(x, weight, bias)
            want = F.linear(x.double(), w, bias.double())
            bound = 1e-5 * (x.abs().double() @ w.abs().T + bias.abs().double())
            assert got.shape == (rows, n), (fmt, rows, got.shape)
            assert ((got.double() - want).abs() <= bound).all(), (fmt, n, k, rows)
            alone = quant_matmul(x[-1:], weight, bias)
            assert torch.equal(alone[0], got[-1]), (fmt, n, k, rows)


def check_bf16() -> None:
    """bf16 x: the tile is dequantized into bf16 (as the tensor cores take it) and summed in fp32,
    the output converted to bf16 once. Triton 3.9's interpreter converts to bf16 by truncating
    (a GPU rounds to nearest), so each weight and the output are held to within one bf16 ulp
    (2^-7 relative) rather than half of one."""
    weight = packed("q4_k", 40, 256)
    x = torch.randn(7, 256, generator=torch.Generator().manual_seed(9)).bfloat16()
    got = quant_matmul(x, weight)
    assert got.dtype == torch.bfloat16
    w = weight.dequantize().double()
    want = F.linear(x.double(), w)
    ulp = 2.0**-7
    bound = ulp * (x.abs().double() @ w.abs().T) * (1 + ulp) + ulp * want.abs()
    assert ((got.double() - want).abs() <= bound).all()
    # a row alone: its batched bits
    assert torch.equal(quant_matmul(x[3:4], weight)[0], got[3])


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    for name in sys.argv[1:]:
        if name == "bf16":
            check_bf16()
        else:
            check_format(name)
    print("ok")
