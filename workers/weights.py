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

from workers.hf_checkpoint import spec_from_hf, unfused
from workers.model import DecoderLM


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


def _shapes(files: list[Path]) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint as an empty `meta` tensor of its shape and dtype."""
    from safetensors import safe_open

    shapes = {}
    for path in files:
        with safe_open(str(path), framework="pt") as shard:
            for name in shard.keys():  # noqa: SIM118
                shape = shard.get_slice(name).get_shape()
                shapes[name] = torch.empty(shape, dtype=torch.float32, device="meta")
    return shapes


def load_weights(
    files: list[Path], config: Any, dtype: torch.dtype, device: str | torch.device
) -> DecoderLM:
    """Our model of a checkpoint's safetensors `files`, on `device` in `dtype`. Raises ValueError
    if the checkpoint's tensors do not fit the model."""
    spec = spec_from_hf(config, unfused(_shapes(files), config))
    inv_freq, rope_scale = rotary_embedding(config)
    with torch.device("meta"):
        model = DecoderLM(spec, inv_freq, rope_scale)
    model = model.to(dtype=dtype).to_empty(device=device)  # storage only on the target
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    with torch.no_grad():
        for name, tensor in _tensors(files):
            # as `transformers` would load it: fp32, then our own conversions
            for key, value in unfused({name: tensor.float()}, config).items():
                if key == "lm_head.weight" and spec.tie_word_embeddings:
                    continue
                if key not in params:
                    if "rotary_emb" in key:
                        continue
                    raise ValueError(f"checkpoint does not fit the model: unexpected {key}")
                params[key].copy_(value)
                loaded.add(key)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"checkpoint does not fit the model: missing {missing[:5]}")
    return model.eval()
