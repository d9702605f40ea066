"""The prefix cache's block index and its use by the policy and the router, without a model."""

from scheduler.cell.coordinator import Coordinator
from scheduler.cell.metrics import RecordingBackend
from scheduler.cell.state import CellConfig
from scheduler.prefix_cache import BLOCK_SIZE, PrefixCache, chain_hashes
from scheduler.request import Request
from scheduler.step_planner import StepPlanner

B = BLOCK_SIZE


def tokens(n, start=1000):
    return list(range(start, start + n))


def request(req_id, prompt):
    return Request(req_id=req_id, prompt_ids=prompt, max_tokens=4)


def test_block_names_name_whole_prefixes():
    a, b = tokens(3 * B), tokens(3 * B)
    b[B + 5] = 7  # differs inside block 1
    names_a, names_b = chain_hashes(a, 3, []), chain_hashes(b, 3, [])
    assert names_a[0] == names_b[0] and names_a[1] != names_b[1] and names_a[2] != names_b[2]
    # extending a known prefix gives the same names
    assert chain_hashes(a, 3, names_a[:1]) == names_a


def test_least_recently_used_block_is_evicted_never_one_in_use_by_the_plan():
    cache = PrefixCache(2)
    n = chain_hashes(tokens(4 * B), 4, [])
    assert cache.allocate(n[0]) is not None and cache.allocate(n[1]) is not None
    assert cache.allocate(n[2]) is None  # both blocks are in use by this plan
    cache.pinned.clear()  # the plan was made
    # evicts n[1], not n[0] just used
    assert cache.match(n[:1]) != [] and cache.allocate(n[2]) is not None
    assert cache.cached_tokens(n) == B and cache.evictions == 1


def run(sched, steps=50):
    """Plan steps as a worker would run them: every token of every chunk computed, samples = 5."""
    plans = []
    for _ in range(steps):
        plan = sched.plan()
        if plan.empty:
            break
        plans.append(plan)
        sched.update(plan, {c.req_id: 5 for c in plan.chunks if c.sample})
    return plans


def test_a_cached_prefix_is_loaded_and_only_the_rest_computed():
    sched = StepPlanner(2, 256, token_budget=64, prefill_chunk=64, prefix_cache_blocks=16)
    first = tokens(2 * B + 8)
    sched.submit(request("a", first))
    plans = run(sched)
    # its two full prompt blocks went to the pool
    assert [save[2] for p in plans for save in p.saves]
    # the same prefix, ending inside block 2: blocks 0-1 are loaded, the rest computed
    b = request("b", first[: 2 * B + 3] + [9, 9])
    sched.submit(b)
    plans = run(sched)
    assert [(load[1], load[2]) for load in plans[0].loads] == [(0, 0), (0, B)]
    assert plans[0].prefill[0].start_pos == 2 * B and plans[0].prefill[0].num_tokens == 5
    # a prompt entirely cached still computes its last token, to sample
    c = request("c", first[: 2 * B])
    sched.submit(c)
    plans = run(sched)
    assert len(plans[0].loads) == 2 and plans[0].prefill[0].start_pos == 2 * B - 1
    assert sched.prefix_cache.hit_tokens == 2 * B + 2 * B - 1
    # each request reports what it found (its usage's cached tokens); a readmission keeps the first
    # count
    assert (b.metrics()["cached_tokens"], c.metrics()["cached_tokens"]) == (2 * B, 2 * B - 1)
    c.reset_cache()
    sched.prefix_cache.admit(c, 1)
    # now with an output token
    assert c.num_computed == 2 * B and c.metrics()["cached_tokens"] == 2 * B - 1
    fresh = StepPlanner(2, 256, token_budget=64, prefill_chunk=64, prefix_cache_blocks=16)
    first_seen = request("a", first)
    fresh.submit(first_seen)
    run(fresh)
    assert first_seen.metrics()["cached_tokens"] == 0


def test_echo_requests_compute_every_prompt_position():
    from scheduler.request import SamplingParams

    sched = StepPlanner(2, 256, token_budget=64, prefill_chunk=64, prefix_cache_blocks=16)
    sched.submit(request("a", tokens(2 * B)))
    run(sched)
    echo = Request(
        req_id="e",
        prompt_ids=tokens(2 * B),
        max_tokens=2,
        sampling=SamplingParams(prompt_logprobs=0),
    )
    sched.submit(echo)
    assert run(sched)[0].loads == []


def cell(cache_routing=True):
    return Coordinator(
        CellConfig(
            mode="disaggregated",
            num_decode_workers=1,
            num_prefill_workers=2,
            decode_slots=8,
            prefill_slots=2,
            capacity=512,
            token_budget=64,
            prefill_chunk=64,
            prefix_cache_blocks=64,
            cache_routing=cache_routing,
        ),
        metrics_backend=RecordingBackend(),
    )


def test_routing_follows_the_cache_and_weighs_queued_work():
    coordinator = cell()
    system = tokens(8 * B)
    coordinator.admit(request("a", system + [1, 2]), consumer="c")
    prefill = coordinator.prefill
    on = {w.name for w in prefill if "a" in w.sched.requests}
    # the same system prompt goes where "a" is computing it (its blocks will be cached there) ...
    coordinator.admit(request("b", system + [3, 4]), consumer="c")
    assert {w.name for w in prefill if "b" in w.sched.requests} == on
    # ... while a prompt with nothing in common goes to the idle worker
    coordinator.admit(request("x", tokens(8 * B, start=5000)), consumer="c")
    assert {w.name for w in prefill if "x" in w.sched.requests} != on
    # by load only, the second one would have gone to the other worker
    by_load = cell(cache_routing=False)
    by_load.admit(request("a", system + [1, 2]), consumer="c")
    by_load.admit(request("b", system + [3, 4]), consumer="c")
    assert [len(w.sched.requests) for w in by_load.prefill] == [1, 1]


def test_a_worker_that_restarts_has_an_empty_cache():
    coordinator = cell()
    worker = coordinator.prefill[0]
    names = chain_hashes(tokens(2 * B), 2, [])
    worker.sched.prefix_cache.allocate(names[0])
    coordinator.worker_died(worker)
    assert worker.sched.prefix_cache.cached_tokens(names) == 0


def test_the_same_prefix_arriving_twice_at_once_is_computed_once():
    sched = StepPlanner(2, 256, token_budget=16, prefill_chunk=16, prefix_cache_blocks=16)
    sched.submit(request("a", tokens(4 * B + 3)))
    sched.submit(request("b", tokens(4 * B) + [7, 7]))
    plans = run(sched)
    computed = {
        r: sum(c.num_tokens for p in plans for c in p.prefill if c.req_id == r) for r in "ab"
    }
    assert computed == {"a": 4 * B + 3, "b": 2}  # b waited for a's four blocks, then loaded them
    assert sched.prefix_cache.hit_tokens == 4 * B
