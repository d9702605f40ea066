"""The batched sampler against its one-row definition (`sampling_reference`): every option in one
batch of mixed options, a row's token whatever shares its batch, the seeded draw's
frequencies."""

import math

import pytest
import torch

from scheduler.request import SamplingParams
from tests.factories import VOCAB
from tests.workers import sampling_reference as reference
from workers.request_state import RequestState
from workers.sampling import draw_key, gumbel_noise, sample, sample_on_device

STOP = VOCAB - 1


class AllowOnly:
    """A grammar that allows only `allowed` next (in place of workers.grammar's matcher)."""

    ended = False

    def __init__(self, allowed: set[int]) -> None:
        self.allowed = allowed

    def mask_logits(self, row: torch.Tensor) -> None:
        banned = torch.ones_like(row, dtype=torch.bool)
        banned[sorted(self.allowed)] = False
        row.masked_fill_(banned, float("-inf"))

    def accept(self, token_id: int) -> None:
        pass


def state(params: SamplingParams, output_ids=(), matcher=None) -> RequestState:
    return RequestState(params, tuple(range(40, 60)), tuple(output_ids), matcher)


def mixed_rows() -> list[tuple[SamplingParams, int, RequestState | None]]:
    """(params, output index, state) of rows asking for every option, greedy and seeded."""
    stops = frozenset({STOP, STOP - 1})
    penalized = SamplingParams(repetition_penalty=1.3, frequency_penalty=0.7, presence_penalty=0.4)
    penalized_drawn = SamplingParams(
        temperature=0.9, seed=6, repetition_penalty=0.8, frequency_penalty=-0.5, presence_penalty=1
    )
    min_tokens = SamplingParams(min_tokens=4, suppress_ids=stops, logit_bias=((STOP, 30.0),))
    grammar = SamplingParams(temperature=0.7, seed=8, structured="{}")
    # a grammar that allows only a stop id wins over min_tokens
    grammar_ends = SamplingParams(structured="{}", min_tokens=5, suppress_ids=stops)
    return [
        (SamplingParams(), 0, None),
        # an id past the vocabulary is ignored
        (SamplingParams(logit_bias=((5, 4.0), (VOCAB + 3, 50.0))), 2, None),
        (SamplingParams(temperature=0.8, seed=1), 0, None),
        (SamplingParams(temperature=1.3, seed=2, top_k=7), 5, None),
        (SamplingParams(temperature=0.6, seed=3, top_p=0.7), 9, None),
        (SamplingParams(temperature=1.0, seed=4, min_p=0.1), 1, None),
        (SamplingParams(temperature=1.5, seed=5, top_k=40, top_p=0.9, min_p=0.02), 3, None),
        (SamplingParams(temperature=2.0, seed=5, logit_bias=((7, 2.0),)), 4, None),
        (penalized, 4, state(penalized, (41, 41, 3, 7, 7, 7))),
        (penalized_drawn, 6, state(penalized_drawn, (41, 2, 2, 9, 9, 50))),
        (min_tokens, 2, None),
        (min_tokens, 4, None),
        (grammar, 0, state(grammar, (), AllowOnly({10, 11, 12}))),
        (grammar_ends, 1, state(grammar_ends, (3,), AllowOnly({STOP}))),
        (SamplingParams(temperature=1.0, seed=2**40 + 7, top_k=VOCAB), 123_456, None),
        (SamplingParams(temperature=0.5, seed=0, top_k=1, top_p=0.01), 7, None),
    ]


