"""Llama / Qwen2 / Qwen3 decoder in torch, run on flat token batches against a paged KV cache."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from workers.kernels import (
    add_rms_norm,
    decode_attention,
    linear,
    paged_decode_attention_torch,
    prompt_attention,
    rope_and_cache,
    silu_mul,
)
from workers.kv_cache import PagedKVCache
from workers.kv_quant import dequantize
from workers.lora import LoraBatch
from workers.quantized import QUANTIZED
from workers.tp import TensorParallel

try:  # CUDA builds of torch ship Triton; without it a GPU takes the torch ops
    from workers import triton_attention
except ImportError:
    triton_attention = None

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "smollm3", "granite")


@dataclass(frozen=True)
class ModelSpec:
    """Architecture numbers, read from a Hugging Face config and its weight names."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    qkv_bias: bool  # Qwen2, and Llama checkpoints with attention_bias
    o_bias: bool
    qk_norm: bool  # Qwen3 normalises each head's q and k before RoPE
    tie_word_embeddings: bool
    # which layers rotate q and k (SmolLM3 skips every 4th); None: all
    rope_layers: tuple[bool, ...] | None = None
    embedding_multiplier: float = 1.0  # Granite scales the embeddings,
    # and divides the logits (its attention and residual multipliers are in the weights)
    logits_scaling: float = 1.0


class PrefillSpan(NamedTuple):
    """Where one prompt chunk sits in a flat batch and in the KV blocks."""

    block_table: torch.Tensor  # [blocks] the request's blocks up to the chunk's last position
    first: int  # flat index of its first token
    num_tokens: int
    start_pos: int  # position of its first token in the request's sequence


