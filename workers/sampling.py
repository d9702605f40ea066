"""Token sampling: greedy, temperature, top-k, top-p, with a seeded draw per request and token."""

from __future__ import annotations

import torch

from scheduler.request import SamplingParams

_SEED_STRIDE = 1_000_003  # a prime, so (seed, index) pairs of nearby requests do not collide


def draw_seed(seed: int, output_index: int) -> int:
    """The seed of one token's draw. It depends only on the request's seed and the token's index,
    so a request samples the same tokens whatever shares its batch, on whichever worker, and after
    being recomputed."""
    return (seed * _SEED_STRIDE + output_index) % (2**63 - 1)


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p on one row of logits. Returns new logits `[vocab]`."""
    logits = logits.float() / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the tokens ranked before it already cover top_p; the first always stays
        drop = probs.cumsum(-1) - probs >= params.top_p
        logits = logits.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    return logits


def sample(logits: torch.Tensor, params: list[SamplingParams], output_indices: list[int]) -> list[int]:
    """One token per row of `logits [M, vocab]`; greedy rows in one argmax, others one draw each."""
    tokens = logits.argmax(dim=-1).tolist()
    for i, (p, index) in enumerate(zip(params, output_indices, strict=True)):
        if p.greedy:
            continue
        probs = filter_logits(logits[i], p).softmax(-1)  # [vocab]
        generator = torch.Generator(device=logits.device).manual_seed(draw_seed(p.seed, index))
        tokens[i] = int(torch.multinomial(probs, 1, generator=generator))
    return tokens
