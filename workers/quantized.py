"""Packed quantized weights: GGUF's Q8_0, Q4_0, Q4_1, Q4_K and Q6_K blocks and per-channel int8,
kept in the kernel's layout, multiplied without dequantizing, put in place of a model's float ones.

A weight `[N, K]` is kept as its quants and scales only (no float copy): Q8_0 is 32 int8 and an
fp16 scale per block of 32 k (value q * d), Q4_0 16 bytes of nibbles and an fp16 scale (value
(q - 8) * d), Q4_1 nibbles, an fp16 scale and an fp16 min (value q * d + m), as llama.cpp lays them
out; int8 (`--quantization int8`, made at load from a float checkpoint) is one int8 per value and an
fp32 scale per output row (value q * s, s = the row's largest |w| / 127). The K-quants' super-blocks
of 256 come apart exactly into these forms with fp32 scales: Q4_K as Q4_1 with each block of 32's
scale d * sc and min -dmin * m (6-bit sc and m), Q6_K as bytes q (0-63) with a scale d * sc per 16
k (value (q - 32) * d * sc, 8-bit sc). The packing only moves
those bits: rows go in panels of 16, `qs [P, K / 32, chunks, 16, 4]` (a chunk is 64 bytes: 4
consecutive k of each of the 16 rows, or for nibbles 8 k, the low nibbles k 0-3 and the high ones
k 4-7), block scales `[P, K / 32, 16]`, so the kernel (`csrc/quant_linear.cpp`) reads a panel in
order. `dequantize()` is the reference: exactly what `gguf.quants.dequantize` gives for GGUF blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from workers.kernels import load_kernels

# the formats served packed, numbered as the kernel knows them
FORMATS = {"q8_0": 0, "q4_0": 1, "q4_1": 2, "int8": 3, "q4_k": 4, "q6_k": 5}
NIBBLES = ("q4_0", "q4_1", "q4_k")  # formats of two values to a byte
BLOCK = 32  # k per block of quants, and per block of the activations' int8
PANEL = 16  # weight rows per panel


@dataclass(frozen=True)
class RowQuants:
    """A weight's quants row by row, as a GGUF file has them, unpacked: `q [N, K]` (int8 values for
    q8_0 and int8, nibbles 0..15 as uint8 for q4_*, 0..63 as uint8 for q6_k), `d` the scales
    (`[N, K / 32]` fp16; fp32 for q4_k, `[N, K / 16]` fp32 for q6_k, `[N]` fp32 for int8) and `m`
    the mins of q4_1 and q4_k (shaped and typed as `d`). The form rows are permuted and
    concatenated in."""

    format: str
    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        """`[N, K]` of the weight."""
        n, k = self.q.shape
        return n, k

    def take(self, rows: torch.Tensor) -> RowQuants:
        """These rows, in this order (a permutation, a slice)."""
        m = None if self.m is None else self.m[rows]
        return RowQuants(self.format, self.q[rows], self.d[rows], m)

    @staticmethod
    def cat(parts: list[RowQuants]) -> RowQuants:
        m = None if parts[0].m is None else torch.cat([p.m for p in parts])
        return RowQuants(
            parts[0].format, torch.cat([p.q for p in parts]), torch.cat([p.d for p in parts]), m
        )


class PackedWeight:
    """A `[N, K]` weight served from its quants: `linear(x)` multiplies without a float copy,
    `dequantize()` is its float reference, `rows(ids)` dequantizes only the rows asked for (an
    embedding lookup). `dtype` is the dtype it takes and gives activations in (the model's)."""

    def __init__(
        self,
        format: str,
        shape: tuple[int, int],
        qs: torch.Tensor,
        scales: torch.Tensor,
        mins: torch.Tensor | None,
        dtype: torch.dtype,
    ) -> None:
        self.format = format
        self.shape = shape
        self.qs = qs  # [P, K / 32, chunks, 16, 4] uint8 (int8 for q8_0 and int8)
        # [P, K / 32, 16] fp16 (fp32 for q4_k), [P, K / 16, 16] fp32 (q6_k), [P, 16] fp32 (int8)
        self.scales = scales
        self.mins = mins  # [P, K / 32, 16] for q4_1 (fp16) and q4_k (fp32)
        self.dtype = dtype

    def __repr__(self) -> str:
        return f"PackedWeight({self.format}, {list(self.shape)}, {self.nbytes} bytes)"

    @property
    def device(self) -> torch.device:
        return self.qs.device

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [self.qs, self.scales] + ([] if self.mins is None else [self.mins])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    @classmethod
    def pack(cls, quants: RowQuants, dtype: torch.dtype = torch.float32) -> PackedWeight:
        """Lay quants out in the kernel's panels (rows padded to a multiple of 16 with zeros)."""
        n, k = quants.q.shape
        if k % BLOCK:
            raise ValueError(f"packed weights need K a multiple of {BLOCK}, got {k}")
        pad = -n % PANEL
        panels = (n + pad) // PANEL
        blocks = k // BLOCK
        q = F.pad(quants.q, (0, 0, 0, pad))  # [P 16, K]
        if quants.format in NIBBLES:
            nib = q.view(panels, PANEL, blocks, 4, 2, 4)  # [P, 16, KB, chunk, lo/hi, 4]
            q = nib[:, :, :, :, 0] | (nib[:, :, :, :, 1] << 4)  # [P, 16, KB, chunk, 4]
        else:
            q = q.view(panels, PANEL, blocks, 8, 4)  # [P, 16, KB, chunk, 4]
        qs = q.permute(0, 2, 3, 1, 4).contiguous()  # [P, KB, chunk, 16, 4]
        if quants.format == "int8":
            scales = F.pad(quants.d, (0, pad)).view(panels, PANEL)  # [P, 16]
            return cls("int8", (n, k), qs, scales.contiguous(), None, dtype)

        def by_panel(t: torch.Tensor) -> torch.Tensor:  # [N, KB] -> [P, KB, 16] (q6_k: 2 KB)
            padded = F.pad(t, (0, 0, 0, pad)).view(panels, PANEL, t.shape[1])
            return padded.transpose(1, 2).contiguous()

        mins = None if quants.m is None else by_panel(quants.m)
        return cls(quants.format, (n, k), qs, by_panel(quants.d), mins, dtype)

    def quants(self, rows: torch.Tensor | None = None) -> RowQuants:
        """The quants of `rows` (all by default) unpacked from the panels: `pack`'s inverse."""
        n, k = self.shape
        rows = torch.arange(n, device=self.device) if rows is None else rows.to(self.device)
        panel = rows // PANEL
        lane = rows % PANEL
        q = self.qs[panel, :, :, lane]  # [R, KB, chunk, 4]
        if self.format in NIBBLES:
            q = torch.stack((q & 0x0F, q >> 4), dim=3)  # [R, KB, chunk, lo/hi, 4]
        q = q.reshape(len(rows), k)  # [R, K]
        if self.format == "int8":
            return RowQuants("int8", q, self.scales[panel, lane])
        m = None if self.mins is None else self.mins[panel, :, lane]  # [R, KB]
        return RowQuants(self.format, q, self.scales[panel, :, lane], m)

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 `[N, K]` (or the rows asked for), as `gguf.quants.dequantize` computes GGUF blocks
        (bit for bit) and `q * s` for int8."""
        quants = self.quants(rows)
        q = quants.q.float()  # [R, K]
        if self.format == "int8":
            return q * quants.d[:, None]  # [R, K]
        r = q.shape[0]
        if self.format == "q6_k":  # a scale per 16
            return (quants.d[:, :, None] * (q.view(r, -1, 16) - 32)).view(r, -1)  # [R, K]
        q = q.view(r, -1, BLOCK)  # [R, KB, 32]
        d = quants.d.float()[:, :, None]  # [R, KB, 1]
        if self.format == "q4_0":
            values = d * (q - 8)
        elif self.format in ("q4_1", "q4_k"):
            values = d * q + quants.m.float()[:, :, None]
        else:
            values = q * d
        return values.view(r, -1)  # [R, K]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """An embedding lookup: rows `ids [T]` dequantized, `[T, K]` in `dtype`."""
        return self.dequantize(ids.reshape(-1)).to(self.dtype).view(*ids.shape, -1)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """`x [M, K] @ W.T + bias` -> `[M, N]`: through `csrc/quant_linear.cpp` (the activations
        quantized per block of 32 to int8, as llama.cpp's), or where the kernels cannot be built,
        F.linear over the dequantized weight (slow: a fallback that keeps serving)."""
        if x.device.type == "cuda" and x.dim() == 2:
            from workers.triton_quant import quant_matmul

            args = (self.qs, self.scales, self.mins, bias, FORMATS[self.format], self.shape[0])
            return quant_matmul(x, *args)  # [M, N]
        module = load_kernels() if x.device.type == "cpu" else None
        if module is None or x.dtype not in (torch.float32, torch.bfloat16) or x.dim() != 2:
            return F.linear(x, self.dequantize().to(x.dtype), bias)
        return module.quant_linear(
            x.contiguous(),
            self.qs,
            self.scales,
            self.mins,
            bias,
            FORMATS[self.format],
            self.shape[0],
        )  # [M, N]

    def to(self, device: str | torch.device) -> PackedWeight:
        """This weight on `device` (itself where it lies there already)."""
        if self.qs.device == torch.device(device):
            return self
        mins = None if self.mins is None else self.mins.to(device)
        return PackedWeight(
            self.format, self.shape, self.qs.to(device), self.scales.to(device), mins, self.dtype
        )

    def take_rows(self, rows: torch.Tensor) -> PackedWeight:
        """A weight of these rows only, in this order; a view where whole panels are taken."""
        first = int(rows[0]) if len(rows) else 0
        whole = (
            len(rows) % PANEL == 0
            and first % PANEL == 0
            and torch.equal(rows, torch.arange(first, first + len(rows)))
        )
        if not whole:
            return PackedWeight.pack(self.quants(rows), self.dtype)
        panels = slice(first // PANEL, (first + len(rows)) // PANEL)
        mins = None if self.mins is None else self.mins[panels]
        shape = (len(rows), self.shape[1])
        return PackedWeight(
            self.format, shape, self.qs[panels], self.scales[panels], mins, self.dtype
        )

    @staticmethod
    def cat(weights: list[PackedWeight]) -> PackedWeight:
        """The weights' rows one after another (a fused projection): panels concatenated where
        every part fills whole panels, else repacked."""
        first = weights[0]
        if any(w.format != first.format or w.shape[1] != first.shape[1] for w in weights):
            raise ValueError(f"cannot concatenate {weights}: formats or K differ")
        shape = (sum(w.shape[0] for w in weights), first.shape[1])
        if all(w.shape[0] % PANEL == 0 for w in weights):
            mins = None if first.mins is None else torch.cat([w.mins for w in weights])
            qs = torch.cat([w.qs for w in weights])
            scales = torch.cat([w.scales for w in weights])
            return PackedWeight(first.format, shape, qs, scales, mins, first.dtype)
        return PackedWeight.pack(RowQuants.cat([w.quants() for w in weights]), first.dtype)


class Fp8Weight:
    """A `[N, K]` weight in FP8 (e4m3) with one fp32 scale per output row (value q * s): vLLM's
    `--quantization fp8` and compressed-tensors' FP8 checkpoints. On a CUDA GPU, with bf16
    activations, `linear` rounds each activation row to FP8 with a scale of its own (its largest
    |x| / 448, as vLLM's dynamic FP8) and multiplies with torch's scaled matmul (the tensor cores'
    FP8); elsewhere it multiplies the dequantized weight. The same interface as PackedWeight."""

    format = "fp8"

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> None:
        self.q = q  # [N, K] float8_e4m3fn
        self.scale = scale  # [N] fp32
        self.dtype = dtype
        self.shape = (q.shape[0], q.shape[1])

    def __repr__(self) -> str:
        return f"Fp8Weight({list(self.shape)}, {self.nbytes} bytes)"

    @property
    def device(self) -> torch.device:
        return self.q.device

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [self.q, self.scale]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 `[N, K]` (or the rows asked for): q * s."""
        q, scale = (self.q, self.scale) if rows is None else (self.q[rows], self.scale[rows])
        return q.float() * scale[:, None]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.dequantize(ids.reshape(-1)).to(self.dtype).view(*ids.shape, -1)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        n, k = self.shape
        if x.device.type == "cuda" and x.dtype == torch.bfloat16 and x.dim() == 2:
            if n % 16 == 0 and k % 16 == 0:
                return scaled_linear(x, self.q, self.scale, bias)
        return F.linear(x, self.dequantize().to(x.dtype), bias)

    def to(self, device: str | torch.device) -> Fp8Weight:
        if self.q.device == torch.device(device):
            return self
        return Fp8Weight(self.q.to(device), self.scale.to(device), self.dtype)

    def take_rows(self, rows: torch.Tensor) -> Fp8Weight:
        """These rows; a view where they are consecutive."""
        first = int(rows[0]) if len(rows) else 0
        if torch.equal(rows.cpu(), torch.arange(first, first + len(rows))):
            part = slice(first, first + len(rows))
            return Fp8Weight(self.q[part], self.scale[part], self.dtype)
        return Fp8Weight(self.q[rows], self.scale[rows], self.dtype)

    @staticmethod
    def cat(weights: list[Fp8Weight]) -> Fp8Weight:
        q = torch.cat([w.q for w in weights])
        return Fp8Weight(q, torch.cat([w.scale for w in weights]), weights[0].dtype)


def scaled_linear(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """`x [M, K] @ (q * scale).T + bias` with x rounded to FP8 per row (scale: its largest |x| /
    448) and torch's scaled matmul (fp32 sums, bf16 out); q `[N, K]` e4m3, scale `[N]` fp32."""
    amax = x.abs().amax(dim=1, keepdim=True).float()  # [M, 1]
    x_scale = torch.where(amax > 0, amax / 448, torch.ones_like(amax))  # [M, 1]
    xq = (x.float() / x_scale).clamp(-448, 448).to(torch.float8_e4m3fn)  # [M, K]
    out = torch._scaled_mm(
        xq, q.t(), scale_a=x_scale, scale_b=scale.view(1, -1), out_dtype=torch.bfloat16
    )  # [M, N]
    return out if bias is None else out + bias


def quantize_fp8(
    weight: torch.Tensor, dtype: torch.dtype, amax: torch.Tensor | None = None
) -> Fp8Weight:
    """Per-output-channel FP8 (e4m3) of a float `[N, K]` weight: each row's scale its largest
    |w| / 448 (`amax [N]`: the largest |w| of rows longer than this slice of them), values
    rounded to the nearest e4m3."""
    w = weight.detach().float()  # [N, K]
    amax = w.abs().amax(dim=1) if amax is None else amax  # [N]
    scale = torch.where(amax > 0, amax / 448, torch.ones_like(amax))
    q = (w / scale[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return Fp8Weight(q, scale, dtype)


def quantize_int8(weight: torch.Tensor, amax: torch.Tensor | None = None) -> RowQuants:
    """Per-output-channel symmetric int8 of a float `[N, K]` weight: each row's scale is its
    largest |w| / 127 (`amax [N]`: the largest |w| of rows longer than this slice of them, as a
    tensor-parallel rank's row-parallel weight is), quants round to nearest (|error| <= scale /
    2)."""
    w = weight.detach().float()  # [N, K]
    scale = (w.abs().amax(dim=1) if amax is None else amax) / 127  # [N]
    inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))  # [N]
    q = torch.round(w * inverse[:, None]).clamp(-127, 127).to(torch.int8)  # [N, K]
    return RowQuants("int8", q, scale)


# the weights a model's matrices may be in place of float ones
QUANTIZED = (PackedWeight, Fp8Weight)


class PackedEmbedding(nn.Module):
    """An embedding table kept packed: a lookup dequantizes only the rows looked up. Tied to the
    head, the same `weight` serves the logits."""

    def __init__(self, weight: PackedWeight | Fp8Weight) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight.rows(ids)  # [T, hidden]


def install(model: nn.Module, weights: dict[str, PackedWeight | Fp8Weight]) -> None:
    """Put packed weights in place of a `DecoderLM`'s float ones, by parameter name: a linear's
    weight (its float parameter dropped), the embedding (its module becomes a PackedEmbedding) and
    the head; then fuse each layer's projections again (the fused weight a concatenation of packed
    rows, each projection a view of its rows)."""
    device = model.model.embed_tokens.weight.device
    for name, weight in weights.items():
        weight = weight.to(device)
        module_name = name.removesuffix(".weight")
        module = model.get_submodule(module_name)
        if isinstance(module, nn.Embedding):
            parent, _, child = module_name.rpartition(".")
            setattr(model.get_submodule(parent), child, PackedEmbedding(weight))
        else:
            del module.weight  # the float parameter goes: no copy is kept
            module.weight = weight
    for layer in model.model.layers:
        layer.self_attn.fuse()
        layer.mlp.fuse()


def check_device(device: str | torch.device, what: str) -> None:
    """Raise ValueError, with the reason, where packed weights cannot run on `device`: the CPU
    kernels serve them on the CPU, the Triton kernel (`workers/triton_quant.py`) on a CUDA GPU."""
    kind = torch.device(device).type
    if kind == "cpu":
        return
    if kind != "cuda":
        raise ValueError(f"{what} runs on the CPU or a CUDA GPU, not on {device}")
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        raise ValueError(
            f"{what} on a GPU needs Triton (CUDA builds of torch ship it), which this Python lacks"
        )


def weight_bytes(model: nn.Module) -> tuple[int, int]:
    """Bytes of a model's float parameters and of its packed weights. A projection's packed weight
    is a view of its fused one: storage is counted once."""
    floats = sum(p.numel() * p.element_size() for p in model.parameters())
    storages = {}
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, QUANTIZED):
                for tensor in value.tensors:
                    if tensor is not None:
                        storage = tensor.untyped_storage()
                        storages[storage.data_ptr()] = storage.nbytes()
    return floats, sum(storages.values())
