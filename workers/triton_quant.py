"""The matmul over packed quantized weights on a GPU: one Triton kernel that reads the CPU kernel's
panels as they lie, dequantizes each tile in registers and multiplies it in the activations' dtype.

The packed layout (`workers/quantized.py`) keeps each (panel of 16 rows, block of 32 k) as one run
of 256 bytes (nibbles) or 512 (bytes), so a program's tile of 64 columns by 32 k reads four runs
in order, and its scales (and mins) are 16 consecutive values per panel and block. Unlike the CPU
kernel, the activations are not rounded to int8: a tile is dequantized to w = d * q + m (Q4_0: q -
8; Q6_K: a scale per half block; int8: the row's scale after the sum) and multiplied in fp32 sums,
as GPTQ's and Marlin's kernels do, so on a GPU the outputs are the dequantized model's up to the
sums' order. Every mode runs this same kernel, so the modes' tokens stay identical.

Where the GPU is absent the same kernel runs on CPU tensors under Triton's interpreter
(`TRITON_INTERPRET=1`): that is how the tests check it against the dequantized reference.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

BLOCK_M = 16  # activation rows per program
BLOCK_N = 64  # output columns per program: four panels
BLOCK_K = 32  # one block of quants


@triton.jit
def _quant_matmul(
    x_ptr,
    qs_ptr,
    scales_ptr,
    mins_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    KB,
    P,
    FORMAT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    cols = pid_n * 64 + tl.arange(0, 64)  # [BN]
    kk = tl.arange(0, 32)  # [BK]
    panel = cols // 16
    lane = cols % 16
    held = panel < P  # [BN]: columns of the packed panels (the last program's may run past)
    nibbles: tl.constexpr = FORMAT == 1 or FORMAT == 2 or FORMAT == 4  # Q4_0, Q4_1, Q4_K
    run: tl.constexpr = 256 if nibbles else 512  # bytes of a (panel, block)
    acc = tl.zeros((BLOCK_M, 64), dtype=tl.float32)
    for b in range(0, KB):
        x = tl.load(
            x_ptr + rows[:, None] * K + b * 32 + kk[None, :], mask=rows[:, None] < M, other=0.0
        )  # [BM, BK]
        base = (panel * KB + b) * run  # [BN]
        if nibbles:
            # byte of (k, row): chunk k // 8 of 64 bytes, 4 bytes a row, k % 4; high nibble for
            # k % 8 >= 4
            offsets = base[None, :] + (kk[:, None] // 8) * 64 + lane[None, :] * 4 + kk[:, None] % 4
            byte = tl.load(qs_ptr + offsets, mask=held[None, :], other=0).to(tl.int32)  # [BK, BN]
            q = (byte >> ((kk[:, None] % 8) // 4 * 4)) & 0x0F
        else:
            offsets = base[None, :] + (kk[:, None] // 4) * 64 + lane[None, :] * 4 + kk[:, None] % 4
            raw = tl.load(qs_ptr + offsets, mask=held[None, :], other=0)
            if FORMAT == 5:  # Q6_K: q 0-63 unsigned
                q = raw.to(tl.int32)
            else:
                q = raw.to(tl.int8, bitcast=True).to(tl.int32)
        at = (panel * KB + b) * 16 + lane  # [BN]
        if FORMAT == 3:  # int8: the row's scale after the sum
            w = q.to(tl.float32)
        elif FORMAT == 5:  # Q6_K: a scale per half block of 16, value (q - 32) * d
            half = kk[:, None] // 16
            d_at = ((panel * KB + b) * 2)[None, :] * 16 + half * 16 + lane[None, :]  # [BK, BN]
            d = tl.load(scales_ptr + d_at, mask=held[None, :], other=0.0)
            w = (q - 32).to(tl.float32) * d
        else:
            d = tl.load(scales_ptr + at, mask=held, other=0.0).to(tl.float32)[None, :]  # [1, BN]
            if FORMAT == 1:  # Q4_0
                w = (q - 8).to(tl.float32) * d
            elif FORMAT == 2 or FORMAT == 4:  # Q4_1, Q4_K: q * d + m
                m = tl.load(mins_ptr + at, mask=held, other=0.0).to(tl.float32)[None, :]
                w = q.to(tl.float32) * d + m
            else:  # Q8_0
                w = q.to(tl.float32) * d
        # in the activations' dtype (bf16, fp16: the tensor cores), fp32 exactly as fp32; under
        # the interpreter, whose 16-bit dot is wrong (Triton 3.9), the same 16-bit values in fp32
        w = w.to(x.dtype)
        if DOT_FP32:
            acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc, input_precision="ieee")
    if FORMAT == 3:
        acc = acc * tl.load(scales_ptr + panel * 16 + lane, mask=held, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    tl.store(
        out_ptr + rows[:, None] * N + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask
    )


def quant_matmul(
    x: torch.Tensor,
    qs: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    bias: torch.Tensor | None,
    format: int,
    n: int,
) -> torch.Tensor:
    """`x [M, K] @ W.T + bias` -> `[M, N]` in x's dtype, W a packed weight's `qs`, `scales` and
    `mins` in format number `format` (`workers/quantized.py`'s FORMATS), on x's device (a GPU, or
    the CPU under Triton's interpreter)."""
    m, k = x.shape
    x = x.contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    # one tile height for every batch: a row's sums do not depend on the rows beside it
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    _quant_matmul[grid](
        x,
        qs,
        scales,
        mins if mins is not None else scales,
        bias if bias is not None else x,
        out,
        m,
        n,
        k,
        k // BLOCK_K,
        qs.shape[0],
        FORMAT=format,
        HAS_BIAS=bias is not None,
        BLOCK_M=BLOCK_M,
        DOT_FP32=os.environ.get("TRITON_INTERPRET") == "1",
    )
    return out
