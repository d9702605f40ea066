"""KV blocks as plain accounting (refcounts, names, eviction) and their use by the planner and the
router: prefixes, forks and preemption share and give back blocks, without a model."""

from scheduler.block_pool import BLOCK_SIZE, BlockPool, chain_hashes
from scheduler.cell.coordinator import Coordinator
from scheduler.cell.metrics import RecordingBackend
from scheduler.cell.state import CellConfig
from scheduler.request import Request, SamplingParams
from scheduler.step_planner import StepPlanner

B = BLOCK_SIZE


def tokens(n, start=1000):
    return list(range(start, start + n))


def request(req_id, prompt, max_tokens=4, priority=0, **sampling):
    return Request(
        req_id=req_id,
        prompt_ids=prompt,
        max_tokens=max_tokens,
        sampling=SamplingParams(**sampling),
        priority=priority,
    )


def planner(num_blocks=16, slots=2, budget=64, chunk=64, caching=True):
    return StepPlanner(
        slots,
        min(256, num_blocks * B),
        token_budget=budget,
        prefill_chunk=chunk,
        num_blocks=num_blocks,
        prefix_caching=caching,
    )


def assert_blocks_consistent(sched):
    """Every block's refcount is the number of tables (running requests and reservations) that
    hold it; a block is free, cached or in use, never two of them."""
    holders = [r.block_table for r in sched.running]
    holders += [blocks for _, blocks in sched.reserved.values()]
    counts = [0] * sched.blocks.num_blocks
    for table in holders:
        for block in table:
            counts[block] += 1
    assert counts == sched.blocks.refs
    free = set(sched.blocks.free)
    cached = set(sched.blocks.cached)
    used = {b for b, n in enumerate(counts) if n}
    assert not (free & cached or free & used or cached & used)
    assert len(free | cached | used) == sched.blocks.num_blocks


def run(sched, steps=80):
    """Plan steps as a worker would run them: every token of every chunk computed, samples = 5."""
    plans = []
    for _ in range(steps):
        plan = sched.plan()
        assert_blocks_consistent(sched)
        if plan.empty:
            break
        plans.append(plan)
        sched.update(plan, {c.req_id: 5 for c in plan.chunks if c.sample})
        assert_blocks_consistent(sched)
    return plans


def test_block_names_name_whole_prefixes():
    a = tokens(3 * B)
    b = tokens(3 * B)
    b[B + 5] = 7  # differs inside block 1
    names_a = chain_hashes(a, 3, [])
    names_b = chain_hashes(b, 3, [])
    assert names_a[0] == names_b[0] and names_a[1] != names_b[1] and names_a[2] != names_b[2]
    # extending a known prefix gives the same names
    assert chain_hashes(a, 3, names_a[:1]) == names_a


def test_unused_named_blocks_are_evicted_least_recently_used_first_never_one_in_use():
    pool = BlockPool(3)
    names = chain_hashes(tokens(4 * B), 4, [])
    first = pool.allocate(3)
    for block, name in zip(first, names, strict=False):
        pool.name(block, name)
    assert pool.allocate(1) is None  # all three in use
    pool.free_blocks(first)  # all cached now, block 0 least recently used
    assert pool.match(names[:1]) == [first[0]]  # in use again, and so not evictable
    fresh = pool.allocate(2)
    assert sorted(fresh) == sorted(first[1:]) and pool.evictions == 2
    assert pool.cached_tokens(names) == B  # block 0 kept its name
    assert pool.allocate(1) is None


def test_a_cached_prefix_is_shared_and_only_the_rest_computed():
    sched = planner()
    first = tokens(2 * B + 8)
    sched.submit(request("a", first))
    run(sched)
    # the same prefix, ending inside block 2: blocks 0-1 are shared, the rest computed
    b = request("b", first[: 2 * B + 3] + [9, 9])
    sched.submit(b)
    plans = run(sched)
    chunk = plans[0].prefill[0]
    assert (chunk.start_pos, chunk.num_tokens) == (2 * B, 5)
    assert chunk.block_table[:2] == plans[0].prefill[0].block_table[:2]
    assert plans[0].copies == []  # nothing is copied: the table points at the cached blocks
    # a prompt of exactly two blocks: its last token must run (to sample), and a cached block is
    # never written again, so only block 0 is shared and block 1 is computed
    c = request("c", first[: 2 * B])
    sched.submit(c)
    plans = run(sched)
    assert plans[0].prefill[0].start_pos == B
    assert sched.blocks.hit_tokens == 2 * B + B
    # each request reports what it found (its usage's cached tokens)
    assert (b.metrics()["cached_tokens"], c.metrics()["cached_tokens"]) == (2 * B, B)
    fresh = planner()
    first_seen = request("a", first)
    fresh.submit(first_seen)
    run(fresh)
    assert first_seen.metrics()["cached_tokens"] == 0


