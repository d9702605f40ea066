"""Decode attention on a GPU: the Triton kernel that reads the blocks in place
(`workers/triton_attention.py`) against the torch ops that gather them into a copy for SDPA
(`paged_decode_attention_torch`) and against FlexAttention over a block mask built from the block
tables (docs/ARCHITECTURE.md, KV blocks, the prefix cache and forks).

    .venv/bin/python -m benchmarks.studies.gpu_attention

Qwen3-0.6B's heads (16 query heads, 8 KV heads, head dim 128) in bf16, blocks of 16 tokens drawn
from a shuffled pool, at 64 rows x 1,024 keys and 1 row x 4,096. Each point cycles over copies of
the pool (one per layer, 512 MiB at least in all) so the keys come from memory, not from L2.
Prints milliseconds per call (CUDA events, the mean of 50 calls after a warm-up) and the KV bytes
read per second (each row's K and V once), the Triton kernel's time replayed from a CUDA graph,
after checking the three results agree and that the Triton launch makes no host sync. Sized to
run well within a minute (most of it FlexAttention's compilation); exits with a message where
there is no CUDA GPU.
"""

import sys
import time

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from workers.kernels import paged_decode_attention_torch

HEADS, KV_HEADS, DIM, BLOCK = 16, 8, 128, 16
POINTS = ((64, 1024), (1, 4096))  # (rows, keys per row)
MIN_BYTES = 512 << 20  # the pools' copies together: well past an H100's or H200's 50 MiB L2
CALLS = 50


