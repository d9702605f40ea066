"""Reads a checkpoint's weights shard by shard, tensor by tensor, straight into our model on its
device and in its dtype.

The model is built on the `meta` device (no memory), given storage on the target device in the
target dtype, and each checkpoint tensor is read (memory-mapped), converted by
`hf_checkpoint.unfused` and copied into its parameter. The host never holds more than one tensor
in fp32 beyond the file's own pages: an 8B model in bf16 starts with about its 16 GB of weights,
not the ~32 GB of an fp32 copy first.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from workers import hf_quantized
from workers.hf_checkpoint import spec_from_hf, unfused
from workers.model import DecoderLM
from workers.quantized import Fp8Weight, PackedWeight, check_device, install
from workers.tp import TensorParallel


def checkpoint_files(checkpoint: str) -> list[Path]:
    """The safetensors files of a checkpoint directory, in its index's order; [] when it has none
    (a hub id, or .bin weights: those load through `transformers`)."""
    root = Path(checkpoint)
    if not root.is_dir():
        return []
    index = root / "model.safetensors.index.json"
    if index.exists():
        names = dict.fromkeys(json.loads(index.read_text())["weight_map"].values())
        return [root / name for name in names]
    return sorted(root.glob("*.safetensors"))


def rotary_embedding(config: Any) -> tuple[torch.Tensor, float]:
    """The checkpoint's rotary frequencies `[head_dim / 2]` and attention scaling, from its own
    `transformers` rotary module (theta and any scaling applied) without building the model."""
    from transformers import AutoModelForCausalLM

    cls = AutoModelForCausalLM._model_mapping[type(config)]
    module = sys.modules[cls.__module__]
    rotary = getattr(module, cls.__name__.removesuffix("ForCausalLM") + "RotaryEmbedding")(config)
    return rotary.inv_freq.detach().float().cpu(), float(getattr(rotary, "attention_scaling", 1.0))


def _tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for path in files:
        with safe_open(str(path), framework="pt") as shard:
            for name in shard.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, shard.get_tensor(name)


def _shapes(files: list[Path], method: str | None) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint as an empty `meta` tensor of its shape and dtype; a quantized
    linear (`method`) as the `weight` it stands for."""
    from safetensors import safe_open

    shapes = {}
    for path in files:
        with safe_open(str(path), framework="pt") as shard:
            for name in shard.keys():  # noqa: SIM118
                shape = shard.get_slice(name).get_shape()
                shapes[name] = torch.empty(shape, dtype=torch.float32, device="meta")
    if method is None:
        return shapes
    linears, rest = hf_quantized.split_tensors(shapes, method)
    for module, tensors in linears.items():
        shape = hf_quantized.weight_shape(method, tensors)
        if shape is not None:
            rest[f"{module}.weight"] = torch.empty(shape, device="meta")
    return rest


