"""A request continued from what its client received (failover to another cell) ends as if never
interrupted."""

import pytest

from scheduler.request import Request, SamplingParams, continuation
from tests.factories import VOCAB, prompt_ids, tiny_tokenizer
from tests.workers.engines import make_engine

EOS = VOCAB - 1


def streamed(requests):
    """Run requests batched together in a fresh engine; every output each stream received, in
    order."""
    engine = make_engine(num_slots=4, tokenizer=tiny_tokenizer())
    outs = {r.req_id: [] for r in requests}
    for request in requests:
        engine.submit(request)
    while not engine.idle:
        for out in engine.step():
            outs[out.req_id].append(out)
    return outs


def ask(req_id, prompt_seed, max_tokens=24, stop=(), **params):
    return Request(
        req_id,
        prompt_ids(13 + prompt_seed, seed=prompt_seed),
        max_tokens,
        SamplingParams(**params),
        stop_token_ids=frozenset({EOS}),
        stop_strings=tuple(stop),
    )


def joined(outs):
    return (
        [t for o in outs for t in o.token_ids],
        "".join(o.text for o in outs),
        [lp for o in outs for lp in o.logprobs],
        outs[-1].finish_reason,
    )


def same(got, want):
    """Tokens, text and finish reason exactly; log-probs to float rounding (a step's batch differs),
    the alternatives' ids exactly."""
    assert got[0] == want[0] and got[1] == want[1] and got[3] == want[3]
    assert len(got[2]) == len(want[2])
    for a, b in zip(got[2], want[2], strict=True):
        assert a.token_id == b.token_id and [t for t, _ in a.top] == [t for t, _ in b.top]
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=1e-4)


ASKS = {
    "greedy": dict(),
    "seeded": dict(temperature=0.9, top_p=0.9, seed=11, logprobs=2),
    "penalized": dict(
        temperature=0.7, seed=5, repetition_penalty=1.3, frequency_penalty=0.5, min_tokens=4
    ),
}


@pytest.mark.parametrize("name", list(ASKS))
def test_a_continuation_from_any_point_gives_the_rest_of_the_stream(name):
    """Cut after each output in turn: the continuation, batched with other requests in another
    engine, streams exactly the tokens, text, log-probs and finish reason the uninterrupted request
    went on to."""
    whole = streamed([ask("x", 1, **ASKS[name])])["x"]
    tokens, text, logprobs, finish = joined(whole)
    assert len(whole) >= 8 and len(logprobs) == (len(tokens) if ASKS[name].get("logprobs") else 0)
    for cut in range(1, len(whole)):
        got = joined(whole[:cut])
        rest = streamed(
            [
                continuation(ask("x", 1, **ASKS[name]), got[0], got[2], len(got[1])),
                ask("other", 2),
                ask("third", 3, temperature=1.0, seed=3),
            ]
        )["x"]
        same(joined(whole[:cut] + rest), (tokens, text, logprobs, finish))


def test_a_continuation_finds_a_stop_string_that_spans_the_cut():
    """Text held back as a possible stop string's start when the cell died is neither lost nor
    repeated, and a stop string whose first characters came before the cut still stops the
    request."""
    free = joined(streamed([ask("x", 4, max_tokens=40)])["x"])[1]
    stop = free[len(free) // 2 : len(free) // 2 + 3]
    whole = streamed([ask("x", 4, max_tokens=40, stop=[stop])])["x"]
    tokens, text, logprobs, finish = joined(whole)
    assert finish == "stop" and stop not in text and len(whole) >= 3
    for cut in range(1, len(whole)):
        got = joined(whole[:cut])
        rest = streamed(
            [continuation(ask("x", 4, max_tokens=40, stop=[stop]), got[0], got[2], len(got[1]))]
        )["x"]
        same(joined(whole[:cut] + rest), (tokens, text, logprobs, finish))


def test_a_continuation_does_not_repeat_prompt_logprobs_or_copy_a_sibling():
    original = Request("x", [1, 2, 3], 8, SamplingParams(prompt_logprobs=1), fork_of="y")
    assert continuation(original, [], [], 0).sampling.prompt_logprobs == 1  # nothing was sent yet
    later = continuation(original, [5], [], 2)
    assert later.sampling.prompt_logprobs is None and later.fork_of is None
    assert later.output_ids == [5] and later.text_sent == 2 and original.output_ids == []