def make_point(rows: int, keys: int, device: str):
    """The query, `layers` copies of a pool just large enough for the rows, the shuffled tables
    and the lengths."""
    g = torch.Generator().manual_seed(rows)
    per_row = -(-keys // BLOCK)
    num_blocks = rows * per_row + 8  # a few spare blocks
    tables = torch.randperm(num_blocks, generator=g)[: rows * per_row].view(rows, per_row)
    pool_bytes = 2 * num_blocks * KV_HEADS * BLOCK * DIM * 2
    layers = max(1, -(-MIN_BYTES // pool_bytes))
    shape = (layers, num_blocks, KV_HEADS, BLOCK, DIM)
    k_pool = torch.randn(shape, dtype=torch.bfloat16, device=device)
    v_pool = torch.randn(shape, dtype=torch.bfloat16, device=device)
    query = torch.randn(rows, KV_HEADS, HEADS // KV_HEADS, DIM, generator=g).bfloat16()
    lengths = torch.full((rows,), keys)
    return query.to(device), k_pool, v_pool, tables.to(device), lengths.to(device)


def flex_block_mask(tables: torch.Tensor, lengths: torch.Tensor, num_blocks: int) -> BlockMask:
    """FlexAttention's paged form: each (row, KV head) a batch entry whose KV is the whole pool
    seen as `[NB KVH BS]` keys of one head (a view, no copy), its sparse blocks the row's blocks
    of that head, and a mask_mod that hides the keys past the row's length in its last block."""
    rows, max_blocks = tables.shape
    device = tables.device
    used = (lengths + BLOCK - 1) // BLOCK  # [B]
    heads = torch.arange(KV_HEADS, device=device)
    flat = tables[:, None, :] * KV_HEADS + heads[None, :, None]  # [B, KVH, MAXB]
    # the mask's kv_indices run as wide as the KV's blocks: [B KVH, 1, 1, NB KVH]
    indices = torch.zeros(
        rows * KV_HEADS, 1, 1, num_blocks * KV_HEADS, dtype=torch.int32, device=device
    )
    indices[:, 0, 0, :max_blocks] = flat.reshape(rows * KV_HEADS, max_blocks)
    counts = used.repeat_interleave(KV_HEADS).to(torch.int32)[:, None, None]  # [B KVH, 1, 1]
    last_at = (used - 1)[:, None, None].expand(rows, KV_HEADS, 1)
    last = flat.gather(2, last_at).reshape(-1)  # [B KVH]: each entry's last block
    tail = (lengths - (used - 1) * BLOCK).repeat_interleave(KV_HEADS)  # [B KVH]

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx // BLOCK != last[b]) | (kv_idx % BLOCK < tail[b])

    return BlockMask.from_kv_blocks(
        counts,
        indices,
        BLOCK_SIZE=(128, BLOCK),
        mask_mod=mask_mod,
        seq_lengths=(HEADS // KV_HEADS, num_blocks * KV_HEADS * BLOCK),
        compute_q_blocks=False,
    )


def flex_decode(flex, query, k_cache, v_cache, mask):
    """`query [B, KVH, G, D]` over the pool through `mask` -> `[B, KVH, G, D]`."""
    rows, kv_heads, group, dim = query.shape
    span = k_cache.numel() // dim
    keys = k_cache.view(1, 1, span, dim).expand(rows * kv_heads, 1, span, dim)
    values = v_cache.view(1, 1, span, dim).expand(rows * kv_heads, 1, span, dim)
    out = flex(query.reshape(rows * kv_heads, 1, group, dim), keys, values, block_mask=mask)
    return out.view(rows, kv_heads, group, dim)


def mean_ms(run, layers: int) -> float:
    """Mean milliseconds of a call of `run(layer)`, cycling over the layers."""
    for layer in range(layers):
        run(layer)
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(CALLS):
        run(i % layers)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / CALLS


def graph_ms(decode, query, k_pool, v_pool, tables, lengths) -> float:
    """The Triton kernel captured in one CUDA graph per layer (no host sync inside), replayed."""
    graphs = []
    for layer in range(k_pool.shape[0]):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            decode(query, k_pool[layer], v_pool[layer], tables, lengths)
        graphs.append(graph)
    return mean_ms(lambda layer: graphs[layer].replay(), len(graphs))


def measure(rows: int, keys: int, flex) -> dict[str, float]:
    """Each way's milliseconds per call at one point, after checking it against the torch ops."""
    from workers import triton_attention

    query, k_pool, v_pool, tables, lengths = make_point(rows, keys, "cuda")
    layers, num_blocks = k_pool.shape[:2]
    want = paged_decode_attention_torch(query, k_pool[0], v_pool[0], tables, lengths)
    got = triton_attention.decode_attention(query, k_pool[0], v_pool[0], tables, lengths)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    torch.cuda.set_sync_debug_mode("error")  # a host sync in the kernels' launch raises
    triton_attention.decode_attention(query, k_pool[0], v_pool[0], tables, lengths)
    torch.cuda.set_sync_debug_mode("default")

    def triton_call(layer):
        triton_attention.decode_attention(query, k_pool[layer], v_pool[layer], tables, lengths)

    def torch_call(layer):
        paged_decode_attention_torch(query, k_pool[layer], v_pool[layer], tables, lengths)

    results = {
        "triton": mean_ms(triton_call, layers),
        "triton, CUDA graph": graph_ms(
            triton_attention.decode_attention, query, k_pool, v_pool, tables, lengths
        ),
        "torch gather + SDPA": mean_ms(torch_call, layers),
    }
    try:
        mask = flex_block_mask(tables, lengths, num_blocks)
        tick = time.perf_counter()
        flexed = flex_decode(flex, query, k_pool[0], v_pool[0], mask)
        torch.cuda.synchronize()
        compiled_s = time.perf_counter() - tick
        torch.testing.assert_close(flexed, want, atol=2e-2, rtol=2e-2)

        def flex_call(layer):
            flex_decode(flex, query, k_pool[layer], v_pool[layer], mask)

        results[f"flex_attention (compiled in {compiled_s:.0f} s)"] = mean_ms(flex_call, layers)
    except Exception as error:  # a study: report FlexAttention's failure, keep the rest
        print(f"  flex_attention failed: {type(error).__name__}: {error}"[:400])
    return results


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("gpu_attention: needs a CUDA GPU (torch.cuda.is_available() is False)")
    print(f"{torch.cuda.get_device_name()}, bf16, H {HEADS}, KVH {KV_HEADS}, D {DIM}, BS {BLOCK}")
    flex = torch.compile(flex_attention, dynamic=False)
    for rows, keys in POINTS:
        results = measure(rows, keys, flex)
        kv_bytes = 2 * rows * keys * KV_HEADS * DIM * 2  # K and V, bf16
        print(f"{rows} rows x {keys} keys ({kv_bytes / 1e6:.0f} MB of KV):")
        for name, ms in results.items():
            print(f"  {name:34s} {ms:8.3f} ms {kv_bytes / ms / 1e6:8.0f} GB/s")


if __name__ == "__main__":
    main()
