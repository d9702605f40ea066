"""The sampler's definition one row at a time, in plain code: what `workers.sampling`'s batched
sampler must give, token for token."""

import torch

from scheduler.request import SamplingParams
from workers.request_state import RequestState
from workers.sampling import draw_key

_MASK32 = 0xFFFFFFFF


def processed(
    logits: torch.Tensor, params: SamplingParams, output_index: int, state: RequestState | None
) -> torch.Tensor:
    """A new float row `[vocab]`: logit_bias added (ids past the vocabulary ignored); repetition
    penalty over prompt and output tokens (a positive logit divided, a negative one multiplied),
    then frequency (per occurrence) and presence (once) penalties over output tokens; every token
    the grammar forbids masked; the stop ids masked while under min_tokens unless nothing else
    is left."""
    row = logits.float().clone()
    vocab = row.shape[-1]
    for token, bias in params.logit_bias:
        if token < vocab:
            row[token] += torch.tensor(bias, dtype=torch.float32)
    if state is not None:
        if params.repetition_penalty != 1.0:
            penalty = torch.tensor(params.repetition_penalty, dtype=torch.float32)
            for token in state.prompt_ids | state.counts.keys():
                if token < vocab:
                    value = row[token]
                    row[token] = value / penalty if value > 0 else value * penalty
        if params.frequency_penalty or params.presence_penalty:
            frequency = torch.tensor(params.frequency_penalty, dtype=torch.float32)
            presence = torch.tensor(params.presence_penalty, dtype=torch.float32)
            for token, count in state.counts.items():
                if token < vocab:
                    row[token] -= frequency * float(count) + presence
        if state.matcher is not None:
            state.matcher.mask_logits(row)
    if output_index < params.min_tokens:
        masked = row.clone()
        for token in params.suppress_ids:
            if token < vocab:
                masked[token] = float("-inf")
        if torch.isfinite(masked).any():
            row = masked
    return row


def filtered(row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then min-p, top-k and top-p on one processed row. Returns new logits
    `[vocab]`."""
    logits = row / torch.tensor(params.temperature, dtype=torch.float32)
    if params.min_p > 0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        # ties ranked by token id
        sorted_logits, order = torch.sort(logits, descending=True, stable=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the tokens ranked before it already cover top_p; the first always stays
        drop = probs.cumsum(-1) - probs >= params.top_p
        logits = logits.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    return logits


def uniforms(seed: int, output_index: int, vocab: int) -> list[float]:
    """u(seed, index, v) for every vocab id v, in Python's integers: two rounds of
    xor-a-key-word, multiply, fold the high 32 bits onto the low ones; the top 23 bits of the
    result make an odd multiple of 2**-24."""
    low, high = draw_key(seed, output_index)
    out = []
    for v in range(vocab):
        x = (v ^ low) * 0x7FEB352D
        x = (x ^ (x >> 32)) & _MASK32
        x = (x ^ high) * 0x5BD1E995
        x = (x ^ (x >> 32)) & _MASK32
        out.append(((x >> 8) | 1) / 2**24)
    return out


def noise(seed: int, output_index: int, vocab: int) -> torch.Tensor:
    """Gumbel noise `[vocab]`: -log(-log u) of `uniforms`, in float32."""
    u = torch.tensor(uniforms(seed, output_index, vocab), dtype=torch.float32)
    return u.log().neg().log().neg()


def draw(row: torch.Tensor, params: SamplingParams, output_index: int) -> int:
    """The seeded draw from a processed row: the Gumbel-max race of its filtered logits."""
    race = filtered(row, params) + noise(params.seed, output_index, row.shape[-1])
    return int(race.max(-1).indices)


def token(
    logits: torch.Tensor, params: SamplingParams, output_index: int, state: RequestState | None
) -> int:
    """One row's token: processed, then the first argmax (greedy) or the seeded draw."""
    row = processed(logits, params, output_index, state)
    if params.greedy:
        return int(row.max(-1).indices)
    return draw(row, params, output_index)