def random_logits(num_rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def sample_rows(logits: torch.Tensor, rows) -> list[int]:
    params, indices, states = zip(*rows, strict=True)
    return sample(logits, list(params), list(indices), list(states))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_batch_of_mixed_options_gives_each_rows_reference_token(dtype):
    rows = mixed_rows()
    logits = random_logits(len(rows)).to(dtype)
    tokens = sample_rows(logits, rows)
    expected = [reference.token(logits[i], *row) for i, row in enumerate(rows)]
    assert tokens == expected
    assert tokens[10] not in {STOP, STOP - 1}  # under min_tokens
    assert tokens[11] == STOP  # past it, the bias wins
    assert tokens[12] in {10, 11, 12}
    assert tokens[13] == STOP
    drawn = [i for i, (p, _, _) in enumerate(rows) if not p.greedy]
    argmax = logits.float().argmax(-1).tolist()
    assert any(tokens[i] != argmax[i] for i in drawn)  # the draws are not all the argmax


def test_a_rows_token_does_not_depend_on_what_shares_its_batch():
    rows = mixed_rows()
    logits = random_logits(len(rows), seed=1)
    tokens = sample_rows(logits, rows)
    order = list(range(len(rows)))[::-1]
    assert sample_rows(logits[order], [rows[i] for i in order]) == [tokens[i] for i in order]
    odd = order[::2]
    assert sample_rows(logits[odd], [rows[i] for i in odd]) == [tokens[i] for i in odd]
    for i, row in enumerate(rows):
        assert sample_rows(logits[i : i + 1], [row]) == [tokens[i]]


def test_the_noise_is_the_hash_of_seed_index_and_token_id():
    """int64 tensor ops give exactly the hash in Python's integers, key words past 2**31 too."""
    draws = [(0, 0), (1, 0), (0, 1), (2**40 + 7, 123_456), (2**62, 2**20), (5, 3)]
    keys = torch.tensor([draw_key(seed, index) for seed, index in draws])
    assert (keys >= 2**31).any()
    expected = torch.stack([reference.noise(seed, index, VOCAB) for seed, index in draws])
    assert torch.equal(gumbel_noise(keys, VOCAB), expected)


def chi_square_limit(dof: int, z: float) -> float:
    """The chi-square quantile at normal quantile `z` (Wilson-Hilferty: within 1% for dof >= 10)."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.8, seed=0),
        SamplingParams(temperature=1.2, top_k=50, top_p=0.9, min_p=0.01, seed=0),
    ],
    ids=["temperature", "filtered"],
)
@pytest.mark.parametrize("sweep", ["seeds", "indices"])
def test_seeded_draws_follow_the_softmax_of_the_filtered_logits(params, sweep):
    """20,000 draws from one row, over seeds 0.. (index 3) or over output indices 0.. (seed 11):
    Pearson's chi-square of the token counts against softmax(filtered logits), bins expecting
    under 5 merged, stays under its 1 - 1e-6 quantile. The seeds are fixed, so the test is
    deterministic; a sampler that draws from the right distribution fails it with probability
    1e-6 over the choice of seeds, and a biased one (or the same draw repeated) fails it."""
    num_draws = 20_000
    logits = random_logits(1, seed=2).expand(num_draws, VOCAB)
    if sweep == "seeds":
        rows = [SamplingParams(**{**vars(params), "seed": s}) for s in range(num_draws)]
        indices = [3] * num_draws
    else:
        rows = [SamplingParams(**{**vars(params), "seed": 11})] * num_draws
        indices = list(range(num_draws))
    counts = torch.bincount(torch.tensor(sample(logits, rows, indices)), minlength=VOCAB)
    probs = reference.filtered(logits[0], params).softmax(-1).double()
    assert counts[probs == 0].sum() == 0  # never a filtered-out token
    expected = probs * num_draws
    big = expected >= 5
    small = ~big & (probs > 0)
    observed = torch.cat([counts[big].double(), counts[small].sum()[None].double()])
    expected = torch.cat([expected[big], expected[small].sum()[None]])
    if expected[-1] == 0:  # nothing to merge
        observed, expected = observed[:-1], expected[:-1]
    chi_square = float(((observed - expected) ** 2 / expected).sum())
    dof = len(expected) - 1
    assert dof >= 10
    assert chi_square < chi_square_limit(dof, z=4.753), (chi_square, dof)


def test_min_p_keeps_the_tokens_at_least_min_p_times_as_likely_as_the_top_one():
    logits = random_logits(1, seed=3).expand(3000, VOCAB)
    params = [SamplingParams(temperature=0.7, min_p=0.05, seed=s) for s in range(3000)]
    drawn = set(sample(logits, params, [0] * 3000))
    probs = (logits[0] / 0.7).softmax(-1).tolist()
    kept = {t for t, q in enumerate(probs) if q >= 0.05 * max(probs)}
    assert drawn == kept
    assert 1 < len(kept) < VOCAB  # the filter did something, and not everything


def test_every_option_stays_on_the_device_of_the_logits():
    """With logits on a device other than the host (`meta` here, as a GPU's would be), nothing
    mixes devices and nothing is read back: the tokens stay there, for the one copy `sample`
    makes."""
    rows = [row for row in mixed_rows() if row[2] is None or row[2].matcher is None]
    params, indices, states = zip(*rows, strict=True)
    logits = torch.zeros(len(rows), VOCAB, device="meta")
    tokens = sample_on_device(logits, params, indices, states)
    assert tokens.device.type == "meta" and tokens.shape == (len(rows),)
