"""Paged attention on a GPU: Triton kernels that read K and V where the blocks lie, through the
block tables, for decode rows (`decode_attention`) and for prompt chunks (`prompt_attention`).

Same arguments and semantics as the CPU kernels of `workers/kernels.py`: the cache `[NB, KVH, BS,
D]`, tables padded with any value past a row's blocks (never read: a key's table entry is loaded
only for keys below its row's length), the query grouped `[.., KVH, G, D]`. A program holds one
KV head's G query heads (padded to a power of two, masked), so each block is read once per KV head
for the whole group (once per tile of a chunk's tokens, for prompts); no gathered copy, no mask
tensor. The softmax is online, in fp32 (exp2, the scale folded with log2 e). An 8-bit cache is
read as its bytes: a key's dot product times its scale, a softmax weight times its value's scale,
as the CPU kernels do.

Decode splits each row's keys into spans of SPLIT_KEYS (flash-decoding): one program per (row, KV
head, span), then a second kernel merges the spans. The span is fixed, not sized to the batch, so
a row's sums do not depend on its batch or its table's width (a span past the row's length adds
exactly nothing), and the grids come from shapes alone: no host sync, so a decode step with its
tables padded to a fixed width can be captured in a CUDA graph.

Where the GPU is absent the same kernels run on CPU tensors under Triton's interpreter
(`TRITON_INTERPRET=1`): that is how the tests check them against the torch ops.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

SPLIT_KEYS = 256  # keys of one decode program: 64 rows x 1,024 keys x 8 KV heads is 2,048 programs
BLOCK_N = 64  # keys per tile of a program's key loop
PROMPT_ROWS = 64  # (token, query head) rows of a prompt program: 64 // G_PAD tokens
LOG2E = math.log2(math.e)

Scales = tuple[torch.Tensor, torch.Tensor]


@triton.jit
def _attend_tile(
    q,
    m_i,
    l_i,
    acc,
    k_ptr,
    v_ptr,
    k_scale_ptr,
    v_scale_ptr,
    kv_at,
    scale_at,
    live,
    visible,
    d,
    d_ok,
    qk_scale,
    KV8: tl.constexpr,
    FP8: tl.constexpr,
):
    """One tile of keys folded into the online softmax of `q [M, D_PAD]`: `kv_at [BN]` where each
    key's row starts in the cache, `live [BN]` the keys that exist (only those are loaded),
    `visible [M, BN]` which of them each query row sees. Returns the new (m_i, l_i, acc)."""
    at = kv_at[:, None] + d[None, :]  # [BN, D_PAD]
    held = live[:, None] & d_ok[None, :]  # [BN, D_PAD]
    k = tl.load(k_ptr + at, mask=held, other=0)  # [BN, D_PAD]
    v = tl.load(v_ptr + at, mask=held, other=0)  # [BN, D_PAD]
    if FP8:  # e4m3 as the cache stores it: its bytes
        k = k.to(tl.float8e4nv, bitcast=True)
        v = v.to(tl.float8e4nv, bitcast=True)
    # 8-bit values are exact in bf16 and fp16, so the dot takes them in the query's dtype
    k = k.to(q.dtype)
    v = v.to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale  # [M, BN], log2 units
    if KV8:
        k_scale = tl.load(k_scale_ptr + scale_at, mask=live, other=0.0).to(tl.float32)  # [BN]
        s = s * k_scale[None, :]
    s = tl.where(visible, s, float("-inf"))
    # every row sees a key of its first tile (key 0, or its span's first), so m_new is finite
    m_new = tl.maximum(m_i, tl.max(s, 1))  # [M]
    alpha = tl.exp2(m_i - m_new)  # [M]
    p = tl.exp2(s - m_new[:, None])  # [M, BN]
    l_i = l_i * alpha + tl.sum(p, 1)
    if KV8:
        v_scale = tl.load(v_scale_ptr + scale_at, mask=live, other=0.0).to(tl.float32)  # [BN]
        p = p * v_scale[None, :]
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision="ieee")  # [M, D_PAD]
    return m_new, l_i, acc


@triton.jit
def _decode_spans(
    q_ptr,
    k_ptr,
    v_ptr,
    k_scale_ptr,
    v_scale_ptr,
    tables_ptr,
    lengths_ptr,
    parts_ptr,
    maxes_ptr,
    sums_ptr,
    qk_scale,
    KVH,
    G,
    D,
    BS,
    table_stride,
    num_spans,
    stride_block,
    stride_head,
    stride_token,
    scale_stride_block,
    scale_stride_head,
    G_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
    SPAN: tl.constexpr,
    BLOCK_N: tl.constexpr,
    KV8: tl.constexpr,
    FP8: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    row = tl.program_id(0)
    h = tl.program_id(1)
    span = tl.program_id(2)
    length = tl.load(lengths_ptr + row).to(tl.int32)
    lo = span * SPAN
    hi = tl.minimum(length, lo + SPAN)  # below lo: the loop does not run, the span adds nothing
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    d_ok = d < D
    q_at = ((row * KVH + h) * G + g[:, None]) * D + d[None, :]  # [G_PAD, D_PAD]
    q = tl.load(q_ptr + q_at, mask=(g[:, None] < G) & d_ok[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    for first in range(lo, hi, BLOCK_N):
        keys = first + tl.arange(0, BLOCK_N)  # [BN]
        live = keys < hi
        block = tl.load(tables_ptr + row * table_stride + keys // BS, mask=live, other=0)  # [BN]
        offset = keys % BS
        kv_at = block * stride_block + h * stride_head + offset * stride_token  # [BN]
        scale_at = block * scale_stride_block + h * scale_stride_head + offset  # [BN]
        m_i, l_i, acc = _attend_tile(
            q,
            m_i,
            l_i,
            acc,
            k_ptr,
            v_ptr,
            k_scale_ptr,
            v_scale_ptr,
            kv_at,
            scale_at,
            live,
            live[None, :],
            d,
            d_ok,
            qk_scale,
            KV8,
            FP8,
        )
    part = (row * KVH + h) * num_spans + span
    tl.store(parts_ptr + (part * G_PAD + g[:, None]) * D_PAD + d[None, :], acc)
    tl.store(maxes_ptr + part * G_PAD + g, m_i)
    tl.store(sums_ptr + part * G_PAD + g, l_i)


@triton.jit
def _merge_spans(
    parts_ptr,
    maxes_ptr,
    sums_ptr,
    out_ptr,
    KVH,
    G,
    D,
    num_spans,
    G_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
):
    row = tl.program_id(0)
    h = tl.program_id(1)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    m_all = tl.full([G_PAD], float("-inf"), tl.float32)
    l_all = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    for span in range(0, num_spans):
        part = (row * KVH + h) * num_spans + span
        m_i = tl.load(maxes_ptr + part * G_PAD + g)  # [G_PAD]
        l_i = tl.load(sums_ptr + part * G_PAD + g)  # [G_PAD]
        o = tl.load(parts_ptr + (part * G_PAD + g[:, None]) * D_PAD + d[None, :])
        m_new = tl.maximum(m_all, m_i)
        # an empty span (-inf, 0, 0) scales by exp2(-inf) = 0 and leaves the rest's bits as they are
        base = tl.where(m_new == float("-inf"), 0.0, m_new)
        a = tl.exp2(m_all - base)
        b = tl.exp2(m_i - base)
        acc = acc * a[:, None] + o * b[:, None]
        l_all = l_all * a + l_i * b
        m_all = m_new
    out = acc / tl.where(l_all > 0, l_all, 1.0)[:, None]  # [G_PAD, D_PAD]; a length 0 row: zeros
    out_at = ((row * KVH + h) * G + g[:, None]) * D + d[None, :]
    held = (g[:, None] < G) & (d[None, :] < D)
    tl.store(out_ptr + out_at, out.to(out_ptr.dtype.element_ty), mask=held)


@triton.jit
def _prompt_chunks(
    q_ptr,
    k_ptr,
    v_ptr,
    k_scale_ptr,
    v_scale_ptr,
    tables_ptr,
    starts_ptr,
    firsts_ptr,
    counts_ptr,
    out_ptr,
    qk_scale,
    KVH,
    G,
    D,
    BS,
    table_stride,
    stride_block,
    stride_head,
    stride_token,
    scale_stride_block,
    scale_stride_head,
    G_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
    TOKENS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    KV8: tl.constexpr,
    FP8: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    chunk = tl.program_id(0)
    tile = tl.program_id(1)
    h = tl.program_id(2)
    count = tl.load(counts_ptr + chunk).to(tl.int32)
    start = tl.load(starts_ptr + chunk).to(tl.int32)
    first_row = tl.load(firsts_ptr + chunk).to(tl.int32)
    r = tl.arange(0, TOKENS * G_PAD)
    token = tile * TOKENS + r // G_PAD  # [M] within the chunk
    g = r % G_PAD  # [M]
    row_ok = (token < count) & (g < G)
    position = start + token  # [M]
    d = tl.arange(0, D_PAD)
    d_ok = d < D
    q_at = (((first_row + token) * KVH + h) * G + g)[:, None] * D + d[None, :]  # [M, D_PAD]
    q = tl.load(q_ptr + q_at, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    # the keys up to the tile's last token; a tile past the chunk's tokens reads none
    end = start + tl.minimum(count, (tile + 1) * TOKENS)
    end = tl.where(tile * TOKENS < count, end, 0)
    m_i = tl.full([TOKENS * G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([TOKENS * G_PAD], tl.float32)
    acc = tl.zeros([TOKENS * G_PAD, D_PAD], tl.float32)
    for first in range(0, end, BLOCK_N):
        keys = first + tl.arange(0, BLOCK_N)  # [BN]
        live = keys < end
        block = tl.load(tables_ptr + chunk * table_stride + keys // BS, mask=live, other=0)
        offset = keys % BS
        kv_at = block * stride_block + h * stride_head + offset * stride_token  # [BN]
        scale_at = block * scale_stride_block + h * scale_stride_head + offset  # [BN]
        visible = live[None, :] & (keys[None, :] <= position[:, None])  # [M, BN]
        m_i, l_i, acc = _attend_tile(
            q,
            m_i,
            l_i,
            acc,
            k_ptr,
            v_ptr,
            k_scale_ptr,
            v_scale_ptr,
            kv_at,
            scale_at,
            live,
            visible,
            d,
            d_ok,
            qk_scale,
            KV8,
            FP8,
        )
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # [M, D_PAD]
    tl.store(out_ptr + q_at, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def _applies(query: torch.Tensor, k_cache: torch.Tensor, scales: Scales | None) -> bool:
    """Whether the kernels run here: a CUDA tensor (or any under the interpreter) in a float dtype
    the dot takes, a cache whose rows are contiguous, and fp8 only where Triton converts e4m3
    (compute capability 8.9 and up)."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if not (query.is_cuda or interpreted):
        return False
    if query.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    if k_cache.stride(3) != 1:
        return False
    if scales is not None and k_cache.dtype == torch.uint8 and query.is_cuda:
        return torch.cuda.get_device_capability(query.device) >= (8, 9)
    return True


