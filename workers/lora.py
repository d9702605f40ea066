"""LoRA adapters on a worker: a PEFT checkpoint read into low-rank updates of the model's fused
projections, a step's tokens grouped by adapter, and the adapters a worker keeps resident."""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import shutil
import tempfile
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from scheduler.request import LoraRef
from workers import kernels

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
    """One adapter as read: per (layer, module), A `[r, in]` and B `[out, r]` with the scaling
    folded into B (fp32, on the host), so that the module's output gains `(x @ A.T) @ B.T`."""

    ref: LoraRef
    rank: int  # the largest r of its modules
    modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


class LoraSlots:
    """Every resident adapter's weights in slot-indexed buffers, per layer and fused projection:
    A `[slots, M R, in]` (M the projection's modules, R the highest rank; module m's A rows in
    band m R .. m R + r, zero past its rank r) and B `[slots, R, out]` (module m's B, transposed,
    at its own output columns: the modules' B side by side, not block diagonal), and each
    (slot, module)'s rank `[slots, M]` (0: a module the adapter does not adapt). A step multiplies
    every slot's tokens in one call whatever mix of adapters it runs (`kernels.lora_add`; punica's
    SGMV), or with batched matmuls where that kernel does not apply."""

    def __init__(
        self, model: Any, num_slots: int, max_rank: int, dtype: torch.dtype | None = None
    ) -> None:
        shapes, self.num_layers = model_shapes(model)
        weight = model.model.embed_tokens.weight
        if dtype is None:  # the model's
            dtype = weight.dtype if weight.dtype.is_floating_point else torch.float32
        device = weight.device
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.shapes = shapes
        # per fused projection, its modules' first output columns and the end: [M + 1]
        self.firsts = {
            site: torch.tensor([0, *itertools.accumulate(outs)], dtype=torch.long)
            for site, (_, outs) in shapes.items()
        }
        self.a: list[dict[str, torch.Tensor]] = []
        self.b: list[dict[str, torch.Tensor]] = []
        self.ranks: list[dict[str, torch.Tensor]] = []
        for _ in range(self.num_layers):
            self.a.append({})
            self.b.append({})
            self.ranks.append({})
            for site, (width, outs) in shapes.items():
                bands = len(outs) * max_rank
                self.a[-1][site] = torch.zeros(num_slots, bands, width, dtype=dtype, device=device)
                self.b[-1][site] = torch.zeros(
                    num_slots, max_rank, sum(outs), dtype=dtype, device=device
                )
                self.ranks[-1][site] = torch.zeros(num_slots, len(outs), dtype=torch.long)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in self.a + self.b for t in d.values())

    def write(self, slot: int, adapter: LoraAdapter) -> None:
        """Put an adapter's weights in a slot (what was there is zeroed first)."""
        for layer in range(self.num_layers):
            for site in self.shapes:
                self.a[layer][site][slot].zero_()
                self.b[layer][site][slot].zero_()
                self.ranks[layer][site][slot].zero_()
        for (layer, module), (a, b) in adapter.modules.items():
            site, index = MODULES[module]
            band = index * self.max_rank
            first, end = self.firsts[site][index : index + 2].tolist()
            r = a.shape[0]
            self.a[layer][site][slot, band : band + r] = a
            self.b[layer][site][slot, :r, first:end] = b.T
            self.ranks[layer][site][slot, index] = r


# a slot with more of a step's tokens than this (a prompt chunk) multiplies on its own where the
# torch ops do the work: the grid of the batched matmul is as tall as its fullest slot, and would
# multiply every slot that tall
OWN_MATMUL_TOKENS = 16