@dataclass
class BatchLayout:
    """Where each token of a flat batch belongs: decode tokens first, then prompt chunks.

    Tensors live on the model's device and are built once per step, so the 30-odd layers only index
    them. Decode tokens attend in one call per layer over their block tables, and so do the prompt
    chunks: the kernels of `workers.kernels` on CPU, those of `workers.triton_attention` on a CUDA
    GPU, both reading the blocks where they lie; elsewhere (no Triton) one SDPA call over the decode
    rows' gathered blocks, and one per chunk over its gathered blocks.
    """

    positions: torch.Tensor  # [num_tokens] position of each token in its sequence
    blocks: torch.Tensor  # [num_tokens] the KV block of each token's position
    offsets: torch.Tensor  # [num_tokens] its offset in that block
    num_decode: int  # the first num_decode tokens are single decode tokens
    decode_tables: torch.Tensor  # [num_decode, max blocks] each decode row's blocks (padded)
    decode_lengths: torch.Tensor  # [num_decode] keys each decode token reads: its position + 1
    prefill: list[PrefillSpan]  # one per prompt chunk
    # the chunks for the prompt kernel: [chunks, max blocks] their blocks (padded), and [chunks]
    # their first positions, first tokens (counted from the first prompt token) and token counts
    prefill_tables: torch.Tensor
    prefill_starts: torch.Tensor
    prefill_firsts: torch.Tensor
    prefill_counts: torch.Tensor
    # the LoRA adapters of the batch's tokens (`workers/lora.py`); None: all the base model's
    lora: LoraBatch | None = None

    @classmethod
    def pack(
        cls,
        rows: list[tuple[list[int], list[int], int]],
        num_decode: int,
        block_size: int,
        device: torch.device | str,
    ) -> tuple[torch.Tensor, BatchLayout]:
        """Flatten `rows` of (block table, token_ids, start_pos), the first `num_decode` single
        decode tokens, into one batch: its input ids `[N]` and its layout."""
        ids: list[int] = []
        positions: list[int] = []
        blocks: list[int] = []
        prefill: list[PrefillSpan] = []
        for i, (table, tokens, start) in enumerate(rows):
            end = start + len(tokens)
            if i >= num_decode:
                used = torch.tensor(table[: -(-end // block_size)], device=device)  # [blocks]
                prefill.append(PrefillSpan(used, len(ids), len(tokens), start))
            ids += tokens
            positions += range(start, end)
            blocks += [table[p // block_size] for p in range(start, end)]
        decode_rows = rows[:num_decode]
        width = max((len(table) for table, _, _ in decode_rows), default=0)
        tables = [table + [0] * (width - len(table)) for table, _, _ in decode_rows]
        chunk_rows = rows[num_decode:]
        chunk_width = max((len(table) for table, _, _ in chunk_rows), default=0)
        chunk_tables = [table + [0] * (chunk_width - len(table)) for table, _, _ in chunk_rows]
        position = torch.tensor(positions, dtype=torch.long, device=device)  # [N]
        # [3, chunks]: their first positions, first tokens (counted from the first prompt token)
        # and token counts, moved to the device once a step, not once a layer
        chunk_args = torch.tensor(
            [
                [s.start_pos for s in prefill],
                [s.first - len(decode_rows) for s in prefill],
                [s.num_tokens for s in prefill],
            ],
            dtype=torch.long,
            device=device,
        ).view(3, len(prefill))
        layout = cls(
            positions=position,
            blocks=torch.tensor(blocks, dtype=torch.long, device=device),
            offsets=position % block_size,
            num_decode=num_decode,
            decode_tables=torch.tensor(tables, dtype=torch.long, device=device).view(
                num_decode, width
            ),
            decode_lengths=position[:num_decode] + 1,
            prefill=prefill,
            prefill_tables=torch.tensor(chunk_tables, dtype=torch.long, device=device).view(
                len(chunk_rows), chunk_width
            ),
            prefill_starts=chunk_args[0],
            prefill_firsts=chunk_args[1],
            prefill_counts=chunk_args[2],
        )
        return torch.tensor(ids, device=device), layout

    @functools.cached_property
    def prefill_masks(self) -> list[torch.Tensor | None]:
        """Per chunk: `[T, start + T]` the keys each token sees, None when it starts the prompt
        (causal). Only the gather + SDPA path reads them: built on its first use in a step."""
        device = self.positions.device
        masks: list[torch.Tensor | None] = []
        for span in self.prefill:
            end = span.start_pos + span.num_tokens
            query_pos = torch.arange(span.start_pos, end, device=device)  # [T]
            key_pos = torch.arange(end, device=device)  # [ctx]
            masks.append(key_pos[None, :] <= query_pos[:, None] if span.start_pos else None)
        return masks


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def fuse_linears(linears: list[nn.Linear], name: str) -> torch.Tensor | None:
    """Concatenate the linears' `name` tensors (weight or bias) along the output dim, then make each
    parameter a view of its rows in the result.

    One matmul over the concatenation replaces several smaller ones (fewer calls, a better-shaped
    GEMM), while the parameters keep Hugging Face's names: loading a state dict copies into the
    views, which writes the fused tensor too, and nothing is stored twice. `DecoderLM._apply` fuses
    again after `.to()`, which gives every parameter storage of its own. Packed weights
    (`workers/quantized.py`) concatenate their packed rows, each projection then a view of its own.
    """
    params = [getattr(linear, name) for linear in linears]
    if params[0] is None:
        return None
    if isinstance(params[0], QUANTIZED):
        packed = type(params[0]).cat(params)
        offset = 0
        for linear, p in zip(linears, params, strict=True):
            setattr(linear, name, packed.take_rows(torch.arange(offset, offset + p.shape[0])))
            offset += p.shape[0]
        return packed
    fused = torch.cat([p.detach() for p in params])  # [sum of out, in] or [sum of out]
    offset = 0
    for p in params:
        p.data = fused[offset : offset + p.shape[0]]
        offset += p.shape[0]
    return fused


def _gather(
    cache: torch.Tensor,
    table: torch.Tensor,
    context: int,
    scale: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Positions 0..context-1 of one request from a layer's blocks `[blocks, KVH, block_size, D]`,
    as `[1, KVH, context, D]`; an 8-bit cache's dequantized with its `scale` into `dtype`."""
    blocks = cache[table]  # [n, KVH, block_size, D]
    if scale is not None:
        blocks = dequantize(blocks, scale[table], dtype)  # [n, KVH, block_size, D]
    n, kv_heads, size, dim = blocks.shape
    joined = blocks.transpose(0, 1).reshape(kv_heads, n * size, dim)  # [KVH, n * block_size, D]
    return joined[None, :, :context]  # [1, KVH, ctx, D]


class Attention(nn.Module):
    """Self-attention over the paged cache. With `tp`, `spec` is its rank's part (its query and KV
    heads): q/k/v are its columns, o its rows, and the ranks' o outputs are summed."""

    def __init__(self, spec: ModelSpec, layer_idx: int, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.tp = tp
        self.num_heads = spec.num_heads
        self.num_kv_heads = spec.num_kv_heads
        self.head_dim = spec.head_dim
        self.q_proj = nn.Linear(
            spec.hidden_size, spec.num_heads * spec.head_dim, bias=spec.qkv_bias
        )
        self.k_proj = nn.Linear(
            spec.hidden_size, spec.num_kv_heads * spec.head_dim, bias=spec.qkv_bias
        )
        self.v_proj = nn.Linear(
            spec.hidden_size, spec.num_kv_heads * spec.head_dim, bias=spec.qkv_bias
        )
        self.o_proj = nn.Linear(spec.num_heads * spec.head_dim, spec.hidden_size, bias=spec.o_bias)
        if spec.qk_norm:
            self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)
            self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)
        self.fuse()

    def fuse(self) -> None:
        projections = [self.q_proj, self.k_proj, self.v_proj]
        self.qkv_weight = fuse_linears(projections, "weight")  # [(H + 2 KVH) D, hidden]
        self.qkv_bias = fuse_linears(projections, "bias")  # [(H + 2 KVH) D] or None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        layout: BatchLayout,
        cache: PagedKVCache,
    ) -> torch.Tensor:
        n = x.shape[0]
        heads = self.num_heads
        kv_heads = self.num_kv_heads
        dim = self.head_dim
        # [N, H+2KVH, D]
        qkv = linear(x, self.qkv_weight, self.qkv_bias)  # [N, (H+2KVH) D]
        if layout.lora is not None:
            layout.lora.add(qkv, x, self.layer_idx, "qkv")
        qkv = qkv.view(n, heads + 2 * kv_heads, dim)
        if hasattr(self, "q_norm"):
            qkv[:, :heads] = self.q_norm(qkv[:, :heads])  # [N, H, D]
            # [N, KVH, D]
            qkv[:, heads : heads + kv_heads] = self.k_norm(qkv[:, heads : heads + kv_heads])
        k_cache = cache.k[self.layer_idx]
        v_cache = cache.v[self.layer_idx]  # [blocks, KVH, block_size, D]
        scales = cache.scales(self.layer_idx)  # 8-bit: [blocks, KVH, block_size] each; else None
        q = rope_and_cache(
            qkv, cos, sin, heads, k_cache, v_cache, layout.blocks, layout.offsets, scales
        )  # [N, H, D]

        out = torch.empty(n, heads, dim, dtype=q.dtype, device=q.device)  # [N, H, D]
        if layout.num_decode:
            # A decode row's query heads that share a KV head go in as that head's query rows (all
            # at the same position): no KV head is repeated for GQA.
            b = layout.num_decode
            grouped = q[:b].reshape(b, kv_heads, heads // kv_heads, dim)  # [B, KVH, G, D]
            tables = layout.decode_tables
            lengths = layout.decode_lengths
            # CPU: the C++ kernel; a GPU: the Triton one; else (no Triton) the torch ops
            attn = decode_attention(grouped, k_cache, v_cache, tables, lengths, scales)
            if attn is None and triton_attention is not None:
                attn = triton_attention.decode_attention(
                    grouped, k_cache, v_cache, tables, lengths, scales
                )  # [B, KVH, G, D]
            if attn is None:  # [B, KVH, G, D]
                attn = paged_decode_attention_torch(
                    grouped, k_cache, v_cache, tables, lengths, scales
                )
            out[:b] = attn.reshape(b, heads, dim)
        if layout.prefill:
            self._prompts(q, layout, k_cache, v_cache, out, scales)
        attended = out.view(n, heads * dim)  # [N, H D]
        projected = linear(attended, self.o_proj.weight, self.o_proj.bias)  # [N, hidden]
        if layout.lora is not None:
            layout.lora.add(projected, attended, self.layer_idx, "o")
        if self.tp is not None:
            self.tp.all_reduce(projected)  # [N, hidden]: every rank's heads
        return projected

    def _prompts(
        self,
        q: torch.Tensor,
        layout: BatchLayout,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor,
        scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """Attention of the prompt chunks' tokens (rows num_decode.. of `q [N, H, D]`) into `out`:
        all chunks in one kernel call over their blocks where one applies (the C++ kernel on CPU,
        the Triton one on a GPU), else per chunk one SDPA call over a gathered copy of its
        blocks."""
        b = layout.num_decode
        n = q.shape[0] - b
        # [P, KVH, G, D]: a prompt token's query heads grouped by KV head, as a decode row's
        grouped = q[b:].reshape(n, self.num_kv_heads, -1, self.head_dim)
        chunks = (
            layout.prefill_tables,
            layout.prefill_starts,
            layout.prefill_firsts,
            layout.prefill_counts,
        )
        attn = prompt_attention(grouped, k_cache, v_cache, *chunks, scales)
        if attn is None and triton_attention is not None:
            attn = triton_attention.prompt_attention(grouped, k_cache, v_cache, *chunks, scales)
        if attn is not None:  # [P, KVH, G, D]
            out[b:] = attn.reshape(n, self.num_heads, self.head_dim)
            return
        k_scale, v_scale = (None, None) if scales is None else scales
        for (table, first, length, start), mask in zip(
            layout.prefill, layout.prefill_masks, strict=True
        ):
            context = start + length
            keys = _gather(k_cache, table, context, k_scale, q.dtype)  # [1, KVH, ctx, D]
            values = _gather(v_cache, table, context, v_scale, q.dtype)  # [1, KVH, ctx, D]
            query = q[first : first + length].transpose(0, 1)[None]  # [1, H, T, D]
            attn = F.scaled_dot_product_attention(
                query, keys, values, attn_mask=mask, is_causal=mask is None, enable_gqa=True
            )  # [1, H, T, D]
            out[first : first + length] = attn[0].transpose(0, 1)  # [T, H, D]: copies any layout


class MLP(nn.Module):
    """SwiGLU. With `tp`, `spec` is its rank's part: gate/up are its columns, down its rows, and
    the ranks' down outputs are summed."""

    def __init__(self, spec: ModelSpec, layer_idx: int, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.tp = tp
        self.gate_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.up_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False)
        self.fuse()

    def fuse(self) -> None:
        # [2 I, hidden]
        self.gate_up_weight = fuse_linears([self.gate_proj, self.up_proj], "weight")

    def forward(self, x: torch.Tensor, lora: LoraBatch | None = None) -> torch.Tensor:
        gate_up = linear(x, self.gate_up_weight)  # [N, 2 I]
        if lora is None:
            down = linear(silu_mul(gate_up), self.down_proj.weight)  # [N, hidden]
        else:
            lora.add(gate_up, x, self.layer_idx, "gate_up")
            h = silu_mul(gate_up)  # [N, I]
            down = linear(h, self.down_proj.weight)  # [N, hidden]
            lora.add(down, h, self.layer_idx, "down")
        if self.tp is not None:
            self.tp.all_reduce(down)  # [N, hidden]: every rank's columns
        return down


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer_idx: int, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec, layer_idx, tp)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec, layer_idx, tp)

    def forward(self, x, delta, cos, sin, layout, cache):  # type: ignore[no-untyped-def]
        """`x + delta` (the previous layer's output, added here in place into `x`, the residual
        stream, so that the add and the norm run as one kernel) is this layer's input. Returns the
        residual stream after attention and this layer's MLP output, which the next layer adds."""
        h = add_rms_norm(x, delta, self.input_layernorm)  # [N, hidden]; x is now x + delta
        # [N, hidden]
        h = add_rms_norm(
            x, self.self_attn(h, cos, sin, layout, cache), self.post_attention_layernorm
        )
        return x, self.mlp(h, layout.lora)  # [N, hidden] each


class Backbone(nn.Module):
    def __init__(self, spec: ModelSpec, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec, i, tp) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)


class DecoderLM(nn.Module):
    """The decoder with Hugging Face's parameter names, so a HF state dict loads as it is.

    `inv_freq` and `rope_scale` come from the checkpoint's own rotary embedding (theta and any
    scaling such as Llama 3's already applied), so positions rotate exactly as in `transformers`.

    With `tp`, it is one rank of a tensor-parallel model (`workers/tp.py`): `spec` stays the whole
    model's, `local_spec` says the heads, MLP columns and vocab rows this rank holds, and the
    forward returns the logits on rank 0 only.
    """

    def __init__(
        self,
        spec: ModelSpec,
        inv_freq: torch.Tensor,
        rope_scale: float = 1.0,
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        self.spec = spec
        self.tp = tp
        self.local_spec = spec if tp is None else tp.local_spec(spec)
        local = self.local_spec
        self.model = Backbone(local, tp)
        if not spec.tie_word_embeddings:
            self.lm_head = nn.Linear(local.hidden_size, local.vocab_size, bias=False)
        self.register_buffer("inv_freq", inv_freq.float().clone(), persistent=False)  # [D/2]
        self.rope_scale = rope_scale

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        """`.to()` and friends give each parameter its own storage: fuse the projections again. The
        rotary frequencies stay fp32 in a bf16 model, as in `transformers`: rounded to bf16, the
        angle of position 1,000 would be off by radians."""
        inv_freq = self.inv_freq  # [D/2] fp32
        super()._apply(fn, recurse)
        self.inv_freq = inv_freq.to(self.inv_freq.device)  # [D/2] fp32, on the new device
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
        return self

    def output_weight(self) -> torch.Tensor:
        return (
            self.model.embed_tokens.weight if self.spec.tie_word_embeddings else self.lm_head.weight
        )

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        layout: BatchLayout,
        cache: PagedKVCache,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor | None:
        """Compute the tokens, write their K/V into the cache, return logits at `logits_indices`
        (None on a tensor-parallel rank other than 0)."""
        if self.tp is None:
            x = self.model.embed_tokens(input_ids)  # [N, hidden]
        else:
            x = self.tp.embed(self.model.embed_tokens, input_ids)  # [N, hidden]
        delta = None  # [N, hidden]
        if self.spec.embedding_multiplier != 1.0:
            x = x * self.spec.embedding_multiplier  # [N, hidden]
        freqs = layout.positions[:, None].float() * self.inv_freq[None, :]  # [N, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [N, D]
        cos = (emb.cos() * self.rope_scale).to(x.dtype)[:, None, :]  # [N, 1, D]
        sin = (emb.sin() * self.rope_scale).to(x.dtype)[:, None, :]  # [N, 1, D]
        rotations = [(cos, sin)] * len(self.model.layers)
        # a layer without RoPE rotates by 0: x * 1 + y * 0 is x exactly
        if self.spec.rope_layers is not None:
            still = (torch.ones_like(cos), torch.zeros_like(sin))  # [N, 1, D] each
            rotations = [(cos, sin) if rope else still for rope in self.spec.rope_layers]
        for layer, (layer_cos, layer_sin) in zip(self.model.layers, rotations, strict=True):
            x, delta = layer(x, delta, layer_cos, layer_sin, layout, cache)  # [N, hidden] each
        x = self.model.norm(x[logits_indices] + delta[logits_indices])  # [M, hidden]
        logits = linear(x, self.output_weight())  # [M, vocab] (this rank's columns with tp)
        if self.tp is not None:
            logits = self.tp.gather_logits(logits, self.spec.vocab_size)  # [M, vocab] or None
            if logits is None:
                return None
        return (
            logits / self.spec.logits_scaling if self.spec.logits_scaling != 1.0 else logits
        ).float()
