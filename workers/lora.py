"""LoRA adapters on a worker: a PEFT checkpoint read into low-rank updates of the model's fused
projections, a step's tokens grouped by adapter, and the adapters a worker keeps resident."""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from scheduler.request import LoraRef

log = logging.getLogger(__name__)

# PEFT's module names → (the model's fused projection, the module's place in it)
MODULES = {
    "q_proj": ("qkv", 0),
    "k_proj": ("qkv", 1),
    "v_proj": ("qkv", 2),
    "o_proj": ("o", 0),
    "gate_proj": ("gate_up", 0),
    "up_proj": ("gate_up", 1),
    "down_proj": ("down", 0),
}
# what an adapter's config may ask for that is not served here, and why
_REFUSED = {
    "use_dora": "DoRA adapters",
    "modules_to_save": "adapters that also train whole modules (modules_to_save)",
    "alpha_pattern": "per-module lora_alpha (alpha_pattern)",
    "layers_to_transform": "adapters of some layers only (layers_to_transform)",
    "fan_in_fan_out": "fan_in_fan_out weights",
}


class LoraError(ValueError):
    """An adapter that cannot be served here, with the reason."""


@dataclass
class LoraAdapter:
    """One adapter's updates: per layer, per fused projection (`qkv`, `o`, `gate_up`, `down`),
    A `[r, in]` and B `[out, r]` with the scaling folded in, so that the projection's output
    gains `(x @ A.T) @ B.T`. Where a projection fuses several modules, A stacks theirs and B is
    block diagonal (a module without an update has zero rows in B)."""

    ref: LoraRef
    rank: int  # the largest r of its modules
    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for s in self.layers for p in s.values() for t in p)


@dataclass
class LoraBatch:
    """The adapters of a step's tokens: each adapter with the flat indices of its tokens (None: all
    of them). Tokens of the base model are in no group."""

    groups: list[tuple[LoraAdapter, torch.Tensor | None]]

    def add(self, out: torch.Tensor, x: torch.Tensor, layer: int, site: str) -> None:
        """Add each group's update of projection `site` of `layer` to its rows of `out [N, out]`,
        the projection of `x [N, in]`."""
        for adapter, rows in self.groups:
            pair = adapter.layers[layer].get(site)
            if pair is None:
                continue
            a, b = pair
            if rows is None:
                out += (x @ a.T) @ b.T  # [N, out]
            else:
                out.index_add_(0, rows, (x[rows] @ a.T) @ b.T)  # [rows, out]


def projection_shapes(
    hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int
) -> dict[str, tuple[int, list[int]]]:
    """Per fused projection: its input width and its modules' output widths."""
    q, kv = heads * head_dim, kv_heads * head_dim
    return {
        "qkv": (hidden, [q, kv, kv]),
        "o": (q, [hidden]),
        "gate_up": (hidden, [intermediate] * 2),
        "down": (intermediate, [hidden]),
    }


def model_shapes(model: Any) -> tuple[dict[str, tuple[int, list[int]]], int]:
    """A DecoderLM's projection shapes and layer count."""
    spec = model.spec
    shapes = projection_shapes(
        spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.intermediate_size
    )
    return shapes, spec.num_layers


def config_shapes(config: Any) -> tuple[dict[str, tuple[int, list[int]]], int]:
    """A Hugging Face config's projection shapes and layer count."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    shapes = projection_shapes(
        config.hidden_size, heads, kv_heads, head_dim, config.intermediate_size
    )
    return shapes, config.num_hidden_layers


def check_adapter(ref: LoraRef, base: Any, max_rank: int) -> int:
    """Whether the PEFT checkpoint at `ref.path` can be served on `base` (a DecoderLM, or a Hugging
    Face config), reading its config and its tensors' shapes only: its rank, or LoraError with
    the reason. What a server checks before it takes the adapter's name."""
    shapes, num_layers = model_shapes(base) if hasattr(base, "spec") else config_shapes(base)
    _adapter_config(ref)
    return _check_shapes(ref, _tensor_shapes(ref), shapes, num_layers, max_rank)