@dataclass
class LoraBatch:
    """A step's tokens by adapter slot: each token's slot (`slot_of`, -1 for the base model's),
    for the kernel; and for the torch ops where it does not apply, the slots with few tokens
    (decode rows) multiply together: the flat indices of their tokens (`rows`) and where each sits
    in a `[slots, per_slot]` grid (`cells`: slot * per_slot + its place among its slot's tokens),
    while a slot with many (a prompt chunk) multiplies alone: (slot, its tokens' flat indices) in
    `own`."""

    slots: LoraSlots
    slot_of: torch.Tensor  # [N] int64, on the host
    rows: torch.Tensor  # [T]
    cells: torch.Tensor  # [T]
    per_slot: int
    own: list[tuple[int, torch.Tensor]]

    @classmethod
    def of(cls, slots: LoraSlots, token_slots: list[int]) -> LoraBatch:
        """The batch of a step whose flat token n runs the adapter in slot `token_slots[n]` (-1:
        the base model)."""
        device = slots.a[0]["qkv"].device
        rows = [n for n, slot in enumerate(token_slots) if slot >= 0]
        counts = [token_slots.count(slot) for slot in range(slots.num_slots)]
        alone = {slot for slot, n in enumerate(counts) if n > OWN_MATMUL_TOKENS}
        own = [
            (slot, torch.tensor([n for n in rows if token_slots[n] == slot], device=device))
            for slot in sorted(alone)
        ]
        grouped = [n for n in rows if token_slots[n] not in alone]
        filled = [0] * slots.num_slots
        cells = []  # each token's cell: its slot's row of the grid, then its place among its own
        for n in grouped:
            cells.append((token_slots[n], filled[token_slots[n]]))
            filled[token_slots[n]] += 1
        per_slot = max(filled)
        return cls(
            slots,
            torch.tensor(token_slots, dtype=torch.long),
            torch.tensor(grouped, dtype=torch.long, device=device),
            torch.tensor([s * per_slot + p for s, p in cells], dtype=torch.long, device=device),
            per_slot,
            own,
        )

    def add(self, out: torch.Tensor, x: torch.Tensor, layer: int, site: str) -> None:
        """Add each token's adapter update of projection `site` of `layer` to its row of
        `out [N, out]`, the projection of `x [N, in]`."""
        a = self.slots.a[layer][site]  # [S, M R, in]
        b = self.slots.b[layer][site]  # [S, R, out]
        ranks = self.slots.ranks[layer][site]  # [S, M]
        firsts = self.slots.firsts[site]  # [M + 1]
        if kernels.lora_add(out, x, a, b, self.slot_of, ranks, firsts):
            return
        a, b = a.to(x.dtype), b.to(x.dtype)  # slots in another dtype than the activations
        if self.per_slot:
            num_slots = a.shape[0]
            grid = x.new_zeros(num_slots * self.per_slot, x.shape[1])  # [S * P, in]
            grid[self.cells] = x[self.rows]
            # [S, P, M R]
            low = torch.bmm(grid.view(num_slots, self.per_slot, -1), a.transpose(1, 2))
            update = _up(low, b, firsts).view(num_slots * self.per_slot, -1)  # [S * P, out]
            out.index_add_(0, self.rows, update[self.cells])
        for slot, rows in self.own:
            low = (x[rows] @ a[slot].T).unsqueeze(0)  # [1, rows, M R]
            out.index_add_(0, rows, _up(low, b[slot : slot + 1], firsts)[0])  # [rows, out]


def _up(low: torch.Tensor, b: torch.Tensor, firsts: torch.Tensor) -> torch.Tensor:
    """`low [S, P, M R]` through each module's B (`b [S, R, out]`, module m's at its columns, its
    band m of low): `[S, P, out]`."""
    rank = b.shape[1]
    update = low.new_empty(low.shape[0], low.shape[1], b.shape[2])  # [S, P, out]
    bounds = firsts.tolist()
    for m, (first, end) in enumerate(itertools.pairwise(bounds)):
        band = low[:, :, m * rank : (m + 1) * rank]  # [S, P, R]
        update[:, :, first:end] = torch.bmm(band, b[:, :, first:end])
    return update


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
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        layer, module, part = _parse_key(ref, key)
        pairs.setdefault((layer, module), {})[part] = tensor
    modules = {}
    for (layer, module), pair in sorted(pairs.items()):
        a, b = pair["A"].float(), pair["B"].float()
        scaling = alpha / (a.shape[0] ** 0.5 if rslora else a.shape[0])
        modules[layer, module] = (a, b * scaling)
    return LoraAdapter(ref, rank, modules)


# the files of a PEFT adapter that are read (the safetensors file, or else the .bin)
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")


