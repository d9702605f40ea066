"""Llama / Qwen2 / Qwen3 decoder in torch, run on flat token batches against a slot KV cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from workers.kv_cache import SlotKVCache

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")


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


@dataclass
class BatchLayout:
    """Where each token of a flat batch belongs: decode tokens first, then prompt chunks.

    Tensors live on the model's device; the Python ints describe the prompt chunks, one attention
    call each. Decode tokens attend one call per row on CPU (each reads only its own keys) or in one
    batched call over their slot span on an accelerator (`batched_decode`), where launches cost more
    than reading padded keys.
    """

    positions: torch.Tensor  # [num_tokens] position of each token in its sequence
    slots: torch.Tensor  # [num_tokens] cache row of each token
    num_decode: int  # the first num_decode tokens are single decode tokens
    decode_rows: list[tuple[int, int]]  # (slot, position) of each decode token
    decode_context: int  # max(position) + 1 over decode tokens: keys to read for them
    decode_span: tuple[int, int]  # (min slot, max slot + 1) over decode tokens
    prefill: list[tuple[int, int, int, int]]  # (slot, first flat index, num_tokens, start_pos)
    batched_decode: bool

    @classmethod
    def build(cls, positions: list[int], slots: list[int], num_decode: int,
              prefill: list[tuple[int, int, int, int]], device: torch.device | str,
              batched_decode: bool | None = None) -> BatchLayout:
        decode_slots = slots[:num_decode]
        return cls(
            positions=torch.tensor(positions, device=device), slots=torch.tensor(slots, device=device),
            num_decode=num_decode, decode_rows=list(zip(decode_slots, positions[:num_decode], strict=True)),
            decode_context=max(positions[:num_decode], default=-1) + 1,
            decode_span=(min(decode_slots, default=0), max(decode_slots, default=-1) + 1), prefill=prefill,
            batched_decode=torch.device(device).type != "cpu" if batched_decode is None else batched_decode)


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


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.q_proj = nn.Linear(spec.hidden_size, spec.num_heads * spec.head_dim, bias=spec.qkv_bias)
        self.k_proj = nn.Linear(spec.hidden_size, spec.num_kv_heads * spec.head_dim, bias=spec.qkv_bias)
        self.v_proj = nn.Linear(spec.hidden_size, spec.num_kv_heads * spec.head_dim, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(spec.num_heads * spec.head_dim, spec.hidden_size, bias=spec.o_bias)
        if spec.qk_norm:
            self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)
            self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: BatchLayout, cache: SlotKVCache
    ) -> torch.Tensor:
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.num_heads, self.head_dim)  # [N, H, D]
        k = self.k_proj(x).view(n, self.num_kv_heads, self.head_dim)  # [N, KVH, D]
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)  # [N, KVH, D]
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q = q * cos + rotate_half(q) * sin  # [N, H, D]
        k = k * cos + rotate_half(k) * sin  # [N, KVH, D]

        k_cache, v_cache = cache.k[self.layer_idx], cache.v[self.layer_idx]  # [S, KVH, C, D]
        k_cache[layout.slots, :, layout.positions] = k.to(k_cache.dtype)
        v_cache[layout.slots, :, layout.positions] = v.to(v_cache.dtype)

        out = torch.empty_like(q)  # [N, H, D]
        if layout.num_decode and not layout.batched_decode:
            # On CPU each decode row attends over its own keys, as views of its cache row: no copy, and
            # no reading past its length (a batched call reads every row up to the longest one).
            # A decode row's query heads that share a KV head go in as that head's query rows (all at
            # the same position, so no mask): no KV head is repeated for GQA.
            group = self.num_heads // self.num_kv_heads
            grouped = q[: layout.num_decode].view(-1, self.num_kv_heads, group, self.head_dim)  # [B, KVH, G, D]
            grouped_out = out[: layout.num_decode].view(-1, self.num_kv_heads, group, self.head_dim)
            for i, (slot, pos) in enumerate(layout.decode_rows):
                grouped_out[i] = F.scaled_dot_product_attention(
                    grouped[i][None], k_cache[slot, :, : pos + 1][None], v_cache[slot, :, : pos + 1][None])[0]
        elif layout.num_decode:
            # On an accelerator, one batched call over the cache rows lo..hi-1 as a view (gathering the
            # decode rows would copy every key and value). Rows in the span that are not decoding get a
            # dummy query that sees key 0 only; their outputs are dropped.
            b, ctx = layout.num_decode, layout.decode_context
            lo, hi = layout.decode_span
            rows = layout.slots[:b] - lo  # [B]
            query = q.new_zeros(hi - lo, self.num_heads, 1, self.head_dim)  # [span, H, 1, D]
            query[rows] = q[:b, :, None, :]
            last = torch.zeros(hi - lo, dtype=torch.long, device=x.device)  # [span]
            last[rows] = layout.positions[:b]
            visible = torch.arange(ctx, device=x.device) <= last[:, None]  # [span, ctx]
            attn = F.scaled_dot_product_attention(
                query, k_cache[lo:hi, :, :ctx], v_cache[lo:hi, :, :ctx],
                attn_mask=visible[:, None, None, :], enable_gqa=True,
            )  # [span, H, 1, D]
            out[:b] = attn[rows, :, 0, :]
        for slot, first, length, start in layout.prefill:
            ctx = start + length
            keys = k_cache[slot, :, :ctx][None]  # [1, KVH, ctx, D]
            values = v_cache[slot, :, :ctx][None]  # [1, KVH, ctx, D]
            query = q[first : first + length].transpose(0, 1)[None]  # [1, H, T, D]
            if start == 0:
                attn = F.scaled_dot_product_attention(query, keys, values, is_causal=True, enable_gqa=True)
            else:
                pos = torch.arange(start, ctx, device=x.device)
                visible = torch.arange(ctx, device=x.device)[None, :] <= pos[:, None]  # [T, ctx]
                attn = F.scaled_dot_product_attention(query, keys, values, attn_mask=visible, enable_gqa=True)
            out[first : first + length] = attn[0].transpose(0, 1)  # [T, H, D]
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim))  # [N, hidden]


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.up_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # [N, hidden]


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec, layer_idx)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec)

    def forward(self, x, cos, sin, layout, cache):  # type: ignore[no-untyped-def]
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, layout, cache)  # [N, hidden]
        return x + self.mlp(self.post_attention_layernorm(x))  # [N, hidden]


class Backbone(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec, i) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)


class DecoderLM(nn.Module):
    """The decoder with Hugging Face's parameter names, so a HF state dict loads as it is.

    `inv_freq` and `rope_scale` come from the checkpoint's own rotary embedding (theta and any
    scaling such as Llama 3's already applied), so positions rotate exactly as in `transformers`.
    """

    def __init__(self, spec: ModelSpec, inv_freq: torch.Tensor, rope_scale: float = 1.0) -> None:
        super().__init__()
        self.spec = spec
        self.model = Backbone(spec)
        if not spec.tie_word_embeddings:
            self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        self.register_buffer("inv_freq", inv_freq.float().clone(), persistent=False)  # [D/2]
        self.rope_scale = rope_scale

    def output_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.spec.tie_word_embeddings else self.lm_head.weight

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, layout: BatchLayout, cache: SlotKVCache, logits_indices: torch.Tensor
    ) -> torch.Tensor:
        """Compute the tokens, write their K/V into the cache, return logits at `logits_indices`."""
        x = self.model.embed_tokens(input_ids)  # [N, hidden]
        freqs = layout.positions[:, None].float() * self.inv_freq[None, :]  # [N, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [N, D]
        cos = (emb.cos() * self.rope_scale).to(x.dtype)[:, None, :]  # [N, 1, D]
        sin = (emb.sin() * self.rope_scale).to(x.dtype)[:, None, :]  # [N, 1, D]
        for layer in self.model.layers:
            x = layer(x, cos, sin, layout, cache)  # [N, hidden]
        x = self.model.norm(x[logits_indices])  # [M, hidden]
        return F.linear(x, self.output_weight()).float()  # [M, vocab]