def read_adapter(ref: LoraRef, model: Any, max_rank: int) -> LoraAdapter:
    """A PEFT LoRA checkpoint (`adapter_config.json` and `adapter_model.safetensors`, or
    `adapter_model.bin`) at `ref.path`, for `model`, on its device and in its dtype. LoraError with
    the reason for what cannot be served: a missing file, another PEFT type, a rank above
    `max_rank`, a module other than q/k/v/o/gate/up/down, shapes that are not the model's."""
    alpha, rslora = _adapter_config(ref)
    tensors = _tensors(ref)
    shapes, num_layers = model_shapes(model)
    rank = _check_shapes(
        ref, {k: tuple(t.shape) for k, t in tensors.items()}, shapes, num_layers, max_rank
    )
    weight = model.model.embed_tokens.weight
    dtype = weight.dtype if weight.dtype.is_floating_point else torch.float32
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        layer, module, part = _parse_key(ref, key)
        pairs.setdefault((layer, module), {})[part] = tensor
    updates: list[dict[str, list[tuple[int, torch.Tensor, torch.Tensor]]]] = [
        {} for _ in range(num_layers)
    ]
    for (layer, module), pair in sorted(pairs.items()):
        a, b = pair["A"], pair["B"]
        site, index = MODULES[module]
        r = a.shape[0]
        scaling = alpha / (r**0.5 if rslora else r)
        updates[layer].setdefault(site, []).append((index, a.float(), b.float() * scaling))
    layers = [
        {site: _fuse(parts, shapes[site][1], dtype, weight.device) for site, parts in u.items()}
        for u in updates
    ]
    return LoraAdapter(ref, rank, layers)


def _adapter_config(ref: LoraRef) -> tuple[float, bool]:
    """The adapter's lora_alpha and use_rslora, its config checked."""
    config_file = Path(ref.path) / "adapter_config.json"
    if not config_file.is_file():
        raise LoraError(f"LoRA adapter {ref.name!r}: no adapter_config.json in {ref.path}")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise LoraError(f"LoRA adapter {ref.name!r}: adapter_config.json unreadable: {e}") from e
    kind = config.get("peft_type", "LORA")
    if kind != "LORA":
        raise LoraError(f"LoRA adapter {ref.name!r} is a {kind} adapter: only LoRA is served")
    for key, what in _REFUSED.items():
        if config.get(key):
            raise LoraError(f"LoRA adapter {ref.name!r}: {what} are not served")
    if config.get("bias", "none") != "none":
        raise LoraError(f"LoRA adapter {ref.name!r}: trained biases (bias={config['bias']!r})")
    return float(config.get("lora_alpha", config.get("r", 8))), bool(config.get("use_rslora"))


def _check_shapes(
    ref: LoraRef,
    tensor_shapes: dict[str, tuple[int, ...]],
    shapes: dict[str, tuple[int, list[int]]],
    num_layers: int,
    max_rank: int,
) -> int:
    """The adapter's rank, each of its tensors checked against the model's projections."""
    pairs: dict[tuple[int, str], dict[str, tuple[int, ...]]] = {}
    for key, shape in tensor_shapes.items():
        layer, module, part = _parse_key(ref, key)
        pairs.setdefault((layer, module), {})[part] = shape
    if not pairs:
        raise LoraError(f"LoRA adapter {ref.name!r} has no LoRA weights")
    rank = 0
    for (layer, module), pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"} or layer >= num_layers:
            raise LoraError(f"LoRA adapter {ref.name!r}: layer {layer} {module} is incomplete")
        a, b = pair["A"], pair["B"]
        site, index = MODULES[module]
        width, outs = shapes[site]
        r = a[0]
        if a != (r, width) or b != (outs[index], r):
            raise LoraError(
                f"LoRA adapter {ref.name!r}: {module} of layer {layer} has A {a} and B {b}, the "
                f"model needs A [r, {width}] and B [{outs[index]}, r]"
            )
        if r > max_rank:
            raise LoraError(
                f"LoRA adapter {ref.name!r} has rank {r}, above --max-lora-rank {max_rank}"
            )
        rank = max(rank, r)
    return rank


