"""A Hugging Face checkpoint's GPTQ, AWQ and compressed-tensors matrices as packed weights, read
from their packed integers (never dequantized), under our model's parameter names.

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
* compressed-tensors (llm-compressor's checkpoints): `pack-quantized` int4 is `weight_packed
  [N, K / 8]` int32, k in bits 4 (k % 8) of word k / 8, each value stored plus 8; `weight_scale`
  `[N, K / g]` (or `[N, 1]` per channel); asymmetric ones a `weight_zero_point [N / 8, K / g]`
  packed along N the same way, plus 8: w = (q - z) * s, z = 8 when symmetric. `int-quantized`
  int8 is `weight [N, K]` int8 with a per-channel (or per-tensor) `weight_scale`: the kernel's
  int8 format as it is. `float-quantized` FP8 (e4m3), `weight` and a per-channel or per-tensor
  `weight_scale`, is served as FP8 on a GPU (`Fp8Weight`) and dequantized at load on a CPU, which
  has no FP8 kernel.
"""

from __future__ import annotations

from typing import Any

import torch

from workers.quantized import BLOCK, Fp8Weight, RowQuants

METHODS = ("gptq", "awq", "compressed-tensors")
CT_TENSORS = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")
# activation scales of static W8A8 schemes: the kernel quantizes activations per block of 32 itself
CT_IGNORED = ("input_scale", "input_zero_point", "output_scale", "output_zero_point")
TENSORS = {
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "awq": ("qweight", "qzeros", "scales"),
    "compressed-tensors": CT_TENSORS + CT_IGNORED,
}
CT_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized", "float-quantized")
QUANTIZED_DTYPES = (torch.int8, torch.float8_e4m3fn)
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
            "GPTQ, AWQ and compressed-tensors checkpoints packed (and GGUF files); dequantize "
            "this one first"
        )
    if method == "compressed-tensors":
        compressed_weights(quant)
        return method
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


def compressed_weights(quant: dict[str, Any]) -> dict[str, Any]:
    """A compressed-tensors checkpoint's weight scheme (its `config_groups`' `weights`, the same
    for every group), checked to be one pdserve serves; else ValueError with the reason."""
    form = quant.get("format")
    if form not in CT_FORMATS:
        raise ValueError(
            f"compressed-tensors format {form}: pdserve serves {', '.join(CT_FORMATS)}"
        )
    schemes = [group.get("weights") or {} for group in quant.get("config_groups", {}).values()]
    if not schemes or any(scheme != schemes[0] for scheme in schemes):
        raise ValueError("compressed-tensors: one weight scheme for every group is served")
    scheme = schemes[0]
    bits, kind = scheme.get("num_bits"), scheme.get("type", "int")
    strategy, group = scheme.get("strategy"), scheme.get("group_size")
    if kind == "float":
        if bits != 8:
            raise ValueError(f"compressed-tensors float{bits} weights: FP8 (e4m3) is served")
        return scheme
    served = (bits == 4 and form == "pack-quantized" and strategy in ("group", "channel")) or (
        bits == 8 and strategy in ("channel", "tensor")
    )
    if not served:
        raise ValueError(
            f"compressed-tensors int{bits} weights per {strategy} ({form}): pdserve serves int4 "
            "per group or channel (pack-quantized) and int8 per channel or tensor"
        )
    if strategy == "group" and group % BLOCK:
        raise ValueError(f"compressed-tensors group size {group}: a multiple of {BLOCK} is served")
    if scheme.get("actorder") not in (None, "static", False):
        raise ValueError("compressed-tensors act-order groups reorder k: not served")
    return scheme


def compressed_quants(tensors: dict[str, torch.Tensor]) -> RowQuants | Fp8Weight:
    """One compressed-tensors linear: its quants (int4 as the 4-bit affine format, int8 as the
    int8 one), or its FP8 weight and per-row scales."""
    scale = tensors["weight_scale"].float()
    if "weight_packed" in tensors:
        packed = tensors["weight_packed"]  # [N, K / 8]
        n, k = packed.shape[0], packed.shape[1] * 8
        q = unpack_words(packed).reshape(n, k)  # [N, K]: values + 8
        groups = scale.shape[1]  # [N, G]
        if "weight_zero_point" in tensors:
            zero = unpack_words(tensors["weight_zero_point"].T.contiguous())  # [G, N / 8, 8]
            zero = zero.reshape(groups, -1)[:, :n].T.float()  # [N, G]: zero points + 8
        else:
            zero = torch.full_like(scale, 8.0)
        g_idx = tensors.get("weight_g_idx")
        if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(k) // (k // groups)):
            raise ValueError("compressed-tensors act-order groups reorder k: not served")
        if (k // groups) % BLOCK:
            raise ValueError(f"compressed-tensors groups of {k // groups} k: not served")
        repeat = k // groups // BLOCK
        d = scale.repeat_interleave(repeat, dim=1)  # [N, K / 32]
        m = -(zero * scale).repeat_interleave(repeat, dim=1)
        return RowQuants("q4_k", q, d.contiguous(), m.contiguous())
    weight = tensors["weight"]
    n = weight.shape[0]
    if weight.dtype == torch.int8:
        return RowQuants("int8", weight, scale.reshape(-1).expand(n).contiguous())
    per_row = scale.reshape(-1).expand(n).contiguous()  # per channel [N, 1] or per tensor [1]
    return Fp8Weight(weight, per_row, torch.float32)


def linear_weight(
    method: str, tensors: dict[str, torch.Tensor], quant: dict[str, Any]
) -> RowQuants | Fp8Weight | None:
    """One quantized linear from its tensors: its quants, or its FP8 weight; None for a module
    with activation scales only."""
    if method == "compressed-tensors":
        if "weight_scale" not in tensors:
            return None
        return compressed_quants(tensors)
    return read_quants(method, tensors, quant)


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
        if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(k) // (k // groups)):
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


def is_quantized_part(method: str, last: str, tensor: torch.Tensor) -> bool:
    """Whether a tensor named `...<last>` belongs to a quantized linear: its packed tensors, or
    compressed-tensors' int8 or FP8 `weight`."""
    if last in TENSORS[method]:
        return True
    return method == "compressed-tensors" and last == "weight" and tensor.dtype in QUANTIZED_DTYPES


def split_tensors(
    named: dict[str, torch.Tensor], method: str
) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """A checkpoint's tensors as (quantized linears: module name -> its packed tensors by last
    name part, the rest by name)."""
    linears: dict[str, dict[str, torch.Tensor]] = {}
    rest = {}
    for name, tensor in named.items():
        module, _, last = name.rpartition(".")
        if is_quantized_part(method, last, tensor):
            linears.setdefault(module, {})[last] = tensor
        else:
            rest[name] = tensor
    return linears, rest


def weight_shape(method: str, tensors: dict[str, torch.Tensor]) -> tuple[int, int] | None:
    """`[N, K]` of a quantized linear, from its packed integers; None where its `weight` is in
    the checkpoint as it is (compressed-tensors' int8 and FP8) or it has none."""
    if method == "compressed-tensors":
        if "weight_packed" not in tensors:
            return None
        rows, cols = tensors["weight_packed"].shape
        return rows, cols * 8
    rows, cols = tensors["qweight"].shape
    return (cols, rows * 8) if method == "gptq" else (cols * 8, rows)