def _cache_args(
    k_cache: torch.Tensor, v_cache: torch.Tensor, scales: Scales | None
) -> tuple[list[torch.Tensor], list[int], dict[str, bool]]:
    """The caches' tensors and strides as the kernels take them, and the kernels' KV8 and FP8."""
    assert k_cache.stride() == v_cache.stride(), "K and V pools of one layout expected"
    if scales is None:
        k_scale, v_scale = k_cache, v_cache  # never read
        scale_strides = [0, 0]
    else:
        k_scale, v_scale = scales
        assert k_scale.stride() == v_scale.stride() and k_scale.stride(2) == 1
        scale_strides = [k_scale.stride(0), k_scale.stride(1)]
    pointers = [k_cache, v_cache, k_scale, v_scale]
    strides = [k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), *scale_strides]
    flags = {"KV8": scales is not None, "FP8": scales is not None and k_cache.dtype == torch.uint8}
    return pointers, strides, flags


def decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    lengths: torch.Tensor,
    scales: Scales | None = None,
) -> torch.Tensor | None:
    """`kernels.decode_attention` on a GPU: `query [B, KVH, G, D]` over keys 0..lengths[b]-1 of
    the blocks `block_tables [B, MAXB]` names, read in place -> `[B, KVH, G, D]` in the query's
    dtype; None where the kernels do not apply (see `_applies`): the torch ops do the work then."""
    if not _applies(query, k_cache, scales):
        return None
    batch, kv_heads, group, dim = query.shape
    device = query.device
    out = torch.empty_like(query, memory_format=torch.contiguous_format)  # [B, KVH, G, D]
    if batch == 0:
        return out
    block_size = k_cache.shape[2]
    tables = block_tables.to(device).contiguous()  # [B, MAXB]
    num_spans = max(1, triton.cdiv(tables.shape[1] * block_size, SPLIT_KEYS))
    g_pad = max(16, triton.next_power_of_2(group))  # tl.dot's least M
    d_pad = max(16, triton.next_power_of_2(dim))
    # [B, KVH, spans, G_PAD, D_PAD] fp32 sums, and each span's running max and softmax sum
    parts = torch.empty(batch, kv_heads, num_spans, g_pad, d_pad, device=device)
    maxes = torch.empty(batch, kv_heads, num_spans, g_pad, device=device)
    sums = torch.empty(batch, kv_heads, num_spans, g_pad, device=device)
    pointers, strides, flags = _cache_args(k_cache, v_cache, scales)
    dot_fp32 = query.dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1"
    _decode_spans[(batch, kv_heads, num_spans)](
        query.contiguous(),
        *pointers,
        tables,
        lengths.to(device),
        parts,
        maxes,
        sums,
        dim**-0.5 * LOG2E,
        kv_heads,
        group,
        dim,
        block_size,
        tables.shape[1],
        num_spans,
        *strides,
        G_PAD=g_pad,
        D_PAD=d_pad,
        SPAN=SPLIT_KEYS,
        BLOCK_N=BLOCK_N,
        DOT_FP32=dot_fp32,
        **flags,
    )
    _merge_spans[(batch, kv_heads)](
        parts, maxes, sums, out, kv_heads, group, dim, num_spans, G_PAD=g_pad, D_PAD=d_pad
    )
    return out


