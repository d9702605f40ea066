"""Decode steps padded to CUDA-graph buckets (`workers/decode_graphs.py`), run eagerly on CPU: the
padding changes no request's tokens or log-probs and writes no block a request holds."""

import torch

from scheduler.request import SamplingParams
from tests.factories import TEST_DEVICE, local_engine, make_requests, tiny_model
from workers.decode_graphs import DecodeGraphs, GraphOptions, graph_buckets

CAPACITY = 256


def test_buckets_are_powers_of_two_to_eight_then_steps_of_sixteen_to_the_most_rows():
    assert graph_buckets(1) == [1]
    assert graph_buckets(6) == [1, 2, 4, 6]
    assert graph_buckets(8) == [1, 2, 4, 8]
    assert graph_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert graph_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]


def _engine(graphs):
    return local_engine(
        tiny_model("qwen3", TEST_DEVICE),
        7,
        CAPACITY,
        token_budget=32,
        prefill_chunk=16,
        graphs=graphs,
    )


def _requests():
    greedy = make_requests(4, prompt_lens=[5, 23, 40, 9], max_tokens=[30, 12, 21, 26])
    seeded = make_requests(
        3,
        prompt_lens=[17, 3, 33],
        max_tokens=[19, 28, 15],
        sampling=SamplingParams(temperature=0.8, top_p=0.9, seed=5, logprobs=3),
    )
    for i, request in enumerate(seeded):
        request.req_id = f"s{i}"
    return greedy + seeded


def test_padded_decode_steps_give_the_eager_tokens_and_logprobs():
    eager = _engine(None).run(_requests())
    engine = _engine(GraphOptions(max_rows=7, max_model_len=CAPACITY, cpu=True))
    graphs = engine.runner.graphs
    padded_steps = []
    run = graphs.run

    def counted(rows):
        padded_steps.append(len(rows))
        return run(rows)

    graphs.run = counted
    results = engine.run(_requests())
    # decode steps of several sizes ran padded to the buckets 1, 2, 4, 7
    assert len(set(padded_steps)) >= 3
    assert any(n not in graphs.buckets for n in padded_steps)
    for req_id, completion in eager.items():
        assert results[req_id].output_ids == completion.output_ids, req_id
        assert results[req_id].logprobs == completion.logprobs, req_id


def test_padding_rows_write_only_the_scratch_block():
    model = tiny_model("llama", TEST_DEVICE)
    engine = local_engine(
        model, 4, CAPACITY, graphs=GraphOptions(max_rows=8, max_model_len=CAPACITY, cpu=True)
    )
    graphs: DecodeGraphs = engine.runner.graphs
    cache = engine.runner.cache
    assert cache.scratch_block == cache.num_blocks  # a block past every block table's
    generator = torch.Generator().manual_seed(0)
    cache.k.copy_(torch.randn(cache.k.shape, generator=generator))
    cache.v.copy_(torch.randn(cache.v.shape, generator=generator))
    before_k = cache.k.clone()
    before_v = cache.v.clone()
    # three rows padded to a bucket of four: row i at position 20 + i of its own two blocks
    rows = [([2 * i, 2 * i + 1], 7 + i, 20 + i) for i in range(3)]
    logits = graphs.run(rows)
    assert logits.shape == (3, model.spec.vocab_size)
    changed = (cache.k != before_k).any(-1) | (cache.v != before_v).any(-1)  # [L, NB, KVH, BS]
    written = {tuple(pair) for pair in changed.any(0).any(1).nonzero().tolist()}  # (block, offset)
    expected = {(2 * i + 1, (20 + i) % 16) for i in range(3)} | {(cache.scratch_block, 0)}
    assert written == expected


def test_a_step_wider_than_the_graphs_runs_eagerly():
    engine = local_engine(
        tiny_model("llama", TEST_DEVICE),
        2,
        CAPACITY,
        graphs=GraphOptions(max_rows=2, max_model_len=32, cpu=True),
    )
    graphs = engine.runner.graphs
    assert graphs.fits(2, 2) and not graphs.fits(3, 2) and not graphs.fits(1, 3)
    widest = []
    run = graphs.run

    def counted(rows):
        widest.append(max(len(table) for table, _, _ in rows))
        return run(rows)

    graphs.run = counted
    # a 50-token prompt's rows need 4 blocks of 16: past the graphs' width, they step eagerly
    results = engine.run(make_requests(3, prompt_lens=[30, 4, 50], max_tokens=[10, 10, 10]))
    reference = local_engine(tiny_model("llama", TEST_DEVICE), 2, CAPACITY).run(
        make_requests(3, prompt_lens=[30, 4, 50], max_tokens=[10, 10, 10])
    )
    assert widest and max(widest) <= 2
    for req_id, completion in reference.items():
        assert results[req_id].output_ids == completion.output_ids
