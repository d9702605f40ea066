"""A Hugging Face checkpoint's GPTQ and AWQ int4 matrices as packed weights, read from their packed
integers (never dequantized), under our model's parameter names.

Both keep a linear `[N, K]` as 4-bit quants q with, per group of `group_size` k, an fp16 scale s
and a 4-bit zero z per output row: w = (q - z) * s. That is the kernel's 4-bit affine format
(`q4_k` in `workers/quantized.py`) with each block of 32 k's scale s and min -z * s, both exact in
fp32, so a group of 128 is four blocks of the same scale. The layouts (AutoGPTQ's and AutoAWQ's,
as vLLM reads them):

* GPTQ: `qweight [K / 8, N]` int32, eight k to a word (k % 8 in bits 4 (k % 8)); `qzeros
  [K / g, N / 8]` int32, eight n to a word, holding z - 1 (`checkpoint_format` gptq; gptq_v2 holds
  z); `scales [K / g, N]` fp16; `g_idx [K]`, k's group, which must be k / g (act-order
  checkpoints, `desc_act`, reorder k and are refused).
* AWQ (GEMM): `qweight [K, N / 8]` int32, eight n to a word in the order 0, 2, 4, 6, 1, 3, 5, 7
  (column c of a word at nibble 0, 4, 1, 5, 2, 6, 3, 7); `qzeros [K / g, N / 8]` the same way,
  holding z; `scales [K / g, N]` fp16.
"""

from __future__ import annotations

from typing import Any

import torch

from workers.quantized import BLOCK, RowQuants

METHODS = ("gptq", "awq")
TENSORS = {"gptq": ("qweight", "qzeros", "scales", "g_idx"), "awq": ("qweight", "qzeros", "scales")}
# AWQ: the nibble of each of a word's eight columns
AWQ_NIBBLE = (0, 4, 1, 5, 2, 6, 3, 7)


def quantization_config(config: Any) -> dict[str, Any] | None:
    """The checkpoint's `quantization_config` as a dict, or None where it has none."""
    found = getattr(config, "quantization_config", None)
    if found is None:
        return None
    return found if isinstance(found, dict) else found.to_dict()


def check_method(quant: dict[str, Any]) -> str:
    """The checkpoint's method if pdserve serves it packed; else ValueError with the reason."""
    method = str(quant.get("quant_method", "")).lower()
    if method not in METHODS:
        raise ValueError(
            f"the checkpoint is quantized with {method or 'an unnamed method'}: pdserve serves "
            "GPTQ and AWQ int4 checkpoints packed (and GGUF files); dequantize this one first"
        )
    bits = quant.get("bits", quant.get("w_bit"))
    if bits != 4:
        raise ValueError(f"{method} with {bits} bits: pdserve serves 4-bit {method} only")
    group = quant.get("group_size", quant.get("q_group_size", 128))
    if group != -1 and group % BLOCK:
        raise ValueError(f"{method} group size {group}: a multiple of {BLOCK} (or -1) is served")
    if method == "awq" and str(quant.get("version", "gemm")).lower() != "gemm":
        raise ValueError(f"AWQ version {quant.get('version')}: the GEMM layout is served")
    if method == "awq" and not quant.get("zero_point", True):
        raise ValueError("AWQ without zero points is not served")
    return method


def unpack_words(words: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """int32 words `[R, C]` as their eight nibbles each, `[R, C, 8]` (uint8), value i of a word
    from nibble `order[i]`."""
    shifts = torch.tensor(order, dtype=torch.int32) * 4  # [8]
    return ((words[:, :, None] >> shifts) & 0x0F).to(torch.uint8)


def read_quants(method: str, tensors: dict[str, torch.Tensor], quant: dict[str, Any]) -> RowQuants:
    """One linear's quants from its packed tensors (by their names' last part): `q [N, K]`
    nibbles, per block of 32 the scale s and min -z * s in fp32."""
    scales = tensors["scales"].float()  # [G, N]
    if method == "gptq":
        packed = tensors["qweight"]  # [K / 8, N]
        k, n = packed.shape[0] * 8, packed.shape[1]
        q = unpack_words(packed.T.contiguous()).reshape(n, k)  # [N, K]
        zeros = unpack_words(tensors["qzeros"]).reshape(scales.shape).float()  # [G, N]
        if quant.get("checkpoint_format", "gptq") != "gptq_v2":
            zeros = zeros + 1  # v1 stores z - 1
        groups = scales.shape[0]
        g_idx = tensors.get("g_idx")
        if g_idx is not None and not torch.equal(
            g_idx.long(), torch.arange(k) // (k // groups)
        ):
            raise ValueError(
                "GPTQ act-order (desc_act) checkpoint: its groups reorder k, which pdserve's "
                "packed weights do not; use a checkpoint quantized without desc_act"
            )
    else:
        packed = tensors["qweight"]  # [K, N / 8]
        k, n = packed.shape[0], packed.shape[1] * 8
        q = unpack_words(packed, AWQ_NIBBLE).reshape(k, n).T.contiguous()  # [N, K]
        zeros = unpack_words(tensors["qzeros"], AWQ_NIBBLE).reshape(scales.shape).float()
    per_group = k // scales.shape[0]  # k per group (K for a group size of -1)
    if per_group % BLOCK:
        raise ValueError(f"{method} groups of {per_group} k: a multiple of {BLOCK} is served")
    repeat = per_group // BLOCK
    d = scales.T.repeat_interleave(repeat, dim=1)  # [N, K / 32]
    m = -(zeros * scales).T.repeat_interleave(repeat, dim=1)  # [N, K / 32]
    return RowQuants("q4_k", q, d.contiguous(), m.contiguous())


def split_tensors(
    named: dict[str, torch.Tensor], method: str
) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """A checkpoint's tensors as (quantized linears: module name -> its packed tensors by last
    name part, the rest by name)."""
    parts = TENSORS[method]
    linears: dict[str, dict[str, torch.Tensor]] = {}
    rest = {}
    for name, tensor in named.items():
        module, _, last = name.rpartition(".")
        if last in parts:
            linears.setdefault(module, {})[last] = tensor
        else:
            rest[name] = tensor
    return linears, rest


def weight_shape(method: str, tensors: dict[str, torch.Tensor]) -> tuple[int, int]:
    """`[N, K]` of a quantized linear, from its qweight."""
    rows, cols = tensors["qweight"].shape
    return (cols, rows * 8) if method == "gptq" else (cols * 8, rows)
