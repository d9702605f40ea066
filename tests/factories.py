"""Small factories shared by the tests: tiny random models with clear argmax margins, and
requests."""

from __future__ import annotations

import contextlib
import functools
import os
import socket
from collections.abc import Iterator
from typing import Any

from scheduler.request import Request, SamplingParams

VOCAB = 384
# the device the parity tests run our side on (`PDSERVE_TEST_DEVICE=cuda make test` on a GPU);
# `transformers`' reference runs on the CPU either way
TEST_DEVICE = os.environ.get("PDSERVE_TEST_DEVICE", "cpu")
# the share of a GPU each Ray worker of a test takes: a test's workers (at most 8) share one GPU
TEST_GPUS_PER_WORKER = 0.125 if TEST_DEVICE.startswith("cuda") else None
# fp32 logits against `transformers`: on the CPU the same ops in another order; on a GPU other
# kernels (TF32 off), within `pdserve gpu-check`'s limit
LOGITS_CLOSE = (
    {"atol": 2e-5, "rtol": 1e-4} if TEST_DEVICE == "cpu" else {"atol": 1e-3, "rtol": 1e-3}
)


# every kind `tiny_hf_config` builds
TINY_KINDS = [
    "llama",
    "qwen3",
    "qwen3-odd-heads",
    "qwen2",
    "llama3-scaled",
    "mistral",
    "phi3",
    "smollm3",
    "granite",
]


def tiny_hf_config(kind: str = "llama"):  # type: ignore[no-untyped-def]
    """A two-layer config. A large initializer_range spreads the logits so argmax has clear margins:
    greedy tokens then do not flip on the last-bit differences between batched and solo matmuls."""
    from transformers import (
        GraniteConfig,
        LlamaConfig,
        MistralConfig,
        Phi3Config,
        Qwen2Config,
        Qwen3Config,
        SmolLM3Config,
    )

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=0.25,
        eos_token_id=VOCAB - 1,
        bos_token_id=1,
        pad_token_id=0,
    )
    if kind == "llama":
        return LlamaConfig(**common, rope_theta=10000.0, tie_word_embeddings=True)
    # rows of whole K-quant super-blocks (256): hidden 256, intermediate 512
    if kind == "llama-wide":
        wide = common | dict(hidden_size=256, intermediate_size=512)
        return LlamaConfig(**wide, rope_theta=10000.0, tie_word_embeddings=True)
    if kind == "llama3-scaled":
        return LlamaConfig(
            **common,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256,
            },
        )
    # a window as long as the context: full attention, as Mistral 7B v0.1 at 4k
    if kind == "mistral":
        return MistralConfig(**common, sliding_window=1024, tie_word_embeddings=False)
    if kind == "qwen2":
        return Qwen2Config(**common)
    if kind == "qwen3":
        return Qwen3Config(**common, head_dim=32, tie_word_embeddings=False)
    # seven query heads on one KV head of 112 dims: neither an AVX-512 width nor a power of two
    if kind == "qwen3-odd-heads":
        heads = {**common, "num_attention_heads": 7, "num_key_value_heads": 1}
        return Qwen3Config(**heads, head_dim=112, tie_word_embeddings=False)
    # Granite 3's multipliers (its attention one is 1 / head_dim, not head_dim ** -0.5)
    if kind == "granite":
        return GraniteConfig(
            **common,
            embedding_multiplier=12.0,
            logits_scaling=2.0,
            residual_multiplier=0.22,
            attention_multiplier=1 / 16,
            tie_word_embeddings=True,
        )
    if kind == "smollm3":  # its second layer without RoPE, as SmolLM3 leaves out every fourth
        return SmolLM3Config(
            **common, no_rope_layers=[1, 0], rope_theta=5e6, tie_word_embeddings=True
        )
    # fused qkv_proj and gate_up_proj; longrope past 64 tokens, as Phi-3 128k past 4k
    if kind == "phi3":
        factors = {
            "short_factor": [1.0 + i / 8 for i in range(8)],
            "long_factor": [2.0 + i for i in range(8)],
        }
        return Phi3Config(
            **common,
            tie_word_embeddings=False,
            original_max_position_embeddings=64,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "original_max_position_embeddings": 64,
                **factors,
            },
        )
    raise ValueError(kind)


