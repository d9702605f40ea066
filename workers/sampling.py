"""Token sampling: logit processing (bias, min_tokens, penalties, grammar), then greedy or a seeded
draw."""

from __future__ import annotations

import torch

from scheduler.request import SamplingParams, TokenLogprob
from workers.request_state import RequestState

_SEED_STRIDE = 1_000_003  # a prime, so (seed, index) pairs of nearby requests do not collide


def draw_seed(seed: int, output_index: int) -> int:
    """The seed of one token's draw. It depends only on the request's seed and the token's index,
    so a request samples the same tokens whatever shares its batch, on whichever worker, and after
    being recomputed."""
    return (seed * _SEED_STRIDE + output_index) % (2**63 - 1)


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then min-p, top-k and top-p on one row of logits. Returns new logits
    `[vocab]`."""
    logits = logits.float() / params.temperature
    if params.min_p > 0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
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


def process_logits(
    logits: torch.Tensor, params: SamplingParams, output_index: int, state: RequestState | None
) -> torch.Tensor:
    """A new float row: logit_bias added; repetition, frequency and presence penalties (vLLM's
    definitions); every token the request's grammar forbids masked; then the stop ids masked while
    under min_tokens, unless nothing else is left (a complete JSON reply allows only EOS: the
    grammar wins)."""
    row = logits.float().clone()
    if params.logit_bias:
        ids, biases = zip(*params.logit_bias, strict=True)
        in_vocab = [i for i, t in enumerate(ids) if t < row.shape[-1]]
        # the option tensors go where the logits are (a GPU's): no host tensor meets a device one
        index = torch.tensor([ids[i] for i in in_vocab], dtype=torch.long, device=row.device)
        row[index] += torch.tensor([biases[i] for i in in_vocab], device=row.device)
    if state is not None:
        state.penalize(row, params)
        if state.matcher is not None:
            state.matcher.mask_logits(row)
    if output_index < params.min_tokens and params.suppress_ids:
        suppressed = torch.tensor(
            sorted(t for t in params.suppress_ids if t < row.shape[-1]),
            dtype=torch.long,
            device=row.device,
        )
        masked = row.index_fill(0, suppressed, float("-inf"))
        # chosen on the device: no host sync per row
        row = torch.where(torch.isfinite(masked).any(), masked, row)
    return row


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    output_indices: list[int],
    states: list[RequestState | None] | None = None,
) -> list[int]:
    """One token per row of `logits [M, vocab]`: rows with nothing to process or draw in one argmax,
    the others each processed (`process_logits`) and then argmax (greedy) or one seeded draw."""
    # max's indices are argmax's (the first of equal maxima) in a third of its time on a CPU
    tokens = logits.max(dim=-1).indices.tolist()
    for i, (p, index) in enumerate(zip(params, output_indices, strict=True)):
        if p.greedy and not p.processes_logits:
            continue
        row = (
            process_logits(logits[i], p, index, states[i] if states else None)
            if p.processes_logits
            else logits[i]
        )
        if p.greedy:
            tokens[i] = int(row.argmax())
            continue
        probs = filter_logits(row, p).softmax(-1)  # [vocab]
        generator = torch.Generator(device=logits.device).manual_seed(draw_seed(p.seed, index))
        tokens[i] = int(torch.multinomial(probs, 1, generator=generator))
    return tokens


def token_logprobs(
    logits: torch.Tensor, token_ids: list[int], num_top: list[int]
) -> list[TokenLogprob]:
    """The model's own log-probabilities (before any processing) of `token_ids`, one per row of
    `logits [M, vocab]`, each with the `num_top[i]` most likely tokens of its row."""
    if not token_ids:
        return []
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(
        1, torch.tensor(token_ids, dtype=torch.long, device=logits.device)[:, None]
    )[:, 0]
    k = max(num_top)
    top_values, top_ids = (
        logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long())
    )
    chosen_list = chosen.tolist()
    values = top_values.tolist()
    ids = top_ids.tolist()
    return [
        TokenLogprob(token, chosen_list[i], tuple(zip(ids[i][:n], values[i][:n], strict=True)))
        for i, (token, n) in enumerate(zip(token_ids, num_top, strict=True))
    ]