def _quantized_linears(
    linears: dict[str, dict[str, torch.Tensor]],
    method: str,
    quant: dict[str, Any],
    config: Any,
    dtype: torch.dtype,
    device: str | torch.device,
) -> tuple[dict[str, PackedWeight | Fp8Weight], dict[str, torch.Tensor]]:
    """The quantized linears by our parameter names: packed weights, and the float weights of
    those without a kernel on `device` (FP8 on a CPU, dequantized); Phi-3's fused `qkv_proj` and
    `gate_up_proj` split by rows, as `unfused` splits float ones."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    q = config.num_attention_heads * head_dim
    kv = (getattr(config, "num_key_value_heads", None) or config.num_attention_heads) * head_dim
    packed, floats = {}, {}
    for module, tensors in linears.items():
        weight = hf_quantized.linear_weight(method, tensors, quant)
        if weight is None:  # activation scales only
            continue
        n = weight.shape[0]
        if module.endswith("self_attn.qkv_proj"):
            prefix = module.removesuffix("qkv_proj")
            parts = {"q_proj": (0, q), "k_proj": (q, q + kv), "v_proj": (q + kv, n)}
        elif module.endswith("mlp.gate_up_proj"):
            prefix = module.removesuffix("gate_up_proj")
            parts = {"gate_proj": (0, n // 2), "up_proj": (n // 2, n)}
        else:
            prefix, parts = "", {module: (0, n)}
        for name, (first, last) in parts.items():
            rows = torch.arange(first, last)
            if not isinstance(weight, Fp8Weight):
                packed[f"{prefix}{name}.weight"] = PackedWeight.pack(weight.take(rows), dtype)
            elif torch.device(device).type == "cuda":
                part = weight.take_rows(rows)
                packed[f"{prefix}{name}.weight"] = Fp8Weight(part.q, part.scale, dtype)
            else:
                floats[f"{prefix}{name}.weight"] = weight.dequantize(rows)
    return packed, floats


def load_weights(
    files: list[Path],
    config: Any,
    dtype: torch.dtype,
    device: str | torch.device,
    tp: TensorParallel | None = None,
) -> DecoderLM:
    """Our model of a checkpoint's safetensors `files`, on `device` in `dtype`; a GPTQ, AWQ or
    compressed-tensors checkpoint's quantized linears served packed (`workers/hf_quantized.py`;
    the CPU kernels; FP8 ones dequantized). With `tp`, that rank's part only: each tensor is read,
    sliced and only the slice kept.
    Raises ValueError if the checkpoint's tensors do not fit the model, or if its quantization
    cannot be served (with the reason)."""
    quant = hf_quantized.quantization_config(config)
    method = None if quant is None else hf_quantized.check_method(quant)
    if method is not None:
        check_device(device, f"a {method} checkpoint")
    if method is not None and tp is not None:
        raise ValueError(
            f"a {method} checkpoint is not served tensor-parallel yet: use --tensor-parallel-size 1"
        )
    if method is not None and getattr(config, "attention_multiplier", None) is not None:
        raise ValueError(
            f"{config.model_type}'s multipliers are folded into float weights at load: its "
            f"{method} checkpoint's packed weights cannot take them"
        )
    spec = spec_from_hf(config, unfused(_shapes(files, method), config))
    inv_freq, rope_scale = rotary_embedding(config)
    with torch.device("meta"):
        model = DecoderLM(spec, inv_freq, rope_scale, tp)
    model = model.to(dtype=dtype).to_empty(device=device)  # storage only on the target
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    linears: dict[str, dict[str, torch.Tensor]] = {}
    with torch.no_grad():
        for name, tensor in _tensors(files):
            module, _, last = name.rpartition(".")
            if method is not None and hf_quantized.is_quantized_part(method, last, tensor):
                linears.setdefault(module, {})[last] = tensor
                continue
            # as `transformers` would load it: fp32, then our own conversions
            for key, value in unfused({name: tensor.float()}, config).items():
                if key == "lm_head.weight" and spec.tie_word_embeddings:
                    continue
                if key not in params:
                    if "rotary_emb" in key:
                        continue
                    raise ValueError(f"checkpoint does not fit the model: unexpected {key}")
                if tp is not None:
                    value = tp.slice(key, value, spec.head_dim)
                params[key].copy_(value)
                loaded.add(key)
    packed, floats = {}, {}
    if method is not None:
        packed, floats = _quantized_linears(linears, method, quant, config, dtype, device)
    unknown = sorted((set(packed) | set(floats)) - set(params))
    if unknown:
        raise ValueError(f"checkpoint does not fit the model: unexpected {unknown[:5]}")
    with torch.no_grad():
        for key, value in floats.items():
            params[key].copy_(value)
    missing = sorted(set(params) - loaded - set(packed) - set(floats))
    if missing:
        raise ValueError(f"checkpoint does not fit the model: missing {missing[:5]}")
    if packed:
        install(model, packed)
    return model.eval()
