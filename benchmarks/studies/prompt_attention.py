"""A prompt chunk's attention over a paged cache: the gathered copy + SDPA of before against the
kernel that reads the blocks in place (docs/BENCHMARKS.md).

    .venv/bin/python -m benchmarks.studies.prompt_attention [THREADS]

The embedded model's heads (3 KV heads of 3 query heads, head dim 64, blocks of 16 tokens, shuffled
in the pool), one chunk of T tokens ending at context C, fp32 and bf16; prints microseconds per
layer call of each and their ratio (kernel / gather + SDPA: below 1, the kernel is faster).
"""

import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from workers.kernels import prompt_attention
from workers.model import _gather

KV_HEADS, GROUP, DIM, BLOCK = 3, 3, 64, 16
CONTEXTS = (256, 1024, 4096)
CHUNKS = (1, 8, 32, 128, 256)


def seconds(fn: Callable[[], object], reps: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def main(threads: int) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(threads)
    heads = KV_HEADS * GROUP
    for dtype in (torch.float32, torch.bfloat16):
        pool = max(CONTEXTS) // BLOCK + 8
        k = torch.randn(pool, KV_HEADS, BLOCK, DIM).to(dtype)
        v = torch.randn(pool, KV_HEADS, BLOCK, DIM).to(dtype)
        shuffled = torch.randperm(pool)
        for context in CONTEXTS:
            table = shuffled[: -(-context // BLOCK)].clone()
            for tokens in CHUNKS:
                start = context - tokens
                q = torch.randn(tokens, heads, DIM).to(dtype)
                mask = torch.arange(context)[None] <= (start + torch.arange(tokens))[:, None]

                def gathered(q=q, k=k, v=v, mask=mask, table=table, context=context):
                    keys = _gather(k, table, context)  # [1, KVH, ctx, D]
                    values = _gather(v, table, context)
                    return F.scaled_dot_product_attention(
                        q.transpose(0, 1)[None], keys, values, attn_mask=mask, enable_gqa=True
                    )

                args = (table[None], torch.tensor([start]), torch.tensor([0]))

                def in_place(q=q, k=k, v=v, args=args, tokens=tokens):
                    grouped = q.view(tokens, KV_HEADS, GROUP, DIM)
                    return prompt_attention(grouped, k, v, *args, torch.tensor([tokens]))

                if in_place() is None:
                    sys.exit("the prompt-attention kernel does not apply here")
                reps = max(3, int(2e7 / (tokens * context * heads * DIM)))
                before, after = seconds(gathered, reps), seconds(in_place, reps)
                print(
                    f"{str(dtype)[6:]:8s} C={context:5d} T={tokens:4d}  gather+SDPA "
                    f"{before * 1e6:9.1f} us  kernel {after * 1e6:9.1f} us  "
                    f"ratio {after / before:5.2f}",
                    flush=True,
                )


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
