"""Llama / Qwen2 / Qwen3 decoder in torch, run on flat token batches against a slot KV cache."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from workers.kernels import add_rms_norm, decode_attention, linear, rope_and_cache, silu_mul
from workers.kv_cache import SlotKVCache

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
    """Where one prompt chunk sits in a flat batch and in its cache row."""

    slot: int  # its cache row
    first: int  # flat index of its first token
    num_tokens: int
    start_pos: int  # position of its first token in the request's sequence


@dataclass
class BatchLayout:
    """Where each token of a flat batch belongs: decode tokens first, then prompt chunks.

    Tensors live on the model's device and are built once per step, so the 30-odd layers only index
    them. Decode tokens attend in one call per layer: the ragged kernel of `workers.kernels` on CPU,
    or one SDPA call over their slot span (`decode_span`, `decode_rows`, `decode_mask`) elsewhere.
    """

    positions: torch.Tensor  # [num_tokens] position of each token in its sequence
    slots: torch.Tensor  # [num_tokens] cache row of each token
    num_decode: int  # the first num_decode tokens are single decode tokens
    decode_context: int  # max(position) + 1 over decode tokens: keys to read for them
    decode_lengths: torch.Tensor  # [num_decode] keys each decode token reads: its position + 1
    decode_span: tuple[int, int]  # (min slot, max slot + 1) over decode tokens
    # [num_decode] each decode token's row in the span; None: row i is token i
    decode_rows: torch.Tensor | None
    # [span, 1, 1, decode_context] keys each span row sees; rows not
    decode_mask: torch.Tensor | None
    # decoding see key 0 only (a dummy query whose output is dropped)
    prefill: list[PrefillSpan]  # one per prompt chunk
    # per chunk: [T, start + T] visible keys, None when start is 0
    prefill_masks: list[torch.Tensor | None]

    @classmethod
    def pack(
        cls, rows: list[tuple[int, list[int], int]], num_decode: int, device: torch.device | str
    ) -> tuple[torch.Tensor, BatchLayout]:
        """Flatten `rows` of (slot, token_ids, start_pos), the first `num_decode` single decode
        tokens, into one batch: its input ids `[N]` and its layout."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        prefill: list[PrefillSpan] = []
        for i, (slot, tokens, start) in enumerate(rows):
            if i >= num_decode:
                prefill.append(PrefillSpan(slot, len(ids), len(tokens), start))
            ids += tokens
            positions += range(start, start + len(tokens))
            slots += [slot] * len(tokens)
        return torch.tensor(ids, device=device), cls.build(
            positions, slots, num_decode, prefill, device
        )

    @classmethod
    def build(
        cls,
        positions: list[int],
        slots: list[int],
        num_decode: int,
        prefill: list[PrefillSpan],
        device: torch.device | str,
    ) -> BatchLayout:
        decode_slots = slots[:num_decode]
        decode_pos = positions[:num_decode]
        lo = min(decode_slots, default=0)
        hi = max(decode_slots, default=-1) + 1
        context = max(decode_pos, default=-1) + 1
        rows = None
        mask = None
        if num_decode:
            last = [0] * (hi - lo)  # [span] last visible position of each span row
            for slot, pos in zip(decode_slots, decode_pos, strict=True):
                last[slot - lo] = pos
            key_pos = torch.arange(context, device=device)  # [ctx]
            # [span, 1, 1, ctx]
            mask = (key_pos <= torch.tensor(last, device=device)[:, None])[:, None, None, :]
            if decode_slots != list(range(lo, hi)):
                rows = torch.tensor([s - lo for s in decode_slots], device=device)  # [B]
        masks = []
        for _, _, length, start in prefill:
            query_pos = torch.arange(start, start + length, device=device)  # [T]
            key_pos = torch.arange(start + length, device=device)  # [ctx]
            masks.append(key_pos[None, :] <= query_pos[:, None] if start else None)  # [T, ctx]
        return cls(
            positions=torch.tensor(positions, device=device),
            slots=torch.tensor(slots, device=device),
            num_decode=num_decode,
            decode_context=context,
            decode_lengths=torch.tensor(
                [p + 1 for p in decode_pos], dtype=torch.long, device=device
            ),
            decode_span=(lo, hi),
            decode_rows=rows,
            decode_mask=mask,
            prefill=prefill,
            prefill_masks=masks,
        )


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
    again after `.to()`, which gives every parameter storage of its own.
    """
    params = [getattr(linear, name) for linear in linears]
    if params[0] is None:
        return None
    fused = torch.cat([p.detach() for p in params])  # [sum of out, in] or [sum of out]
    offset = 0
    for p in params:
        p.data = fused[offset : offset + p.shape[0]]
        offset += p.shape[0]
    return fused


def _span_decode_attention(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, layout: BatchLayout
) -> torch.Tensor:
    """Decode attention as one SDPA call over the slot span lo..hi-1, a view of the cache (gathering
    the rows would copy every key): the call reads each row up to the longest decode context, but
    one call per layer costs far less than one per row (on CPU every call is a thread-pool fork and
    join). `query [B, KVH, G, D]` -> `[B, KVH, G, D]`."""
    lo, hi = layout.decode_span
    ctx = layout.decode_context
    if layout.decode_rows is not None:
        span_query = query.new_zeros(hi - lo, *query.shape[1:])  # [span, KVH, G, D]
        span_query[layout.decode_rows] = query
        query = span_query
    attn = F.scaled_dot_product_attention(
        query, k_cache[lo:hi, :, :ctx], v_cache[lo:hi, :, :ctx], attn_mask=layout.decode_mask
    )  # [span, KVH, G, D]
    return attn if layout.decode_rows is None else attn[layout.decode_rows]  # [B, KVH, G, D]


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
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
        cache: SlotKVCache,
    ) -> torch.Tensor:
        n = x.shape[0]
        heads = self.num_heads
        kv_heads = self.num_kv_heads
        dim = self.head_dim
        # [N, H+2KVH, D]
        qkv = linear(x, self.qkv_weight, self.qkv_bias).view(n, heads + 2 * kv_heads, dim)
        if hasattr(self, "q_norm"):
            qkv[:, :heads] = self.q_norm(qkv[:, :heads])  # [N, H, D]
            # [N, KVH, D]
            qkv[:, heads : heads + kv_heads] = self.k_norm(qkv[:, heads : heads + kv_heads])
        k_cache = cache.k[self.layer_idx]
        v_cache = cache.v[self.layer_idx]  # [S, KVH, C, D]
        # [N, H, D]
        q = rope_and_cache(qkv, cos, sin, heads, k_cache, v_cache, layout.slots, layout.positions)

        out = torch.empty(n, heads, dim, dtype=q.dtype, device=q.device)  # [N, H, D]
        if layout.num_decode:
            # A decode row's query heads that share a KV head go in as that head's query rows (all
            # at the same position): no KV head is repeated for GQA.
            b = layout.num_decode
            grouped = q[:b].reshape(b, kv_heads, heads // kv_heads, dim)  # [B, KVH, G, D]
            attn = decode_attention(
                grouped, k_cache, v_cache, layout.slots[:b], layout.decode_lengths
            )
            if attn is None:
                attn = _span_decode_attention(grouped, k_cache, v_cache, layout)  # [B, KVH, G, D]
            out[:b] = attn.view(b, heads, dim)
        for (slot, first, length, start), mask in zip(
            layout.prefill, layout.prefill_masks, strict=True
        ):
            keys = k_cache[slot, :, : start + length][None]  # [1, KVH, ctx, D]
            values = v_cache[slot, :, : start + length][None]  # [1, KVH, ctx, D]
            query = q[first : first + length].transpose(0, 1)[None]  # [1, H, T, D]
            attn = F.scaled_dot_product_attention(
                query, keys, values, attn_mask=mask, is_causal=mask is None, enable_gqa=True
            )  # [1, H, T, D]
            out[first : first + length] = attn[0].transpose(0, 1)  # [T, H, D]
        return linear(out.view(n, heads * dim), self.o_proj.weight, self.o_proj.bias)  # [N, hidden]


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.up_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False)
        self.fuse()

    def fuse(self) -> None:
        # [2 I, hidden]
        self.gate_up_weight = fuse_linears([self.gate_proj, self.up_proj], "weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [N, hidden]
        return linear(silu_mul(linear(x, self.gate_up_weight)), self.down_proj.weight)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec, layer_idx)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec)

    def forward(self, x, delta, cos, sin, layout, cache):  # type: ignore[no-untyped-def]
        """`x + delta` (the previous layer's output, added here in place into `x`, the residual
        stream, so that the add and the norm run as one kernel) is this layer's input. Returns the
        residual stream after attention and this layer's MLP output, which the next layer adds."""
        h = add_rms_norm(x, delta, self.input_layernorm)  # [N, hidden]; x is now x + delta
        # [N, hidden]
        h = add_rms_norm(
            x, self.self_attn(h, cos, sin, layout, cache), self.post_attention_layernorm
        )
        return x, self.mlp(h)  # [N, hidden] each


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
        cache: SlotKVCache,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """Compute the tokens, write their K/V into the cache, return logits at `logits_indices`."""
        x = self.model.embed_tokens(input_ids)
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
        logits = linear(x, self.output_weight())  # [M, vocab]
        return (
            logits / self.spec.logits_scaling if self.spec.logits_scaling != 1.0 else logits
        ).float()
