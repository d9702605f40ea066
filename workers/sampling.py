"""Token sampling for a whole batch in tensor ops on the logits' device: logit processing (bias,
penalties, grammar, min_tokens), then greedy or a seeded draw; the sampled ids come back to the
host once."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from scheduler.request import SamplingParams, TokenLogprob
from workers.request_state import RequestState

_SEED_STRIDE = 1_000_003  # a prime, so (seed, index) pairs of nearby requests do not collide
_MASK32 = 0xFFFFFFFF
_MASK64 = 2**64 - 1
# odd multipliers below 2**31: a 32-bit value times one stays below 2**63, so int64 never overflows
_MIX1 = 0x7FEB352D
_MIX2 = 0x5BD1E995


def draw_seed(seed: int, output_index: int) -> int:
    """The seed of one token's draw. It depends only on the request's seed and the token's index,
    so a request samples the same tokens whatever shares its batch, on whichever worker, and after
    being recomputed."""
    return (seed * _SEED_STRIDE + output_index) % (2**63 - 1)


def draw_key(seed: int, output_index: int) -> tuple[int, int]:
    """Two 32-bit words keying one token's draw: `draw_seed` through splitmix64's finalizer, so
    nearby seeds and indices give unrelated keys."""
    z = draw_seed(seed, output_index)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return z & _MASK32, z >> 32


def _fold(x: torch.Tensor, multiplier: int) -> torch.Tensor:
    """In place on int64 values in [0, 2**32): multiply (exact, below 2**63), then fold the high
    half onto the low one. Every value stays non-negative, so `>>` needs no mask."""
    x.mul_(multiplier)
    return x.bitwise_xor_(x >> 32).bitwise_and_(_MASK32)


def gumbel_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """Gumbel noise `[m, vocab]` float32 for `keys [m, 2]` (`draw_key` words, int64): for every
    vocab id v, a hash of (key, v) gives a uniform u = odd / 2**24 in (0, 1), exact in float32,
    and the noise is -log(-log u). It is elementwise: a row's noise depends on its key alone."""
    ids = torch.arange(vocab, dtype=torch.int64, device=keys.device)  # [vocab]
    x = ids ^ keys[:, :1]  # [m, vocab]
    _fold(x, _MIX1)
    x.bitwise_xor_(keys[:, 1:])
    _fold(x, _MIX2)
    u = x.bitwise_right_shift_(8).bitwise_or_(1).float().mul_(2.0**-24)  # [m, vocab]
    return u.log_().neg_().log_().neg_()


def sample_on_device(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    output_indices: Sequence[int],
    states: Sequence[RequestState | None] | None = None,
) -> torch.Tensor:
    """One token per row of `logits [M, vocab]`, as `[M]` int64 on the logits' device; nothing is
    read back to the host (a grammar's mask is built there, for the rows that have one). Each row
    is processed (logit_bias, penalties, grammar, min_tokens), then takes its argmax (greedy) or
    the race of its filtered logits against its own Gumbel noise: a row's token depends on its
    seed, its output index and its logits only, whatever shares the batch."""
    drawn = [i for i, p in enumerate(params) if not p.greedy]
    if not drawn and not any(p.processes_logits for p in params):
        # max's indices are argmax's (the first of equal maxima) in a third of its time on a CPU
        return logits.max(dim=-1).indices
    rows = logits.to(torch.float32, copy=True)  # [M, vocab]
    _process(rows, params, output_indices, states or [None] * len(params))
    tokens = rows.max(dim=-1).indices  # [M]
    if drawn:
        at = _to_device(drawn, torch.int64, rows.device)  # [m]
        picked = _draw(rows[at], [params[i] for i in drawn], [output_indices[i] for i in drawn])
        tokens.index_copy_(0, at, picked)
    return tokens


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    output_indices: Sequence[int],
    states: Sequence[RequestState | None] | None = None,
) -> list[int]:
    """`sample_on_device`'s tokens on the host."""
    # the one host sync of a step's sampling: every row's token comes back at once
    return sample_on_device(logits, params, output_indices, states).tolist()


def _to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host values as a tensor on `device`. To a GPU through pinned memory, without waiting: a
    copy from pageable memory would wait for the step's forward to finish."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def _process(
    rows: torch.Tensor,
    params: Sequence[SamplingParams],
    output_indices: Sequence[int],
    states: Sequence[RequestState | None],
) -> None:
    """In place on float rows `[M, vocab]`, in `SamplingParams`' order: logit_bias; repetition,
    frequency and presence penalties (vLLM's definitions); every token a grammar forbids masked;
    the stop ids masked while under min_tokens."""
    _add_bias(rows, params)
    _penalize(rows, params, states)
    for i, state in enumerate(states):
        if state is not None and state.matcher is not None:
            state.matcher.mask_logits(rows[i])
    _suppress_stop_ids(rows, params, output_indices)


