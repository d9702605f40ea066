"""The prefix cache changes no output: the same tokens with it as without, in every case it has to
handle."""

import pytest

from scheduler.block_pool import BLOCK_SIZE
from scheduler.request import Request, SamplingParams
from tests.factories import VOCAB, local_engine, prompt_ids, tiny_model
from workers.runner import ModelRunner

CAPACITY = 256
SYSTEM = prompt_ids(3 * BLOCK_SIZE + 5, 100)  # a shared prefix that ends inside a block


def engine(caching, num_blocks=None, num_slots=3):
    return local_engine(
        tiny_model("llama"),
        num_slots,
        CAPACITY if num_blocks is None else min(CAPACITY, num_blocks * BLOCK_SIZE),
        num_blocks=num_blocks,
        prefix_caching=caching,
        token_budget=24,
        prefill_chunk=8,
    )


def workload(sampling):
    turns = [SYSTEM + prompt_ids(n, 200 + n) for n in (3, 11, 20, 7)]
    whole = prompt_ids(2 * BLOCK_SIZE, 300)  # a prompt that will be cached entirely
    prompts = turns + [
        turns[1],
        turns[1],
        whole,
        whole,
        whole[: BLOCK_SIZE + 1],
        prompt_ids(40, 400),
    ]
    return [
        Request(
            req_id=f"r{i}",
            prompt_ids=p,
            max_tokens=8 + i % 5,
            sampling=sampling,
            stop_token_ids=frozenset({VOCAB - 1}),
        )
        for i, p in enumerate(prompts)
    ]


def run_waves(eng, requests, wave=3):
    """Submit in waves (each after the last finished), so later prompts find earlier ones cached."""
    results = {}
    for i in range(0, len(requests), wave):
        results |= eng.run(requests[i : i + wave])
    return {k: r.output_ids for k, r in results.items()}


@pytest.mark.parametrize(
    "sampling",
    [SamplingParams(), SamplingParams(temperature=0.8, top_k=40, seed=9)],
    ids=["greedy", "seeded"],
)
# 64 blocks: every cached block stays; 8 (the 3 requests of a wave need about 15): evictions and
# preemptions
@pytest.mark.parametrize("blocks", [64, 8], ids=["roomy", "evicting"])
def test_outputs_with_the_cache_equal_outputs_without(sampling, blocks):
    """Shared prefixes ending inside a block, the same prompt twice at once, a prompt entirely
    cached, and (with 8 blocks) eviction and preemption under pressure."""
    expected = run_waves(engine(False), workload(sampling))
    cached = engine(True, num_blocks=blocks)
    assert run_waves(cached, workload(sampling)) == expected
    stats = cached.scheduler.blocks.stats()
    assert stats["hit_tokens"] > 0 and stats["blocks_used"] == 0  # all given back at the end
    if blocks == 8:
        assert stats["evictions"] > 0 and cached.scheduler.num_preemptions > 0


def test_recompute_after_preemption_uses_the_cache():
    """Two slots, long low-priority requests on a shared prefix, urgent ones arriving mid-output:
    the evicted ones find their prefix (and the blocks of their own output) cached instead of
    recomputing it."""

    def requests():
        normal = [
            Request(
                req_id=f"n{i}",
                prompt_ids=SYSTEM + prompt_ids(5, 500 + i),
                max_tokens=40,
                priority=1,
            )
            for i in range(2)
        ]
        urgent = [
            Request(req_id=f"u{i}", prompt_ids=prompt_ids(9, 600 + i), max_tokens=6)
            for i in range(2)
        ]
        return normal, urgent

    def run(caching):
        eng = engine(caching, num_slots=2)
        normal, urgent = requests()
        for r in normal:
            eng.submit(r)
        for step in range(1000):
            if step == 30:
                for r in urgent:
                    eng.submit(r)
            eng.step()
            if eng.idle and step > 30:
                break
        return {r.req_id: r.output_ids for r in normal + urgent}, eng

    expected, _ = run(False)
    got, eng = run(True)
    assert got == expected
    assert eng.scheduler.num_preemptions > 0
    # the recompute found its prompt and output blocks in the pool: more hits than the prompts alone
    # give
    assert eng.scheduler.blocks.hit_tokens > 3 * BLOCK_SIZE


def test_a_pool_that_does_not_fit_fails_at_start_up_with_the_numbers():
    """Asking for more KV than the machine has fails before anything is allocated, saying how
    much."""
    huge = 10**9 // BLOCK_SIZE  # a billion tokens
    with pytest.raises(MemoryError, match=r"62500000 blocks of 16 tokens.* GiB.* available"):
        ModelRunner(tiny_model("llama"), huge)
