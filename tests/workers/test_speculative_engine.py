"""Speculative decoding on a real (tiny) model in the in-process engine, with n-gram proposals and
with a draft model's: the tokens, log-probs and finish reasons of speculation off, greedy and
seeded, with penalties, stops and max_tokens inside accepted runs, preemption, prefix caching and
n > 1; drafts verified and accepted along the way, and no block a rejected draft touched left held
or cached."""

import pytest
import torch

from scheduler.block_pool import BLOCK_SIZE
from scheduler.request import Request, SamplingParams
from scheduler.speculation import SpeculativeConfig
from tests.factories import VOCAB, local_engine, make_requests, prompt_ids, tiny_model

NGRAM = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)
DRAFT = SpeculativeConfig(method="draft_model", model="(in the test)", num_speculative_tokens=4)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def requests(sampling=None, stop=frozenset(), max_tokens=(60, 13, 90, 7, 45, 120)) -> list:
    """Random prompts, and prompts that repeat themselves (their continuation is proposed)."""
    out = make_requests(4, [5, 31, 12, 47], list(max_tokens), sampling, stop)
    for i in range(2):
        pattern = prompt_ids(6 + i, seed=40 + i)
        out.append(
            Request(f"rep{i}", pattern * 5, max_tokens[4 + i], sampling or SamplingParams(), stop)
        )
    return out


@pytest.fixture(scope="module")
def drafts():
    """Draft models of the test model's vocabulary: the model itself (every greedy draft right
    while its KV is), the model with its weights perturbed (about half right) and a model of
    another architecture (almost none right)."""
    perturbed = tiny_model("llama")
    noise = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in perturbed.parameters():
            p.add_(torch.randn(p.shape, generator=noise) * 0.02 * p.float().std())
    return {"itself": tiny_model("llama"), "perturbed": perturbed, "other": tiny_model("qwen2")}


def run(model, speculative, reqs, draft=None, **engine):
    """The engine, each request's (tokens, finish reason), and its log-probs as numbers."""
    args = dict(num_slots=4, capacity=400, token_budget=64, prefill_chunk=32) | engine
    eng = local_engine(model, speculative=speculative, draft_model=draft, **args)
    done = eng.run(reqs)
    tokens = {r: (tuple(q.output_ids), q.finish_reason) for r, q in done.items()}
    return eng, tokens, {r: logprob_values(q.logprobs) for r, q in done.items()}


def logprob_values(logprobs) -> list[tuple]:
    return [(lp.token_id, lp.logprob, *(t for pair in lp.top for t in pair)) for lp in logprobs]


def assert_logprobs_close(on: dict, off: dict) -> None:
    """Each log-prob within 1e-4 of speculation off's: a chunk with drafts computes its rows as
    a prompt chunk does, whose fp32 sums go in another order than a decode row's (measured: a
    few 1e-6 apart); the tokens and their order are the same."""
    assert on.keys() == off.keys()
    for req_id in on:
        assert len(on[req_id]) == len(off[req_id])
        for a, b in zip(on[req_id], off[req_id], strict=True):
            assert a[0] == b[0] and a[2::2] == b[2::2]  # sampled and top token ids
            assert max(abs(x - y) for x, y in zip(a[1::2], b[1::2], strict=True)) < 1e-4


def check_blocks_back(eng) -> None:
    """Every block free (or cached, whole and named) once everything finished."""
    pool = eng.scheduler.blocks
    assert eng.scheduler.idle and pool.num_free == pool.num_blocks


@pytest.mark.parametrize(
    "sampling",
    [
        None,
        SamplingParams(temperature=0.9, seed=11, logprobs=2),
        SamplingParams(repetition_penalty=1.3, presence_penalty=0.5),
        SamplingParams(temperature=1.0, top_k=20, seed=3, min_tokens=5),
    ],
    ids=["greedy", "seeded", "penalties", "top-k"],
)
def test_outputs_equal_speculation_off(model, sampling):
    """A sampled token depends only on its logits, the request's state before it and (seeded) its
    output index: taking drafts while they equal the samples gives decoding's tokens exactly."""
    _, off, off_logprobs = run(model, None, requests(sampling))
    eng, on, on_logprobs = run(model, NGRAM, requests(sampling))
    assert on == off
    assert_logprobs_close(on_logprobs, off_logprobs)
    stats = eng.scheduler.spec_stats.as_dict()
    assert stats["num_drafts"] > 0  # (random samples rarely repeat: acceptance below)
    check_blocks_back(eng)


def test_greedy_drafts_are_both_accepted_and_rejected(model):
    """Both outcomes of a verification occur on these requests (so the tests above cover both):
    drafts taken, and drafts refused with their positions given back."""
    eng, _, _ = run(model, NGRAM, requests())
    stats = eng.scheduler.spec_stats.as_dict()
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]
    assert stats["accepted_per_position"][0] == max(stats["accepted_per_position"])


def test_stops_and_max_tokens_inside_accepted_runs(model):
    """Every token of the off run a stop token in turn (a stop inside a run of drafts ends the
    request there), and max_tokens of every length up to a few drafts past the prompt."""
    _, off, _ = run(model, None, requests())
    outputs = off["rep0"][0]
    for stop in sorted(set(outputs[1:8]))[:4]:
        stops = frozenset({stop})
        assert (
            run(model, NGRAM, requests(stop=stops))[1] == run(model, None, requests(stop=stops))[1]
        )
    lengths = (1, 2, 3, 5, 6, 9)
    assert (
        run(model, NGRAM, requests(max_tokens=lengths))[1]
        == run(model, None, requests(max_tokens=lengths))[1]
    )


