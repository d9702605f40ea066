"""A GGUF file's quantized matrices as packed weights under our model's parameter names, read from
their blocks (never dequantized), q and k rows put back in Hugging Face's order.

llama.cpp's converter permutes the q and k rows of Llama-family checkpoints (GGUF architecture
`llama`) for its RoPE layout, and `transformers` un-permutes them when it dequantizes; a row
permutation of the quants and their scales does the same here, row for row.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from workers.quantized import PackedWeight, RowQuants

# GGUF tensor types served packed (llama.cpp's block layouts), by their names in `gguf`
SERVED = {"Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_1": "q4_1", "Q4_K": "q4_k", "Q6_K": "q6_k"}
SUPER = 256  # k per K-quant super-block
# tensor types left as the float weights the model loaded
FLOATS = ("F32", "F16", "BF16")


def read_quants(name: str, type_name: str, raw: torch.Tensor, k: int) -> RowQuants:
    """The quants of one GGUF tensor from its raw blocks `raw [N, bytes]` (uint8, rows of
    `k` values): Q8_0 = fp16 d + 32 int8; Q4_0 = fp16 d + 16 bytes of nibbles; Q4_1 = fp16 d +
    fp16 m + 16 bytes, byte j holding value j in its low nibble and value j + 16 in its high one;
    the K-quants' super-blocks of 256 as `k_quants` reads them."""
    if type_name not in SERVED:
        raise ValueError(
            f"GGUF tensor {name} is {type_name}: --quantization gguf serves Q8_0, Q4_0, Q4_1, "
            "Q4_K and Q6_K blocks (Q5_0, Q5_1, Q2_K, Q3_K, Q5_K, the IQ types and the others "
            "have no kernel yet); leave --quantization unset to serve this file dequantized"
        )
    if type_name in ("Q4_K", "Q6_K"):
        return k_quants(type_name, raw, k)
    n = raw.shape[0]
    blocks = raw.view(n, k // 32, -1)  # [N, KB, block bytes]

    def half(first: int) -> torch.Tensor:  # [N, KB] fp16 at byte `first` of each block
        return blocks[:, :, first : first + 2].contiguous().view(torch.float16)[:, :, 0]

    if type_name == "Q8_0":
        q = blocks[:, :, 2:].contiguous().view(torch.int8)  # [N, KB, 32]
        return RowQuants("q8_0", q.reshape(n, k), half(0))
    first = 2 if type_name == "Q4_0" else 4
    nibbles = blocks[:, :, first:]  # [N, KB, 16]
    q = torch.cat((nibbles & 0x0F, nibbles >> 4), dim=2)  # [N, KB, 32]: values 0-15, then 16-31
    m = half(2) if type_name == "Q4_1" else None
    return RowQuants(SERVED[type_name], q.reshape(n, k), half(0), m)


def k_quants(type_name: str, raw: torch.Tensor, k: int) -> RowQuants:
    """A Q4_K or Q6_K tensor's super-blocks as RowQuants with fp32 scales, exactly the values
    `gguf.quants.dequantize` computes. Q4_K (144 bytes): fp16 d, fp16 dmin, 12 bytes of 6-bit
    scales and mins for its 8 blocks of 32, 128 bytes of nibbles (byte i of 32-byte chunk c: value
    i of block 2c low, of block 2c + 1 high); value d * sc * q - dmin * m. Q6_K (210 bytes): 128
    bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales (one per 16 values), fp16 d;
    value d * sc * (q - 32)."""
    n = raw.shape[0]
    supers = raw.view(n, k // SUPER, -1)  # [N, S, bytes]

    def half(first: int) -> torch.Tensor:  # [N, S] fp32 of the fp16 at byte `first`
        return supers[:, :, first : first + 2].contiguous().view(torch.float16)[:, :, 0].float()

    if type_name == "Q4_K":
        packed = supers[:, :, 4:16].view(n, -1, 3, 4)  # [N, S, 3, 4]: the 12 bytes of scales
        low, high, both = packed[:, :, 0], packed[:, :, 1], packed[:, :, 2]  # [N, S, 4] each
        sc = torch.cat((low & 0x3F, (both & 0x0F) | ((low >> 2) & 0x30)), dim=2)  # [N, S, 8]
        mins = torch.cat((high & 0x3F, (both >> 4) | ((high >> 2) & 0x30)), dim=2)  # [N, S, 8]
        d = (half(0)[:, :, None] * sc.float()).view(n, -1)  # [N, K / 32]
        m = -(half(2)[:, :, None] * mins.float()).view(n, -1)  # [N, K / 32]
        nibbles = supers[:, :, 16:].view(n, -1, 4, 1, 32)  # [N, S, chunk, 1, 32]
        q = torch.cat((nibbles & 0x0F, nibbles >> 4), dim=3)  # [N, S, chunk, lo/hi, 32]
        return RowQuants("q4_k", q.reshape(n, k), d, m)
    low = supers[:, :, :128].view(n, -1, 2, 1, 64)  # [N, S, half, 1, 64]
    low = torch.cat((low & 0x0F, low >> 4), dim=3).view(n, -1, 2, 4, 32)  # [N, S, half, j, 32]
    high = supers[:, :, 128:192].view(n, -1, 2, 1, 32)  # [N, S, half, 1, 32]
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 1, 4, 1)
    high = (high >> shifts) & 0x03  # [N, S, half, j, 32]
    q = (low | (high << 4)).reshape(n, k)  # [N, K]: 0-63
    sc = supers[:, :, 192:208].contiguous().view(torch.int8).float()  # [N, S, 16]
    d = (half(208)[:, :, None] * sc).view(n, -1)  # [N, K / 16]
    return RowQuants("q6_k", q, d)


def unpermute_rows(num_rows: int, num_heads: int) -> torch.Tensor:
    """The rows, in llama.cpp's order, of Hugging Face's q or k rows 0..num_rows-1 (transformers'
    `_reverse_permute_weights`): each head's rows were interleaved, first half with second."""
    half = num_rows // num_heads // 2
    return torch.arange(num_rows).view(num_heads, half, 2).transpose(1, 2).reshape(-1)


def gguf_weights(
    path: Path, model: nn.Module, config: Any, dtype: torch.dtype
) -> dict[str, PackedWeight]:
    """Every quantized matrix of the GGUF at `path` that `model` (a DecoderLM) has, packed, by our
    parameter name. Raises ValueError, naming the tensor and the reason, when one cannot be served
    packed (a type without a kernel, a weight missing from the file or of another shape, or
    multipliers our loader folds into float weights)."""
    import gguf

    folded = [
        key
        for key in ("attention_multiplier", "residual_multiplier")
        if getattr(config, key, None) is not None
    ]
    if folded:
        raise ValueError(
            f"{path.name}: {config.model_type}'s {' and '.join(folded)} are folded into float "
            "weights at load, which --quantization gguf keeps packed as the file has them: leave "
            "--quantization unset for this model"
        )
    reader = gguf.GGUFReader(str(path))
    field = reader.fields["general.architecture"]
    arch_name = bytes(field.parts[field.data[0]]).decode()
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch_name)
    names = gguf.get_tensor_name_map(arch, model.spec.num_layers)
    tensors = {t.name: t for t in reader.tensors}
    spec = model.spec
    out = {}
    for name, param in model.named_parameters():
        if param.dim() != 2:
            continue
        base = name.removesuffix(".weight")
        gguf_name = names.get_name(base)
        tensor = tensors.get(f"{gguf_name}.weight")
        if tensor is None:
            raise ValueError(f"{path.name} has no tensor for {name} (looked for {gguf_name})")
        type_name = tensor.tensor_type.name
        if type_name in FLOATS:
            continue
        k, n = (int(s) for s in tensor.shape)  # GGUF lists the fastest dimension first
        if (n, k) != tuple(param.shape):
            raise ValueError(f"{tensor.name} is {n} x {k}, {name} is {tuple(param.shape)}")
        raw = torch.from_numpy(tensor.data.copy())  # [N, bytes] (the file is mapped read-only)
        quants = read_quants(tensor.name, type_name, raw, k)
        if arch_name == "llama" and base.endswith(("q_proj", "k_proj")):
            heads = spec.num_heads if base.endswith("q_proj") else spec.num_kv_heads
            quants = quants.take(unpermute_rows(n, heads))
        out[name] = PackedWeight.pack(quants, dtype)
    return out
