"""A `transformers` checkpoint in our model's terms: its architecture as a `ModelSpec` and its
tensors under the names our model loads.

Both ways of loading read it: `workers/loader.py` from a loaded `transformers` model,
`workers/weights.py` tensor by tensor from safetensors files.
"""

from __future__ import annotations

from typing import Any

import torch

from workers.model import SUPPORTED_MODEL_TYPES, ModelSpec


def rope_parameters(config: Any) -> dict[str, Any]:
    """A config's RoPE parameters (`rope_parameters`, or the older `rope_scaling`); {} when it has
    none."""
    return getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}


def unfused(state: dict[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
    """Phi-3's fused projections (`qkv_proj`, `gate_up_proj`) as the separate ones our model loads
    (and fuses again its own way), with Granite's multipliers folded in; other checkpoints' weights
    as they are."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    q = config.num_attention_heads * head_dim
    kv = (getattr(config, "num_key_value_heads", None) or config.num_attention_heads) * head_dim
    out = {}
    for name, tensor in state.items():
        if name.endswith("self_attn.qkv_proj.weight"):
            prefix = name.removesuffix("qkv_proj.weight")
            for part, piece in zip(("q", "k", "v"), tensor.split([q, kv, kv]), strict=True):
                out[f"{prefix}{part}_proj.weight"] = piece
        elif name.endswith("mlp.gate_up_proj.weight"):
            prefix = name.removesuffix("gate_up_proj.weight")
            out[f"{prefix}gate_proj.weight"], out[f"{prefix}up_proj.weight"] = tensor.chunk(
                2, dim=0
            )
        else:
            out[name] = tensor
    return _multiplied(out, config, head_dim)


def _multiplied(
    state: dict[str, torch.Tensor], config: Any, head_dim: int
) -> dict[str, torch.Tensor]:
    """Granite's attention multiplier (the attention's scale, where others have head_dim ** -0.5) in
    the query projection, and its residual multiplier in the projections whose outputs join the
    residual stream, so the attention kernels and the fused add-and-norm stay as they are. New
    tensors: `transformers`' own weights are left alone."""
    factors = {}
    if getattr(config, "attention_multiplier", None) is not None:
        factors["self_attn.q_proj."] = config.attention_multiplier * head_dim**0.5
    if getattr(config, "residual_multiplier", None) is not None:
        factors["self_attn.o_proj."] = factors["mlp.down_proj."] = config.residual_multiplier
    for name in list(state):
        factor = next((f for part, f in factors.items() if part in name), None)
        if factor is not None:
            state[name] = state[name] * factor
    return state


def spec_from_hf(config: Any, state: dict[str, torch.Tensor]) -> ModelSpec:
    """Read the architecture from a HF config; biases and q/k norms from which weights exist."""
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model type {config.model_type!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(
            f"activation {config.hidden_act!r} is not supported (the MLP is SwiGLU with silu)"
        )
    partial = rope_parameters(config).get(
        "partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)
    )
    if partial != 1.0:
        raise ValueError(
            f"partial_rotary_factor {partial} is not supported (RoPE rotates whole heads here)"
        )
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    tie = bool(getattr(config, "tie_word_embeddings", False)) or "lm_head.weight" not in state
    # SmolLM3: 1 for a layer with RoPE, 0 without
    rope_layers = getattr(config, "no_rope_layers", None)
    return ModelSpec(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_layers=config.num_hidden_layers,
        num_heads=config.num_attention_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        head_dim=head_dim,
        rms_norm_eps=config.rms_norm_eps,
        qkv_bias="model.layers.0.self_attn.q_proj.bias" in state,
        o_bias="model.layers.0.self_attn.o_proj.bias" in state,
        qk_norm="model.layers.0.self_attn.q_norm.weight" in state,
        tie_word_embeddings=tie,
        rope_layers=tuple(bool(r) for r in rope_layers)
        if rope_layers and not all(rope_layers)
        else None,
        embedding_multiplier=float(getattr(config, "embedding_multiplier", 1.0)),
        logits_scaling=float(getattr(config, "logits_scaling", 1.0)),
    )
