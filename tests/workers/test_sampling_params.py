"""Log-probs, echo log-probs, penalties, logit_bias and min_tokens against plain references on
transformers."""

import math

import pytest
import torch

from scheduler.request import Request, SamplingParams
from tests.factories import VOCAB, prompt_ids, tiny_hf_model
from tests.workers import sampling_reference
from tests.workers.engines import make_engine
from tests.workers.sampling_cases import EOS, processed_requests, request
from workers.sampling import sample


def hf_logprobs(tokens: list[int]) -> torch.Tensor:
    """transformers' log_softmax at every position of `tokens` [len, vocab], in float64."""
    with torch.no_grad():
        logits = tiny_hf_model("llama")(torch.tensor([tokens])).logits[0]
    return torch.log_softmax(logits.double(), dim=-1)


def test_logprobs_and_echo_logprobs_equal_transformers():
    """Batched with plain requests, chunked (chunk 8 < prompt): every output token's log-prob and
    top alternatives, and every prompt token's after the first, equal transformers' log_softmax."""
    asks = [
        request("a", 21, 9, 1, logprobs=3, prompt_logprobs=2),
        request("b", 5, 12, 2, logprobs=0),
        request("c", 30, 6, 3),
        request("d", 13, 7, 4, prompt_logprobs=0),
        request("e", 17, 8, 5, temperature=0.9, seed=7, logprobs=5),
    ]
    results = make_engine(num_slots=3).run(asks)
    for req in asks:
        done = results[req.req_id]
        lp = hf_logprobs(done.prompt_ids + done.output_ids)
        n = len(done.prompt_ids)
        if req.sampling.logprobs is None:
            assert done.logprobs == []
        else:
            assert [t.token_id for t in done.logprobs] == done.output_ids
            for i, token in enumerate(done.logprobs):
                row = lp[n - 1 + i]
                assert token.logprob == pytest.approx(row[token.token_id].item(), abs=1e-4)
                top = row.topk(req.sampling.logprobs)
                assert [t for t, _ in token.top] == top.indices.tolist()
                assert [v for _, v in token.top] == pytest.approx(top.values.tolist(), abs=1e-4)
        if req.sampling.prompt_logprobs is None:
            assert done.prompt_logprobs == []
            continue
        assert [t.token_id for t in done.prompt_logprobs] == done.prompt_ids[1:]
        # prompt token i + 1, predicted at position i
        for i, token in enumerate(done.prompt_logprobs):
            assert token.logprob == pytest.approx(lp[i, token.token_id].item(), abs=1e-4)
            assert [t for t, _ in token.top] == lp[i].topk(
                req.sampling.prompt_logprobs
            ).indices.tolist()


def reference_tokens(req: Request) -> list[int]:
    """One token at a time on transformers' logits, processed in plain Python floats: logit_bias,
    stop ids masked under min_tokens, repetition / frequency / presence penalties; then argmax, or
    the seeded draw's definition."""
    p, prompt, out = req.sampling, list(req.prompt_ids), []
    while len(out) < req.max_tokens:
        with torch.no_grad():
            row = tiny_hf_model("llama")(torch.tensor([prompt + out])).logits[0, -1].tolist()
        for token, bias in p.logit_bias:
            row[token] += bias
        if len(out) < p.min_tokens:
            for token in p.suppress_ids:
                row[token] = -math.inf
        if p.repetition_penalty != 1.0:
            for token in set(prompt) | set(out):
                row[token] = (
                    row[token] / p.repetition_penalty
                    if row[token] > 0
                    else row[token] * p.repetition_penalty
                )
        for token in set(out):
            row[token] -= p.frequency_penalty * out.count(token) + p.presence_penalty
        if p.greedy:
            token = max(range(len(row)), key=row.__getitem__)
        else:
            token = sampling_reference.draw(torch.tensor(row), p, len(out))
        out.append(token)
        if token in req.stop_token_ids:
            break
    return out