@functools.cache
def tiny_hf_model(kind: str = "llama"):  # type: ignore[no-untyped-def]
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1234)
    return AutoModelForCausalLM.from_config(tiny_hf_config(kind)).eval()


def tiny_model(kind: str = "llama", device: str = "cpu"):  # type: ignore[no-untyped-def]
    from workers.loader import from_hf_model

    return from_hf_model(tiny_hf_model(kind), device=device)


def slot_blocks(slot: int, num_slots: int, capacity: int, block_size: int = 16) -> list[int]:
    """A block table standing for a slot of `capacity` positions: its blocks interleaved with the
    other slots' (block k of slot s is s + k * num_slots), so no table is contiguous."""
    return [slot + k * num_slots for k in range(-(-capacity // block_size))]


def local_engine(  # type: ignore[no-untyped-def]
    model,
    num_slots: int,
    capacity: int,
    *,
    num_blocks: int | None = None,
    block_size: int = 16,
    prefix_caching: bool = False,
    tokenizer=None,
    draft_model=None,
    max_loras: int | None = None,
    max_lora_rank: int = 16,
    lora_dtype: str = "auto",
    graphs=None,
    **planner: Any,
):
    """The in-process engine on `model`: a planner of `num_slots` requests at once of up to
    `capacity` tokens over `num_blocks` KV blocks (default: every slot's whole context), and a
    runner whose cache holds them (and a `draft_model`'s, for a draft model's speculation); with
    `graphs` (`workers.decode_graphs.GraphOptions`), its decode steps padded to graph buckets."""
    from scheduler.step_planner import StepPlanner
    from workers.drafter import Drafter
    from workers.engine import LocalEngine
    from workers.lora import ResidentLoras
    from workers.runner import ModelRunner

    scheduler = StepPlanner(
        num_slots,
        capacity,
        num_blocks=num_blocks,
        block_size=block_size,
        prefix_caching=prefix_caching,
        max_loras=max_loras,
        **planner,
    )
    num_blocks = scheduler.blocks.num_blocks
    drafter = None if draft_model is None else Drafter(draft_model, num_blocks, block_size)
    loras = (
        None if max_loras is None else ResidentLoras(model, max_loras, max_lora_rank, lora_dtype)
    )
    runner = ModelRunner(
        model, num_blocks, block_size=block_size, drafter=drafter, loras=loras, graphs=graphs
    )
    return LocalEngine(runner, scheduler, tokenizer)


def run_one_step_ahead(planner, runner) -> bool:  # type: ignore[no-untyped-def]
    """Step `planner`'s requests on `runner` as the Ray loop does, until all end: step N+1 is
    planned and run before step N's tokens are applied, so the runner feeds in the tokens it
    sampled (`PENDING` in the plan). Whether any plan carried a PENDING token."""
    from scheduler.request import PENDING

    in_flight = None
    saw_pending = False
    while in_flight is not None or not planner.idle:
        plan = planner.plan()
        saw_pending |= any(PENDING in c.token_ids for c in plan.chunks)
        sent = (plan, runner.execute(plan).tokens) if not plan.empty else None
        if in_flight is not None:
            planner.update(*in_flight)
        in_flight = sent
    return saw_pending


def prompt_ids(length: int, seed: int) -> list[int]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, VOCAB - 1, (length,), generator=g).tolist()


def make_request(
    req_id: str,
    prompt_len: int = 10,
    max_tokens: int = 4,
    priority: int = 0,
    stop_token_ids: frozenset[int] = frozenset(),
    seed: int | None = None,
    arrival_s: float | None = None,
) -> Request:
    """One greedy request; its prompt is 1..prompt_len, or random ids drawn from `seed`."""
    prompt = list(range(1, prompt_len + 1)) if seed is None else prompt_ids(prompt_len, seed)
    request = Request(
        req_id=req_id,
        prompt_ids=prompt,
        max_tokens=max_tokens,
        priority=priority,
        stop_token_ids=stop_token_ids,
    )
    if arrival_s is not None:
        request.arrival_s = arrival_s
    return request


def make_requests(
    n: int,
    prompt_lens: list[int],
    max_tokens: list[int],
    sampling: SamplingParams | None = None,
    stop_token_ids: frozenset[int] = frozenset(),
) -> list[Request]:
    """n requests cycling through the given prompt lengths and output lengths."""
    return [
        Request(
            req_id=f"r{i}",
            prompt_ids=prompt_ids(prompt_lens[i % len(prompt_lens)], seed=i),
            max_tokens=max_tokens[i % len(max_tokens)],
            sampling=sampling or SamplingParams(),
            stop_token_ids=stop_token_ids,
        )
        for i in range(n)
    ]


CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@functools.cache
def tiny_tokenizer():  # type: ignore[no-untyped-def]
    """A byte-level BPE tokenizer with VOCAB ids (EOS last), so text and multi-byte characters
    work."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - 1,
        special_tokens=["<unk>", "<s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [
        "the quick brown fox jumps over the lazy dog",
        "hello world, héllo wörld",
        "paris is in france",
    ] * 5
    tok.train_from_iterator(corpus, trainer)
    tok.add_tokens([f"<extra_{i}>" for i in range(VOCAB - 1 - tok.get_vocab_size())])
    tok.add_special_tokens(["</s>"])  # id VOCAB - 1: the configs' EOS
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.chat_template = CHAT_TEMPLATE
    assert fast.eos_token_id == VOCAB - 1, fast.eos_token_id
    return fast


def save_tiny_checkpoint(path, kind: str = "llama"):  # type: ignore[no-untyped-def]
    """A checkpoint directory as `save_pretrained` writes it: config, safetensors, tokenizer."""
    tiny_hf_model(kind).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def free_port() -> int:
    """A free loopback TCP port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def served_app(checkpoint: str, name: str, **args: Any) -> Iterator[str]:
    """The pdserve Serve app on the tiny checkpoint (served as "tiny") on a free loopback port;
    yields its base URL and shuts Serve down after."""
    from ray import serve

    from deploy.serving.app import build_app

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(
        build_app({"model": checkpoint, "served_model_name": "tiny", **args}),
        name=name,
        route_prefix="/",
    )
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()


def gguf_quantize(w: Any, type_name: str) -> Any:
    """`w [N, K]` (numpy fp32) as a GGUF tensor's raw blocks of `type_name`: `gguf`'s own quantizer,
    or for Q4_K and Q6_K (which `gguf` can read but not write) a plain one of ours: each block's
    scale (and min) from its range, 6- or 8-bit super-block scales, nearest rounding. Valid blocks
    that `gguf.quants.dequantize` reads, not llama.cpp's error-minimizing choice."""
    import gguf
    import numpy as np

    if type_name not in ("Q4_K", "Q6_K"):
        return gguf.quants.quantize(w, gguf.GGMLQuantizationType[type_name])
    n, k = w.shape
    if type_name == "Q4_K":
        x = w.reshape(n, k // 256, 8, 32).astype(np.float32)
        low = np.minimum(x.min(axis=3), 0)  # [N, S, 8]
        scale = (x.max(axis=3) - low) / 15
        d = (scale.max(axis=2, keepdims=True) / 63).astype(np.float16)  # [N, S, 1]
        dmin = (-low.min(axis=2, keepdims=True) / 63).astype(np.float16)
        with np.errstate(divide="ignore", invalid="ignore"):
            sc = np.nan_to_num(np.round(scale / d.astype(np.float32))).clip(0, 63).astype(np.uint8)
            m = np.nan_to_num(np.round(-low / dmin.astype(np.float32))).clip(0, 63).astype(np.uint8)
            step = (d.astype(np.float32) * sc)[..., None]
            shift = (dmin.astype(np.float32) * m)[..., None]
            q = np.nan_to_num(np.round((x + shift) / step)).clip(0, 15).astype(np.uint8)
        scales = np.concatenate(
            [
                (sc[..., :4] | ((sc[..., 4:] & 0x30) << 2)),
                (m[..., :4] | ((m[..., 4:] & 0x30) << 2)),
                ((sc[..., 4:] & 0x0F) | ((m[..., 4:] & 0x0F) << 4)),
            ],
            axis=2,
        ).astype(np.uint8)  # [N, S, 12]
        q = q.reshape(n, k // 256, 4, 2, 32)
        nibbles = (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).reshape(n, k // 256, 128)
        blocks = [d.view(np.uint8), dmin.view(np.uint8), scales, nibbles]
    else:
        x = w.reshape(n, k // 256, 16, 16).astype(np.float32)
        scale = np.abs(x).max(axis=3) / 32  # [N, S, 16]
        d = (scale.max(axis=2, keepdims=True) / 127).astype(np.float16)  # [N, S, 1]
        with np.errstate(divide="ignore", invalid="ignore"):
            sc = np.nan_to_num(np.round(scale / d.astype(np.float32))).clip(-128, 127)
            step = (d.astype(np.float32) * sc)[..., None]
            q = np.nan_to_num(np.round(x / step)).clip(-32, 31).astype(np.int16) + 32
        q = q.astype(np.uint8).reshape(n, k // 256, 2, 128)  # 0-63, by half super-block
        low = q & 0x0F
        ql = (low[..., :64] | (low[..., 64:] << 4)).reshape(n, k // 256, 128)
        pairs = (q >> 4).reshape(n, k // 256, 2, 4, 32)
        qh = np.zeros((n, k // 256, 2, 32), dtype=np.uint8)
        for j in range(4):
            qh |= pairs[:, :, :, j] << (2 * j)
        sc8 = sc.astype(np.int8).view(np.uint8)
        blocks = [ql, qh.reshape(n, k // 256, 64), sc8, d.view(np.uint8)]
    return np.concatenate(blocks, axis=2).reshape(n, -1)


def save_tiny_gguf(  # type: ignore[no-untyped-def]
    path, kind: str = "llama", linear_type: str = "Q4_1"
):
    """The tiny model's tensors as llama.cpp's converter writes a GGUF (architecture `llama`):
    matrices quantized (the embedding Q8_0, the others `linear_type`), norms F32, the q and k rows
    permuted for its RoPE layout. Only the tensors and the architecture: no tokenizer."""
    import gguf

    hf = tiny_hf_model(kind)
    config = hf.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, tensor in hf.state_dict().items():
        base = name.removesuffix(".weight")
        if base == "lm_head" and config.tie_word_embeddings:
            continue
        w = tensor.float().numpy()
        if base.endswith(("q_proj", "k_proj")):
            heads = config.num_attention_heads
            if base.endswith("k_proj"):
                heads = config.num_key_value_heads
            shape = w.shape
            w = w.reshape(heads, 2, shape[0] // heads // 2, shape[1]).swapaxes(1, 2).reshape(shape)
        qtype = gguf.GGMLQuantizationType.F32
        if w.ndim == 2:
            matrix = "Q8_0" if base in ("model.embed_tokens", "lm_head") else linear_type
            qtype = gguf.GGMLQuantizationType[matrix]
        raw = gguf_quantize(w, qtype.name) if w.ndim == 2 else w
        writer.add_tensor(f"{names.get_name(base)}.weight", raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def save_lora_adapter(  # type: ignore[no-untyped-def]
    path,
    kind: str = "llama",
    rank: int = 8,
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj"),
    seed: int = 0,
    bf16_values: bool = False,
    **lora: Any,
):
    """A PEFT LoRA adapter of the tiny `kind` model written by PEFT itself to `path`, with random
    A and B (PEFT starts B at zero: an adapter that changes nothing), rounded to bf16 values with
    `bf16_values` (as an adapter trained in bf16); returns the path."""
    import copy

    import torch
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=lora.pop("lora_alpha", 2 * rank), **lora)
    config.target_modules = set(targets)
    peft_model = get_peft_model(copy.deepcopy(tiny_hf_model(kind)), config)
    noise = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                value = torch.randn(param.shape, generator=noise) * 0.5 / param.shape[-1] ** 0.5
                param.copy_(value.bfloat16().float() if bf16_values else value)
    peft_model.save_pretrained(str(path))
    return path


def peft_greedy(kind: str, adapter, prompt: list[int], max_tokens: int) -> list[int]:  # type: ignore[no-untyped-def]
    """`transformers` + PEFT's greedy continuation of `prompt` with the adapter at `adapter` (the
    base model's with None)."""
    import copy

    import torch
    from peft import PeftModel

    model = copy.deepcopy(tiny_hf_model(kind))
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter)).eval()
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor([prompt]),
            max_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=VOCAB - 1,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()
