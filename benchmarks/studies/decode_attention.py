"""Decode rows' attention over a KV pool of a worker's size: how fast the kernel reads the keys and
values from memory, in the pool `PagedKVCache` allocates and in a plain one (docs/BENCHMARKS.md).

    .venv/bin/python -m benchmarks.studies.decode_attention [THREADS]

The embedded model's heads (3 KV heads of 3 query heads, head dim 64) and 30 layers over 1 GiB of
KV (1,456 blocks of 16 tokens in fp32, 2,912 in bf16), each row's blocks drawn from a shuffled
pool, as a worker's are after a while; each layer's call reads its own layer, so the reads come
from memory, not from the caches. Prints milliseconds per layer call and the KV bytes read per
second, for `PagedKVCache`'s pool (2 MiB pages where Linux grants them) and for a plain tensor
(4 KiB pages); the results of both are checked equal.
"""

import sys
import time

import torch

from workers.kernels import decode_attention
from workers.kv_cache import PagedKVCache

LAYERS, KV_HEADS, GROUP, DIM, BLOCK = 30, 3, 3, 64, 16
POOL_BYTES = 1 << 30
# (rows, shortest context, longest context): the mixed workload's decode steps, a full batch of
# mid-length contexts, and a few long ones
BATCHES = ((26, 16, 780), (64, 300, 700), (16, 2000, 3000))
ROUNDS = 3


def tables_for(lengths: torch.Tensor, num_blocks: int, seed: int) -> torch.Tensor:
    """Each row's blocks, taken in turn from one shuffle of the pool (from its start again when it
    runs out): `[rows, most blocks]`, padded with 0."""
    shuffled = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
    counts = [-(-int(n) // BLOCK) for n in lengths]
    tables = torch.zeros(len(counts), max(counts), dtype=torch.int64)
    taken = 0
    for row, count in enumerate(counts):
        if taken + count > num_blocks:
            taken = 0
        tables[row, :count] = shuffled[taken : taken + count]
        taken += count
    return tables


def per_layer_s(query, k, v, tables, lengths) -> tuple[float, list[torch.Tensor]]:
    """Seconds per layer call, the best of ROUNDS passes over every layer, and the last outputs."""
    best = float("inf")
    outputs: list[torch.Tensor] = []
    for _ in range(ROUNDS):
        start = time.perf_counter()
        outputs = [decode_attention(query, k[i], v[i], tables, lengths) for i in range(LAYERS)]
        best = min(best, (time.perf_counter() - start) / LAYERS)
    return best, outputs


def main(threads: int) -> None:
    torch.set_num_threads(threads)
    for dtype in (torch.float32, torch.bfloat16):
        per_token = PagedKVCache.bytes_per_token(LAYERS, KV_HEADS, DIM, dtype)
        num_blocks = POOL_BYTES // (per_token * BLOCK)
        shape = (LAYERS, num_blocks, KV_HEADS, BLOCK, DIM)
        torch.manual_seed(0)
        paged = PagedKVCache(LAYERS, num_blocks, KV_HEADS, BLOCK, DIM, dtype=dtype)
        paged.k.copy_(torch.randn(shape).to(dtype))
        paged.v.copy_(torch.randn(shape).to(dtype))
        plain_k, plain_v = paged.k.clone(), paged.v.clone()
        for seed, (rows, shortest, longest) in enumerate(BATCHES):
            generator = torch.Generator().manual_seed(seed)
            lengths = torch.randint(shortest, longest + 1, (rows,), generator=generator)
            tables = tables_for(lengths, num_blocks, seed)
            query = torch.randn(rows, KV_HEADS, GROUP, DIM, generator=generator).to(dtype)
            if decode_attention(query, paged.k[0], paged.v[0], tables, lengths) is None:
                sys.exit("the decode-attention kernel does not apply here")
            pooled, pooled_out = per_layer_s(query, paged.k, paged.v, tables, lengths)
            plain, plain_out = per_layer_s(query, plain_k, plain_v, tables, lengths)
            if not all(map(torch.equal, pooled_out, plain_out)):
                sys.exit("the two pools gave different results")
            read = int(lengths.sum()) * per_token // LAYERS  # K and V bytes a layer call reads
            print(
                f"{str(dtype)[6:]:8s} rows={rows:3d} context {shortest}-{longest}:  "
                f"PagedKVCache {pooled * 1e3:6.3f} ms {read / pooled / 1e9:5.1f} GB/s  "
                f"plain {plain * 1e3:6.3f} ms {read / plain / 1e9:5.1f} GB/s",
                flush=True,
            )


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