def prompt_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    starts: torch.Tensor,
    firsts: torch.Tensor,
    counts: torch.Tensor,
    scales: Scales | None = None,
) -> torch.Tensor | None:
    """`kernels.prompt_attention` on a GPU: chunk c's `counts[c]` tokens, rows `firsts[c]`.. of
    `query [N, KVH, G, D]` at positions `starts[c]`.., each seeing the keys up to its own position
    in the blocks `block_tables[c]` names (its cached prefix's included) -> `[N, KVH, G, D]`; None
    where the kernels do not apply. The grid has a program per KV head and tile of N tokens in
    every chunk (from shapes alone); a tile past its chunk's tokens reads and writes nothing."""
    if not _applies(query, k_cache, scales):
        return None
    total, kv_heads, group, dim = query.shape
    device = query.device
    out = torch.empty_like(query, memory_format=torch.contiguous_format)  # [N, KVH, G, D]
    num_chunks = starts.numel()
    if total == 0 or num_chunks == 0:
        return out
    tables = block_tables.to(device).contiguous()  # [C, MAXB]
    # [3, C]: the chunks' arguments, often host tensors, in one copy that does not wait for the
    # GPU (a blocking copy would sync with the host in every layer)
    chunks = torch.stack([starts, firsts, counts]).to(device, torch.int64, non_blocking=True)
    g_pad = triton.next_power_of_2(group)
    tokens = max(1, PROMPT_ROWS // g_pad)
    pointers, strides, flags = _cache_args(k_cache, v_cache, scales)
    dot_fp32 = query.dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1"
    _prompt_chunks[(num_chunks, triton.cdiv(total, tokens), kv_heads)](
        query.contiguous(),
        *pointers,
        tables,
        chunks[0],
        chunks[1],
        chunks[2],
        out,
        dim**-0.5 * LOG2E,
        kv_heads,
        group,
        dim,
        k_cache.shape[2],
        tables.shape[1],
        *strides,
        G_PAD=g_pad,
        D_PAD=max(16, triton.next_power_of_2(dim)),
        TOKENS=tokens,
        BLOCK_N=BLOCK_N,
        DOT_FP32=dot_fp32,
        **flags,
    )
    return out
