"""A step's LoRA work alone on the embedded model's shapes (docs/BENCHMARKS.md, LoRA adapters):
`LoraBatch.add` for every projection of 30 layers, for 18 decode tokens spread over 8 slots of
rank 16 (fp32, and bf16 as `--lora-dtype bfloat16` holds them), 8 of rank 8 and 1 of rank 16, and
for a prompt chunk of 128 tokens of one rank-16 adapter (random weights). Milliseconds per step,
the mean of 20 steps after a warm-up, and the slot buffers' size; through the kernel
(`csrc/lora.cpp`), and through the torch ops with `PDSERVE_KERNELS=0`:

    .venv/bin/python -m benchmarks.studies.lora_step [THREADS]
"""

import sys
import time
from types import SimpleNamespace

import torch

from workers.lora import LoraBatch, LoraSlots

SPEC = dict(
    hidden_size=576,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    intermediate_size=1536,
    num_layers=30,
)
TOKENS = 18
CHUNK = 128  # a prompt chunk's tokens, of one adapter


def step_ms(
    num_slots: int, rank: int, dtype: torch.dtype, tokens: int = TOKENS
) -> tuple[float, float]:
    """Milliseconds of one decode step's LoRA work, and the slots' MiB."""
    weight = torch.zeros(1)
    model = SimpleNamespace(
        spec=SimpleNamespace(**SPEC),
        model=SimpleNamespace(embed_tokens=SimpleNamespace(weight=weight)),
    )
    slots = LoraSlots(model, num_slots, rank, dtype)
    for buffers in slots.a + slots.b:
        for buffer in buffers.values():
            buffer.normal_()
    for ranks in slots.ranks:
        for buffer in ranks.values():
            buffer.fill_(rank)
    batch = LoraBatch.of(slots, [n % num_slots for n in range(tokens)])
    total = 0.0
    for site, (width, outs) in slots.shapes.items():
        x = torch.randn(tokens, width)
        out = torch.randn(tokens, sum(outs))
        for _ in range(3):
            batch.add(out, x, 0, site)
        start = time.perf_counter()
        for _ in range(20):
            for layer in range(SPEC["num_layers"]):
                batch.add(out, x, layer, site)
        total += (time.perf_counter() - start) / 20
    return total * 1000, slots.nbytes / 2**20


def main() -> None:
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else torch.get_num_threads())
    for num_slots, rank, dtype, tokens in (
        (8, 16, torch.float32, TOKENS),
        (8, 16, torch.bfloat16, TOKENS),
        (8, 8, torch.float32, TOKENS),
        (1, 16, torch.float32, TOKENS),
        (1, 16, torch.float32, CHUNK),
    ):
        ms, mib = step_ms(num_slots, rank, dtype, tokens)
        slots = f"{num_slots} slot{'s' if num_slots > 1 else ''}"
        print(
            f"{tokens} tokens, {slots} of rank {rank} in {str(dtype)[6:]}: {ms:.1f} ms a step, "
            f"slot buffers {mib:.0f} MiB"
        )


if __name__ == "__main__":
    main()
