"""The GPU bench's models: a Qwen3-0.6B-shaped (or tiny) checkpoint with random weights, built
offline, and the roofline's model shapes (Qwen3-0.6B, Llama-3-8B) built straight on the device."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from deploy.bench.arguments import GPU_PRESETS as PRESETS

# std of the roofline models' random weights: activations stay well inside bf16's range
INIT_STD = 0.02


def qwen3_config(preset: str) -> Any:
    """A transformers Qwen3Config: Qwen3-0.6B's shape, or a tiny two-layer one for tests."""
    from transformers import Qwen3Config

    if preset == "qwen3-0.6b":
        return Qwen3Config(
            vocab_size=151936,
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
            max_position_embeddings=40960,
            rms_norm_eps=1e-6,
            hidden_act="silu",
            attention_bias=False,
            bos_token_id=151643,
            eos_token_id=151645,
            pad_token_id=0,
        )
    if preset == "tiny":
        return Qwen3Config(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
            max_position_embeddings=1024,
            rms_norm_eps=1e-6,
            bos_token_id=1,
            eos_token_id=511,
            pad_token_id=0,
        )
    raise ValueError(f"unknown preset {preset!r}; use one of {', '.join(PRESETS)}")


def word_level_tokenizer(vocab_size: int, eos_token_id: int) -> Any:
    """A tokenizer built offline: token i is the word `t{i}`, so every id decodes and load_model
    finds one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="t0", eos_token=f"t{eos_token_id}"
    )


def build_checkpoint(preset: str, dtype: torch.dtype, device: str, seed: int, root: Path) -> Path:
    """Save a random-weight model of the preset (and a tokenizer) under `root`; reuse one saved
    before."""
    from transformers import AutoModelForCausalLM

    path = root / f"{preset}-{str(dtype).removeprefix('torch.')}-seed{seed}"
    done = path / ".complete"
    if done.exists():
        return path
    config = qwen3_config(preset)
    torch.manual_seed(seed)
    with torch.device(device):  # random init on the device: seconds for 0.6B parameters on a GPU
        hf = AutoModelForCausalLM.from_config(config, dtype=dtype)
    hf.save_pretrained(path)
    word_level_tokenizer(config.vocab_size, config.eos_token_id).save_pretrained(path)
    del hf
    done.touch()
    return path


def model_shape(shape: str) -> tuple[Any, float]:
    """The roofline's `ModelSpec` of a shape name and its RoPE theta: qwen3-0.6b and tiny as the
    presets above, llama3-8b as Meta-Llama-3-8B's config."""
    from workers.model import ModelSpec

    if shape == "llama3-8b":
        spec = ModelSpec(
            vocab_size=128256,
            hidden_size=4096,
            intermediate_size=14336,
            num_layers=32,
            num_heads=32,
            num_kv_heads=8,
            head_dim=128,
            rms_norm_eps=1e-5,
            qkv_bias=False,
            o_bias=False,
            qk_norm=False,
            tie_word_embeddings=False,
        )
        return spec, 500_000.0
    config = qwen3_config(shape)  # raises on an unknown name
    spec = ModelSpec(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_layers=config.num_hidden_layers,
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        rms_norm_eps=config.rms_norm_eps,
        qkv_bias=False,
        o_bias=False,
        qk_norm=True,
        tie_word_embeddings=config.tie_word_embeddings,
    )
    return spec, config.rope_parameters["rope_theta"]


def random_model(shape: str, dtype: torch.dtype, device: str, seed: int) -> Any:
    """A `workers.model.DecoderLM` of `shape` with N(0, INIT_STD) weights and unit norms, every
    module created on `device` in `dtype` as it is built: the 8B shape never passes through host
    memory nor through fp32 (16 GB in bf16)."""
    from workers.model import DecoderLM

    spec, theta = model_shape(shape)
    # on the device: the model keeps the tensor it is given (fp32, as the loader's)
    dims = torch.arange(0, spec.head_dim, 2, dtype=torch.float32, device=device)
    inv_freq = 1.0 / theta ** (dims / spec.head_dim)  # [D/2]
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = DecoderLM(spec, inv_freq)
    finally:
        torch.set_default_dtype(previous)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, INIT_STD)
    return model.eval()