def _add_bias(rows: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    vocab = rows.shape[-1]
    # ids past the vocabulary (a tokenizer's added tokens the model has no logits for) are ignored
    biased = [(i, t, b) for i, p in enumerate(params) for t, b in p.logit_bias if t < vocab]
    if not biased:
        return
    at = _to_device([(i, t) for i, t, _ in biased], torch.int64, rows.device)  # [n, 2]
    bias = _to_device([b for _, _, b in biased], torch.float32, rows.device)  # [n]
    rows.index_put_((at[:, 0], at[:, 1]), bias, accumulate=True)


def _penalize(
    rows: torch.Tensor, params: Sequence[SamplingParams], states: Sequence[RequestState | None]
) -> None:
    """Repetition penalty over prompt and output tokens (a positive logit divided, a negative one
    multiplied), then frequency (per occurrence) and presence (once) penalties over output
    tokens: (row, token) pairs gathered from every state, applied in one indexed op each."""
    vocab = rows.shape[-1]
    seen: list[tuple[int, int]] = []
    counted: list[tuple[int, int, int]] = []
    for i, (p, state) in enumerate(zip(params, states, strict=True)):
        if state is None:
            continue
        if p.repetition_penalty != 1.0:
            seen += [(i, t) for t in state.prompt_ids | state.counts.keys() if t < vocab]
        if p.frequency_penalty or p.presence_penalty:
            counted += [(i, t, c) for t, c in state.counts.items() if t < vocab]
    if not seen and not counted:
        return
    penalties = [(p.repetition_penalty, p.frequency_penalty, p.presence_penalty) for p in params]
    penalties = _to_device(penalties, torch.float32, rows.device)  # [M, 3]
    if seen:
        at = _to_device(seen, torch.int64, rows.device)  # [n, 2]
        where = (at[:, 0], at[:, 1])
        penalty = penalties[at[:, 0], 0]  # [n]
        values = rows[where]
        rows[where] = torch.where(values > 0, values / penalty, values * penalty)
    if counted:
        at = _to_device(counted, torch.int64, rows.device)  # [n, 3]
        counts = at[:, 2].float()
        frequency = penalties[at[:, 0], 1]  # [n]
        presence = penalties[at[:, 0], 2]
        rows.index_put_((at[:, 0], at[:, 1]), -(frequency * counts + presence), accumulate=True)


def _suppress_stop_ids(
    rows: torch.Tensor, params: Sequence[SamplingParams], output_indices: Sequence[int]
) -> None:
    """The stop ids masked while under min_tokens, unless nothing else is left (a complete JSON
    reply allows only EOS: the grammar wins). The choice is made on the device."""
    vocab = rows.shape[-1]
    under = [
        i
        for i, (p, index) in enumerate(zip(params, output_indices, strict=True))
        if index < p.min_tokens and p.suppress_ids
    ]
    suppressed = [(j, t) for j, i in enumerate(under) for t in params[i].suppress_ids if t < vocab]
    if not suppressed:
        return
    at = _to_device(under, torch.int64, rows.device)  # [m]
    pairs = _to_device(suppressed, torch.int64, rows.device)  # [n, 2]
    part = rows[at]  # [m, vocab]
    minus_inf = torch.full((), float("-inf"), device=rows.device)  # a fill: no copy from the host
    masked = part.index_put((pairs[:, 0], pairs[:, 1]), minus_inf)
    rows[at] = torch.where(torch.isfinite(masked).any(-1, keepdim=True), masked, part)


def _draw(
    rows: torch.Tensor, params: Sequence[SamplingParams], output_indices: Sequence[int]
) -> torch.Tensor:
    """The tokens `[m]` of processed float rows `[m, vocab]` (changed in place): temperature,
    min-p, top-k and top-p, then the argmax of the filtered logits plus each row's Gumbel noise
    (the Gumbel-max race: exactly a draw from their softmax)."""
    vocab = rows.shape[-1]
    device = rows.device
    # top-k off is k = vocab; top-p off is p = inf (no cumulative sum reaches it)
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    options = [(p.temperature, p.min_p, p.top_p if p.top_p < 1 else float("inf")) for p in params]
    options = _to_device(options, torch.float32, device)  # [m, 3]
    keys = [draw_key(p.seed, index) for p, index in zip(params, output_indices, strict=True)]
    ints = _to_device([(k, *key) for k, key in zip(top_k, keys, strict=True)], torch.int64, device)
    rows.div_(options[:, :1])
    with_min_p = [j for j, p in enumerate(params) if p.min_p > 0]
    if with_min_p:
        at = _to_device(with_min_p, torch.int64, device)
        part = rows[at]  # [m', vocab]
        probs = part.softmax(-1)
        floor = options[at, 1:2] * probs.max(-1, keepdim=True).values  # [m', 1]
        rows[at] = part.masked_fill_(probs < floor, float("-inf"))
    sorted_rows = [j for j, p in enumerate(params) if top_k[j] < vocab or p.top_p < 1]
    if sorted_rows:
        at = _to_device(sorted_rows, torch.int64, device)
        top_p = any(params[j].top_p < 1 for j in sorted_rows)
        rows[at] = _top_k_top_p(rows[at], ints[at, 0], options[at, 2:3], top_p)
    return rows.add_(gumbel_noise(ints[:, 1:], vocab)).max(dim=-1).indices


def _top_k_top_p(
    rows: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, any_top_p: bool
) -> torch.Tensor:
    """Top-k (`top_k [m]`, the kth largest and its equals kept), then top-p (`top_p [m, 1]`: a
    token dropped when those ranked before it already cover top_p; the first always stays) on
    `rows [m, vocab]`, with one stable sort: top-k masks a suffix of it, so it stays sorted."""
    values, order = rows.sort(dim=-1, descending=True, stable=True)  # [m, vocab]
    kth = values.gather(1, top_k[:, None] - 1)  # [m, 1]
    values.masked_fill_(values < kth, float("-inf"))
    if any_top_p:
        probs = values.softmax(-1)
        values.masked_fill_(probs.cumsum(-1) - probs >= top_p, float("-inf"))
    return rows.scatter_(1, order, values)


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