def test_generated_blocks_are_cached_too():
    """A reply's blocks are named once its tokens are known: the next turn of the conversation
    finds the previous reply cached."""
    sched = planner()
    turn = request("t1", tokens(B + 4), max_tokens=2 * B)
    sched.submit(turn)
    run(sched)
    history = turn.prompt_ids + turn.output_ids
    follow = request("t2", history + [42, 43])
    sched.submit(follow)
    run(sched)
    assert follow.num_cached == (len(history) // B) * B


def test_echo_requests_compute_every_prompt_position():
    sched = planner()
    sched.submit(request("a", tokens(2 * B)))
    run(sched)
    echo = request("e", tokens(2 * B), max_tokens=2, prompt_logprobs=0)
    sched.submit(echo)
    plans = run(sched)
    assert plans[0].prefill[0].start_pos == 0 and echo.num_cached is None


def test_forks_share_the_prompts_full_blocks_and_copy_the_partial_one():
    sched = planner(caching=False)
    prompt = tokens(2 * B + 5)
    first = request("a", prompt, max_tokens=6, temperature=1.0, seed=1)
    fork = request("a-1", prompt, max_tokens=6, temperature=1.0, seed=2)
    fork.fork_of = "a"
    sched.submit(first)
    sched.submit(fork)
    plans = run(sched)
    copies = [c for p in plans for c in p.copies]
    assert len(copies) == 1
    fork_chunks = [c for p in plans for c in p.prefill if c.req_id == "a-1"]
    assert [(c.start_pos, c.num_tokens) for c in fork_chunks] == [(len(prompt) - 1, 1)]
    first_table = next(c.block_table for p in plans for c in p.chunks if c.req_id == "a")
    assert fork_chunks[0].block_table[:2] == first_table[:2]  # shared
    assert copies[0] == (first_table[2], fork_chunks[0].block_table[2])  # copied


def test_a_block_freed_while_a_fork_reads_its_old_owner_is_not_reused():
    """The first choice finishes early: its prompt blocks stay with the fork that shares them."""
    sched = planner(num_blocks=8, caching=False)
    prompt = tokens(2 * B + 5)
    first = request("a", prompt, max_tokens=1)
    fork = request("a-1", prompt, max_tokens=2 * B)
    fork.fork_of = "a"
    sched.submit(first)
    sched.submit(fork)
    run(sched, steps=4)
    assert first.finished and not fork.finished
    shared = fork.block_table[:2]
    assert all(sched.blocks.refs[b] == 1 for b in shared)
    other = request("x", tokens(3 * B, start=7000), max_tokens=2)
    sched.submit(other)
    run(sched)
    assert fork.finished and other.finished  # assert_blocks_consistent held throughout


def test_decodes_out_of_blocks_preempt_the_least_urgent_and_every_request_completes():
    # 6 blocks: each request needs 2 for its prompt, then a third as it decodes past 2 blocks
    sched = planner(num_blocks=6, slots=3, caching=True)
    reqs = [
        request(f"r{i}", tokens(2 * B - 1, start=1000 * (i + 1)), max_tokens=B) for i in range(3)
    ]
    for r in reqs:
        sched.submit(r)
    run(sched, steps=200)
    assert all(r.finished and len(r.output_ids) == B for r in reqs)
    assert sched.num_preemptions >= 1


def test_two_requests_sharing_a_prefix_where_one_is_preempted():
    sched = planner(num_blocks=6, slots=2, caching=True)
    system = tokens(2 * B)
    a = request("a", system + [1, 2, 3], max_tokens=2 * B)
    b = request("b", system + [4, 5], max_tokens=2 * B, priority=1)
    sched.submit(a)
    run(sched, steps=1)
    sched.submit(b)
    run(sched, steps=300)
    assert a.finished and b.finished
    assert len(a.output_ids) == len(b.output_ids) == 2 * B
    assert b.num_preemptions >= 1 and a.num_preemptions == 0


def test_a_pool_smaller_than_one_request_of_max_model_len_is_refused():
    try:
        StepPlanner(2, 256, num_blocks=256 // B - 1)
    except ValueError as error:
        assert "max_model_len 256" in str(error)
    else:
        raise AssertionError("a pool too small for max_model_len was accepted")


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
            prefix_caching=True,
            cache_routing=cache_routing,
        ),
        metrics_backend=RecordingBackend(),
    )