@pytest.mark.parametrize("preempt", [False, True], ids=["batched", "preempted"])
def test_penalties_bias_and_min_tokens_equal_a_plain_reference(preempt):
    """Batched together (and, on two slots with more urgent requests arriving mid-output, preempted
    and recomputed): each request's tokens equal the one-at-a-time reference."""
    engine = make_engine(num_slots=2 if preempt else 3)
    requests = processed_requests()
    late = requests[4:] if preempt else []
    for r in requests[:4] if preempt else requests:
        r.priority = 1 if preempt else 0
        engine.submit(r)
    finished = set()
    for step in range(10_000):
        if step == 8:
            for r in late:
                engine.submit(r)
        finished |= {out.req_id for out in engine.step() if out.finished}
        if engine.idle and step > 8:
            break
    assert finished == {r.req_id for r in requests}
    for req in processed_requests():
        got = next(r for r in requests if r.req_id == req.req_id)
        assert got.output_ids == reference_tokens(req), req.req_id
    # min_tokens=6, then EOS
    assert requests[5].output_ids[-1] == EOS and len(requests[5].output_ids) == 7
    echo = requests[0]  # its prompt log-probs arrive once, whole, however often it was recomputed
    lp = hf_logprobs(echo.prompt_ids + echo.output_ids)
    assert [t.logprob for t in echo.prompt_logprobs] == pytest.approx(
        [lp[i, t].item() for i, t in enumerate(echo.prompt_ids[1:])], abs=1e-4
    )
    assert [t.logprob for t in echo.logprobs] == pytest.approx(
        [lp[len(echo.prompt_ids) - 1 + i, t].item() for i, t in enumerate(echo.output_ids)],
        abs=1e-4,
    )
    if preempt:
        assert echo.num_preemptions > 0
    # the next plan carries what left: the worker drops its states
    engine.run([request("after", 4, 2, 19)])
    assert engine.runner.states.states == {}
    assert set(engine.runner.states.params) == {"after"}  # its own release rides on the next plan


@pytest.mark.parametrize("prompt_len", [1, 2, 29])
def test_n_choices_share_one_prefill_and_equal_separate_requests(prompt_len):
    """Choice i (fork_of choice 0, seed + i) equals a request of its own with that seed; the prompt
    is computed once: each later choice copies its sibling's KV and computes only the last prompt
    token. min_tokens keeps choice 0 running while the others fork from it, whatever its seed
    draws first."""

    def choices(n: int, seed: int) -> list[Request]:
        prompt = prompt_ids(prompt_len, 21)
        return [
            Request(
                req_id=f"x-{i}",
                prompt_ids=prompt,
                max_tokens=9,
                stop_token_ids=frozenset({EOS}),
                sampling=SamplingParams(
                    temperature=0.9,
                    seed=seed + i,
                    presence_penalty=0.5,
                    logprobs=1,
                    min_tokens=3,
                    suppress_ids=frozenset({EOS}),
                ),
                fork_of="x-0" if i else None,
            )
            for i in range(n)
        ]

    engine = make_engine(num_slots=4)
    plans = []
    execute = engine.runner.execute
    engine.runner.execute = lambda plan: plans.append(plan) or execute(plan)
    forked = engine.run(choices(3, 40) + [request("other", 11, 6, 22)])
    computed = sum(c.num_tokens for p in plans for c in p.prefill if c.req_id.startswith("x-"))
    copies = [copy for p in plans for copy in p.copies]
    if prompt_len > 1:
        # one prompt, then one token per later choice
        assert computed == prompt_len + 2 and len(copies) == 2
    for i, expected in enumerate(choices(3, 40)):
        alone = make_engine(num_slots=1).run(
            [
                Request(
                    req_id="solo",
                    prompt_ids=expected.prompt_ids,
                    max_tokens=9,
                    stop_token_ids=frozenset({EOS}),
                    sampling=expected.sampling,
                )
            ]
        )
        assert forked[f"x-{i}"].output_ids == alone["solo"].output_ids
        assert [t.logprob for t in forked[f"x-{i}"].logprobs] == pytest.approx(
            [t.logprob for t in alone["solo"].logprobs], abs=1e-5
        )
    assert len({tuple(forked[f"x-{i}"].output_ids) for i in range(3)}) > 1  # the seeds differ


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_rows_take_the_first_of_equal_maxima(dtype):
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(0)).to(dtype)
    top = [(3, 40), (0, VOCAB - 1), (7, 8), (VOCAB - 2, VOCAB - 1), (11, 12)]
    for row, columns in enumerate(top):
        logits[row, list(columns)] = 100.0  # a tie between two tokens
    tokens = sample(logits, [SamplingParams()] * 5, [0] * 5)
    assert tokens == [first for first, _ in top] == logits.float().argmax(dim=-1).tolist()