def test_preemption_and_prefix_caching_keep_the_tokens(model):
    """Blocks run short (requests are preempted and recompute), and with prefix caching a
    conversation's next turn reuses the blocks of the first: a rejected draft's KV never enters
    a cached block, or the second turn's tokens would differ."""
    few = dict(capacity=200, num_blocks=14, prefix_caching=True)
    eng, on, _ = run(model, NGRAM, requests(), **few)
    _, off, _ = run(model, None, requests(), **few)
    assert on == off and eng.scheduler.num_preemptions > 0
    check_blocks_back(eng)
    first = requests()[4]
    turn = first.prompt_ids + list(on["rep0"][0]) + prompt_ids(5, seed=9)
    second = [Request("turn2", turn, 40, SamplingParams())]
    eng = local_engine(model, 4, 400, prefix_caching=True, speculative=NGRAM)
    eng.run(requests()[4:5])
    again = eng.run(second)["turn2"].output_ids
    assert eng.scheduler.blocks.hit_tokens >= BLOCK_SIZE  # the first turn's blocks were reused
    plain = local_engine(model, 4, 400)
    assert again == plain.run([Request("turn2", turn, 40, SamplingParams())])["turn2"].output_ids
    assert VOCAB > max(again)


@pytest.mark.parametrize(
    ("sampling", "draft"),
    [
        (None, "itself"),
        (None, "perturbed"),
        (None, "other"),
        (SamplingParams(temperature=0.9, seed=11, logprobs=2), "perturbed"),
        (SamplingParams(repetition_penalty=1.3, presence_penalty=0.5), "perturbed"),
    ],
    ids=["greedy-itself", "greedy-perturbed", "greedy-other", "seeded", "penalties"],
)
def test_draft_model_outputs_equal_speculation_off(model, drafts, sampling, draft):
    """The draft model's greedy proposals are verified as n-gram ones are: the same tokens and
    log-probs as decoding one at a time, however good the draft model is."""
    _, off, off_logprobs = run(model, None, requests(sampling))
    eng, on, on_logprobs = run(model, DRAFT, requests(sampling), drafts[draft])
    assert on == off
    assert_logprobs_close(on_logprobs, off_logprobs)
    stats = eng.scheduler.spec_stats.as_dict()
    assert stats["num_drafts"] > 0
    if sampling is None:
        rate = stats["acceptance_rate"]
        assert {"itself": rate == 1.0, "perturbed": 0.3 < rate < 0.8, "other": rate < 0.1}[draft]
    check_blocks_back(eng)


def test_a_draft_models_kv_follows_preemption_prefix_hits_and_forks(model, drafts):
    """The draft model keeps KV of its own in the request's blocks, for the positions it has read:
    after a preemption (recompute), a prefix-cache hit (blocks computed by another request) and
    a fork (a choice copying its sibling's prompt), it reads what it has not seen first. Drafting
    with the model itself shows it: a draft is wrong only where the draft model's KV is."""
    few = dict(capacity=200, num_blocks=14, prefix_caching=True)
    eng, on, _ = run(model, DRAFT, requests(), drafts["itself"], **few)
    assert on == run(model, None, requests(), **few)[1]
    assert eng.scheduler.num_preemptions > 0 and eng.scheduler.blocks.hit_tokens > 0
    assert eng.scheduler.spec_stats.as_dict()["acceptance_rate"] == 1.0
    check_blocks_back(eng)

    def choices(sampling):
        prompt = prompt_ids(29, 21)
        return [
            Request(f"x-{i}", prompt, 30, sampling(i), fork_of="x-0" if i else None)
            for i in range(3)
        ]

    greedy = choices(lambda i: SamplingParams())
    eng, on, _ = run(model, DRAFT, greedy, drafts["itself"])
    assert on == run(model, None, choices(lambda i: SamplingParams()))[1]
    assert eng.scheduler.spec_stats.as_dict()["acceptance_rate"] == 1.0
    seeded = choices(lambda i: SamplingParams(temperature=0.8, seed=7 + i))
    _, on, _ = run(model, DRAFT, seeded, drafts["perturbed"])
    assert on == run(model, None, choices(lambda i: SamplingParams(temperature=0.8, seed=7 + i)))[1]
    assert len({tokens for tokens, _ in on.values()}) > 1  # the seeds differ


def test_stops_and_max_tokens_inside_a_draft_models_accepted_runs(model, drafts):
    """With every draft right, each stop and max_tokens falls inside an accepted run."""
    _, off, _ = run(model, None, requests())
    for stop in sorted(set(off["r0"][0][1:8]))[:3]:
        stops = frozenset({stop})
        on = run(model, DRAFT, requests(stop=stops), drafts["itself"])[1]
        assert on == run(model, None, requests(stop=stops))[1]
    lengths = (1, 2, 3, 5, 6, 9)
    on = run(model, DRAFT, requests(max_tokens=lengths), drafts["itself"])[1]
    assert on == run(model, None, requests(max_tokens=lengths))[1]


def test_a_draft_model_of_another_vocabulary_is_refused_with_both_sizes(model):
    from transformers import AutoModelForCausalLM

    from tests.factories import tiny_hf_config
    from workers.drafter import check_vocabulary
    from workers.loader import from_hf_model

    config = tiny_hf_config("llama")
    config.vocab_size = VOCAB + 64
    other = from_hf_model(AutoModelForCausalLM.from_config(config))
    with pytest.raises(
        ValueError, match=rf"vocabulary of {VOCAB + 64} tokens, the served model {VOCAB}"
    ):
        check_vocabulary(other, model, "other")
    check_vocabulary(tiny_model("qwen2"), model, "qwen2")  # same ids: accepted