def _tensor_shapes(ref: LoraRef) -> dict[str, tuple[int, ...]]:
    """The adapter's tensors' shapes, from the safetensors header alone where there is one."""
    path = Path(ref.path) / "adapter_model.safetensors"
    if not path.is_file():
        return {k: tuple(t.shape) for k, t in _tensors(ref).items()}
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}  # noqa: SIM118


def _tensors(ref: LoraRef) -> dict[str, torch.Tensor]:
    path = Path(ref.path)
    safetensors_file = path / "adapter_model.safetensors"
    if safetensors_file.is_file():
        from safetensors.torch import load_file

        return load_file(str(safetensors_file))
    bin_file = path / "adapter_model.bin"
    if bin_file.is_file():
        return torch.load(bin_file, map_location="cpu", weights_only=True)
    raise LoraError(
        f"LoRA adapter {ref.name!r}: no adapter_model.safetensors (or .bin) in {ref.path}"
    )


def _parse_key(ref: LoraRef, key: str) -> tuple[int, str, str]:
    """(layer, module, "A" or "B") of a PEFT tensor name such as
    `base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight`."""
    parts = key.split(".")
    try:
        at = parts.index("layers")
        layer = int(parts[at + 1])
        kind = next(p for p in parts if p in ("lora_A", "lora_B"))
        module = parts[parts.index(kind) - 1]
    except (ValueError, IndexError, StopIteration):
        raise LoraError(
            f"LoRA adapter {ref.name!r}: {key} is not a decoder layer's LoRA weight (embedding "
            "and head adapters are not served)"
        ) from None
    if module not in MODULES:
        raise LoraError(
            f"LoRA adapter {ref.name!r} targets {module}: pdserve serves adapters of "
            f"{', '.join(MODULES)}"
        )
    return layer, module, kind[-1]


def _fuse(
    parts: list[tuple[int, torch.Tensor, torch.Tensor]],
    outs: list[int],
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One fused projection's A (its modules' stacked) and block-diagonal B."""
    parts = sorted(parts, key=lambda p: p[0])
    a = torch.cat([p[1] for p in parts])  # [sum r, in]
    b = torch.zeros(sum(outs), a.shape[0])  # [sum out, sum r]
    row_of = [sum(outs[:i]) for i in range(len(outs))]
    col = 0
    for index, _, part_b in parts:
        r = part_b.shape[1]
        b[row_of[index] : row_of[index] + outs[index], col : col + r] = part_b
        col += r
    return a.to(device, dtype).contiguous(), b.to(device, dtype).contiguous()


class ResidentLoras:
    """The adapters a worker holds, least recently used first: up to `max_loras` (the scheduler
    never runs more at once on one worker); a step's adapter not held is read from its path."""

    def __init__(self, model: Any, max_loras: int, max_rank: int) -> None:
        self.model = model
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.adapters: OrderedDict[LoraRef, LoraAdapter] = OrderedDict()
        self.num_loads = 0

    def get(self, ref: LoraRef) -> LoraAdapter:
        adapter = self.adapters.get(ref)
        if adapter is not None:
            self.adapters.move_to_end(ref)
            return adapter
        adapter = read_adapter(ref, self.model, self.max_rank)
        self.num_loads += 1
        while len(self.adapters) >= self.max_loras:
            self.adapters.popitem(last=False)
        self.adapters[ref] = adapter
        log.info(
            "LoRA adapter %s loaded from %s: rank %d, %.1f MiB",
            ref.name,
            ref.path,
            adapter.rank,
            adapter.nbytes / 2**20,
        )
        return adapter

    def batch(self, refs: list[LoraRef | None], counts: list[int]) -> LoraBatch | None:
        """The step's LoraBatch: `refs[i]` is the adapter of the next `counts[i]` flat tokens."""
        if not any(refs):
            return None
        rows: dict[LoraRef, list[int]] = {}
        start = 0
        for ref, count in zip(refs, counts, strict=True):
            if ref is not None:
                rows.setdefault(ref, []).extend(range(start, start + count))
            start += count
        device = self.model.model.embed_tokens.weight.device
        groups = []
        for ref, indices in rows.items():
            every = len(indices) == start
            index = None if every else torch.tensor(indices, dtype=torch.long, device=device)
            groups.append((self.get(ref), index))
        return LoraBatch(groups)
