"""The paged-attention kernels' test cases: ragged rows over shuffled and shared blocks (and the
same keys in the identity and slot layouts), prompt chunks over them, and the tolerances the
kernels are held to."""

import math

import pytest
import torch

from workers.kv_quant import STORAGE, dequantize, quantize

# bf16: the same fp32 sums in another order, rounded once to bf16: at most an ulp of bf16 apart
TOLERANCE = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.bfloat16: {"atol": 0.05, "rtol": 0.01},
}
BLOCK = 16  # tokens per KV block


# ragged rows: mid-block, exactly one and two blocks, a single key, three blocks and a bit
LENGTHS = [37, 32, 1, 50, 16]
# (row, its first n blocks) shared with row 0's, as prefix caching shares a common prompt
SHARED = {1: 2, 4: 1}


class PagedCase:
    """Random q and per-row contiguous keys and values, and the same keys in three caches: a pool of
    shuffled blocks (row 1 and row 4 reuse row 0's first blocks, two spare blocks, padding entries
    out of range), a pool with each row's blocks its own and in order, and one block per row of
    capacity max(LENGTHS) (the slot layout). Whatever a cache holds past a row's length is NaN, so a
    read of it shows."""

    def __init__(self, dtype: torch.dtype, heads_per_kv: int, dim: int) -> None:
        g = torch.Generator().manual_seed(dim * 10 + heads_per_kv)
        rows, kv_heads, longest = len(LENGTHS), 2, max(LENGTHS)
        self.lengths = torch.tensor(LENGTHS)  # [B]
        self.query = torch.randn(rows, kv_heads, heads_per_kv, dim, generator=g).to(dtype)
        keys = torch.randn(2, rows, kv_heads, longest, dim, generator=g).to(dtype)  # K, V
        for row, blocks in SHARED.items():
            keys[:, row, :, : blocks * BLOCK] = keys[:, 0, :, : blocks * BLOCK]
        for row, length in enumerate(LENGTHS):
            keys[:, row, :, length:] = math.nan
        self.keys = keys  # [2, B, KVH, L, D]: K and V, each row's contiguous

        # slot layout: [S, KVH, C, D] per cache, table [B, 1]
        self.slot = (keys[0], keys[1], torch.arange(rows)[:, None])

        max_blocks = -(-longest // BLOCK) + 1  # a column of padding at least
        padded = keys.new_full((2, rows, kv_heads, max_blocks * BLOCK, dim), math.nan)
        padded[:, :, :, :longest] = keys
        blocks = padded.view(2, rows, kv_heads, max_blocks, BLOCK, dim).transpose(2, 3)
        # identity layout: row b's block i is block b * max_blocks + i: [B MAXB, KVH, BS, D]
        own = blocks.reshape(2, rows * max_blocks, kv_heads, BLOCK, dim)
        self.identity = (
            own[0].contiguous(),
            own[1].contiguous(),
            torch.arange(rows * max_blocks).view(rows, max_blocks),
        )

        # shuffled layout: every (row, block) in use gets a block of a shuffled pool, except the
        # shared ones, which point at row 0's
        used = [(row, i) for row, n in enumerate(LENGTHS) for i in range(-(-n // BLOCK))]
        owned = [(row, i) for row, i in used if i >= SHARED.get(row, 0)]
        pool_size = len(owned) + 2
        place = dict(zip(owned, torch.randperm(pool_size, generator=g).tolist(), strict=False))
        for row, n in SHARED.items():
            place.update({(row, i): place[(0, i)] for i in range(n)})
        pool = keys.new_full((2, pool_size, kv_heads, BLOCK, dim), math.nan)
        # padding entries: out of range, below (even rows) and above (odd rows); never read
        padding = torch.where(torch.arange(rows) % 2 == 0, -1, pool_size + 7)  # [B]
        tables = padding[:, None].repeat(1, max_blocks)  # [B, MAXB]
        for (row, i), block in place.items():
            pool[:, block] = blocks[:, row, i]
            tables[row, i] = block
        self.shuffled = (pool[0], pool[1], tables)  # [NB, KVH, BS, D] x2, [B, MAXB]

    def reference(self) -> torch.Tensor:
        """Softmax attention in float64 over each row's keys: `[B, KVH, G, D]`."""
        out = []
        for row, length in enumerate(LENGTHS):
            q = self.query[row].double()  # [KVH, G, D]
            k, v = self.keys[:, row, :, :length].double()  # [KVH, len, D] each
            weights = torch.softmax(q @ k.transpose(1, 2) * q.shape[-1] ** -0.5, dim=-1)
            out.append(weights @ v)  # [KVH, G, D]
        return torch.stack(out)  # [B, KVH, G, D]


def paged_cases():
    for dtype in (torch.float32, torch.bfloat16):
        for dim in (16, 64, 128, 24):  # 24: not an AVX-512 width, the scalar loops
            for heads_per_kv in (1, 3):
                yield pytest.param(dtype, heads_per_kv, dim, id=f"{dtype}-G{heads_per_kv}-D{dim}")
        # seven query heads of 112 dims: an odd group over vector widths and a scalar tail
        yield pytest.param(dtype, 7, 112, id=f"{dtype}-G7-D112")


# prompt chunks over the case's rows: (first position, tokens), ending at each row's length: a
# whole prompt, a chunk from mid-block, one token, a chunk across blocks, one whole block
CHUNKS = [(0, 37), (27, 5), (0, 1), (30, 20), (0, 16)]


def prompt_chunks(case: PagedCase, chunks: list[tuple[int, int]]) -> tuple[torch.Tensor, ...]:
    """Queries for the chunks (one per row of the case, in order) and the kernel's chunk
    arguments: `(query [N, KVH, G, D], starts, firsts, counts)`."""
    g = torch.Generator().manual_seed(7)
    _, kv_heads, heads_per_kv, dim = case.query.shape
    total = sum(n for _, n in chunks)
    query = torch.randn(total, kv_heads, heads_per_kv, dim, generator=g).to(case.query.dtype)
    counts = torch.tensor([n for _, n in chunks])
    firsts = torch.cumsum(counts, 0) - counts
    return query, torch.tensor([s for s, _ in chunks]), firsts, counts


class Kv8Case(PagedCase):
    """A PagedCase with its K and V quantized: the shuffled pool (NaN past each row's keys, so
    their scales are NaN and a stray read shows) and its scales; `keys`, the reference's, the
    rows' own keys quantized and dequantized in float64 (a row's bytes depend on it alone: the
    pool's are the same)."""

    def __init__(self, kind: str, dtype: torch.dtype, heads_per_kv: int, dim: int) -> None:
        super().__init__(dtype, heads_per_kv, dim)
        storage = STORAGE[kind]
        k_pool, v_pool, tables = self.shuffled
        k_values, k_scales = quantize(k_pool, storage)  # [NB, KVH, BS, D], [NB, KVH, BS]
        v_values, v_scales = quantize(v_pool, storage)
        self.shuffled = (k_values, v_values, tables)
        self.scales = (k_scales, v_scales)
        values, scales = quantize(self.keys, storage)  # [2, B, KVH, L, D], [2, B, KVH, L]
        self.keys = dequantize(values, scales, torch.float64)