def adapter_dir(ref: LoraRef) -> Path:
    """The local directory of an adapter's files: its path (or a `file://` URI's); for another URI
    (`s3://`, `gs://`, `hf://`, ...: any filesystem fsspec reads in this process) a copy of them
    fetched on first use into a directory of this process and name (`PDSERVE_LORA_CACHE`, else
    the system's temporary directory), so an adapter loaded again under a new name is fetched
    again."""
    scheme, sep, rest = ref.path.partition("://")
    if not sep:
        return Path(ref.path)
    if scheme == "file":
        return Path(rest)
    key = hashlib.sha1(f"{os.getpid()}:{ref.name}:{ref.path}".encode()).hexdigest()[:16]
    root = Path(
        os.environ.get("PDSERVE_LORA_CACHE") or Path(tempfile.gettempdir()) / "pdserve-loras"
    )
    local = root / key
    if local.is_dir():
        return local
    try:
        import fsspec

        fs, remote = fsspec.core.url_to_fs(ref.path)
        fetching = Path(tempfile.mkdtemp(prefix=f"{key}.", dir=_made(root)))
        for name in ADAPTER_FILES:
            if fs.exists(f"{remote.rstrip('/')}/{name}"):
                fs.get(f"{remote.rstrip('/')}/{name}", str(fetching / name))
    except Exception as e:  # an unknown scheme, its filesystem not installed, no such bucket, ...
        raise LoraError(
            f"LoRA adapter {ref.name!r}: cannot fetch {ref.path} ({type(e).__name__}: {e})"
        ) from None
    try:
        fetching.rename(local)  # whole, or not at all
    except OSError:  # another thread of this process fetched it first
        shutil.rmtree(fetching, ignore_errors=True)
    log.info("LoRA adapter %s fetched from %s into %s", ref.name, ref.path, local)
    return local


def _made(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def _adapter_config(ref: LoraRef) -> tuple[float, bool]:
    """The adapter's lora_alpha and use_rslora, its config checked."""
    config_file = adapter_dir(ref) / "adapter_config.json"
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
    path = adapter_dir(ref) / "adapter_model.safetensors"
    if not path.is_file():
        return {k: tuple(t.shape) for k, t in _tensors(ref).items()}
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}  # noqa: SIM118


def _tensors(ref: LoraRef) -> dict[str, torch.Tensor]:
    path = adapter_dir(ref)
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


class ResidentLoras:
    """The adapters a worker holds, least recently used first, one per slot of its LoraSlots: up
    to `max_loras` (the scheduler never runs more at once on one worker); a step's adapter not
    held is read from its path into the slot of the least recently used."""

    def __init__(self, model: Any, max_loras: int, max_rank: int, dtype: str = "auto") -> None:
        self.model = model
        self.max_loras = max_loras
        self.max_rank = max_rank
        # the slots' (`--lora-dtype`; None: the model's)
        self.dtype = None if dtype == "auto" else getattr(torch, dtype)
        self.slots: LoraSlots | None = None  # made with the first adapter
        self.held: OrderedDict[LoraRef, int] = OrderedDict()  # adapter -> its slot
        self.num_loads = 0

    def get(self, ref: LoraRef) -> int:
        """The slot of an adapter, read into one first if it is not held."""
        slot = self.held.get(ref)
        if slot is not None:
            self.held.move_to_end(ref)
            return slot
        adapter = read_adapter(ref, self.model, self.max_rank)
        if self.slots is None:
            self.slots = LoraSlots(self.model, self.max_loras, self.max_rank, self.dtype)
            log.info(
                "LoRA slots: %d adapters of rank up to %d in %s, %.1f MiB",
                self.max_loras,
                self.max_rank,
                self.slots.a[0]["qkv"].dtype,
                self.slots.nbytes / 2**20,
            )
        if len(self.held) < self.max_loras:
            slot = len(self.held)
        else:
            _, slot = self.held.popitem(last=False)
        self.slots.write(slot, adapter)
        self.held[ref] = slot
        self.num_loads += 1
        log.info("LoRA adapter %s read from %s: rank %d", ref.name, ref.path, adapter.rank)
        return slot

    def batch(self, refs: list[LoraRef | None], counts: list[int]) -> LoraBatch | None:
        """The step's LoraBatch: `refs[i]` is the adapter of the next `counts[i]` flat tokens.
        Its adapters are made resident first (a step never names more than `max_loras`)."""
        if not any(refs):
            return None
        distinct = list(dict.fromkeys(r for r in refs if r is not None))
        if len(distinct) > self.max_loras:
            raise RuntimeError(
                f"a step of {len(distinct)} LoRA adapters on a worker that holds {self.max_loras}"
            )
        # each read evicts the least recently used: never one this step read before it
        slot_of = {ref: self.get(ref) for ref in distinct}
        token_slots: list[int] = []
        for ref, count in zip(refs, counts, strict=True):
            token_slots.extend([-1 if ref is None else slot_of[ref]] * count)
        assert self.slots is not None
        return LoraBatch.of(self.slots, token_slots)