def test_routing_follows_the_cache_and_weighs_queued_work():
    coordinator = cell()
    system = tokens(8 * B)
    coordinator.admit(request("a", system + [1, 2]), consumer="c")
    prefill = coordinator.prefill
    on = {w.name for w in prefill if "a" in w.step_planner.requests}
    # the same system prompt goes where "a" is computing it (its blocks will be cached there) ...
    coordinator.admit(request("b", system + [3, 4]), consumer="c")
    assert {w.name for w in prefill if "b" in w.step_planner.requests} == on
    # ... while a prompt with nothing in common goes to the idle worker
    coordinator.admit(request("x", tokens(8 * B, start=5000)), consumer="c")
    assert {w.name for w in prefill if "x" in w.step_planner.requests} != on
    # by load only, the second one would have gone to the other worker
    by_load = cell(cache_routing=False)
    by_load.admit(request("a", system + [1, 2]), consumer="c")
    by_load.admit(request("b", system + [3, 4]), consumer="c")
    assert [len(w.step_planner.requests) for w in by_load.prefill] == [1, 1]


def test_a_worker_that_restarts_has_an_empty_cache():
    coordinator = cell()
    worker = coordinator.prefill[0]
    names = chain_hashes(tokens(2 * B), 2, [])
    blocks = worker.step_planner.blocks.allocate(1)
    worker.step_planner.blocks.name(blocks[0], names[0])
    worker.step_planner.blocks.free_blocks(blocks)
    coordinator.worker_died(worker)
    assert worker.step_planner.blocks.cached_tokens(names) == 0
    assert worker.step_planner.blocks.num_free == worker.step_planner.blocks.num_blocks


def test_the_same_prefix_arriving_twice_at_once_is_computed_once():
    sched = planner(budget=16, chunk=16)
    sched.submit(request("a", tokens(4 * B + 3)))
    sched.submit(request("b", tokens(4 * B) + [7, 7]))
    plans = run(sched)
    computed = {
        r: sum(c.num_tokens for p in plans for c in p.prefill if c.req_id == r) for r in "ab"
    }
    assert computed == {"a": 4 * B + 3, "b": 2}  # b waited for a's four blocks, then shared them
    assert sched.blocks.hit_tokens == 4 * B


def test_blocks_planned_before_their_tokens_were_known_are_named_when_they_are():
    """A decode burst plans many steps before any result comes (each samples a token the next one
    feeds in): the request can end before a plan sees its last tokens. Its full blocks are named as
    the tokens arrive, so the next turn of a conversation finds them."""
    sched = planner()
    first = request("a", tokens(B - 2), max_tokens=2 * B)
    sched.submit(first)
    prefill = sched.plan()
    sched.update(prefill, {c.req_id: 5 for c in prefill.chunks if c.sample})
    burst = []
    while not (plan := sched.plan()).empty:  # every decode step, planned at once
        burst.append(plan)
    for plan in burst:
        sched.update(plan, {c.req_id: 5 + c.output_index for c in plan.chunks if c.sample})
    assert first.finished
    sequence = first.prompt_ids + first.output_ids
    computed = len(sequence) - 1  # the last output's KV is never computed
    names = chain_hashes(sequence, computed // B, [])
    assert sched.blocks.cached_tokens(names) == (computed // B) * B


def test_a_request_as_long_as_the_pool_runs_when_it_is_alone():
    """The 1% kept for growth does not stop a request that needs every block from running alone."""
    sched = StepPlanner(1, 200 * B, token_budget=200 * B, prefill_chunk=200 * B, num_blocks=200)
    assert sched.tables.watermark == 2
    whole = request("w", tokens(200 * B - 1), max_tokens=1)
    sched.submit(whole)
    run(sched)
    assert whole.finished and len(whole.output_ids) == 1
